"""The point-maze recipe: D4RL maze2d's waypoint controller, the dataset it writes, its rewards."""

import numpy as np
import pytest
import torch

pytest.importorskip("gymnasium_robotics")

from offline_plugins.envs.maze import U_MAZE, PointMazeGoalEnv, WaypointController, cell_xy, maze_goal, xy_cell  # noqa: E402

MAZE = "offline-plugins/pointmaze/umaze-v0"


def test_the_controller_reaches_its_goals_and_the_stream_visits_every_cell():
    from offline_plugins.data.maze import waypoint_stream

    s = waypoint_stream("UMaze", 3000, seed=0)
    assert s["observations"].shape == (3001, 4) and s["actions"].shape == (3000, 2)
    assert np.abs(s["actions"]).max() <= 1.0
    free = {(r, c) for r, row in enumerate(U_MAZE) for c, v in enumerate(row) if v == 0}
    assert {xy_cell(U_MAZE, p) for p in s["observations"][:, :2]} == free
    # a random goal cell every arrival: dozens in 3000 steps (the U's far end is 6 cells away)
    assert s["arrivals"] >= 20
    again = waypoint_stream("UMaze", 300, seed=0)
    assert np.array_equal(again["observations"], s["observations"][:301])
    assert not np.array_equal(waypoint_stream("UMaze", 300, seed=1)["observations"], again["observations"])


def test_without_noise_the_controller_drives_from_the_far_end_to_the_goal_and_stays():
    env, controller = PointMazeGoalEnv("UMaze"), WaypointController(U_MAZE, noise=0.0)
    obs, _ = env.reset(seed=0, options={"reset_cell": np.array([3, 1])})
    assert xy_cell(U_MAZE, obs[:2]) == (3, 1)
    rewards = []
    for _ in range(300):
        obs, r, term, trunc, _ = env.step(controller.act(obs, (1, 1), None))
        rewards.append(r)
        assert not term and not trunc
    assert np.linalg.norm(obs[:2] - np.array([-1.0, 1.0])) < 0.1
    first = rewards.index(1.0)
    assert 20 < first < 250 and all(r == 1.0 for r in rewards[first:])


def test_the_recipe_writes_episodes_of_the_horizon_with_rewards_at_the_fixed_goal(minari_store):
    from offline_plugins.data import load_offline_data
    from offline_plugins.data.store import make_dataset

    make_dataset(MAZE, steps=1500, progress=False, force=True)
    data = load_offline_data(MAZE)
    td = data.td
    assert data.num_episodes == 5 and torch.equal(torch.as_tensor(data.episode_lengths), torch.full((5,), 300))
    assert td["observation"].shape == (1500, 4) and td["action"].shape == (1500, 2)
    # one stream cut into episodes: each episode starts where the previous one stopped, truncated, never terminated
    ends = torch.arange(299, 1500, 300)
    assert torch.equal(td["observation"][ends[:-1] + 1], td["next", "observation"][ends[:-1]])
    assert td["next", "truncated"][ends].all() and td["next", "truncated"].sum() == 5
    assert not td["next", "terminated"].any()
    # the sparse reward recomputed by hand: 1 where the next position is within 0.5 of the goal cell (1, 1)'s centre
    goal = torch.tensor([-1.0, 1.0], dtype=td["observation"].dtype)
    by_hand = ((td["next", "observation"][:, :2] - goal).norm(dim=-1) <= 0.5).float()
    assert torch.equal(td["next", "reward"][:, 0].float(), by_hand) and by_hand.sum() > 0
    # the evaluation env is recovered from the metadata, with references random < controller
    env = data.make_env()
    assert env.spec.max_episode_steps == 300 and np.array_equal(env.unwrapped.goal, [-1.0, 1.0])
    assert 0 <= data.stats.ref_min_score < 30 < 150 < data.stats.ref_max_score <= 300
    assert np.array_equal(maze_goal(data.env_id), [-1.0, 1.0]) and maze_goal("Pendulum-v1") is None


def test_the_env_pays_one_within_half_a_unit_of_the_goal_and_starts_elsewhere():
    env = PointMazeGoalEnv("UMaze")
    for seed in range(5):
        obs, _ = env.reset(seed=seed)
        assert obs.shape == (4,) and np.linalg.norm(obs[:2] - env.goal) > 0.5
    env.inner.reset(seed=0, options={"goal_cell": np.array([1, 1]), "reset_cell": np.array([1, 2])})
    obs, r, *_ = env.step(np.zeros(2, np.float32))
    assert r == float(np.linalg.norm(obs[:2] - cell_xy(U_MAZE, (1, 1))) <= 0.5)
    with pytest.raises(ValueError, match="maze='Spiral'"):
        PointMazeGoalEnv("Spiral")
