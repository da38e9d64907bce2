"""Glue of the sequence-model algorithms (``dt``, ``odt``, ``tt``, ``diffuser``, ``ad``); no torch at import."""
