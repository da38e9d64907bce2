"""Built-in verifiable text tasks: prompts with an exact-match reward, no network.

A task makes problems (prompt, answer) from a seed, splits them deterministically
into train and test (a problem is in exactly one split), and scores a response by
exact match. :mod:`offline_plugins.data.text_tasks` turns a task into SFT data and
preference pairs; :class:`offline_plugins.envs.text.TextEnv` serves its prompts.

>>> task = ArithmeticTask(digits=2)
>>> p = task.problems(3, split="train", seed=0)
>>> p[0].prompt, p[0].answer
('73+46=', '119')
>>> task.reward(p[0].prompt, "119"), task.reward(p[0].prompt, " 120")
(1.0, 0.0)
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Literal, Sequence

from offline_plugins.errors import UserError

__all__ = ["CHARSET", "Problem", "ArithmeticTask", "TaskError", "exact_match"]

#: characters a task's prompts and answers use
CHARSET = "0123456789+-*= "

Split = Literal["train", "test"]


def exact_match(response: str, answer: object) -> float:
    """1.0 if ``response`` and ``answer``, each stripped of surrounding spaces, are the same text; else 0.0.

    The one exact-match rule: a task's reward, a JSONL file's reward against its ``answer``
    column, and every held-out exact-match score.

    >>> exact_match(" 119", "119"), exact_match("1190", "119")
    (1.0, 0.0)
    """
    return 1.0 if response.strip() == str(answer).strip() else 0.0


class TaskError(UserError, ValueError):
    """A prompt the task did not make, or a bad task setting."""


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


@dataclass(frozen=True)
class ArithmeticTask:
    """Multi-digit integer arithmetic: ``"a+b="`` -> ``"c"``.

    Attributes:
        digits: operands have 1..``digits`` digits.
        ops: operators to draw from, a subset of ``"+-*"``.
        test_fraction: share of all problems reserved for the test split.
    """

    digits: int = 2
    ops: str = "+"
    test_fraction: float = 0.1

    def __post_init__(self) -> None:
        if self.digits < 1 or not self.ops or set(self.ops) - set("+-*"):
            raise TaskError(f"ArithmeticTask needs digits >= 1 and ops within '+-*', got {self.digits}, {self.ops!r}")

    @property
    def name(self) -> str:
        return f"arithmetic-{self.digits}d{''.join(sorted(self.ops))}"

    @staticmethod
    def _solve(a: int, op: str, b: int) -> int:
        return a + b if op == "+" else a - b if op == "-" else a * b

    def _split_of(self, a: int, op: str, b: int) -> Split:
        h = int.from_bytes(hashlib.blake2b(f"{a}{op}{b}".encode(), digest_size=4).digest(), "little")
        return "test" if (h % 10_000) < self.test_fraction * 10_000 else "train"

    def problems(self, n: int, *, split: Split = "train", seed: int = 0) -> list[Problem]:
        """``n`` problems of ``split``, reproducible from ``seed`` (repeats allowed when the split is small)."""
        rng = random.Random(f"{self.name}-{split}-{seed}")
        hi = 10**self.digits - 1
        out: list[Problem] = []
        while len(out) < n:
            a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice(self.ops)
            if self._split_of(a, op, b) == split:
                out.append(Problem(f"{a}{op}{b}=", str(self._solve(a, op, b))))
        return out

    def answer(self, prompt: str) -> str:
        """The exact answer to a prompt this task makes."""
        body = prompt.strip()
        if not body.endswith("="):
            raise TaskError(f"{self.name}: prompt {prompt!r} does not end with '='; prompts look like '12+34='")
        body = body[:-1]
        for i, ch in enumerate(body[1:], start=1):  # skip a leading minus sign
            if ch in self.ops:
                try:
                    return str(self._solve(int(body[:i]), ch, int(body[i + 1 :])))
                except ValueError:
                    break
        raise TaskError(f"{self.name}: cannot parse prompt {prompt!r}; prompts look like '12+34='")

    def reward(self, prompt: str, response: str) -> float:
        """1.0 if the response, stripped of surrounding spaces, is exactly the answer; else 0.0."""
        return exact_match(response, self.answer(prompt))

    def rewards(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        return [self.reward(p, r) for p, r in zip(prompts, responses)]

    def corrupt(self, answer: str, rng: random.Random) -> str:
        """A wrong answer close to the right one (one digit changed, or off by a small amount)."""
        value = int(answer)
        for _ in range(10):
            wrong = value + rng.choice([-10, -2, -1, 1, 2, 10, 100])
            if str(wrong) != answer:
                return str(wrong)
        return str(value + 1)
