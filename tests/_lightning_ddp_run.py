"""Run by tests/test_lightning_ddp.py: a 2-process CPU DDP run of the tiny TD3+BC.

Lightning's launcher re-runs this script once per extra rank; every rank writes
its final parameters and a fingerprint of each batch it drew to OUT/rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _lightning_fixtures import TINY_SPEC, FakeOfflineData  # noqa: E402
from _ranks import SaveRankState  # noqa: E402

from offline_plugins.lightning.run import train_algorithm  # noqa: E402


class RecordRank(SaveRankState):
    def __init__(self, out: Path) -> None:
        super().__init__(out)
        self.batches: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(float(batch["observation"].sum()))

    def extra(self, trainer) -> dict:
        return {"batches": self.batches, "steps": trainer.global_step}


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    train_algorithm(TINY_SPEC, FakeOfflineData(), steps=steps, seed=0, eval_every=0, eval_episodes=1, devices=2,
          accelerator="cpu", out_dir=out, progress=False, callbacks=[RecordRank(out)])
