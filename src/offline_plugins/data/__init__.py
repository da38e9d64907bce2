"""The data the algorithms read, made or loaded locally: Minari recipes (Pendulum tiers, MuJoCo tiers,
OGBench's manipulation datasets by their own recipe, mazes) and any Minari dataset as TorchRL replay
buffers (``offline``, ``store``, ``recipes``, ``ogbench``); preference pairs and their sources
(``preference``, ``preference_sources``); the online text stack: prompt sources and rewards
(``prompts``, ``remote``, ``reward_source``), the rollout collector and its multi-turn episodes
(``collector``, ``multiturn``, ``rollouts``), the sampler process of overlapped rounds
(``async_sampler``) and the check that a sampler holds the trainer's weights (``sync_check``); PRM step
labels (``steps``).

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
