"""Behaviour-policy training (TorchRL SAC / DQN) and the shipped policy files."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("gymnasium")

from offline_plugins.data.behaviour import POLICY_DIR, load_policy_file  # noqa: E402
from offline_plugins.data.errors import DatasetError  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from train_behaviour import TrainSettings, train  # noqa: E402  (a maintainer's script, not in the package)

sys.path.pop(0)


@pytest.mark.parametrize(
    "env_id, settings",
    [
        ("Pendulum-v1", TrainSettings(steps=120, warmup=60, eval_every=40, eval_episodes=1, hidden=(8, 8),
                                      critic_hidden=(16, 16), batch_size=16, random_episodes=1, reference_episodes=1)),
        ("CartPole-v1", TrainSettings(kind="dqn", steps=120, warmup=60, eval_every=40, eval_episodes=1, hidden=(8, 8),
                                      batch_size=16, noise=0.05, eps_decay_steps=100, random_episodes=2, reference_episodes=1)),
    ],
    ids=["sac", "dqn"],
)
def test_train_writes_loadable_policies(tmp_path, env_id, settings):
    card = train(env_id, settings, seed=0, out_dir=tmp_path, log=lambda m: None)
    files = load_policy_file(env_id, tmp_path)
    assert files.kind == settings.kind
    assert json.loads((tmp_path / f"{env_id.lower()}.json").read_text())["script"].startswith(
        "python scripts/train_behaviour.py " + env_id
    )
    assert card["seed"] == 0 and card["steps_trained"] == 120
    assert files.ref_min_score == card["random_return"] and files.ref_max_score == card["expert_return"]
    g = torch.Generator().manual_seed(0)
    obs = torch.zeros(files.payload["obs_dim"])
    for tier in ("medium", "expert"):
        a = files.policy(tier).act(obs, g)
        assert a.shape == ((1,) if settings.kind == "sac" else ())
    segments = files.replay_segments()
    assert sum(n for n, _ in segments) == card["medium_replay_steps"] == card["medium"]["step"]


def test_shipped_policy_files_are_small_and_documented():
    cards = sorted(POLICY_DIR.glob("*.json"))
    assert cards, "no behaviour policies shipped"
    for card_path in cards:
        card = json.loads(card_path.read_text())
        pt = card_path.with_suffix(".pt")
        assert pt.stat().st_size < 1_000_000
        for key in ("script", "seed", "steps", "expert", "medium", "random_return", "expert_return"):
            assert key in card, (card_path.name, key)
        assert card["expert_return"] > card["random_return"]


def test_missing_policy_file_says_how_to_train(tmp_path):
    with pytest.raises(DatasetError, match=r"scripts/train_behaviour.py Acrobot-v1"):
        load_policy_file("Acrobot-v1", tmp_path)
