"""Build a point-maze dataset the way D4RL made maze2d (Fu et al. 2020, arXiv:2004.07219).

One long stream of experience: the point starts in a random cell, the
:class:`~offline_plugins.envs.maze.WaypointController` (with its noise) drives it to a
random goal cell, and a new random goal cell is drawn each time it arrives (within 0.5
of the cell's centre). The stream is cut into episodes of the evaluation horizon
(truncated, never terminated: consecutive episodes share their boundary observation;
the steps are rounded up to whole episodes).
Rewards are those of the evaluation task: 1.0 within 0.5 of its fixed goal. The
reference returns are a uniform random policy's and the controller's (heading for
the evaluation goal) over the evaluation env's reset seeds ``0..REFERENCE_EPISODES-1``.
"""

from __future__ import annotations

import warnings
from typing import Optional

from offline_plugins.data.errors import DatasetError
from offline_plugins.data.store import build_atomically, check_data_format

__all__ = ["MAZE_RECIPES", "REFERENCE_EPISODES", "make_maze_dataset", "reference_returns", "waypoint_stream"]

#: recipe name -> its options: the maze (``offline_plugins.envs.maze.MAZES``) and the steps of experience
MAZE_RECIPES: dict[str, tuple] = {"pointmaze": (("maze", "UMaze"), ("steps", 100_000))}

REFERENCE_EPISODES = 50


def waypoint_stream(maze: str, steps: int, seed: int, pbar=None) -> dict:
    """``steps`` steps of the noisy waypoint controller on ``maze``: ``observations`` ``[steps + 1, 4]``,
    ``actions`` ``[steps, 2]``, ``goals`` (the cell it was heading for at each step) and ``arrivals``."""
    import numpy as np

    from offline_plugins.envs.maze import PointMazeGoalEnv, WaypointController, cell_xy

    env = PointMazeGoalEnv(maze)
    controller, rng = WaypointController(env.layout), np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    goal = controller.free[rng.integers(len(controller.free))]
    observations, actions, goals, arrivals = [obs], [], [], 0
    for _ in range(steps):
        action = controller.act(obs, goal, rng)
        obs, *_ = env.step(action)
        observations.append(obs)
        actions.append(action)
        goals.append(goal)
        if np.linalg.norm(obs[:2] - cell_xy(env.layout, goal)) < 0.5:
            goal, arrivals = controller.free[rng.integers(len(controller.free))], arrivals + 1
        if pbar is not None:
            pbar.update(1)
    env.close()
    return {"observations": np.stack(observations), "actions": np.stack(actions), "goals": np.array(goals),
            "arrivals": arrivals}


def reference_returns(maze: str, episodes: int = REFERENCE_EPISODES) -> tuple[float, float]:
    """``(random, controller)`` mean returns over the evaluation env's reset seeds ``0..episodes-1``."""
    import gymnasium as gym
    import numpy as np

    from offline_plugins.envs.maze import WaypointController, maze_env_spec

    env = gym.make(maze_env_spec(maze))
    controller, rng = WaypointController(env.unwrapped.layout), np.random.default_rng(0)
    env.action_space.seed(0)
    totals = []
    for policy in (lambda o: env.action_space.sample(), lambda o: controller.act(o, env.unwrapped.goal_cell, rng)):
        returns = []
        for k in range(episodes):
            obs, _ = env.reset(seed=k)
            done, ret = False, 0.0
            while not done:
                obs, r, term, trunc, _ = env.step(policy(obs))
                ret, done = ret + r, term or trunc
            returns.append(ret)
        totals.append(float(np.mean(returns)))
    env.close()
    return totals[0], totals[1]


def make_maze_dataset(
    spec,
    *,
    seed: int = 0,
    progress: bool = True,
    steps: Optional[int] = None,
    episodes: Optional[int] = None,
    data_format: Optional[str] = None,
    force: bool = False,
    save_as: Optional[str] = None,
):
    """Make the point-maze dataset of recipe ``spec`` in the local Minari store.

    Keyword Args:
        seed: the start, the controller's goals and its noise follow from it.
        progress: show a tqdm progress bar (one tick per step).
        steps: steps of experience (default: the recipe's ``steps`` option).
        episodes: stop after this many episodes of the evaluation horizon (small datasets for tests).
        data_format, force, save_as: as :func:`~offline_plugins.data.build.make_recipe_dataset`.
    """
    dataset_id = save_as or spec.id
    for name, value in (("steps", steps), ("episodes", episodes)):
        if value is not None and int(value) < 1:
            raise DatasetError(f"dataset recipe {spec.id!r}: {name}={value} must be at least 1")
    check_data_format(dataset_id, data_format)

    def build():
        return _build(spec, dataset_id, seed=seed, progress=progress, steps=steps, episodes=episodes,
                      data_format=data_format)

    return build_atomically(dataset_id, build, force=force)


def _build(spec, dataset_id: str, *, seed: int, progress: bool, steps, episodes, data_format):
    import gymnasium as gym
    import minari
    import numpy as np
    from minari.data_collector import EpisodeBuffer
    from tqdm.auto import tqdm

    from offline_plugins.envs.maze import GOAL_RADIUS, MAZES, maze_env_spec

    options = dict(spec.options)
    maze = options["maze"]
    horizon = MAZES[maze][2]
    steps = -(-int(steps if steps is not None else options["steps"]) // horizon) * horizon  # whole episodes
    if episodes is not None:
        steps = min(steps, int(episodes) * horizon)
    env_spec = maze_env_spec(maze)
    try:
        env = gym.make(env_spec)
        goal = env.unwrapped.goal
        env.close()
    except Exception as exc:  # gymnasium-robotics or mujoco missing
        raise DatasetError(f"dataset recipe {spec.id!r} needs the point maze, which cannot be made ({exc}); "
                           "pip install 'offline-plugins[mujoco]'") from None
    with tqdm(total=steps, desc=dataset_id, unit="step", disable=not progress, leave=False) as pbar:
        stream = waypoint_stream(maze, steps, seed, pbar)
    obs, actions = stream["observations"], stream["actions"]
    rewards = (np.linalg.norm(obs[1:, :2] - goal, axis=-1) <= GOAL_RADIUS).astype(np.float64)
    buffers = []
    for k, start in enumerate(range(0, steps, horizon)):
        end = min(start + horizon, steps)
        buffers.append(EpisodeBuffer(id=k, seed=seed, observations=obs[start:end + 1], actions=actions[start:end],
                                     rewards=rewards[start:end], terminations=np.zeros(end - start, bool),
                                     truncations=np.arange(start, end) == end - 1))
    ref_min, ref_max = reference_returns(maze)
    description = (f"{spec.summary} Made by offline-plugins recipe {spec.id!r} (seed {seed}): {steps} steps of "
                   f"D4RL's noisy waypoint controller ({stream['arrivals']} goals reached) cut into episodes of "
                   f"{horizon}; rewards against the evaluation goal {goal.tolist()}. Reference returns over reset "
                   f"seeds 0-{REFERENCE_EPISODES - 1}: uniform random actions (min) and the controller (max).")
    extra = {"data_format": data_format} if data_format else {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*author_email.*")
        return minari.create_dataset_from_buffers(
            dataset_id=dataset_id,
            buffer=buffers,
            env=env_spec,
            eval_env=env_spec,
            algorithm_name="offline-plugins/waypoint controller (D4RL maze2d)",
            author="offline-plugins",
            code_permalink="offline_plugins.data.maze:make_maze_dataset",
            description=description,
            ref_min_score=ref_min,
            ref_max_score=ref_max,
            **extra,
        )
