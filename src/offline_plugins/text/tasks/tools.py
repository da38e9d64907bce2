"""The built-in tool tasks: :class:`ToolArithmeticTask` (``tool-arithmetic``) and :class:`ToolPythonTask`
(``tool-python``), each a task whose episodes take several turns with tools (its ``multiturn``, a
:class:`~offline_plugins.text.tools.multiturn.MultiTurn`).

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
>>> shaped = ToolArithmeticTask(tool_reward=0.25).multiturn
>>> shaped.turn_reward(p.prompt, shaped.tools.run_response('<tool name="calculator">329*165</tool>'))
0.25
>>> ToolArithmeticTask(tools=("calculator", "abacus"))
Traceback (most recent call last):
...
offline_plugins.text.tools.tools.ToolError: unknown tool 'abacus' in tools=('calculator', 'abacus'); the registered tools are calculator, python...('offline-plugins list', tools)
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

from offline_plugins.text.tasks.arithmetic import ArithmeticTask
from offline_plugins.text.tasks.base import Problem, exact_match
from offline_plugins.text.tools.multiturn import FAILURE_KINDS, MultiTurn, make_tools  # noqa: F401 (FAILURE_KINDS: the old path envs.multiturn)
from offline_plugins.text.tools.tools import ToolError, ToolResult

__all__ = ["ToolArithmeticTask", "ToolPythonTask"]


@dataclass(frozen=True)
class ToolArithmeticTask:
    """``a*b`` for ``digits``-digit ``a`` and ``b``, answered with the calculator's help.

    The prompt states the call format; the verifier is exact match of the final answer (the text
    after the last observation). Problems split into train and test by a hash of ``a*b``, as
    :class:`~offline_plugins.text.tasks.ArithmeticTask`'s.

    Attributes:
        digits: the operands' digits.
        max_turns: the episode's turn limit.
        test_fraction: share of problems held out.
        tools: the built-in tools the episodes may call (registered :class:`~offline_plugins.plugins.registry.ToolSpec` names).
        tool_timeout: seconds one call of the Python tool may take.
        tool_sandbox: the registered sandbox the Python tool's code runs in (None: ``bwrap``).
        tool_reward: the per-turn reward of a turn whose call answered the product (0: the verifier's
            reward at the end only).
    """

    digits: int = 3
    max_turns: int = 3
    test_fraction: float = 0.1
    tools: tuple = ("calculator",)
    tool_timeout: float = 5.0
    tool_reward: float = 0.0
    tool_sandbox: Optional[str] = None
    scores_exact_match: ClassVar[bool] = True
    #: the SFT reference's token budget: prompt, call, observation and answer (the tiny model's context)
    sft_max_length: ClassVar[int] = 128
    #: SFT steps of the cached reference: the documented results' recipe (docs/online.md); 2000 steps of
    #: 128-token demonstrations took about 85 minutes on a loaded 2-core machine
    reference_sft_steps: ClassVar[int] = 130
    #: each turn's budget: a calculator call of two 3-digit numbers is 37 characters (docs/online.md)
    max_new_tokens: ClassVar[int] = 40
    #: the call format, before each problem (short: prompt and episode fit the tiny model's 128 positions)
    hint: ClassVar[str] = '<tool name="calculator">...</tool> '
    #: the problem after the hint (``{a}``, ``{b}``: the operands)
    question: ClassVar[str] = "{a}*{b}="
    #: the task's name before its digits
    kind: ClassVar[str] = "tool-arithmetic"

    def __post_init__(self) -> None:
        if self.digits < 1:
            raise ToolError(f"ToolArithmeticTask needs digits >= 1, got {self.digits!r}")
        object.__setattr__(self, "tools", tuple(self.tools))
        if isinstance(self.tool_reward, bool) or not isinstance(self.tool_reward, (int, float)) \
                or not math.isfinite(self.tool_reward):
            raise ToolError(f"tool_reward must be a finite number (the reward of a turn whose call answered the "
                            f"product), got {self.tool_reward!r}; e.g. tool_reward=0.2")
        self.multiturn  # checks max_turns and the tools

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.digits}d"

    @property
    def reference_task(self) -> "ToolArithmeticTask":
        return self

    @property
    def multiturn(self) -> MultiTurn:
        # an answer's observation is <= 23 tokens; a failure's is cut to 24, so an episode fits 128 positions
        return MultiTurn(make_tools(self.tools, timeout=self.tool_timeout, sandbox=self.tool_sandbox), max_turns=self.max_turns,
                         max_observation_tokens=24, turn_reward=self._turn_reward if self.tool_reward else None)

    def _turn_reward(self, prompt: str, results: Sequence[ToolResult]) -> float:
        """``tool_reward`` for a turn with a call that answered this prompt's product, else 0."""
        answer = self.answer(prompt)
        return float(self.tool_reward) if any(r.ok and r.text.strip() == answer for r in results) else 0.0

    @property
    def longest_prompts(self) -> list[str]:
        return [self.hint + self.question.format(a="9" * self.digits, b="9" * self.digits)]

    def _operands(self, prompt: str) -> tuple[int, int]:
        body = prompt[len(self.hint):] if prompt.startswith(self.hint) else prompt
        found = re.fullmatch(re.escape(self.question).replace(r"\{a\}", r"(\d+)").replace(r"\{b\}", r"(\d+)"),
                             body.strip())
        if found is None:
            raise ToolError(f"{self.name}: cannot parse prompt {prompt!r}; prompts look like "
                            f"{self.hint + self.question.format(a=123, b=456)!r}")
        return int(found.group(1)), int(found.group(2))

    def problems(self, n: int, *, split: str = "train", seed: int = 0) -> list[Problem]:
        """``n`` problems of ``split``, reproducible from ``seed``."""
        splitter = ArithmeticTask(digits=self.digits, ops="*", test_fraction=self.test_fraction)
        rng = random.Random(f"{self.name}-{split}-{seed}")
        lo, hi = 10 ** (self.digits - 1), 10 ** self.digits - 1
        out: list[Problem] = []
        while len(out) < n:
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            if splitter._split_of(a, "*", b) == split:
                out.append(Problem(self.hint + self.question.format(a=a, b=b), self.solve(a, b)))
        return out

    @staticmethod
    def solve(a: int, b: int) -> str:
        """The answer to the problem of ``a`` and ``b``."""
        return str(a * b)

    @staticmethod
    def call(a: int, b: int) -> str:
        """The tool call that answers the problem of ``a`` and ``b`` (the demonstrations')."""
        return f'<tool name="calculator">{a}*{b}</tool>'

    def answer(self, prompt: str) -> str:
        return self.solve(*self._operands(prompt))

    def demonstration(self, problem: Problem) -> str:
        """An episode that calls the tool and answers with its result, as one SFT completion."""
        return "".join(text for text, _ in self.demonstration_segments(problem))

    def demonstration_segments(self, problem: Problem) -> list[tuple[str, bool]]:
        """The demonstration as ``(text, trained)``: the call, the tool's observation (not trained: the
        environment writes it), the answer."""
        return [(self.call(*self._operands(problem.prompt)), True),
                (self.multiturn.observe([problem.answer]), False), (problem.answer, True)]

    def reward(self, prompt: str, response: str) -> float:
        return exact_match(response, self.answer(prompt))

    def rewards(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        return [self.reward(p, r) for p, r in zip(prompts, responses)]


@dataclass(frozen=True)
class ToolPythonTask(ToolArithmeticTask):
    """The digits of ``a*b`` written backwards, answered with the Python tool's help.

    The calculator cannot reverse a number; one line of Python can. The demonstrations call
    ``print(str(a*b)[::-1])`` in the sandboxed :class:`~offline_plugins.text.tools.tools.PythonTool`
    (a fresh process per call, under ``tool_timeout`` seconds):

    >>> task = ToolPythonTask()
    >>> p = task.problems(1, seed=0)[0]
    >>> p.prompt, p.answer
    ('<tool name="python">...</tool> rev(387*584)=', '800622')
    >>> task.demonstration(p)
    '<tool name="python">print(str(387*584)[::-1])</tool><result>800622</result>800622'
    >>> [r.text for r in task.multiturn.tools.run_response(task.call(329, 165))]
    ['58245']
    """

    tools: tuple = ("python",)
    hint: ClassVar[str] = '<tool name="python">...</tool> '
    question: ClassVar[str] = "rev({a}*{b})="
    kind: ClassVar[str] = "tool-python"
    #: a call is 52 characters (docs/online.md)
    max_new_tokens: ClassVar[int] = 56

    @staticmethod
    def solve(a: int, b: int) -> str:
        return str(a * b)[::-1]

    @staticmethod
    def call(a: int, b: int) -> str:
        return f'<tool name="python">print(str({a}*{b})[::-1])</tool>'
