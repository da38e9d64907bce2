"""The training shell: one thin LightningModule, a replay-buffer data module, callbacks.

``train`` and ``evaluate_checkpoint`` are imported on first use, so importing this
package (as the CLI does) loads neither torch nor Lightning.
"""

from __future__ import annotations

from offline_plugins._lazy import lazy_exports

__all__ = [
    "train",
    "plan_run",
    "evaluate_checkpoint",
    "load_checkpoint",
    "OfflineAlgorithmModule",
    "OfflineDataModule",
    "ReplayBufferStream",
    "TargetNetworkUpdate",
    "NonFiniteGuard",
    "NonFiniteLossError",
    "PolicyEvaluation",
]

_LAZY = {
    "train": "offline_plugins.lightning.run",
    "plan_run": "offline_plugins.lightning.run",
    "evaluate_checkpoint": "offline_plugins.lightning.run",
    "load_checkpoint": "offline_plugins.lightning.run",
    "OfflineAlgorithmModule": "offline_plugins.lightning.module",
    "OfflineDataModule": "offline_plugins.lightning.data",
    "ReplayBufferStream": "offline_plugins.lightning.data",
    "TargetNetworkUpdate": "offline_plugins.lightning.callbacks",
    "NonFiniteGuard": "offline_plugins.lightning.callbacks",
    "NonFiniteLossError": "offline_plugins.lightning.callbacks",
    "PolicyEvaluation": "offline_plugins.lightning.callbacks",
}


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
