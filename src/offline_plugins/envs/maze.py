"""A point mass in a 2-D maze with a fixed goal, and the waypoint controller that made D4RL's maze2d.

:class:`PointMazeGoalEnv` is gymnasium-robotics' ``PointMazeEnv`` (the D4RL maze2d
point mass: force actions in ``[-1, 1]^2``, 0.01 s per step) seen as D4RL's
``maze2d-*`` evaluation env (Fu et al. 2020, arXiv:2004.07219): the observation is
the point's position and velocity ``(x, y, vx, vy)``, the goal is fixed per task,
the start is a random free cell, and the sparse reward is 1 within 0.5 of the goal.

:class:`WaypointController` is D4RL's: a PD controller (``action = 10 (waypoint -
position) - velocity``) toward the centre of the next cell on the shortest cell path
(breadth-first search on the maze map) to a goal cell, with Gaussian action noise.

>>> import numpy as np
>>> c = WaypointController(U_MAZE)
>>> c.path((3, 1), (1, 1))
[(3, 1), (3, 2), (3, 3), (2, 3), (1, 3), (1, 2), (1, 1)]
>>> cell_xy(U_MAZE, (1, 1)).tolist(), xy_cell(U_MAZE, np.array([-1.2, 0.7]))
([-1.0, 1.0], (1, 1))
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import gymnasium as gym
import numpy as np

__all__ = ["U_MAZE", "MEDIUM_MAZE", "MAZES", "GOAL_RADIUS", "maze_env_spec", "maze_goal", "cell_xy", "xy_cell",
           "WaypointController", "PointMazeGoalEnv"]

# gymnasium-robotics' maps (1: wall, 0: free), the D4RL maze2d layouts
U_MAZE = ((1, 1, 1, 1, 1), (1, 0, 0, 0, 1), (1, 1, 1, 0, 1), (1, 0, 0, 0, 1), (1, 1, 1, 1, 1))
MEDIUM_MAZE = ((1, 1, 1, 1, 1, 1, 1, 1), (1, 0, 0, 1, 1, 0, 0, 1), (1, 0, 0, 1, 0, 0, 0, 1), (1, 1, 0, 0, 0, 1, 1, 1),
               (1, 0, 0, 1, 0, 0, 0, 1), (1, 0, 1, 0, 0, 1, 0, 1), (1, 0, 0, 0, 1, 0, 0, 1), (1, 1, 1, 1, 1, 1, 1, 1))

#: maze name -> (map, evaluation goal cell (row, col), evaluation episode steps: D4RL's maze2d limits)
MAZES: dict[str, tuple[tuple, tuple[int, int], int]] = {
    "UMaze": (U_MAZE, (1, 1), 300),
    "Medium": (MEDIUM_MAZE, (6, 6), 600),
}

GOAL_RADIUS = 0.5  # D4RL maze2d's sparse reward: 1 within this distance of the goal


def maze_env_spec(maze: str) -> gym.envs.registration.EnvSpec:
    """The Gymnasium spec of :class:`PointMazeGoalEnv` on ``maze`` (what the Minari dataset records)."""
    return gym.envs.registration.EnvSpec(
        id=f"offline_plugins/PointMaze{maze}Goal-v0", entry_point="offline_plugins.envs.maze:PointMazeGoalEnv",
        kwargs={"maze": maze}, max_episode_steps=MAZES[maze][2],
    )


def maze_goal(env_id: Optional[str]) -> Optional[np.ndarray]:
    """The fixed goal position ``(x, y)`` of a maze env id of :func:`maze_env_spec` (None for other envs)."""
    for maze, (layout, goal, _) in MAZES.items():
        if env_id == maze_env_spec(maze).id:
            return cell_xy(layout, goal)
    return None


def cell_xy(layout, cell) -> np.ndarray:
    """Centre ``(x, y)`` of cell ``(row, col)``: gymnasium-robotics' frame (scale 1, the map centred on 0)."""
    rows, cols = len(layout), len(layout[0])
    return np.array([cell[1] + 0.5 - cols / 2, rows / 2 - cell[0] - 0.5])


def xy_cell(layout, xy) -> tuple[int, int]:
    """The cell ``(row, col)`` that contains position ``xy``."""
    rows, cols = len(layout), len(layout[0])
    return int(np.floor(rows / 2 - xy[1])), int(np.floor(xy[0] + cols / 2))


class WaypointController:
    """D4RL's maze2d controller: PD toward the next cell of the breadth-first path to the goal cell.

    Args:
        layout: the maze map (rows of 1 = wall, 0 = free).

    Keyword Args:
        p_gain, d_gain: ``action = p_gain (waypoint - position) + d_gain velocity`` (D4RL: 10, -1).
        noise: standard deviation of the Gaussian noise added to the action before clipping
            to ``[-1, 1]`` (D4RL's noisy data: 0.5).
    """

    def __init__(self, layout, *, p_gain: float = 10.0, d_gain: float = -1.0, noise: float = 0.5) -> None:
        self.layout = layout
        self.p_gain, self.d_gain, self.noise = float(p_gain), float(d_gain), float(noise)
        self.free = [(r, c) for r, row in enumerate(layout) for c, v in enumerate(row) if v == 0]
        self._next: dict = {}  # goal cell -> {cell: next cell toward it}

    def path(self, start, goal) -> list:
        """Cells from ``start`` to ``goal`` along a shortest path."""
        cells = [tuple(start)]
        while cells[-1] != tuple(goal):
            cells.append(self._toward(tuple(goal))[cells[-1]])
        return cells

    def _toward(self, goal: tuple) -> dict:
        if goal not in self._next:  # breadth-first search from the goal: each cell's parent is its next step
            nxt, queue = {goal: goal}, deque([goal])
            while queue:
                r, c = queue.popleft()
                for n in ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)):
                    if n not in nxt and self.layout[n[0]][n[1]] == 0:
                        nxt[n] = (r, c)
                        queue.append(n)
            self._next[goal] = nxt
        return self._next[goal]

    def act(self, observation: np.ndarray, goal_cell, rng: np.random.Generator) -> np.ndarray:
        """The noisy, clipped action at ``observation = (x, y, vx, vy)`` toward ``goal_cell``."""
        pos, vel = observation[:2], observation[2:4]
        here = xy_cell(self.layout, pos)
        nxt = self._toward(tuple(goal_cell)).get(here, tuple(goal_cell))
        action = self.p_gain * (cell_xy(self.layout, nxt) - pos) + self.d_gain * vel
        if self.noise > 0:
            action = action + self.noise * rng.standard_normal(2)
        return np.clip(action, -1.0, 1.0).astype(np.float32)


class PointMazeGoalEnv(gym.Env):
    """D4RL's maze2d evaluation env on gymnasium-robotics' point maze: a fixed goal, a random start.

    Observation ``(x, y, vx, vy)``; reward 1.0 while within :data:`GOAL_RADIUS` of the goal
    (the centre of the task's goal cell), else 0; never terminates (the spec's time limit
    ends an episode). ``goal`` is the goal position.

    Args:
        maze: a name of :data:`MAZES`.
    """

    metadata = {"render_modes": []}

    def __init__(self, maze: str = "UMaze") -> None:
        if maze not in MAZES:
            raise ValueError(f"PointMazeGoalEnv: maze={maze!r} is not one of {', '.join(MAZES)}")
        try:
            from gymnasium_robotics.envs.maze.point_maze import PointMazeEnv
        except ImportError as exc:
            raise gym.error.DependencyNotInstalled(
                f"{exc}; the point maze needs gymnasium-robotics: pip install 'offline-plugins[mujoco]'"
            ) from None
        self.layout, self.goal_cell, _ = MAZES[maze]
        self.goal = cell_xy(self.layout, self.goal_cell)
        self.inner = PointMazeEnv(maze_map=[list(r) for r in self.layout], continuing_task=True, reset_target=False)
        self.action_space = self.inner.action_space
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float64)

    def reset(self, *, seed: Optional[int] = None, options: Optional[dict] = None):
        super().reset(seed=seed)
        obs, _ = self.inner.reset(seed=seed, options={"goal_cell": np.array(self.goal_cell), **(options or {})})
        return obs["observation"], {}

    def step(self, action):
        obs, _, _, _, info = self.inner.step(action)
        reward = float(np.linalg.norm(obs["observation"][:2] - self.goal) <= GOAL_RADIUS)
        return obs["observation"], reward, False, False, info

    def close(self) -> None:
        self.inner.close()
