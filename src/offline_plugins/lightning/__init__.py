"""The training shell: one thin LightningModule, a replay-buffer data module, callbacks.

``train(...)`` runs the whole pipeline; ``build(...)`` hands over the module, the data
module and the callbacks an algorithm needs, for a ``lightning.Trainer`` of the user's own
(docs/lightning.md). Everything is imported on first use, so importing this package (as
the CLI does) loads neither torch nor Lightning.
"""

from __future__ import annotations

from offline_plugins._lazy import lazy_exports

__all__ = [
    "build",
    "LightningParts",
    "train",
    "plan_run",
    "evaluate_checkpoint",
    "load_checkpoint",
    "AlgorithmModule",
    "ReplayDataModule",
    "ReplayBufferStream",
    "TargetNetworkUpdate",
    "NonFiniteGuard",
    "NonFiniteLossError",
    "PolicyEvaluation",
]

_LAZY = {
    "build": "offline_plugins.lightning.builder",
    "LightningParts": "offline_plugins.lightning.builder",
    "train": "offline_plugins.lightning.run",
    "plan_run": "offline_plugins.lightning.run",
    "evaluate_checkpoint": "offline_plugins.lightning.run",
    "load_checkpoint": "offline_plugins.lightning.run",
    "AlgorithmModule": "offline_plugins.lightning.module",
    "ReplayDataModule": "offline_plugins.lightning.data",
    # the earlier names, kept as aliases (not in __all__)
    "OfflineAlgorithmModule": "offline_plugins.lightning.module",
    "OfflineDataModule": "offline_plugins.lightning.data",
    "ReplayBufferStream": "offline_plugins.lightning.data",
    "TargetNetworkUpdate": "offline_plugins.lightning.callbacks",
    "NonFiniteGuard": "offline_plugins.lightning.callbacks",
    "NonFiniteLossError": "offline_plugins.lightning.callbacks",
    "PolicyEvaluation": "offline_plugins.lightning.callbacks",
}


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
