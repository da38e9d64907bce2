"""A built-in multi-step task whose every step can be checked: chains of arithmetic, one step a line.

A prompt is a chain evaluated left to right, ``"7+5*3-2="``; a solution writes one step a
line, ``["7+5=12", "12*3=36", "36-2=34"]``, and its last result is the answer. Because each
step can be checked, step labels are generated rather than annotated (as Math-Shepherd,
Wang et al. 2024, arXiv:2312.08935, generates them, here exactly): a step is correct when
it applies the prompt's next operation to the correct running value and writes the right
result; from the first wrong step on, every step is labelled wrong (PRM800K's first-error
convention, Lightman et al. 2023, arXiv:2305.20050: a solution is wrong from its first error).

Labels are PRM800K's per-step ratings: ``1`` good, ``-1`` bad (``0``, neutral, is never made
here but is read from files; see :mod:`offline_plugins.text.data.steps`).

>>> task = StepChainTask()
>>> row = task.rows(1, seed=0, error_rate=1.0)[0]
>>> row["prompt"], row["steps"], row["labels"]
('1-8-5+9=', ['1-8=-7', '-7-5=-12', '-12+9=-6'], [1, 1, -1])
>>> task.step_labels("2*7+8=", ["2*7=15", "15+8=23"]), task.first_error("2*7+8=", ["2*7=14", "14+8=22"])
([-1, -1], None)
>>> task.reward("2*7+8=", "2*7=14\\n14+8=22")
1.0
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

from offline_plugins.text.tasks.base import Problem, TaskError, exact_match, hash_split

__all__ = ["STEP_SEPARATOR", "StepChainTask"]

#: the text between two steps of a solution
STEP_SEPARATOR = "\n"

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_OP_NAMES = {"+": "add", "-": "sub", "*": "mul"}
_STEP = re.compile(r"^\s*(-?\d+)\s*([+\-*])\s*(\d+)\s*=\s*(-?\d+)\s*$")


@dataclass(frozen=True)
class StepChainTask:
    """Chains of ``min_steps``..``max_steps`` operations on operands 1..``max_operand``, one step a line.

    Attributes:
        min_steps, max_steps: how many operations a prompt chains.
        max_operand: operands are drawn from 1..max_operand.
        ops: operators to draw from, a subset of ``"+-*"``.
        test_fraction: share of the prompts held out (by a hash of the prompt).
    """

    min_steps: int = 2
    max_steps: int = 3
    max_operand: int = 9
    ops: str = "+-*"
    test_fraction: float = 0.1
    #: the outcome verifier (ORM) is exact match of the last step's result, not of the whole solution (a
    #: problem's ``answer``): the rollout task's held-out gold is the verifier's reward (``heldout_reward``)
    scores_exact_match: ClassVar[bool] = False
    #: the SFT reference's token budget: the prompt and its whole solution (the ``steps-arithmetic`` rollout task)
    sft_max_length: ClassVar[int] = 64
    #: SFT steps of the cached reference: the PRM results' recipe (docs/prm.md)
    reference_sft_steps: ClassVar[int] = 800
    #: a solution of up to 3 steps, one a line (scripts/prm_results.py)
    max_new_tokens: ClassVar[int] = 32

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps or self.max_operand < 1 or not self.ops or set(self.ops) - set(_OPS):
            raise TaskError(f"StepChainTask needs 1 <= min_steps <= max_steps, max_operand >= 1 and ops within "
                            f"'+-*', got {self.min_steps}, {self.max_steps}, {self.max_operand}, {self.ops!r}")

    @property
    def name(self) -> str:
        ops = "".join(_OP_NAMES[op] for op in sorted(self.ops))  # no "*" in cache folder names
        return f"steps-{self.min_steps}to{self.max_steps}x{self.max_operand}-{ops}"

    def _parse(self, prompt: str) -> tuple[int, list[tuple[str, int]]]:
        body = prompt.strip()
        m = re.fullmatch(r"(\d+)((?:[+\-*]\d+)+)=", body)
        if m is None:
            raise TaskError(f"{self.name}: prompt {prompt!r} is not a chain like '7+5*3='; this task made no such prompt")
        return int(m.group(1)), [(op, int(b)) for op, b in re.findall(r"([+\-*])(\d+)", m.group(2))]

    def _split_of(self, prompt: str) -> str:
        return hash_split(prompt, self.test_fraction)

    def prompts(self, n: int, *, split: str = "train", seed: int = 0) -> list[str]:
        """``n`` prompts of ``split``, reproducible from ``seed`` (repeats allowed)."""
        rng = random.Random(f"{self.name}-{split}-{seed}")
        out: list[str] = []
        while len(out) < n:
            k = rng.randint(self.min_steps, self.max_steps)
            ops = "".join(f"{rng.choice(self.ops)}{rng.randint(1, self.max_operand)}" for _ in range(k))
            prompt = f"{rng.randint(1, self.max_operand)}{ops}="
            if self._split_of(prompt) == split:
                out.append(prompt)
        return out

    def problems(self, n: int, *, split: str = "train", seed: int = 0) -> list[Problem]:
        """``n`` problems whose answer is the whole correct solution, one step a line: what SFT on
        the task trains a solution writer on (:func:`offline_plugins.text.data.task_data.sft_reference`)."""
        return [Problem(p, STEP_SEPARATOR.join(self.solution(p))) for p in self.prompts(n, split=split, seed=seed)]

    def solution(self, prompt: str, *, error_at: Optional[int] = None, delta: int = 1) -> list[str]:
        """The steps of ``prompt``'s solution; with ``error_at = k`` the k-th step's result is off by
        ``delta`` and the later steps go on correctly from that wrong value."""
        value, chain = self._parse(prompt)
        steps = []
        for i, (op, b) in enumerate(chain):
            result = _OPS[op](value, b) + (delta if i == error_at else 0)
            steps.append(f"{value}{op}{b}={result}")
            value = result
        return steps

    def answer(self, prompt: str) -> str:
        return self.solution(prompt)[-1].split("=")[1]

    def step_labels(self, prompt: str, steps: Sequence[str]) -> list[int]:
        """PRM800K ratings of ``steps``: 1 while each step is the correct next step, -1 from the first that
        is not (a wrong result, operation or operand, an unreadable step, or a step beyond the chain)."""
        value, chain = self._parse(prompt)
        labels, ok = [], True
        for i, step in enumerate(steps):
            m = _STEP.match(step)
            if ok and m is not None and i < len(chain):
                a, op, b, result = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
                value_next = _OPS[chain[i][0]](value, chain[i][1])
                ok = (a, op, b, result) == (value, *chain[i], value_next)
                value = value_next
            else:
                ok = False
            labels.append(1 if ok else -1)
        return labels

    def first_error(self, prompt: str, steps: Sequence[str]) -> Optional[int]:
        """The index of the first wrong step, or None when every step is right."""
        return next((i for i, label in enumerate(self.step_labels(prompt, steps)) if label < 0), None)

    def reward(self, prompt: str, response: str) -> float:
        """The outcome verifier (ORM): 1.0 when the last line's result is the answer, whatever the steps."""
        last = response.strip().split(STEP_SEPARATOR)[-1]
        return exact_match(last.split("=")[-1], self.answer(prompt))

    def rewards(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        return [self.reward(p, r) for p, r in zip(prompts, responses)]

    @property
    def longest_prompts(self) -> list[str]:
        """The longest prompts the task makes (what the collector checks against the model's context)."""
        return [f"{self.max_operand}{f'{op}{self.max_operand}' * self.max_steps}=" for op in self.ops]

    def rows(self, n: int, *, split: str = "train", seed: int = 0, error_rate: float = 0.5) -> list[dict]:
        """``n`` step-labelled rows ``{"prompt", "steps", "labels"}``: a share ``error_rate`` of them with
        one planted error (at a uniformly drawn step, off by 1 to 3 either way), the rest correct."""
        rng = random.Random(f"{self.name}-rows-{split}-{seed}")
        out = []
        for prompt in self.prompts(n, split=split, seed=seed):
            n_steps = len(self._parse(prompt)[1])
            error_at = rng.randrange(n_steps) if rng.random() < error_rate else None
            steps = self.solution(prompt, error_at=error_at, delta=rng.choice((-3, -2, -1, 1, 2, 3)))
            out.append({"prompt": prompt, "steps": steps, "labels": self.step_labels(prompt, steps)})
        return out
