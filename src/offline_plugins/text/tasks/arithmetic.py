"""The arithmetic tasks: prompts with an exact-match reward, no network.

A task makes problems (prompt, answer) from a seed, splits them deterministically
into train and test (a problem is in exactly one split), and scores a response by
exact match. :mod:`offline_plugins.text.data.task_data` turns a task into SFT data and
preference pairs; :class:`offline_plugins.text.envs.text.TextEnv` serves its prompts.

>>> task = ArithmeticTask(digits=2)
>>> p = task.problems(3, split="train", seed=0)
>>> p[0].prompt, p[0].answer
('73+46=', '119')
>>> task.reward(p[0].prompt, "119"), task.reward(p[0].prompt, " 120")
(1.0, 0.0)

:class:`LengthTask` asks the same prompts but scores a response by its length against a
target (a gold reward a small reward model can learn; the RLHF over-optimisation study):

>>> LengthTask(target=6).rewards(["73+46=", "73+46="], ["119", "119119"])
[0.5, 1.0]
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar, Sequence

from offline_plugins.text.tasks.base import Problem, Split, TaskError, exact_match, hash_split

__all__ = ["CHARSET", "ArithmeticTask", "LengthTask", "length_reward"]

#: characters a task's prompts and answers use
CHARSET = "0123456789+-*= "


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
    #: the verifier is exact match against :meth:`answer` (the held-out exact match is the gold score)
    scores_exact_match: ClassVar[bool] = True
    #: SFT steps of the cached reference the online and preference algorithms start from (the results' recipe)
    reference_sft_steps: ClassVar[int] = 2000
    #: the response budget of the online algorithms (its documented results')
    max_new_tokens: ClassVar[int] = 6

    def __post_init__(self) -> None:
        if self.digits < 1 or not self.ops or set(self.ops) - set("+-*"):
            raise TaskError(f"ArithmeticTask needs digits >= 1 and ops within '+-*', got {self.digits}, {self.ops!r}")

    @property
    def name(self) -> str:
        return f"arithmetic-{self.digits}d{''.join(sorted(self.ops))}"

    @property
    def reference_task(self) -> "ArithmeticTask":
        """The task whose exact answers train the SFT reference: this one."""
        return self

    @staticmethod
    def _solve(a: int, op: str, b: int) -> int:
        return a + b if op == "+" else a - b if op == "-" else a * b

    def _split_of(self, a: int, op: str, b: int) -> Split:
        return hash_split(f"{a}{op}{b}", self.test_fraction)

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


def length_reward(response: str, target: int) -> float:
    """``max(0, 1 - |len(response.strip()) - target| / target)``: 1 at ``target`` characters, falling linearly to
    0 at none and at twice the target.

    >>> [length_reward(r, 6) for r in ("", "119", "119119", " 1191191 ", "x" * 12, "x" * 20)]
    [0.0, 0.5, 1.0, 0.8333333333333334, 0.0, 0.0]
    """
    return max(0.0, 1.0 - abs(len(response.strip()) - target) / target)


@dataclass(frozen=True)
class LengthTask:
    """:class:`ArithmeticTask`'s prompts, scored by the response's length against ``target`` characters.

    The gold reward of the RLHF over-optimisation study (Gao et al. 2023, arXiv:2210.10760):
    a known function of the text (:func:`length_reward`) that a small reward model can learn
    from pairs. The SFT reference is the arithmetic task's (it answers in 1-3 characters, well
    under the default target of 6), so "longer is better" holds on the reference's samples
    and a policy pushed past ``target`` is over-optimising. Problems, splits and answers are
    the arithmetic task's (the answers stay on the rows: held-out exact match is reported
    beside the gold score).

    Attributes:
        target: the response length, in characters after stripping surrounding spaces, that scores 1.
        digits, ops, test_fraction: the arithmetic task's.
    """

    target: int = 6
    digits: int = 2
    ops: str = "+"
    test_fraction: float = 0.1
    scores_exact_match: ClassVar[bool] = False
    #: room past the 6-character target, so a policy can over-optimise the length (docs/rlhf.md)
    max_new_tokens: ClassVar[int] = 12

    def __post_init__(self) -> None:
        if isinstance(self.target, bool) or not isinstance(self.target, int) or self.target < 1:
            raise TaskError(f"LengthTask target must be a whole number of characters >= 1, got {self.target!r}; "
                            "e.g. target=6")
        self.reference_task  # checks digits and ops

    @property
    def reference_task(self) -> ArithmeticTask:
        """The arithmetic task: its exact answers train the SFT reference, and its problems are these."""
        return ArithmeticTask(digits=self.digits, ops=self.ops, test_fraction=self.test_fraction)

    @property
    def name(self) -> str:
        return f"{self.reference_task.name}-length{self.target}"

    def problems(self, n: int, *, split: Split = "train", seed: int = 0) -> list[Problem]:
        """The arithmetic task's problems (the same prompts and answers for the same ``seed``)."""
        return self.reference_task.problems(n, split=split, seed=seed)

    def answer(self, prompt: str) -> str:
        return self.reference_task.answer(prompt)

    def reward(self, prompt: str, response: str) -> float:
        """:func:`length_reward` of the response (the prompt does not enter)."""
        return length_reward(response, self.target)

    def rewards(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        return [length_reward(r, self.target) for r in responses]
