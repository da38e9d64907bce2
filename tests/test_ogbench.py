"""OGBench's manipulation datasets made by their recipe: what was made matches the published
description, the single-task rewards are OGBench's own, the score is the success rate, and each
bad input meets one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("ogbench")

from offline_plugins.cli import main  # noqa: E402
from offline_plugins.data.errors import DatasetError  # noqa: E402
from offline_plugins.data.ogbench import (  # noqa: E402
    _targets,
    collect_episodes,
    singletask_env_id,
    successes,
)
from offline_plugins.data.store import make_dataset, store_path  # noqa: E402


@pytest.fixture(scope="module")
def cube_single(minari_store):
    """Two whole episodes (1,001 steps each) of cube-single's play recipe, and its task-3 view."""
    make_dataset("ogbench/cube-single-play-v0", episodes=2, progress=False, exist_ok=True)
    make_dataset("ogbench/cube-single-play-singletask-task3-v0", progress=False, exist_ok=True)
    return minari_store


def _note(dataset_id: str) -> dict:
    return json.loads((store_path() / dataset_id / "offline_plugins.json").read_text())


def test_the_play_recipe_makes_whole_episodes_of_1001_steps_in_which_the_oracle_finishes_its_subtasks(cube_single):
    import minari

    dataset = minari.load_dataset("ogbench/cube-single-play-v0")
    episodes = list(dataset.iterate_episodes())
    assert len(episodes) == 2 and all(len(ep.actions) == 1001 for ep in episodes)
    assert all(ep.observations.shape == (1002, 28) for ep in episodes)
    assert np.abs(np.concatenate([ep.actions for ep in episodes])).max() <= 1.0
    note = _note("ogbench/cube-single-play-v0")
    assert note["ogbench"] and note["task"] == 2 and note["eval_env"] == "cube-single-singletask-task2-v0"
    # the plan oracle picks up the cube and places it at a new target again and again: in 1,001 steps
    # it finishes several sub-tasks, and reaches the target in almost all of them
    assert note["subtasks"] >= 6 and note["solved"] >= 0.8 * note["subtasks"]
    assert dataset.recover_environment(eval_env=True).spec.id == "cube-single-singletask-task2-v0"


def test_the_collection_is_a_function_of_the_seed_and_leaves_numpy_global_stream_as_it_was():
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    a, record_a = collect_episodes("cube-single", "play", episodes=1, steps=120, seed=4)
    assert (np.random.get_state()[1] == before).all()
    b, _ = collect_episodes("cube-single", "play", episodes=1, steps=120, seed=4)
    c, _ = collect_episodes("cube-single", "play", episodes=1, steps=120, seed=5)
    assert np.array_equal(a[0]["actions"], b[0]["actions"]) and np.array_equal(a[0]["qpos"], b[0]["qpos"])
    assert not np.array_equal(a[0]["actions"], c[0]["actions"])
    assert a[0]["qpos"].shape[0] == 121 and record_a["retries"] == 0


def test_the_noisy_recipe_draws_random_actions_at_its_rate():
    # cube's noisy data: a uniform random action with probability 0.1, else the Markov oracle plus noise
    eps, _ = collect_episodes("cube-single", "noisy", episodes=1, steps=400, seed=0)
    assert eps[0]["actions"].shape == (400, 5) and np.abs(eps[0]["actions"]).max() <= 1.0
    puzzle, _ = collect_episodes("puzzle-3x3", "noisy", episodes=1, steps=50, seed=0)
    assert puzzle[0]["button_states"].shape == (51, 9)


@pytest.mark.parametrize("env", ["cube-single", "puzzle-3x3", "scene"])
def test_the_relabelled_success_is_the_one_ogbench_single_task_env_computes(env):
    """Our vectorised success of every object at every state equals what OGBench's own env says
    (``_compute_successes`` after ``set_state``) on states the oracle visited."""
    import gymnasium as gym

    eps, _ = collect_episodes(env, "play", episodes=1, steps=300, seed=1)
    ep = eps[0]
    for task in (1, 4):
        goal = _targets(env, task)
        ours = successes(env, goal, ep["qpos"], ep.get("button_states"))
        check = gym.make(singletask_env_id(env, task))
        check.reset(seed=0)
        u = check.unwrapped
        # the visited states, and the same states with every object moved to its goal (all solved)
        solved_qpos, solved_buttons = ep["qpos"].copy(), ep.get("button_states")
        for i in range(goal["num_cubes"]):
            solved_qpos[:, 14 + 7 * i:17 + 7 * i] = goal["cubes"][i]
        if "buttons" in goal:
            solved_buttons = np.broadcast_to(goal["buttons"], ep["button_states"].shape).copy()
        if "drawer" in goal:
            drawer = 14 + 7 * goal["num_cubes"] + goal["num_buttons"]
            solved_qpos[:, drawer], solved_qpos[:, drawer + 1] = goal["drawer"], goal["window"]
        solved = successes(env, goal, solved_qpos, solved_buttons)
        assert solved.all() and not ours.all()
        for t, qpos, buttons, expect in [(t, ep["qpos"][t], ep.get("button_states", [None] * 300)[t], ours[t])
                                         for t in range(0, 300, 23)] + [
                                        (t, solved_qpos[t], (solved_buttons if solved_buttons is not None
                                                             else [None] * 300)[t], solved[t]) for t in (0, 150)]:
            if buttons is not None:
                u.set_state(qpos, ep["qvel"][t], buttons)
            else:
                u.set_state(qpos, ep["qvel"][t])
            theirs = u._compute_successes()
            if env == "scene":  # cubes, buttons, then the drawer and the window
                cubes, buttons, drawer, window = theirs
                theirs = [*cubes, *buttons, drawer, window]
            assert list(expect) == [bool(x) for x in theirs], (env, task, t)
        check.close()


def test_a_task_view_holds_the_tasks_rewards_and_stops_bootstrapping_where_it_is_solved(cube_single):
    from offline_plugins.data import load_offline_data

    base = load_offline_data("ogbench/cube-single-play-v0")
    view = load_offline_data("ogbench/cube-single-play-singletask-task3-v0")
    assert len(view) == len(base) == 2002 and view.env_id == "cube-single-singletask-task3-v0"
    assert base.env_id == "cube-single-singletask-task2-v0"
    assert torch_equal(view.td["observation"], base.td["observation"])
    for data in (base, view):  # one cube: reward 0 where it sits at the target, else -1, terminal exactly there
        reward, term = data.td["next", "reward"].squeeze(-1), data.td["next", "terminated"].squeeze(-1)
        assert set(reward.unique().tolist()) <= {-1.0, 0.0}
        assert ((reward == 0) == term).all()
    assert _note("ogbench/cube-single-play-singletask-task3-v0")["from"] == "ogbench/cube-single-play-v0"


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_a_task_outside_1_to_5_an_env_not_made_here_and_another_ogbench_each_meet_one_line(cube_single, capsys):
    from offline_plugins.data import load_offline_data

    assert main(["train", "iql", "--dataset", "ogbench/cube-single-play-singletask-task6-v0", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "cube-single has tasks 1-5, not 6" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    with pytest.raises(DatasetError, match="antmaze-large.*cube-single, cube-double, scene, puzzle-3x3"):
        load_offline_data("ogbench/antmaze-large-play-v0")
    path = store_path() / "ogbench/cube-single-play-v0" / "offline_plugins.json"
    saved = path.read_text()
    try:
        path.write_text(json.dumps({**json.loads(saved), "ogbench": "0.9.0"}))
        with pytest.raises(DatasetError, match=r"made with ogbench 0\.9\.0, and ogbench .* is installed.*--force"):
            load_offline_data("ogbench/cube-single-play-v0")
    finally:
        path.write_text(saved)


def test_without_ogbench_the_recipe_names_the_extra(monkeypatch):
    import builtins

    from offline_plugins.data.ogbench import _import_ogbench

    real = builtins.__import__

    def refuse(name, *args, **kwargs):
        if name == "ogbench" or name.startswith("ogbench."):
            raise ImportError("No module named 'ogbench'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", refuse)
    with pytest.raises(DatasetError, match=r"ogbench package.*pip install 'offline-plugins\[mujoco\]'"):
        _import_ogbench()


def test_training_on_a_task_prints_the_success_rate_and_plots_it(cube_single, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "iql", "--dataset", "ogbench/cube-single-play-singletask-task3-v0", "--steps", "4",
                 "--eval-every", "2", "--eval-episodes", "2", "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "success rate 0.0%" in text  # 4 steps of IQL do not solve a manipulation task
    summary = json.loads((out / "summary.json").read_text())
    assert summary["success_rate"] == 0.0 and summary["env_id"] == "cube-single-singletask-task3-v0"
    assert "eval/success_rate" in (out / "metrics.csv").read_text().splitlines()[0]


def test_the_success_rate_is_the_share_of_episodes_whose_last_step_reports_success():
    """An env reporting ``info["success"]`` (as OGBench's do) is scored by it: a policy that solves
    the episodes started at an even seed scores 1/2."""
    import gymnasium as gym
    import torch
    from tensordict.nn import TensorDictModule

    from offline_plugins.eval.rollout import evaluate_policy

    class Coin(gym.Env):
        observation_space = gym.spaces.Box(-1, 1, (1,), np.float32)
        action_space = gym.spaces.Box(-1, 1, (1,), np.float32)

        def reset(self, *, seed=None, options=None):
            self.even, self.t = seed % 2 == 0, 0
            return np.zeros(1, np.float32), {}

        def step(self, action):
            self.t += 1
            done = self.t == 3
            return np.zeros(1, np.float32), -1.0, done and self.even, done and not self.even, {"success": done and self.even}

    policy = TensorDictModule(lambda obs: torch.zeros_like(obs), in_keys=["observation"], out_keys=["action"])
    result = evaluate_policy(policy, Coin, episodes=4, seed=0)
    assert result.extra["success_rate"] == 0.5 and result.to_dict()["success_rate"] == 0.5
