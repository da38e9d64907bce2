"""Multi-step word problems in GSM8K's shape, made from a seed: a task with headroom for ``small``.

A problem tells a short story in words (a starting quantity, then 2 to 8 changes to it: bought,
given away, multiplied, shared out) and asks for the quantity at the end. A solution writes
one step a line, the arithmetic of each change, and ends with the answer on a line of its own
after ``####``, as GSM8K's solutions do (Cobbe et al. 2021, arXiv:2110.14168):

>>> task = WordProblemTask(tiers=("easy",))
>>> p = task.problems(1, seed=0)[0]
>>> print(p.prompt)
There are 19 marbles in Leo's box. He sells 11 of the marbles. He loses 5 marbles. How many marbles are left in the end?
>>> print(p.answer)
19-11=8
8-5=3
#### 3
>>> task.reward(p.prompt, "19-11=8\\n8-5=3\\n#### 3"), task.reward(p.prompt, "#### 4"), task.reward(p.prompt, "3")
(1.0, 0.0, 0.0)

The verifier reads the number after the last ``####`` (commas and surrounding spaces allowed)
and compares it with the answer; ``format_reward`` (default 0) is what a wrong answer in the
right form earns. Difficulty comes in tiers, drawn in turn:

======  =====  ===================  ==========================================
tier    steps  operations           numbers
======  =====  ===================  ==========================================
easy    2-3    add, subtract        start 5-30, changes 2-20
medium  3-5    and multiply (x2-4)  start 5-50, changes 2-30
hard    5-8    and divide (2-9)     start 10-99, changes 2-60, multiply x2-5
======  =====  ===================  ==========================================

The quantity stays a whole number from 0 to 9,999 (a division is drawn only where it comes out
even). Problems split into train and test by a hash of the prompt. Two multi-turn variants
hand the arithmetic to a tool, so what is left to learn is reading the story:

* :class:`CalculatorWordProblemTask`: one calculator call per step, one step a turn;
* :class:`PythonWordProblemTask`: one Python program for the whole story, in the sandbox.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

from offline_plugins.modules.task_text import FRIENDS, ITEMS, OPENINGS, OPERATIONS, PEOPLE, QUESTIONS
from offline_plugins.text.tasks.base import Problem, TaskError, hash_split
from offline_plugins.text.tools.multiturn import MultiTurn, make_tools

__all__ = ["TIERS", "WORD_PROBLEM_TASKS", "WordProblemTask", "CalculatorWordProblemTask", "PythonWordProblemTask",
           "final_answer", "answer_format", "step_accuracy"]

_SYMBOL = {"add": "+", "sub": "-", "mul": "*", "div": "/"}


@dataclass(frozen=True)
class Tier:
    """How hard a problem is: its steps, the operations drawn and the numbers' ranges."""

    min_steps: int
    max_steps: int
    operations: tuple[str, ...]
    start: tuple[int, int]
    change: tuple[int, int]
    factor: tuple[int, int] = (2, 4)
    divisor: tuple[int, int] = (2, 9)


#: the difficulty tiers by name
TIERS: dict[str, Tier] = {
    "easy": Tier(2, 3, ("add", "sub"), (5, 30), (2, 20)),
    "medium": Tier(3, 5, ("add", "sub", "mul"), (5, 50), (2, 30)),
    "hard": Tier(5, 8, ("add", "sub", "mul", "div"), (10, 99), (2, 60), factor=(2, 5)),
}

_MAX_VALUE = 9_999
_FINAL = re.compile(r"####\s*(-?[\d,]*\d)\s*$")


def final_answer(response: str) -> Optional[int]:
    """The number after the last ``####`` of ``response`` when that line holds just a whole number
    (commas allowed), else None.

    >>> final_answer("3+4=7\\n#### 7"), final_answer("#### 1,234 "), final_answer("#### 7 apples"), final_answer("7")
    (7, 1234, None, None)
    """
    tail = response.rsplit("####", 1)
    if len(tail) != 2:
        return None
    found = _FINAL.match("####" + tail[1])
    return int(found.group(1).replace(",", "")) if found is not None else None


_STEP = re.compile(r"\s*(-?\d+)\s*([+\-*/])\s*(-?\d+)\s*=\s*(-?\d+)\s*")


def answer_format(prompts: Sequence[str], responses: Sequence[str], **_) -> list[float]:
    """A reward for the form alone: 1.0 where a response ends with a ``#### N`` line, else 0.0
    (``--reward format=offline_plugins.text.tasks.word_problems:answer_format``; a second reward of ``gdpo``).

    >>> answer_format(["", ""], ["3+4=7\\n#### 7", "the answer is 7"])
    [1.0, 0.0]
    """
    return [1.0 if final_answer(r) is not None else 0.0 for r in responses]


def step_accuracy(prompts: Sequence[str], responses: Sequence[str], **_) -> list[float]:
    """A reward for the working: the share of a response's ``a op b = c`` lines whose arithmetic holds
    (0.0 without any; ``--reward steps=offline_plugins.text.tasks.word_problems:step_accuracy``). It says
    nothing of whether the steps solve the story: a second reward beside the answer's.

    >>> step_accuracy(["", "", ""], ["3+4=7\\n7*2=15\\n#### 15", "#### 4", "8/2=4"])
    [0.5, 0.0, 1.0]
    """
    out = []
    for response in responses:
        steps = [m for m in (_STEP.fullmatch(line) for line in response.split("\n")) if m is not None]
        right = 0
        for m in steps:
            a, op, b, c = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
            value = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else (
                a // b if b != 0 and a % b == 0 else None)
            right += value == c
        out.append(right / len(steps) if steps else 0.0)
    return out


@dataclass(frozen=True)
class _Story:
    prompt: str
    start: int
    steps: tuple[tuple[str, int], ...]  # (operation, number)

    def values(self) -> list[int]:
        out = [self.start]
        for op, b in self.steps:
            v = out[-1]
            out.append(v + b if op == "add" else v - b if op == "sub" else v * b if op == "mul" else v // b)
        return out

    def lines(self) -> list[str]:
        values = self.values()
        return [f"{v}{_SYMBOL[op]}{b}={r}" for (op, b), v, r in zip(self.steps, values, values[1:])]


@dataclass(frozen=True)
class WordProblemTask:
    """Word problems of the ``tiers`` named, solved one step a line and answered after ``####``.

    Attributes:
        tiers: the difficulty tiers to draw from, in turn (:data:`TIERS`).
        test_fraction: share of the problems held out, by a hash of the prompt.
        format_reward: the reward of a wrong answer written as ``#### N`` (0: exact answers only).
    """

    tiers: tuple = ("easy", "medium", "hard")
    test_fraction: float = 0.1
    format_reward: float = 0.0
    #: the verifier reads the final number, not the whole solution: the held-out gold is its reward
    scores_exact_match: ClassVar[bool] = False
    #: a problem's answer is its worked solution (what SFT trains on); the verifier scores its final line
    worked_solutions: ClassVar[bool] = True
    #: the SFT reference's token budget: the longest story and its solution in ``small``'s tokens
    sft_max_length: ClassVar[int] = 256
    #: SFT steps of the cached reference: at 900 (lr 1e-3, batch 64) ``small`` answers 43 % of 300 held-out
    #: problems, inside the 20-50 % the comparison wants (3.7 % at 200 steps, 8.0 % at 600; docs/online.md)
    reference_sft_steps: ClassVar[int] = 900
    #: a solution of up to 8 lines of up to 13 characters, and the answer line
    max_new_tokens: ClassVar[int] = 128
    #: the task's name before its tiers
    kind: ClassVar[str] = "word-problems"

    def __post_init__(self) -> None:
        tiers = (self.tiers,) if isinstance(self.tiers, str) else tuple(self.tiers)
        unknown = [t for t in tiers if t not in TIERS]
        if not tiers or unknown:
            raise TaskError(f"{self.kind}: tiers must name some of {', '.join(TIERS)}, got {self.tiers!r}; "
                            "e.g. tiers=easy,medium")
        object.__setattr__(self, "tiers", tiers)
        if isinstance(self.format_reward, bool) or not isinstance(self.format_reward, (int, float)) \
                or not 0.0 <= float(self.format_reward) < 1.0:
            raise TaskError(f"{self.kind}: format_reward must be a number in [0, 1) (what a wrong answer written as "
                            f"'#### N' earns), got {self.format_reward!r}; e.g. format_reward=0.1")

    @property
    def name(self) -> str:
        return f"{self.kind}-{'-'.join(self.tiers)}"

    @property
    def reference_task(self) -> "WordProblemTask":
        return self

    # -- making problems -------------------------------------------------------------------------
    def _story(self, rng: random.Random, tier: Tier) -> _Story:
        name, subject, obj = rng.choice(PEOPLE)
        item = rng.choice(ITEMS)
        start = rng.randint(*tier.start)
        words = {"name": name, "P": subject.capitalize(), "p": subject, "o": obj, "item": item}
        sentences = [rng.choice(OPENINGS).format(b=start, **words)]
        steps: list[tuple[str, int]] = []
        value = start
        for _ in range(rng.randint(tier.min_steps, tier.max_steps)):
            op, b = self._step(rng, tier, value)
            steps.append((op, b))
            value = value + b if op == "add" else value - b if op == "sub" else value * b if op == "mul" else value // b
            sentence = rng.choice(OPERATIONS[op]).format(b=b, friend=rng.choice(FRIENDS), **words)
            sentences.append(sentence[0].upper() + sentence[1:])
        sentences.append(rng.choice(QUESTIONS).format(**words))
        return _Story(" ".join(sentences), start, tuple(steps))

    @staticmethod
    def _step(rng: random.Random, tier: Tier, value: int) -> tuple[str, int]:
        for _ in range(50):
            op = rng.choice(tier.operations)
            if op == "add":
                b = rng.randint(*tier.change)
                if value + b <= _MAX_VALUE:
                    return op, b
            elif op == "sub" and value >= tier.change[0]:
                return op, rng.randint(tier.change[0], min(value, tier.change[1]))
            elif op == "mul":
                b = rng.randint(*tier.factor)
                if 0 < value and value * b <= _MAX_VALUE:
                    return op, b
            elif op == "div":
                even = [d for d in range(tier.divisor[0], tier.divisor[1] + 1) if value >= d and value % d == 0]
                if even:
                    return op, rng.choice(even)
        return "add", 1

    def _split_of(self, prompt: str) -> str:
        return hash_split(prompt, self.test_fraction)

    def stories(self, n: int, *, split: str = "train", seed: int = 0) -> list[_Story]:
        rng = random.Random(f"{self.name}-{split}-{seed}")
        out: list[_Story] = []
        while len(out) < n:
            story = self._story(rng, TIERS[self.tiers[len(out) % len(self.tiers)]])
            if self._split_of(story.prompt) == split:
                out.append(story)
        return out

    def problems(self, n: int, *, split: str = "train", seed: int = 0) -> list[Problem]:
        """``n`` problems of ``split`` (the tiers in turn), reproducible from ``seed``; a problem's
        answer is its whole solution, one step a line, then ``#### N``."""
        return [Problem(s.prompt, self.solution(s)) for s in self.stories(n, split=split, seed=seed)]

    @staticmethod
    def solution(story: _Story) -> str:
        return "\n".join([*story.lines(), f"#### {story.values()[-1]}"])

    @property
    def longest_prompts(self) -> list[str]:
        """Prompts at least as long as any this task makes, one per person, thing and giver: the most
        steps of its tiers, each the longest sentence with the widest number (what the collector
        sizes the rollout budget on; tokens are counted on each, so no wording is missed)."""
        tier_steps = max(TIERS[t].max_steps for t in self.tiers)
        widest = {op: max(len(str(getattr(TIERS[t], f)[1])) for t in self.tiers)
                  for op, f in (("add", "change"), ("sub", "change"), ("mul", "factor"), ("div", "divisor"))}
        start = "9" * max(len(str(TIERS[t].start[1])) for t in self.tiers)
        ops = sorted({op for t in self.tiers for op in TIERS[t].operations})
        out = []
        for name, subject, obj in PEOPLE:
            for item in ITEMS:
                for friend in FRIENDS:
                    words = {"name": name, "P": subject.capitalize(), "p": subject, "o": obj, "item": item}
                    step = max((f.format(b="9" * widest[op], friend=friend, **words) for op in ops
                                for f in OPERATIONS[op]), key=len)
                    out.append(" ".join([max((f.format(b=start, **words) for f in OPENINGS), key=len),
                                         *[step[0].upper() + step[1:]] * tier_steps,
                                         max((q.format(**words) for q in QUESTIONS), key=len)]))
        return [self.hint + p for p in out]

    # -- scoring ---------------------------------------------------------------------------------
    def parse(self, prompt: str) -> _Story:
        """The story of a prompt this task makes (its numbers, read back from the words)."""
        body = prompt[len(self.hint):] if prompt.startswith(self.hint) else prompt
        numbers = [int(x) for x in re.findall(r"\d+", body)]
        sentences = re.findall(r"[^.?]+[.?]", body.strip())
        if len(numbers) < 2 or len(sentences) != len(numbers) + 1:
            raise TaskError(f"{self.name}: cannot read the story {prompt!r}; this task made no such prompt")
        steps = []
        for sentence, b in zip(sentences[1:-1], numbers[1:]):
            op = next((op for op, forms in OPERATIONS.items()
                       if any(_matches(f, sentence.strip()) for f in forms)), None)
            if op is None:
                raise TaskError(f"{self.name}: cannot read the step {sentence.strip()!r} of {prompt!r}")
            steps.append((op, b))
        return _Story(body, numbers[0], tuple(steps))

    #: text before the story (the tool variants' call format)
    hint: ClassVar[str] = ""

    def answer(self, prompt: str) -> str:
        """The number the story ends with."""
        return str(self.parse(prompt).values()[-1])

    def reward(self, prompt: str, response: str) -> float:
        """1.0 when the number after the last ``####`` is the answer; ``format_reward`` for another
        number in that form; else 0.0."""
        got = final_answer(response)
        if got is None:
            return 0.0
        return 1.0 if str(got) == self.answer(prompt) else float(self.format_reward)

    def rewards(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        return [self.reward(p, r) for p, r in zip(prompts, responses)]

    def corrupt(self, answer: str, rng: random.Random) -> str:
        """A wrong solution close to the right one: one step's result off by a little, the later
        steps carried on from it, and the answer line from the last (a slip that the later steps
        wash out, as a division can, is drawn again; the last step's slip always shows)."""
        lines = answer.split("\n")
        parsed = [re.fullmatch(r"(-?\d+)([+\-*/])(\d+)=(-?\d+)", s) for s in lines[:-1]]
        right = lines[-1]
        for attempt in range(20):
            k = rng.randrange(len(parsed)) if attempt < 19 else len(parsed) - 1
            slip = rng.choice((-10, -2, -1, 1, 2, 10))
            value, out = None, []
            for i, m in enumerate(parsed):
                a, op, b = int(m.group(1)) if value is None else value, m.group(2), int(m.group(3))
                r = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a // b
                value = r + slip if i == k else r
                out.append(f"{a}{op}{b}={value}")
            if f"#### {value}" != right:
                break
        return "\n".join([*out, f"#### {value}"])


def _matches(form: str, sentence: str) -> bool:
    pattern = re.escape(form)
    for field in ("P", "p", "o", "item", "friend", "name"):
        pattern = pattern.replace(re.escape("{" + field + "}"), r"[\w' ]+?")
    pattern = pattern.replace(re.escape("{b}"), r"\d+")
    return re.fullmatch(pattern, sentence) is not None


@dataclass(frozen=True)
class CalculatorWordProblemTask(WordProblemTask):
    """The word problems with a calculator: each step a call (``<tool name="calculator">14+9</tool>``),
    its result shown (``<result>23</result>``), one step a turn; the last turn writes ``#### N``.

    >>> task = CalculatorWordProblemTask(tiers=("easy",))
    >>> p = task.problems(1, seed=0)[0]
    >>> task.demonstration(p)
    '<tool name="calculator">5+16</tool><result>21</result><tool name="calculator">21-16</tool><result>5</result><tool name="calculator">5-3</tool><result>2</result>#### 2'
    >>> task.multiturn.max_turns
    4
    """

    tools: tuple = ("calculator",)
    tool_timeout: float = 5.0
    tool_sandbox: Optional[str] = None
    tool_reward: float = 0.0
    max_turns: Optional[int] = None
    kind: ClassVar[str] = "word-problems-calculator"
    #: a problem's answer is the final number (the episode's demonstration is the tool calls and the answer line)
    worked_solutions: ClassVar[bool] = False
    hint: ClassVar[str] = '<tool name="calculator">...</tool> '
    #: one turn's budget: a call of two numbers
    max_new_tokens: ClassVar[int] = 24
    #: the prompt, a call and a result per step (8 at most) and the answer
    sft_max_length: ClassVar[int] = 320

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "tools", tuple(self.tools))
        if self.max_turns is None:  # a turn per step of the longest tier, and the answer's
            object.__setattr__(self, "max_turns", max(TIERS[t].max_steps for t in self.tiers) + 1)
        if isinstance(self.tool_reward, bool) or not isinstance(self.tool_reward, (int, float)) \
                or not math.isfinite(self.tool_reward):
            raise TaskError(f"tool_reward must be a finite number, got {self.tool_reward!r}; e.g. tool_reward=0.1")
        self.multiturn  # checks max_turns and the tools

    @property
    def multiturn(self):
        return MultiTurn(make_tools(self.tools, timeout=self.tool_timeout, sandbox=self.tool_sandbox),
                         max_turns=self.max_turns, max_observation_tokens=16,
                         turn_reward=self._turn_reward if self.tool_reward else None)

    def _turn_reward(self, prompt: str, results) -> float:
        """``tool_reward`` for a turn whose call gave one of the story's running values."""
        values = {str(v) for v in self.parse(prompt).values()[1:]}
        return float(self.tool_reward) if any(r.ok and r.text.strip() in values for r in results) else 0.0

    def problems(self, n: int, *, split: str = "train", seed: int = 0) -> list[Problem]:
        """The problems with the call format before the story; the answer is the final number."""
        return [Problem(self.hint + s.prompt, str(s.values()[-1])) for s in self.stories(n, split=split, seed=seed)]

    def calls(self, story: _Story) -> list[str]:
        values = story.values()
        return [f'<tool name="calculator">{v}{_SYMBOL[op]}{b}</tool>' for (op, b), v in zip(story.steps, values)]

    def results(self, story: _Story) -> list[str]:
        return [str(v) for v in story.values()[1:]]

    def demonstration(self, problem: Problem) -> str:
        """An episode that calls the tool for every step and answers, as one SFT completion."""
        return "".join(text for text, _ in self.demonstration_segments(problem))

    def demonstration_segments(self, problem: Problem) -> list[tuple[str, bool]]:
        """The demonstration as ``(text, trained)``: each call (trained), its result (the tool's: not
        trained), then the answer line."""
        story = self.parse(problem.prompt)
        out: list[tuple[str, bool]] = []
        for call, result in zip(self.calls(story), self.results(story)):
            out += [(call, True), (self.multiturn.observe([result]), False)]
        return [*out, (f"#### {story.values()[-1]}", True)]

    def corrupt(self, answer: str, rng: random.Random) -> str:
        return str(int(answer) + rng.choice((-10, -2, -1, 1, 2, 10)))


@dataclass(frozen=True)
class PythonWordProblemTask(CalculatorWordProblemTask):
    """The word problems with Python: one program for the whole story, run in the sandbox, then ``#### N``.

    >>> task = PythonWordProblemTask(tiers=("easy",))
    >>> p = task.problems(1, seed=0)[0]
    >>> print(task.demonstration(p))
    <tool name="python">x=21
    x=x+16
    x=x+7
    x=x-6
    print(x)</tool><result>38</result>#### 38
    """

    tools: tuple = ("python",)
    max_turns: Optional[int] = 2
    kind: ClassVar[str] = "word-problems-python"
    hint: ClassVar[str] = '<tool name="python">...</tool> '
    #: a program of up to 8 lines
    max_new_tokens: ClassVar[int] = 96

    def calls(self, story: _Story) -> list[str]:
        ops = {"add": "+", "sub": "-", "mul": "*", "div": "//"}
        body = "\n".join([f"x={story.start}", *(f"x=x{ops[op]}{b}" for op, b in story.steps), "print(x)"])
        return [f'<tool name="python">{body}</tool>']

    def results(self, story: _Story) -> list[str]:
        return [str(story.values()[-1])]

    def _turn_reward(self, prompt: str, results) -> float:
        answer = self.answer(prompt)
        return float(self.tool_reward) if any(r.ok and r.text.strip() == answer for r in results) else 0.0


#: the word-problem tasks by their ``kind`` (the built-in task ids' ``task``)
WORD_PROBLEM_TASKS: dict[str, type] = {cls.kind: cls for cls in
                                       (WordProblemTask, CalculatorWordProblemTask, PythonWordProblemTask)}
