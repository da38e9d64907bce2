"""A bare resume finishes the run it resumes: its steps, seed, schedule and config come from the
checkpoint; what is given again overrides them, and the summary records which."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from lightning.pytorch import Callback

from _lightning_fixtures import TINY_SPEC, FakeOfflineData
from offline_plugins.cli import main
from offline_plugins.lightning.guards import RunInterrupted
from offline_plugins.lightning.run import load_checkpoint, train_algorithm

torch.set_num_threads(1)

DATASET = "pendulum/medium-replay-v0"


class _InterruptAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def _interrupted(out, **kw):
    with pytest.raises(RunInterrupted):
        train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=out, callbacks=[_InterruptAt(8)], progress=False, **kw)
    assert load_checkpoint(out / "checkpoints" / "last.ckpt")["global_step"] == 8


def test_a_bare_resume_takes_the_runs_steps_seed_schedule_and_config(tmp_path):
    run = dict(steps=24, seed=3, eval_every=6, eval_episodes=1, log_every=4, overrides=["hidden=8"])
    _interrupted(tmp_path / "cut", **run)
    resumed = train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=tmp_path / "cut", resume=True, progress=False)
    straight = train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=tmp_path / "straight", progress=False, **run)

    assert resumed["steps"] == 24 and resumed["seed"] == 3 and resumed["config"]["hidden"] == 8
    assert [h["step"] for h in resumed["eval_history"]] == [h["step"] for h in straight["eval_history"]]
    a, b = load_checkpoint(resumed["checkpoint"]), load_checkpoint(straight["checkpoint"])
    for k in b["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k
    record = resumed["resume"]
    assert record["from"].endswith("last.ckpt") and record["overridden"] == {}
    assert {k: record["kept"][k] for k in ("steps", "seed", "eval_every", "eval_episodes", "log_every")} == \
        {"steps": 24, "seed": 3, "eval_every": 6, "eval_episodes": 1, "log_every": 4}


def test_options_given_again_override_the_checkpoints_and_are_recorded(tmp_path):
    _interrupted(tmp_path / "cut", steps=24, seed=3, eval_every=6, eval_episodes=1)
    resumed = train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=tmp_path / "cut", resume=True, progress=False,
                    steps=30, overrides=["tau=0.1"])
    assert resumed["steps"] == 30 and resumed["seed"] == 3
    record = resumed["resume"]
    assert record["overridden"]["steps"] == {"checkpoint": 24, "now": 30}
    assert record["overridden"]["config.tau"] == {"checkpoint": 0.05, "now": 0.1}
    assert "steps" not in record["kept"] and record["kept"]["seed"] == 3


def test_the_cli_resume_without_flags_finishes_the_interrupted_run(tmp_path, minari_store, monkeypatch, capsys):
    monkeypatch.setenv("OFFLINE_PLUGINS_OFFLINE", "1")
    out = tmp_path / "run"
    with pytest.raises(RunInterrupted):
        train_algorithm("iql", DATASET, out_dir=out, steps=20, seed=1, eval_every=10, eval_episodes=1, threads=1,
              overrides=["hidden=[16,16]", "batch_size=32"], callbacks=[_InterruptAt(8)], progress=False)
    code = main(["train", "iql", "--dataset", DATASET, "--out", str(out), "--resume", "--no-progress",
                 "--threads", "1", "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 20 and summary["seed"] == 1
    assert summary["config"]["hidden"] == [16, 16] and summary["config"]["batch_size"] == 32
    assert [h["step"] for h in summary["eval_history"]] == [10, 20]
    assert summary["resume"]["kept"]["steps"] == 20 and summary["resume"]["overridden"] == {}


def test_a_bare_resume_keeps_logging_where_the_run_logged(tmp_path):
    pytest.importorskip("tensorboard")
    _interrupted(tmp_path / "cut", steps=12, eval_every=0, eval_episodes=1, logger="tensorboard")
    resumed = train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=tmp_path / "cut", resume=True, progress=False)
    assert resumed["resume"]["kept"]["logger"] == ["tensorboard"]
    assert set(resumed["loggers"]) == {"csv", "tensorboard"}


def test_resuming_a_finished_run_keeps_its_summary_and_files_and_a_larger_steps_trains_on(tmp_path):
    out = tmp_path / "done"
    first = train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=out, steps=12, eval_every=6, eval_episodes=1,
                            log_every=4, progress=False)
    assert first["losses"]
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    again = train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=out, resume=True, progress=False)
    assert again["already_complete"] and again["losses"] == first["losses"] and again["steps"] == 12
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == files  # nothing rewritten
    longer = train_algorithm(TINY_SPEC, FakeOfflineData(), out_dir=out, resume=True, steps=16, progress=False)
    assert longer["steps"] == 16 and longer["losses"] and "already_complete" not in longer
    assert json.loads((out / "summary.json").read_text())["steps"] == 16
