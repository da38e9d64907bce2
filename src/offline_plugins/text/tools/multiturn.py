"""How a multi-turn episode goes on after a turn: :class:`MultiTurn` (the tools, the turn limit, the
observation's form and budget) and :func:`make_tools` (a toolbox of registered tools).

An episode takes up to :attr:`MultiTurn.max_turns` turns: the policy writes a turn, which ends at
the end of a tool call (``</tool>``), at eos or at the turn's token budget; the calls it made are
run by the :class:`~offline_plugins.text.tools.tools.ToolBox` and their answers appended as one
observation (``<result>56088</result>``), and the policy goes on; a turn without a call (or the
last turn) ends the episode, and the verifier scores its final answer, the text of its last turn.
Rewards come at the end (the verifier) and, where :attr:`MultiTurn.turn_reward` is set, per turn:
each turn's reward sits on its last token, the verifier's on the last turn's, and the episode's
return is their sum. A task carrying a :class:`MultiTurn` (``task.multiturn``, e.g.
:class:`~offline_plugins.text.tasks.tools.ToolArithmeticTask`) makes the text environment's step one
turn (:class:`~offline_plugins.text.envs.text.TextEnv`).

>>> MultiTurn(ToolBox([Calculator()]), max_turns=0)
Traceback (most recent call last):
...
offline_plugins.text.tools.tools.ToolError: max_turns must be a whole number >= 1 (turns the policy takes per episode), got 0; e.g. max_turns=3
>>> make_tools(["calculator", "abacus"])
Traceback (most recent call last):
...
offline_plugins.text.tools.tools.ToolError: unknown tool 'abacus' in tools=('calculator', 'abacus'); the registered tools are calculator, python...('offline-plugins list', tools)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from offline_plugins.plugins import shared_registry
from offline_plugins.text.tools.tools import Calculator, ToolBox, ToolError, ToolResult  # noqa: F401 (Calculator: the doctests)

__all__ = ["MultiTurn", "FAILURE_KINDS", "make_tools"]

#: the kinds of a failed tool call (:class:`~offline_plugins.text.tools.tools.ToolResult`), each counted per round
FAILURE_KINDS = ("malformed", "unknown_tool", "error", "timeout", "sandbox", "crash")

def make_tools(names: Sequence[str], *, timeout: float = 5.0, sandbox: Optional[str] = None) -> ToolBox:
    """A :class:`~offline_plugins.text.tools.tools.ToolBox` of the registered tools ``names``
    (:class:`~offline_plugins.plugins.registry.ToolSpec`: the built-in ``calculator`` and ``python``, a
    plugin's); a tool that runs code runs it in the registered sandbox ``sandbox`` (None: ``bwrap``)."""
    names = tuple(names)
    if not names:
        raise ToolError("tools is empty; name at least one tool, e.g. tools=calculator")
    tools = shared_registry().tools
    unknown = [n for n in names if n not in tools]
    if unknown:
        raise ToolError(f"unknown tool {unknown[0]!r} in tools={names!r}; the registered tools are "
                        f"{', '.join(tools)} ('offline-plugins list', tools)")
    return ToolBox([tools[n].make(timeout=timeout, sandbox=sandbox) for n in names])


@dataclass(frozen=True)
class MultiTurn:
    """How an episode goes on after a turn: the tools, the turn limit, the observation's form and budget.

    Attributes:
        tools: the :class:`~offline_plugins.text.tools.tools.ToolBox` that runs the calls.
        max_turns: turns the policy takes at most (>= 1); the last turn's text is the answer.
        stop: where a turn that calls a tool ends (the call's closing tag).
        observation: the form of one tool answer shown to the policy (``{}``: its text).
        max_observation_tokens: an observation longer than this is cut to it.
        turn_reward: None (the verifier's reward at the end only), or ``turn_reward(prompt, results)
            -> float``, the reward of a turn that called tools, from the calls' results.
    """

    tools: ToolBox
    max_turns: int = 3
    stop: str = "</tool>"
    observation: str = "<result>{}</result>"
    max_observation_tokens: int = 96
    turn_reward: Optional[Callable[[str, Sequence[ToolResult]], float]] = None

    def __post_init__(self) -> None:
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ToolError(f"max_turns must be a whole number >= 1 (turns the policy takes per episode), got "
                            f"{self.max_turns!r}; e.g. max_turns=3")
        if self.max_observation_tokens < 1:
            raise ToolError(f"max_observation_tokens must be >= 1, got {self.max_observation_tokens!r}")

    def observe(self, texts: Sequence[str]) -> str:
        """The observation of one turn's tool answers."""
        return "".join(self.observation.format(t) for t in texts)


