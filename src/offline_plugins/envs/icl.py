"""Task families for in-context RL (Algorithm Distillation), and the source learners whose histories it learns.

Laskin et al. 2022, "In-context Reinforcement Learning with Algorithm Distillation",
arXiv:2210.14215: multi-armed bandits and dark room. One Gymnasium episode of these
envs is a whole *learning history*: ``episodes`` in-context episodes of ``episode_len``
steps on one task drawn at ``reset``, played one after the other (the dark-room agent
goes back to the start between them). ``info["episode_end"]`` marks the last step of
each in-context episode; ``env.unwrapped.episode_returns`` lists their returns, as does
the last step's ``info["in_context_returns"]``.

Tasks are split by seed: ``reset(seed=s)`` draws task ``s`` of the env's ``split``
(``"train"`` or ``"test"``) from ``numpy.random.default_rng([split, s])``, so training
and held-out bandits are different draws, and held-out dark-room goals are cells no
training task uses (:data:`DARKROOM_TEST_CELLS` of them).

Numpy and Gymnasium only; :func:`learning_history` runs a :class:`UCB1` or
:class:`QLearning` learner over one history.

>>> env = BanditEnv(arms=3, episodes=50, split="test")
>>> h = learning_history(env, UCB1(3), np.random.default_rng(0), seed=0)
>>> h["actions"].shape, h["observations"].shape, bool(h["truncations"][-1]), len(env.episode_returns)
((50,), (51, 1), True, 50)
>>> room = DarkRoomEnv(size=5, episode_len=8, episodes=3)
>>> obs, _ = room.reset(seed=1)
>>> obs.tolist(), tuple(room.goal) != (2, 2), len(room.goal_cells)
([2.0, 2.0], True, 19)
"""

from __future__ import annotations

import abc
from typing import Optional

import gymnasium as gym
import numpy as np

__all__ = [
    "InContextEnv", "BanditEnv", "DarkRoomEnv", "UniformActions", "UCB1", "QLearning", "learning_history", "env_spec",
    "DARKROOM_TEST_CELLS",
]

_SPLITS = {"train": 0, "test": 1}
#: dark-room goal cells held out of training (the rest are training goals)
DARKROOM_TEST_CELLS = 0.2


def env_spec(name: str, **kwargs) -> gym.envs.registration.EnvSpec:
    """The Gymnasium spec of ``BanditEnv`` or ``DarkRoomEnv`` with ``kwargs`` (what a Minari dataset records)."""
    return gym.envs.registration.EnvSpec(id=f"offline_plugins/{name}-v0", entry_point=f"offline_plugins.envs.icl:{name}Env",
                                         kwargs=kwargs)


class InContextEnv(gym.Env, abc.ABC):
    """A task drawn at reset, then ``episodes`` in-context episodes of ``episode_len`` steps on it.

    Subclasses draw the task (:meth:`_draw_task`), start an episode (:meth:`_start`,
    returning the first observation) and move (:meth:`_move`, returning the next
    observation and the reward).
    """

    metadata = {"render_modes": []}

    def __init__(self, *, episodes: int, episode_len: int, split: str) -> None:
        if split not in _SPLITS:
            raise ValueError(f"{type(self).__name__}: split={split!r} must be 'train' or 'test'")
        if episodes < 1 or episode_len < 1:
            raise ValueError(f"{type(self).__name__}: episodes={episodes} and episode_len={episode_len} must be >= 1")
        self.episodes, self.episode_len, self.split = int(episodes), int(episode_len), split
        self.episode_returns: list[float] = []
        self._t = 0

    def reset(self, *, seed: Optional[int] = None, options: Optional[dict] = None):
        super().reset(seed=seed)
        rng = np.random.default_rng([_SPLITS[self.split], seed]) if seed is not None else self.np_random
        self._draw_task(rng)
        self.episode_returns, self._t = [0.0], 0
        return self._start(), {}

    def step(self, action):
        obs, reward = self._move(int(action))
        self._t += 1
        self.episode_returns[-1] += reward
        episode_end = self._t % self.episode_len == 0
        truncated = self._t >= self.episodes * self.episode_len
        if episode_end and not truncated:
            obs = self._start()
            self.episode_returns.append(0.0)
        info = {"episode_end": episode_end}
        if truncated:
            info["in_context_returns"] = list(self.episode_returns)
        return obs, reward, False, truncated, info

    @abc.abstractmethod
    def oracle_return(self) -> float:
        """The expected return of the whole history of a policy that knows the task (after ``reset``)."""

    @abc.abstractmethod
    def _draw_task(self, rng: np.random.Generator) -> None:
        """Draw this history's task (arm means, goal cell) from ``rng``."""

    @abc.abstractmethod
    def _start(self) -> np.ndarray:
        """The observation an inner episode starts from (and the agent's position reset)."""

    @abc.abstractmethod
    def _move(self, action: int) -> tuple[np.ndarray, float]:
        """Apply ``action``: the next observation and the step's reward."""


class BanditEnv(InContextEnv):
    """A Bernoulli ``arms``-armed bandit whose arm means are drawn uniformly in [0, 1] per task.

    An in-context episode is one pull (reward 1 with the arm's probability); the
    observation is a constant zero (a bandit has no state).
    """

    def __init__(self, arms: int = 5, episodes: int = 100, split: str = "train") -> None:
        super().__init__(episodes=episodes, episode_len=1, split=split)
        self.arms = int(arms)
        self.action_space = gym.spaces.Discrete(self.arms)
        self.observation_space = gym.spaces.Box(0.0, 1.0, (1,), np.float32)
        self.means = np.zeros(self.arms)

    def oracle_return(self):
        return float(self.means.max()) * self.episodes

    def _draw_task(self, rng):
        self.means = rng.uniform(0.0, 1.0, self.arms)

    def _start(self):
        return np.zeros(1, np.float32)

    def _move(self, action):
        return self._start(), float(self.np_random.random() < self.means[action])


class DarkRoomEnv(InContextEnv):
    """A ``size`` x ``size`` grid; the agent starts in the centre and sees its own cell only.

    Actions: stay, up, down, left, right. Reward 1 on every step spent on the task's
    goal cell, which the observation does not show (Laskin et al. 2022: 9x9, episodes
    of 20 steps). The goal is any cell but the start; goals of the ``"test"`` split are a
    fixed fifth of those cells.
    """

    _MOVES = np.array([[0, 0], [-1, 0], [1, 0], [0, -1], [0, 1]])

    def __init__(self, size: int = 9, episode_len: int = 20, episodes: int = 40, split: str = "train") -> None:
        super().__init__(episodes=episodes, episode_len=episode_len, split=split)
        self.size = int(size)
        self.action_space = gym.spaces.Discrete(5)
        self.observation_space = gym.spaces.Box(0.0, self.size - 1.0, (2,), np.float32)
        start = (self.size // 2) * (self.size + 1)
        cells = np.random.default_rng(0).permutation(np.delete(np.arange(self.size * self.size), start))
        n_test = max(1, int(round(DARKROOM_TEST_CELLS * cells.size)))
        self.goal_cells = {"test": cells[:n_test], "train": cells[n_test:]}[split]
        self.goal = np.zeros(2, np.int64)
        self.pos = np.zeros(2, np.int64)

    def oracle_return(self):
        # walk straight to the goal, then stay: rewarded from the step that arrives to the episode's end
        distance = int(np.abs(self.goal - self.size // 2).sum())
        return float(max(self.episode_len - distance + 1, 0)) * self.episodes

    def _draw_task(self, rng):
        cell = int(rng.choice(self.goal_cells))
        self.goal = np.array(divmod(cell, self.size))

    def _start(self):
        self.pos = np.full(2, self.size // 2)
        return self.pos.astype(np.float32)

    def _move(self, action):
        self.pos = np.clip(self.pos + self._MOVES[action], 0, self.size - 1)
        return self.pos.astype(np.float32), float((self.pos == self.goal).all())


class UniformActions:
    """The random baseline: uniform actions, learns nothing."""

    def __init__(self, actions: int) -> None:
        self.actions = actions

    def act(self, obs, rng) -> int:
        return int(rng.integers(self.actions))

    def update(self, *transition) -> None:
        pass


class UCB1:
    """UCB1 (Auer et al. 2002): each arm once, then ``argmax mean + sqrt(2 ln t / n)``."""

    def __init__(self, arms: int) -> None:
        self.counts, self.sums = np.zeros(arms), np.zeros(arms)

    def act(self, obs, rng) -> int:
        untried = np.flatnonzero(self.counts == 0)
        if untried.size:
            return int(untried[0])
        t = self.counts.sum()
        return int(np.argmax(self.sums / self.counts + np.sqrt(2.0 * np.log(t) / self.counts)))

    def update(self, obs, action, reward, next_obs, episode_end) -> None:
        self.counts[action] += 1
        self.sums[action] += reward


class QLearning:
    """Tabular epsilon-greedy Q-learning over grid cells, optimistic start ``Q = 1`` (explores the room)."""

    def __init__(self, size: int, actions: int = 5, *, lr: float = 0.5, gamma: float = 0.9, epsilon: float = 0.1) -> None:
        self.size, self.q = size, np.ones((size * size, actions))
        self.lr, self.gamma, self.epsilon = lr, gamma, epsilon

    def _cell(self, obs) -> int:
        return int(obs[0]) * self.size + int(obs[1])

    def act(self, obs, rng) -> int:
        q = self.q[self._cell(obs)]
        if rng.random() < self.epsilon:
            return int(rng.integers(q.size))
        return int(rng.choice(np.flatnonzero(q == q.max())))

    def update(self, obs, action, reward, next_obs, episode_end) -> None:
        s = self._cell(obs)
        target = reward + (0.0 if episode_end else self.gamma * self.q[self._cell(next_obs)].max())
        self.q[s, action] += self.lr * (target - self.q[s, action])


def learning_history(env: gym.Env, learner, rng: np.random.Generator, *, seed: Optional[int] = None) -> dict:
    """Run ``learner`` through one Gymnasium episode of ``env`` (a whole learning history).

    ``env`` is reset with ``seed`` (which picks the task). Returns
    ``observations [T+1, D]``, ``actions [T]``, ``rewards [T]``, ``terminations``,
    ``truncations`` (Minari's episode fields) and ``episode_returns`` (per in-context episode).
    """
    base = env.unwrapped
    obs = env.reset(seed=seed)[0]
    fields = {"observations": [obs], "actions": [], "rewards": [], "terminations": [], "truncations": []}
    done = False
    while not done:
        action = learner.act(obs, rng)
        next_obs, reward, term, trunc, info = env.step(action)
        # at an episode's end next_obs is the next episode's start, which the learner does not bootstrap from
        learner.update(obs, action, reward, next_obs, info["episode_end"])
        for key, value in zip(fields, (next_obs, action, reward, term, trunc)):
            fields[key].append(value)
        obs, done = next_obs, term or trunc
    out = {k: np.asarray(v) for k, v in fields.items()}
    out["rewards"] = out["rewards"].astype(np.float64)
    out["episode_returns"] = np.asarray(base.episode_returns)
    return out
