"""The sequence models through the training shell: `train` builds, trains, evaluates and writes summary.json."""

from __future__ import annotations

import json

import pytest
import torch

from test_sequence_common import make_data


@pytest.fixture
def pendulum_like_data():
    gym = pytest.importorskip("gymnasium")
    from torchrl.data import Bounded

    data = make_data(lengths=(60, 80, 70))
    data.action_spec = Bounded(-2 * torch.ones(1), 2 * torch.ones(1), (1,))
    data.td["action"] = data.td["action"] * 2
    data.stats.ref_min_score, data.stats.ref_max_score = -1500.0, -150.0
    data.make_env = lambda **kw: gym.make("Pendulum-v1", max_episode_steps=15)
    return data


def test_dt_trains_evaluates_and_reloads_through_the_shell(pendulum_like_data, tmp_path):
    from offline_plugins.lightning.run import evaluate_checkpoint, train_algorithm

    summary = train_algorithm(
        "dt",
        pendulum_like_data,
        steps=2,
        eval_episodes=1,
        eval_every=0,
        out_dir=tmp_path / "run",
        progress=False,
        log_every=1,
        overrides={"context_len": "5", "batch_size": "40", "embed_dim": "16", "num_layers": "1", "warmup_steps": "2"},
    )
    assert summary["steps"] == 2 and summary["algorithm"] == "dt"
    assert summary["return_mean"] is not None and summary["normalized_score"] is not None
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["config"]["context_len"] == 5
    assert "train/loss" in saved["losses"]
    # the checkpoint rebuilds the same policy (the storage columns are re-added on the way)
    again = evaluate_checkpoint(summary["checkpoint"], data=pendulum_like_data, episodes=1)
    assert again["episodes"] == 1 and again["return_mean"] is not None


@pytest.mark.parametrize(
    "algo, overrides",
    [
        ("tt", {"slice_len": "4", "batch_size": "32", "bins": "8", "max_bin_error": "1.0", "embed_dim": "16",
                "num_layers": "1", "num_heads": "1", "horizon": "2", "beam_width": "2", "max_context_transitions": "2"}),
        ("diffuser", {"slice_len": "8", "batch_size": "32", "dim": "8", "n_diffusion_steps": "3", "n_samples": "2",
                      "plan_every": "2"}),
    ],
)
def test_planners_train_and_report_their_planning_cost(pendulum_like_data, tmp_path, algo, overrides):
    from offline_plugins.lightning.run import train_algorithm

    summary = train_algorithm(algo, pendulum_like_data, steps=2, eval_episodes=2, eval_every=0, out_dir=tmp_path / "run",
                    progress=False, log_every=1, overrides=overrides)
    # 2 episodes of 15 steps; the planning cost per action and the evaluation's wall time are in the summary
    assert summary["eval_history"][-1]["length_mean"] == 15
    assert summary["ms_per_action"] > 0 and summary["eval_s"] >= summary["eval_history"][-1]["eval_s"] > 0
    record = summary["eval_history"][-1]
    # one batched call acts in both episodes: a call costs about twice an action
    assert record["ms_per_call"] == pytest.approx(2 * record["ms_per_action"], rel=1e-3)
