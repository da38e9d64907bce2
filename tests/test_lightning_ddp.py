"""``devices=2`` on CPU trains with DDP (gloo): the ranks end with identical
parameters and drew different batches. Spawns two processes (~20-45 s on 2 busy cores)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from _ranks import launch, ranks_in_sync

SCRIPT = Path(__file__).parent / "_lightning_ddp_run.py"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_cpu_ranks_stay_in_sync_and_sample_differently(tmp_path):
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = launch([sys.executable, str(SCRIPT), str(out), "8"], env, 230)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = ranks_in_sync(out)
    assert len(ranks[0]["batches"]) == len(ranks[1]["batches"]) == 8
    assert all(x != y for x, y in zip(ranks[0]["batches"], ranks[1]["batches"]))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 8
    assert (out / "checkpoints" / "last.ckpt").is_file()



@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_error_on_rank_zero_ends_the_rank_it_launched_instead_of_leaving_it_in_a_collective(tmp_path):
    # rank 0 catches the error and lives on, so only ending rank 1 frees it from its all-reduce
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = launch([sys.executable, str(Path(__file__).parent / "_ddp_rank0_fails.py"), str(tmp_path / "ddp")], env,
                  240)
    assert "rank 0 caught: planted failure on rank 0" in proc.stdout, proc.stderr[-3000:]
    assert "launched rank ended with" in proc.stdout and proc.returncode == 0, proc.stdout
