"""Multi-turn text episodes with tools: the settings, and the built-in ``tool-arithmetic`` task.

An episode takes up to :attr:`MultiTurn.max_turns` turns: the policy writes a turn, which ends at
the end of a tool call (``</tool>``), at eos or at the turn's token budget; the calls it made are
run by the :class:`~offline_plugins.envs.tools.ToolBox` and their answers appended as one
observation (``<result>56088</result>``), and the policy goes on; a turn without a call (or the
last turn) ends the episode, and the verifier scores its final answer, the text of its last turn.
The rollout collector runs the episodes (:mod:`offline_plugins.data.multiturn`) when its prompt
source carries a :class:`MultiTurn`.

:class:`ToolArithmeticTask` is multiplication of ``digits``-digit numbers, beyond the tiny model's
reach unless it calls the calculator; its SFT demonstrations call it
(:meth:`ToolArithmeticTask.demonstration`):

>>> task = ToolArithmeticTask()
>>> p = task.problems(1, seed=0)[0]
>>> p.prompt, p.answer
('<tool name="calculator">...</tool> 329*165=', '54285')
>>> task.demonstration(p)
'<tool name="calculator">329*165</tool><result>54285</result>54285'
>>> task.reward(p.prompt, "54285"), task.reward(p.prompt, '<tool name="calculator">329*165</tool>')
(1.0, 0.0)
>>> MultiTurn(ToolBox([Calculator()]), max_turns=0)
Traceback (most recent call last):
...
offline_plugins.envs.tools.ToolError: max_turns must be a whole number >= 1 (turns the policy takes per episode), got 0; e.g. max_turns=3
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar, Sequence

from offline_plugins.envs.tasks import Problem, exact_match
from offline_plugins.envs.tools import Calculator, ToolBox, ToolError

__all__ = ["MultiTurn", "ToolArithmeticTask", "FAILURE_KINDS"]

#: the kinds of a failed tool call (:class:`~offline_plugins.envs.tools.ToolResult`), each counted per round
FAILURE_KINDS = ("malformed", "unknown_tool", "error", "timeout", "sandbox")


@dataclass(frozen=True)
class MultiTurn:
    """How an episode goes on after a turn: the tools, the turn limit, the observation's form and budget.

    Attributes:
        tools: the :class:`~offline_plugins.envs.tools.ToolBox` that runs the calls.
        max_turns: turns the policy takes at most (>= 1); the last turn's text is the answer.
        stop: where a turn that calls a tool ends (the call's closing tag).
        observation: the form of one tool answer shown to the policy (``{}``: its text).
        max_observation_tokens: an observation longer than this is cut to it.
    """

    tools: ToolBox
    max_turns: int = 3
    stop: str = "</tool>"
    observation: str = "<result>{}</result>"
    max_observation_tokens: int = 96

    def __post_init__(self) -> None:
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ToolError(f"max_turns must be a whole number >= 1 (turns the policy takes per episode), got "
                            f"{self.max_turns!r}; e.g. max_turns=3")
        if self.max_observation_tokens < 1:
            raise ToolError(f"max_observation_tokens must be >= 1, got {self.max_observation_tokens!r}")

    def observe(self, texts: Sequence[str]) -> str:
        """The observation of one turn's tool answers."""
        return "".join(self.observation.format(t) for t in texts)


@dataclass(frozen=True)
class ToolArithmeticTask:
    """``a*b`` for ``digits``-digit ``a`` and ``b``, answered with the calculator's help.

    The prompt states the call format; the verifier is exact match of the final answer (the text
    after the last observation). Problems split into train and test by a hash of ``a*b``, as
    :class:`~offline_plugins.envs.tasks.ArithmeticTask`'s.

    Attributes:
        digits: the operands' digits.
        max_turns: the episode's turn limit.
        test_fraction: share of problems held out.
    """

    digits: int = 3
    max_turns: int = 3
    test_fraction: float = 0.1
    scores_exact_match: ClassVar[bool] = True
    #: the SFT reference's token budget: prompt, call, observation and answer (the tiny model's context)
    sft_max_length: ClassVar[int] = 128
    #: the call format, before each problem (short: prompt and episode fit the tiny model's 128 positions)
    hint: ClassVar[str] = '<tool name="calculator">...</tool> '

    def __post_init__(self) -> None:
        if self.digits < 1:
            raise ToolError(f"ToolArithmeticTask needs digits >= 1, got {self.digits!r}")
        self.multiturn  # checks max_turns

    @property
    def name(self) -> str:
        return f"tool-arithmetic-{self.digits}d"

    @property
    def reference_task(self) -> "ToolArithmeticTask":
        return self

    @property
    def multiturn(self) -> MultiTurn:
        # an answer's observation is <= 23 tokens; a failure's is cut to 24, so an episode fits 128 positions
        return MultiTurn(ToolBox([Calculator()]), max_turns=self.max_turns, max_observation_tokens=24)

    @property
    def longest_prompts(self) -> list[str]:
        return [f"{self.hint}{'9' * self.digits}*{'9' * self.digits}="]

    def _operands(self, prompt: str) -> tuple[int, int]:
        body = prompt[len(self.hint):] if prompt.startswith(self.hint) else prompt
        a, _, b = body.strip().rstrip("=").partition("*")
        try:
            return int(a), int(b)
        except ValueError:
            raise ToolError(f"{self.name}: cannot parse prompt {prompt!r}; prompts look like "
                            f"'{self.hint}123*456='") from None

    def problems(self, n: int, *, split: str = "train", seed: int = 0) -> list[Problem]:
        """``n`` problems of ``split``, reproducible from ``seed``."""
        from offline_plugins.envs.tasks import ArithmeticTask

        splitter = ArithmeticTask(digits=self.digits, ops="*", test_fraction=self.test_fraction)
        rng = random.Random(f"{self.name}-{split}-{seed}")
        lo, hi = 10 ** (self.digits - 1), 10 ** self.digits - 1
        out: list[Problem] = []
        while len(out) < n:
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            if splitter._split_of(a, "*", b) == split:
                out.append(Problem(f"{self.hint}{a}*{b}=", str(a * b)))
        return out

    def answer(self, prompt: str) -> str:
        a, b = self._operands(prompt)
        return str(a * b)

    def demonstration(self, problem: Problem) -> str:
        """An episode that calls the calculator and answers with its result, as one SFT completion."""
        a, b = self._operands(problem.prompt)
        return f'<tool name="calculator">{a}*{b}</tool>{self.multiturn.observe([problem.answer])}{problem.answer}'

    def reward(self, prompt: str, response: str) -> float:
        return exact_match(response, self.answer(prompt))

    def rewards(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        return [self.reward(p, r) for p, r in zip(prompts, responses)]
