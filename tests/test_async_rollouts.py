"""Overlapped rollouts (issue 43 item 1, ``--set async_rollouts=true``): the next round is sampled in a
worker process while the current one trains, from weights at most ``max_staleness`` steps old.
What a user relies on: a seeded run is the same run bit for bit for a given ``max_staleness`` (and with
0 it is the synchronous loop's); the lag of each round is logged and bounded; ``--resume`` continues the
same run, after a clean stop or ``kill -9``; the worker does not outlive its trainer; bad settings are
one line."""

from __future__ import annotations

import contextlib
import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
TESTS = Path(__file__).resolve().parent
# 6 prompts x 4 responses = 24 rollouts a round, 8 a step: 3 updates a round
SETTINGS = {"group_size": 4, "prompts_per_round": 6, "batch_size": 8, "max_new_tokens": 4, "eval_prompts": 10,
            "lr": 3e-3}


def _train(prompt_file, out, *, steps=12, resume=False, **overrides):
    from offline_plugins.lightning.run import train_algorithm

    return train_algorithm("grpo", str(prompt_file), steps=steps, seed=0, out_dir=out, progress=False, threads=1,
                           reward="_text_rewards:digit_share", eval_every=0, log_every=1, resume=resume,
                           overrides={**SETTINGS, **overrides} if not resume else None)


def _weights(out: Path) -> bytes:
    return (out / "model" / "model.safetensors").read_bytes()


def _column(out: Path, name: str) -> list[float]:
    return [float(r[name]) for r in csv.DictReader(open(out / "metrics.csv")) if r.get(name)]


@pytest.mark.slow
def test_a_seeded_async_run_repeats_bit_for_bit_and_its_lag_is_the_bound(prompt_file, tmp_path):
    a = _train(prompt_file, tmp_path / "a", async_rollouts=True)
    b = _train(prompt_file, tmp_path / "b", async_rollouts=True)
    assert a["steps"] == b["steps"] == 12 and _weights(tmp_path / "a") == _weights(tmp_path / "b")
    # the whole round overlapped (max_staleness unset): each round after the first trained 3 steps after its weights
    assert _column(tmp_path / "a", "rollout/sampler_lag_steps") == [0.0, 3.0, 3.0, 3.0]
    # a tighter bound: the weights are taken 1 step before the round starts
    c = _train(prompt_file, tmp_path / "c", async_rollouts=True, max_staleness=1)
    assert c["steps"] == 12 and _column(tmp_path / "c", "rollout/sampler_lag_steps") == [0.0, 1.0, 1.0, 1.0]
    assert _weights(tmp_path / "c") != _weights(tmp_path / "a")
    # the rollout correction was turned on (it weighs the lag) and the sync check ran on the first round
    assert a["config"]["rollout_correction"] == 2.0
    assert _column(tmp_path / "a", "rollout/sync_logprob_gap")[0] < 1e-5


@pytest.mark.slow
def test_with_no_staleness_it_is_the_synchronous_loop_bit_for_bit(prompt_file, tmp_path):
    _train(prompt_file, tmp_path / "sync", rollout_correction=2.0)
    _train(prompt_file, tmp_path / "async", async_rollouts=True, max_staleness=0)
    assert _weights(tmp_path / "sync") == _weights(tmp_path / "async")
    assert _column(tmp_path / "async", "rollout/sampler_lag_steps") == [0.0] * 4


@pytest.mark.slow
def test_a_resumed_async_run_is_the_uninterrupted_one(prompt_file, tmp_path):
    _train(prompt_file, tmp_path / "full", async_rollouts=True)
    # stopped mid-round (step 4 of round 1, round 2 being sampled), then continued
    _train(prompt_file, tmp_path / "part", steps=4, async_rollouts=True)
    resumed = _train(prompt_file, tmp_path / "part", steps=12, resume=True)
    assert resumed["steps"] == 12 and _weights(tmp_path / "part") == _weights(tmp_path / "full")


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "State:\tZ" in state


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["kill-9", "ctrl-c"])
def test_a_killed_or_interrupted_run_loses_nothing_and_the_sampler_does_not_outlive_it(sig, prompt_file, tmp_path):
    _train(prompt_file, tmp_path / "full", steps=30, async_rollouts=True)
    out = tmp_path / "stopped"
    argv = [sys.executable, "-m", "offline_plugins.cli", "train", "grpo", "--dataset", str(prompt_file),
            "--steps", "30", "--seed", "0", "--eval-every", "0", "--log-every", "1", "--checkpoint-every", "2",
            "--threads", "1", "--no-progress", "--out", str(out), "--reward", "_text_rewards:digit_share",
            *[x for k, v in {**SETTINGS, "async_rollouts": "true"}.items() for x in ("--set", f"{k}={v}")]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _stop_midway(proc, out, sig, prompt_file, tmp_path)
    finally:  # a failed check leaves no run behind
        for pid in [proc.pid, *_children(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def _stop_midway(proc, out, sig, prompt_file, tmp_path):
    ckpt = out / "checkpoints" / "last.ckpt"
    deadline = time.time() + 120
    workers: list[int] = []
    while time.time() < deadline and proc.poll() is None:
        workers = workers or _children(proc.pid)
        if ckpt.is_file() and workers and ckpt.stat().st_size > 0:
            time.sleep(0.3)  # a few steps past the first checkpoints
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
    assert workers, "the run started no sampler process"
    os.kill(proc.pid, sig)  # SIGINT: the whole group gets Ctrl-C, as a terminal sends it
    if sig == signal.SIGINT:
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w, signal.SIGINT)
    code = proc.wait(timeout=60)
    assert code != 0  # stopped before its 30 steps (an interrupted run exits non-zero, saying how to resume)
    end = time.time() + 10
    while time.time() < end and not all(_gone(w) for w in workers):
        time.sleep(0.1)
    assert all(_gone(w) for w in workers), f"the sampler {workers} outlived its trainer"
    resumed = _train(prompt_file, out, steps=30, resume=True)
    assert resumed["steps"] == 30 and _weights(out) == _weights(tmp_path / "full")


@pytest.mark.parametrize("overrides, match", [
    ({"async_rollouts": True, "max_staleness": -1}, "config key 'max_staleness' of GRPOConfig must be >= 0 "
                                                    r"\(async_rollouts: the most optimiser steps"),
    ({"max_staleness": 2}, "max_staleness bounds the overlapped rollouts of --set async_rollouts=true"),
])
def test_bad_async_settings_are_one_line(overrides, match, prompt_file, tmp_path):
    from offline_plugins.errors import UserError

    with pytest.raises(UserError, match=match):
        _train(prompt_file, tmp_path / "r", steps=1, **overrides)


def test_the_cli_says_a_negative_staleness_in_one_line(prompt_file, tmp_path, capsys):
    from offline_plugins.cli import main

    rc = main(["train", "grpo", "--dataset", str(prompt_file), "--steps", "1", "--out", str(tmp_path / "r"),
               "--no-progress", "--reward", "_text_rewards:digit_share", "--set", "async_rollouts=true",
               "--set", "max_staleness=-3"])
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err and "max_staleness" in err and "-3" in err, err
