"""The built-in text tasks as Gymnasium environments (one prompt per episode).

Registered as ``offline_plugins/TextArithmetic-v0`` by
:func:`offline_plugins.envs.register_gymnasium`: observations and actions are
strings (``gymnasium.spaces.Text``), the reward is the task's exact match.

>>> import gymnasium as gym
>>> from offline_plugins.envs import register_gymnasium
>>> register_gymnasium()
>>> env = gym.make("offline_plugins/TextArithmetic-v0", digits=2)
>>> obs, info = env.reset(seed=0)
>>> obs
'73+46='
>>> env.step("119")[1:3]
(1.0, True)
"""

from __future__ import annotations

from typing import Any, Optional

import gymnasium as gym

from offline_plugins.text.tasks.arithmetic import CHARSET, ArithmeticTask

__all__ = ["TextTaskGymEnv"]


class TextTaskGymEnv(gym.Env):
    """A verifiable text task as a one-step Gymnasium env: reset gives a prompt, step scores a response."""

    metadata = {"render_modes": []}

    def __init__(self, digits: int = 2, ops: str = "+", split: str = "train", max_length: int = 32) -> None:
        self.task = ArithmeticTask(digits=digits, ops=ops)
        self.split = split
        self.observation_space = gym.spaces.Text(max_length=max_length, charset=CHARSET)
        self.action_space = gym.spaces.Text(max_length=max_length, charset=CHARSET)
        self._prompt: Optional[str] = None
        self._count = 0
        self._seed = 0

    def reset(self, *, seed: Optional[int] = None, options: Optional[dict] = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        if seed is not None:
            self._seed, self._count = int(seed), 0
        problem = self.task.problems(1, split=self.split, seed=self._seed * 100_003 + self._count)[0]
        self._count += 1
        self._prompt = problem.prompt
        return problem.prompt, {"answer": problem.answer}

    def step(self, action: Any) -> tuple[str, float, bool, bool, dict]:
        if self._prompt is None:
            raise gym.error.ResetNeeded("call reset() before step()")
        reward = self.task.reward(self._prompt, str(action))
        prompt, self._prompt = self._prompt, None
        return prompt, reward, True, False, {"answer": self.task.answer(prompt)}
