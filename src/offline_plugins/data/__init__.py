"""The offline RL datasets the algorithms read, made or loaded locally: Minari recipes (Pendulum tiers, MuJoCo
tiers, OGBench's manipulation datasets by their own recipe, mazes, learning histories) and any Minari dataset
as TorchRL replay buffers (``offline``, ``store``, ``recipes``, ``ogbench``, ``maze``, ``histories``,
``behaviour``, ``build``), and the file utilities the run uses (``files``, ``jsonl``). Text data (prompts,
preference pairs, step labels) is :mod:`offline_plugins.text`.

``load_offline_data`` and ``OfflineData`` are imported on first use, so importing
this package (and listing recipes) loads no torch.
"""

from __future__ import annotations

from offline_plugins._lazy import lazy_exports

__all__ = ["load_offline_data", "OfflineData", "DataStatistics", "DatasetError", "make_dataset"]

_LAZY = {
    "load_offline_data": "offline_plugins.data.offline",
    "OfflineData": "offline_plugins.data.offline",
    "DataStatistics": "offline_plugins.data.offline",
    "DatasetError": "offline_plugins.data.errors",
    "make_dataset": "offline_plugins.data.store",
}


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
