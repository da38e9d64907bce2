"""The training shell: one thin LightningModule, a replay-buffer data module, callbacks.

``train_algorithm("iql", "pendulum/medium-replay-v0", steps=...)`` runs the whole pipeline
(``train(plan_run(...), RunSettings(...))``: a checked plan, then the run); ``build(...)`` hands
over the module, the data module and the callbacks an algorithm needs, for a
``lightning.Trainer`` of the user's own (docs/lightning.md). Everything is imported on first use, so importing this package (as
the CLI does) loads neither torch nor Lightning.
"""

from __future__ import annotations

from offline_plugins._lazy import lazy_exports

__all__ = [
    "build",
    "LightningParts",
    "train",
    "train_algorithm",
    "RunSettings",
    "plan_run",
    "RunPlan",
    "ResumedRun",
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
    "train_algorithm": "offline_plugins.lightning.run",
    "RunSettings": "offline_plugins.lightning.run",
    "plan_run": "offline_plugins.lightning.plan",
    "RunPlan": "offline_plugins.lightning.plan",
    "ResumedRun": "offline_plugins.lightning.checkpoints",
    "evaluate_checkpoint": "offline_plugins.lightning.checkpoints",
    "load_checkpoint": "offline_plugins.lightning.checkpoints",
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
