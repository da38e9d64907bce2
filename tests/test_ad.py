"""Algorithm Distillation: the task families, the source learners, the history data, the loss, in-context gain."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from tensordict import TensorDict

gym = pytest.importorskip("gymnasium")

from offline_plugins.envs.icl import (  # noqa: E402
    DarkRoomEnv, BanditEnv, QLearning, UCB1, UniformActions, env_spec, learning_history)

BANDIT = "offline-plugins/bandit/histories-v0"


def test_tasks_are_a_pure_function_of_split_and_seed_and_the_splits_differ():
    a, b, test = BanditEnv(split="train"), BanditEnv(split="train"), BanditEnv(split="test")
    a.reset(seed=3), b.reset(seed=3), test.reset(seed=3)
    assert np.array_equal(a.means, b.means) and not np.allclose(a.means, test.means)
    a.reset(seed=4)
    assert not np.allclose(a.means, b.means)
    # dark room: held-out goals are cells no training task uses, and never the start cell
    train = {int(c) for c in DarkRoomEnv(split="train").goal_cells}
    held_out = {int(c) for c in DarkRoomEnv(split="test").goal_cells}
    assert not train & held_out and len(train | held_out) == 80 and 40 not in train | held_out
    room = DarkRoomEnv(split="test")
    goals = set()
    for seed in range(40):
        room.reset(seed=seed)
        goals.add(int(room.goal[0]) * 9 + int(room.goal[1]))
    assert goals <= held_out and len(goals) > 5
    with pytest.raises(ValueError, match="split='valid' must be 'train' or 'test'"):
        BanditEnv(split="valid")


def test_bandit_pays_each_arm_with_its_probability_and_a_history_is_many_one_pull_episodes():
    env = BanditEnv(arms=3, episodes=3000)
    env.reset(seed=0)
    rewards = np.array([env.step(1)[1] for _ in range(3000)])
    # 3000 Bernoulli draws: the frequency is within 4 standard errors of the arm's mean
    assert abs(rewards.mean() - env.means[1]) < 4 * math.sqrt(0.25 / 3000)
    assert len(env.episode_returns) == 3000 and env.episode_returns[:5] == list(rewards[:5])


def test_dark_room_rewards_every_step_on_the_unseen_goal_and_restarts_each_episode():
    env = DarkRoomEnv(size=5, episode_len=6, episodes=2)
    env.reset(seed=0)
    env.goal = np.array([0, 2])  # two steps up from the centre (2, 2)
    steps = [env.step(1) for _ in range(6)]  # up, up, then bump into the wall four times
    assert [s[1] for s in steps] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert steps[-1][4]["episode_end"] and steps[-1][0].tolist() == [2.0, 2.0]  # back at the start
    assert not any(s[3] for s in steps)
    obs, reward, _, truncated, info = env.step(0)
    assert reward == 0.0 and obs.tolist() == [2.0, 2.0] and not truncated
    for _ in range(5):
        *_, truncated, info = env.step(0)
    assert truncated and info["in_context_returns"] == [5.0, 0.0] == env.episode_returns
    assert env.oracle_return() == 2 * (6 - 2 + 1)


def test_the_source_learners_improve_across_their_histories():
    # UCB1: the regret of the last 20 pulls is well under that of the first 20, over 40 tasks
    regret = []
    for seed in range(40):
        env = BanditEnv(arms=5, episodes=100)
        h = learning_history(env, UCB1(5), np.random.default_rng(seed), seed=seed)
        regret.append(env.means.max() - env.means[h["actions"]])
    regret = np.asarray(regret)
    assert regret[:, -20:].mean() < 0.6 * regret[:, :20].mean()  # measured: 0.125 against 0.233
    # Q-learning in dark room: the last 10 episodes earn over 4x the first 10; random actions do not improve
    q, random = [], []
    for seed in range(10):
        env = DarkRoomEnv(episodes=50)
        q.append(learning_history(env, QLearning(9), np.random.default_rng(seed), seed=seed)["episode_returns"])
        random.append(learning_history(env, UniformActions(5), np.random.default_rng(seed), seed=seed)["episode_returns"])
    q, random = np.asarray(q), np.asarray(random)
    assert q[:, -10:].mean() > 4 * q[:, :10].mean() and q[:, -10:].mean() > 4 * random[:, -10:].mean() + 1


@pytest.fixture(scope="module")
def bandit_data(minari_store):
    from offline_plugins.data import load_offline_data
    from offline_plugins.data.store import make_dataset

    make_dataset(BANDIT, episodes=120, progress=False, force=True)
    return load_offline_data(BANDIT)


def test_history_data_layout_one_minari_episode_per_task_and_previous_step_columns(bandit_data):
    from offline_plugins.algorithms.sequence.ad import add_previous_steps

    data = bandit_data
    assert data.action_space == "discrete" and data.num_episodes == 120
    assert torch.equal(torch.as_tensor(data.episode_lengths), torch.full((120,), 100))
    td = data.td
    assert td["action"].dtype == torch.int64 and td["action"].shape == (12000,)
    # histories are the source learner's: task k of the seed-0 recipe is train task k, UCB1 from scratch
    env = BanditEnv(arms=5, episodes=100)
    h = learning_history(env, UCB1(5), np.random.default_rng(0), seed=0)
    assert td["action"][:5].tolist() == [0, 1, 2, 3, 4] == h["actions"][:5].tolist()  # UCB1 tries each arm once
    add_previous_steps(data, 5)
    a, r, prev_a, prev_r = td["action"], td["next", "reward"][:, 0], td["prev_action"], td["prev_reward"][:, 0]
    starts = torch.arange(0, 12000, 100)
    assert (prev_a[starts] == 5).all() and (prev_r[starts] == 0).all()
    inside = torch.ones(12000, dtype=torch.bool)
    inside[starts] = False
    assert torch.equal(prev_a[inside], a.roll(1)[inside]) and torch.equal(prev_r[inside], r.roll(1)[inside])
    # the evaluation env is the held-out family, with reference returns between random and oracle
    assert data.make_env().unwrapped.split == "test"
    assert 45 < data.stats.ref_min_score < 55 < 75 < data.stats.ref_max_score < 90


def test_loss_is_the_mean_cross_entropy_of_the_learners_actions():
    from tensordict.nn import TensorDictModule

    from offline_plugins.errors import UserError
    from offline_plugins.objectives.sequence.algorithm_distillation import AlgorithmDistillationLoss

    head = torch.nn.Linear(1, 2)
    with torch.no_grad():  # logits (0, x * ln 3): softmax (1/4, 3/4) at x = 1, (1/2, 1/2) at x = 0
        head.weight.copy_(torch.tensor([[0.0], [math.log(3)]]))
        head.bias.zero_()
    actor = TensorDictModule(head, ["observation"], ["action_logits"])
    batch = TensorDict({"observation": torch.tensor([[1.0], [1.0], [0.0]]), "action": torch.tensor([1, 0, 0])}, [3])
    loss = AlgorithmDistillationLoss(actor, diagnostics=True)
    expected = (-math.log(3 / 4) - math.log(1 / 4) - math.log(1 / 2)) / 3
    out = loss(batch)
    assert out["loss"].item() == pytest.approx(expected, rel=1e-6)
    assert out["action_accuracy"].item() == pytest.approx(2 / 3)  # argmax 1, 1, 0 (a tie goes to 0)
    per_step = AlgorithmDistillationLoss(actor, reduction="none")(batch)["loss"]
    assert per_step.tolist() == pytest.approx([-math.log(3 / 4), -math.log(1 / 4), -math.log(1 / 2)], rel=1e-6)
    one_hot = batch.clone().set("action", torch.nn.functional.one_hot(batch["action"], 2))
    assert loss(one_hot)["loss"].item() == pytest.approx(expected, rel=1e-6)
    out["loss"].backward()
    assert all(p.grad is not None for p in loss.actor_network_params.values(True, True))
    with pytest.raises(UserError, match="no key 'action'"):
        loss(batch.exclude("action"))
    with pytest.raises(UserError, match="reduction='avg'"):
        AlgorithmDistillationLoss(actor, reduction="avg")


def test_policy_refuses_a_step_without_the_previous_reward():
    from offline_plugins.errors import UserError
    from offline_plugins.modules.sequence.algorithm_distillation import (
        AlgorithmDistillationNet, AlgorithmDistillationPolicy)

    policy = AlgorithmDistillationPolicy(AlgorithmDistillationNet(1, 3, embed_dim=8, num_layers=1, num_heads=1,
                                                                  context_len=4), context_len=4)
    policy(TensorDict({"observation": torch.zeros(2, 1)}, [2]))
    with pytest.raises(UserError, match="no 'reward'"):
        policy(TensorDict({"observation": torch.zeros(2, 1)}, [2]))


def test_ad_improves_in_context_on_held_out_bandits(bandit_data, tmp_path):
    from offline_plugins.algorithms.sequence.ad import in_context_returns
    from offline_plugins.lightning.checkpoints import evaluate_checkpoint, load_trained_run
    from offline_plugins.lightning.run import train_algorithm

    summary = train_algorithm("ad", bandit_data, steps=300, seed=0, eval_episodes=2, eval_every=0,
                              out_dir=tmp_path / "run", progress=False,
                              overrides={"batch_size": "300", "num_layers": "1", "warmup_steps": "20", "lr": "2e-3",
                                         "dropout": "0"})
    # the shell's evaluation reports the in-context curve of the held-out tasks
    assert len(summary["eval_history"][-1]["in_context_return_mean"]) == 100
    policy = load_trained_run(summary["checkpoint"], data=bandit_data).module.policy
    returns = in_context_returns(policy, bandit_data.make_env, tasks=200, seed=1000)  # [tasks, pulls]
    assert returns.shape == (200, 100)
    first, last = returns[:, :10].mean(), returns[:, -20:].mean()
    # held-out arm means are U(0, 1): a random pull earns 0.5, the best of 5 arms 5/6 on average;
    # measured here: 0.56 over the first 10 pulls, 0.67 over the last 20 (UCB1: 0.57, 0.69)
    assert last > first + 0.06 and last > 0.5 + 0.1, (first, last)
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["config"]["context_len"] == 100 and "train/action_accuracy" in saved["losses"]
    # what `offline-plugins eval --json` prints carries the curve too
    again = evaluate_checkpoint(summary["checkpoint"], data=bandit_data, episodes=2)
    assert len(again["in_context_return_mean"]) == 100 and again["normalized_score"] is not None


def test_list_and_info_show_ad_and_its_recipes(capsys):
    from offline_plugins.cli import main

    assert main(["list"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("ad "))
    assert "sequence-model" in line and "trajectories" in line
    assert main(["info", "ad"]) == 0
    out = capsys.readouterr().out
    assert "arXiv:2210.14215" in out and "context_len" in out and "discrete" in out
    assert main(["data", "list"]) == 0
    out = capsys.readouterr().out
    assert BANDIT in out and "offline-plugins/darkroom/histories-v0" in out


def test_ad_refuses_continuous_actions_and_a_context_longer_than_the_histories(bandit_data):
    from offline_plugins.algorithms.sequence.ad import ADConfig, build
    from offline_plugins.errors import UserError

    with pytest.raises(UserError, match="context_len=150 is longer than every episode"):
        build(ADConfig(context_len=150, batch_size=300), bandit_data)
    with pytest.raises(UserError, match="batch_size=1000 must be a multiple of context_len=30"):
        build(ADConfig(context_len=30), bandit_data)
    continuous = type("Data", (), {"observation_spec": bandit_data.observation_spec,
                                   "action_spec": bandit_data.action_spec, "action_space": "continuous"})()
    with pytest.raises(UserError, match="'continuous' actions but ad needs 'discrete'"):
        build(ADConfig(), continuous)
