"""Run by tests/test_lightning_ddp.py: a 2-process CPU DDP run of the tiny TD3+BC whose rank 0 raises at
its third batch, while rank 1 goes on into the next gradient all-reduce. Rank 0 catches the error and
stays alive (as a notebook or a user's program would), so rank 1's gloo connection stays open; it
prints whether the rank it launched ended within 60 s."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback

sys.path.insert(0, str(Path(__file__).parent))

from _lightning_fixtures import TINY_SPEC, FakeOfflineData  # noqa: E402

from offline_plugins.lightning.run import train_algorithm  # noqa: E402


class FailOnRankZero(Callback):
    launcher = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == 0 and batch_idx == 2:
            FailOnRankZero.launcher = trainer.strategy.launcher
            raise RuntimeError("planted failure on rank 0")


if __name__ == "__main__":
    torch.set_num_threads(1)
    try:
        train_algorithm(TINY_SPEC, FakeOfflineData(), steps=50, seed=0, eval_every=0, eval_episodes=1, devices=2,
                        accelerator="cpu", out_dir=Path(sys.argv[1]), progress=False, callbacks=[FailOnRankZero()])
    except RuntimeError as exc:
        if FailOnRankZero.launcher is None:  # rank 1: ended by rank 0's error (it should not get here)
            raise
        print(f"rank 0 caught: {exc}", flush=True)
        for proc in FailOnRankZero.launcher.procs:
            try:
                print(f"launched rank ended with {proc.wait(timeout=60)}", flush=True)
            except subprocess.TimeoutExpired:
                print("launched rank still running after 60 s", flush=True)
                proc.kill()
                sys.exit(3)
