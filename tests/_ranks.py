"""Multi-process runs from the tests: each in its own process group, ended whole afterwards; what each
rank of a DDP run saves (:class:`SaveRankState`) and the check that the ranks ended in sync."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import torch
from lightning.pytorch import Callback


def launch(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` (a script whose Lightning launcher starts more ranks) in its own process group and
    kill the group when it returns or times out: a launched rank must not outlive a failed or
    timed-out rank 0, or it waits on gloo for Lightning's 30-minute timeout."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc.returncode is None:
            proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class SaveRankState(Callback):
    """Every rank writes its final parameters, the world size and what :meth:`extra` adds to ``OUT/rank<r>.pt``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def extra(self, trainer) -> dict:
        return {}

    def on_train_end(self, trainer, pl_module) -> None:
        state = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}
        torch.save({"state": state, "world_size": trainer.world_size, **self.extra(trainer)},
                   self.out / f"rank{trainer.global_rank}.pt")


def ranks_in_sync(out: Path) -> list[dict]:
    """The two ranks' records that :class:`SaveRankState` wrote to ``out``, after checking that both ran in a
    world of two and ended with the same parameters."""
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    a, b = (r["state"] for r in ranks)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), (out.name, k)
    return ranks
