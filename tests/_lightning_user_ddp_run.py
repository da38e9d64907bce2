"""Run by tests/test_lightning_user_trainer.py: ``build(...)`` fitted by a user's ``lightning.Trainer``
with ``devices=2, strategy="ddp"`` on CPU (gloo).

Lightning's launcher re-runs this script for rank 1; every rank writes its final parameters,
the global step and a fingerprint of each batch it drew to OUT/rank<r>.pt; rank 0's CSVLogger
writes OUT/logs/metrics.csv.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning
import torch
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).parent))

from _lightning_ddp_run import RecordRank  # noqa: E402
from _lightning_fixtures import TINY_SPEC, FakeOfflineData  # noqa: E402

import offline_plugins.lightning as opl  # noqa: E402


if __name__ == "__main__":
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    out = Path(sys.argv[1])
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    parts = opl.build(TINY_SPEC, FakeOfflineData(), seed=0, eval_episodes=1)
    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=steps,
                                callbacks=[*parts.callbacks, RecordRank(out)],
                                logger=CSVLogger(out, name="logs", version=""), log_every_n_steps=1,
                                enable_progress_bar=False, enable_checkpointing=False, default_root_dir=str(out))
    trainer.fit(parts.module, datamodule=parts.datamodule)
