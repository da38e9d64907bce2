"""Glue of the sequence-model algorithms (``dt``, ``tt``, ``diffuser``); no torch at import."""
