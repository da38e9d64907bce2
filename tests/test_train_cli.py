"""``offline-plugins train`` / ``eval``: the contract users and scripts rely on.

Bad input: one line on stderr, exit 2, nothing written. A short IQL run on the
built-in Pendulum medium-replay dataset (made in a private Minari store) writes
the summary, metrics, learning curve and checkpoint, and ``eval`` re-scores it.
"""

from __future__ import annotations

import csv
import json

import pytest
import torch

from _cli_checks import fails_cleanly

from offline_plugins.cli import main

torch.set_num_threads(1)

DATASET = "pendulum/medium-replay-v0"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("OFFLINE_PLUGINS_OFFLINE", "1")


def test_unknown_algorithm(capsys, tmp_path):
    fails_cleanly(capsys, tmp_path, "iqll", "--dataset", DATASET, match="unknown algorithm 'iqll'; did you mean 'iql'")


def test_unknown_dataset(capsys, tmp_path, minari_store):
    fails_cleanly(capsys, tmp_path, "iql", "--dataset", "pendulum/nope-v0", match="unknown dataset 'pendulum/nope-v0'")


def test_action_space_mismatch(capsys, tmp_path, minari_store):
    fails_cleanly(
        capsys, tmp_path, "cql-discrete", "--dataset", DATASET, match="needs discrete actions, but dataset"
    )


def test_unknown_set_key(capsys, tmp_path, minari_store):
    fails_cleanly(capsys, tmp_path, "iql", "--dataset", DATASET, "--set", "lrr=1", match="unknown config key 'lrr'")


def test_malformed_set_and_bad_value(capsys, tmp_path, minari_store):
    fails_cleanly(capsys, tmp_path, "iql", "--dataset", DATASET, "--set", "actor_lr", match="--set expects key=value")
    fails_cleanly(capsys, tmp_path, "iql", "--dataset", DATASET, "--set", "actor_lr=fast", match="expects float")


def test_malformed_config_file(capsys, tmp_path, minari_store):
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor_lr: [1e-3\n")
    fails_cleanly(capsys, tmp_path, "iql", "--dataset", DATASET, "--config", str(bad), match="is not valid YAML")
    listing = tmp_path / "list.yaml"
    listing.write_text("- actor_lr\n")
    fails_cleanly(capsys, tmp_path, "iql", "--dataset", DATASET, "--config", str(listing), match="must hold a mapping")


def test_eval_of_a_missing_checkpoint(capsys, tmp_path):
    assert main(["eval", str(tmp_path / "nope.ckpt")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_train_then_eval_iql_on_pendulum(capsys, tmp_path, minari_store):
    out = tmp_path / "iql"
    config = tmp_path / "iql.yaml"
    config.write_text("hidden: [32, 32]\nbatch_size: 64\n")
    args = ["train", "iql", "--dataset", DATASET, "--steps", "30", "--seed", "1", "--eval-every", "15"]
    args += ["--eval-episodes", "2", "--config", str(config), "--set", "expectile=0.8", "--out", str(out)]
    assert main(args + ["--no-progress", "--threads", "1", "--log-every", "5"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("iql on offline-plugins/pendulum/medium-replay-v0, 30 steps, seed 1: normalised score")
    assert " ms per action) in " in line  # the policy's acting cost (a planner's planning cost)

    summary = json.loads((out / "summary.json").read_text())
    for key in ("algorithm", "dataset", "steps", "seed", "return_mean", "return_std", "normalized_score", "wall_s"):
        assert summary[key] is not None, key
    assert (summary["algorithm"], summary["steps"], summary["seed"]) == ("iql", 30, 1)
    assert summary["config"]["hidden"] == [32, 32] and summary["config"]["expectile"] == 0.8
    with open(out / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert sum(1 for r in rows if r.get("train/loss_value")) == 6
    assert sum(1 for r in rows if r.get("eval/normalized_score")) == 2
    assert (out / "learning_curve.png").stat().st_size > 1000
    ckpt = out / "checkpoints" / "last.ckpt"

    assert main(["eval", str(ckpt), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["episodes"] == 2 and result["step"] == 30
    assert result["return_mean"] == pytest.approx(summary["return_mean"])
    assert result["normalized_score"] == pytest.approx(summary["normalized_score"])

    # the same folder again, without --resume: refused before anything is touched
    assert main(args + ["--no-progress"]) == 2
    assert "already holds a run" in capsys.readouterr().err

    # --resume continues to a larger step count
    more = ["train", "iql", "--dataset", DATASET, "--steps", "40", "--seed", "1", "--eval-every", "15"]
    more += ["--eval-episodes", "2", "--config", str(config), "--set", "expectile=0.8", "--out", str(out)]
    assert main(more + ["--resume", "--no-progress", "--threads", "1", "--json"]) == 0
    resumed = json.loads(capsys.readouterr().out)
    assert resumed["steps"] == 40 and [h["step"] for h in resumed["eval_history"]] == [15, 30, 40]
