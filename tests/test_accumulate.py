"""Gradient accumulation: micro-batches of one step's batch give that batch's gradient, in less memory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _lightning_fixtures import FakeOfflineData  # noqa: E402

from offline_plugins.cli import main  # noqa: E402
from offline_plugins.lightning.run import load_checkpoint, train_algorithm  # noqa: E402

torch.set_num_threads(1)

QUIET = dict(progress=False, eval_episodes=1, seed=0, eval_every=0)


def _params(summary) -> dict:
    return load_checkpoint(summary["checkpoint"])["state_dict"]


def _close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key].float(), b[key].float(), atol=tol, rtol=tol), key


def test_iql_with_four_micro_batches_trains_as_the_whole_batch(tmp_path):
    # IQL's terms are batch means with no sampling inside the loss: four weighted micro-batch
    # backwards sum to the whole batch's gradient (up to float rounding)
    kw = dict(overrides=["hidden=[16,16]", "batch_size=32"], steps=6, **QUIET)
    whole = train_algorithm("iql", FakeOfflineData(), out_dir=tmp_path / "whole", **kw)
    split = train_algorithm("iql", FakeOfflineData(), out_dir=tmp_path / "split", accumulate=4, **kw)
    _close(_params(whole), _params(split), 1e-5)
    assert split["config"]["batch_size"] == 32
    assert load_checkpoint(split["checkpoint"])["offline_plugins"]["run"]["accumulate"] == 4
    # the logged terms are the whole batch's: each micro-batch's weighted by its share
    for key, value in whole["losses"].items():
        assert split["losses"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_dpo_counts_pairs_per_step_whatever_the_micro_batches(tmp_path, preference_pairs):
    data = preference_pairs([{"prompt": f"q{i}=", "chosen": "good" + "!" * (i % 3), "rejected": "bad"}
                             for i in range(200)])
    kw = dict(steps=3, overrides={"batch_size": 8}, **QUIET)
    whole = train_algorithm("dpo", data, out_dir=tmp_path / "whole", **kw)
    split = train_algorithm("dpo", data, out_dir=tmp_path / "split", accumulate=2, **kw)
    _close(_params(whole), _params(split), 1e-5)


def test_bad_accumulation_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(Exception, match="accumulate must be a whole number >= 1"):
        train_algorithm("iql", FakeOfflineData(), out_dir=tmp_path / "a", accumulate=0, steps=1, **QUIET)
    with pytest.raises(Exception, match="a batch has only 4 elements"):
        train_algorithm("iql", FakeOfflineData(), out_dir=tmp_path / "b", accumulate=8, steps=1,
              overrides=["hidden=[16,16]", "batch_size=4"], **QUIET)
    with pytest.raises(SystemExit) as exit_:  # argparse's own usage error
        main(["train", "iql", "--dataset", "pendulum/medium-replay-v0", "--accumulate", "0", "--out",
              str(tmp_path / "c")])
    assert exit_.value.code == 2 and "argument --accumulate: expected a number >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
