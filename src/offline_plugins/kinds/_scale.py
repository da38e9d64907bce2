"""The scale check the language-model kinds share: a batch no larger than the data, whose forward
and backward fit in the memory that is free (:meth:`~offline_plugins.plugins.datakind.DataKind.check_scale`)."""

from __future__ import annotations

from typing import Any, Optional

from offline_plugins.modules.causal_lm import forward_memory_bytes
from offline_plugins.plugins.datakind import check_memory, check_rows, config_value

__all__ = ["check_lm_batch"]


def check_lm_batch(config, model, *, batch_size: int, rows: Optional[int], what: str, per_row: int, length: int,
                   accumulate: int = 1, device: Any = None) -> None:
    """A language-model kind's check: no more ``what`` per batch than the data has (``rows``; None:
    the kind checks that itself), and a micro-batch of ``per_row`` sequences a row, ``length``
    tokens each, that fits in memory (:func:`~offline_plugins.modules.causal_lm.forward_memory_bytes`,
    with the config's ``logprob_chunk``)."""
    if rows is not None:
        check_rows(batch_size, rows, what=what)
    micro = -(-batch_size // max(1, accumulate))
    chunk = int(config_value(config, "logprob_chunk", 0) or 0)
    need = forward_memory_bytes(model, micro * per_row, length, logprob_chunk=chunk)
    check_memory(need, device=device, what=f"batch_size={batch_size} ({micro * per_row} sequences of {length} tokens "
                 f"per step{', log-probs in chunks of ' + str(chunk) if chunk else ''})",
                 fix="lower --set batch_size, split it with --accumulate N"
                     + ("" if chunk else ", or compute log-probs in chunks with --set logprob_chunk=256"))
