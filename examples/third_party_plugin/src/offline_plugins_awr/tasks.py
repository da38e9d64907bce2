"""A text task, a tool, a reward function and a dataset recipe of this plugin: what a third party adds
beside algorithms.

- ``ReverseTask`` (``awr/reverse/v0``, short ``reverse``): ``rev abc=`` -> ``cba``, exact match.
- ``ReverseTool`` (``reverse``): a tool a multi-turn policy may call, answering its argument backwards.
- ``letter_overlap`` (``--reward letter-overlap``): the share of the prompt's letters the response uses,
  a dense reward for the reverse task.
- ``make_still_pendulum`` (``awr/pendulum-still-v0``): Pendulum-v1 under zero torque, a Minari dataset
  made locally.

Pure Python at import (no torch): the host lists them without importing anything heavy.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar, Sequence

from offline_plugins.text.tasks import Problem, exact_match, hash_split
from offline_plugins.text.tools.tools import Tool, ToolResult

LETTERS = "abcdefgh"


@dataclass(frozen=True)
class ReverseTask:
    """Write a word of 3 to ``longest`` letters backwards: ``rev abc=`` -> ``cba``.

    >>> task = ReverseTask()
    >>> p = task.problems(1, seed=0)[0]
    >>> task.reward(p.prompt, p.answer), task.reward(p.prompt, p.answer + "x")
    (1.0, 0.0)
    """

    longest: int = 5
    test_fraction: float = 0.1
    scores_exact_match: ClassVar[bool] = True
    reference_sft_steps: ClassVar[int] = 300
    max_new_tokens: ClassVar[int] = 8

    @property
    def name(self) -> str:
        return f"reverse-{self.longest}"

    @property
    def reference_task(self) -> "ReverseTask":
        return self

    @property
    def longest_prompts(self) -> list[str]:
        """The longest prompts it makes (the host sizes the rollouts' prompt budget on them)."""
        return [f"rev {'a' * self.longest}="]

    def problems(self, n: int, *, split: str = "train", seed: int = 0) -> list[Problem]:
        rng = random.Random(f"{self.name}-{split}-{seed}")
        out: list[Problem] = []
        while len(out) < n:
            word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, self.longest)))
            if hash_split(word, self.test_fraction) == split:
                out.append(Problem(f"rev {word}=", word[::-1]))
        return out

    def answer(self, prompt: str) -> str:
        return prompt.strip()[len("rev "):-1][::-1]

    def reward(self, prompt: str, response: str) -> float:
        return exact_match(response, self.answer(prompt))

    def rewards(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        return [self.reward(p, r) for p, r in zip(prompts, responses)]

    def corrupt(self, answer: str, rng: random.Random) -> str:
        return answer[::-1] if answer != answer[::-1] else answer + rng.choice(LETTERS)


class ReverseTool(Tool):
    """Answers its argument backwards.

    >>> ReverseTool().run("abc").text
    'cba'
    """

    name = "reverse"
    description = "writes its argument backwards, e.g. abc -> cba"
    health_call = ("abc", "cba")

    def run(self, argument: str) -> ToolResult:
        return ToolResult(self.name, argument.strip()[::-1])


def letter_overlap(prompts: Sequence[str], responses: Sequence[str], **columns) -> list[float]:
    """The share of the letters after ``rev `` in each prompt that its response contains (0 to 1)."""
    out = []
    for prompt, response in zip(prompts, responses):
        word = prompt.removeprefix("rev ").rstrip("=")
        out.append(sum(c in response for c in word) / max(len(word), 1))
    return out


def make_still_pendulum(spec, *, seed: int = 0, progress: bool = True, episodes=None, steps=None,
                        data_format=None, force: bool = False, save_as=None):
    """``episodes`` (default 4) episodes of Pendulum-v1 under zero torque, written with Minari (the host
    runs this inside its atomic build: a stopped make leaves nothing)."""
    import gymnasium as gym
    import minari
    import numpy as np
    from minari.data_collector import EpisodeBuffer

    n = int(episodes or 4)
    env = gym.make("Pendulum-v1")
    buffers = []
    for k in range(n):
        obs, _ = env.reset(seed=seed * 1000 + k)
        observations, rewards = [obs], []
        done = False
        while not done:
            obs, reward, terminated, truncated, _ = env.step(np.zeros(1, np.float32))
            observations.append(obs)
            rewards.append(reward)
            done = terminated or truncated
        T = len(rewards)
        buffers.append(EpisodeBuffer(id=k, seed=seed * 1000 + k, observations=np.asarray(observations, np.float32),
                                     actions=np.zeros((T, 1), np.float32), rewards=np.asarray(rewards),
                                     terminations=np.zeros(T, bool), truncations=np.arange(T) == T - 1))
    env.close()
    return minari.create_dataset_from_buffers(dataset_id=save_as or spec.id, buffer=buffers, env="Pendulum-v1",
                                              algorithm_name="zero torque", author="offline-plugins-awr",
                                              description="Pendulum-v1 left to swing under zero torque.")
