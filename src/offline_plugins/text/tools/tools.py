"""Tools a text policy calls inside its response: the call format, a calculator and a Python sandbox.

The first part of multi-turn text environments (issue 29, item 1): a response is parsed for tool
calls in TorchRL's XML block format (``torchrl.envs.llm.transforms.XMLBlockParser``)::

    the product is <tool name="calculator">123*456</tool>

and each call is run by a :class:`ToolBox`, whose answer becomes the next observation of the
episode. Every way a call can go wrong ends in a defined :class:`ToolResult` (``ok=False`` and a
``failure`` of ``"malformed"``, ``"unknown_tool"``, ``"error"``, ``"timeout"``, ``"sandbox"`` or
``"crash"``) that the environment shows the policy and counts; nothing a response holds can hang
the run or raise out of it. A ``"crash"`` is a tool whose own code raised: the round then makes the
tool's health call (:meth:`ToolBox.broken`) and stops the run only when the tool fails that too
(:func:`offline_plugins.text.collectors.multiturn.run_episodes`).

- :class:`Calculator` evaluates arithmetic iteratively (numbers, ``+ - * / // %``, ``**`` with a
  bounded exponent, parentheses, Python's precedence), never ``eval`` and never recursion.
- :class:`PythonTool` runs code in a sandbox (:mod:`offline_plugins.text.tools.sandbox`): by default
  bubblewrap's namespaces (no network, a read-only system, a private tmpfs, rlimits, killed as a
  whole on timeout), read back by a parent that stays safe whatever the code prints.

>>> box = ToolBox([Calculator()])
>>> [r.text for r in box.run_response('so <tool name="calculator">12*(3+4)</tool>')]
['84']
>>> r = box.run_response('<tool name="calculator">1/0</tool>')[0]
>>> r.ok, r.failure, r.text
(False, 'error', 'calculator error: division by zero')
>>> box.run_response('<tool name="calculator">2+2')[0].failure
'malformed'
"""

from __future__ import annotations

import abc
import dataclasses
import operator
import re
import signal
from typing import Any, Optional, Sequence

from offline_plugins.errors import UserError
from offline_plugins.plugins import shared_registry
from offline_plugins.text.tools.sandbox import Limits, Sandbox, make_parent_undumpable

__all__ = ["ToolResult", "Tool", "Calculator", "PythonTool", "ToolBox", "ToolError", "parse_calls"]


class ToolError(UserError, ValueError):
    """A tool set up wrongly (by the user, not by a response)."""


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What one call gave: ``text`` is what the policy sees next.

    Attributes:
        tool: the name called (``""`` for a malformed call).
        text: the answer, or a one-line description of the failure.
        ok: the call ran and answered.
        failure: None, or ``"malformed"``, ``"unknown_tool"``, ``"error"``, ``"timeout"``, ``"sandbox"``,
            ``"crash"`` (the tool's own code raised).
    """

    tool: str
    text: str
    ok: bool = True
    failure: Optional[str] = None


class Tool(abc.ABC):
    """A named tool: ``run(argument) -> ToolResult``.

    ``health_call``: ``(argument, expected answer)``, a call that a working tool answers; when calls
    of a round crash, the round makes it to tell a broken tool (the run stops) from responses that
    made the tool fail (counted, the run goes on).
    """

    name: str = ""
    description: str = ""
    health_call: Optional[tuple[str, str]] = None

    @abc.abstractmethod
    def run(self, argument: str) -> ToolResult:
        """Run the call with its ``argument`` text; every failure is a :class:`ToolResult` with ``ok=False``."""

    def check(self) -> None:
        """Raise a :class:`ToolError` when the tool cannot work here (called once before a run starts)."""

    def _fail(self, failure: str, message: str) -> ToolResult:
        return ToolResult(self.name, f"{self.name} {failure}: {message}", ok=False, failure=failure)


# the calculator's tokens: a number, an operator or a parenthesis (whitespace between them is skipped)
_TOKEN = re.compile(r"\s*(?:(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)|(?P<op>\*\*|//|[-+*/%()]))")
_BINARY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv, "//": operator.floordiv,
           "%": operator.mod, "**": operator.pow}
# binding strength: ** above the unary signs above * / // % above + - (Python's: -2**2 == -4, 2**-1 == 0.5)
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2, "//": 2, "%": 2, "u+": 3, "u-": 3, "**": 4}
_ALLOWED = "only numbers and + - * / // % ** ( ) are allowed"


class Calculator(Tool):
    """Arithmetic on numbers: ``+ - * / // % **`` and parentheses, with Python's precedence.

    Evaluated iteratively (operator precedence with explicit stacks, never ``eval`` and never
    recursion), so no input of any length raises out of it: deep nesting, thousands of signs or
    terms and huge literals are each a defined ``error`` result.

    Keyword Args:
        max_exponent: the largest ``|exponent|`` of ``**`` (a response asking ``9**9**9`` gets an error,
            not a hang).
        max_digits: the longest integer, literal or answer, in digits.
        max_depth: the deepest nesting of parentheses.
        max_length: the longest expression, in characters.

    >>> calc = Calculator()
    >>> [calc.run(e).text for e in ("-2**2", "2**-1", "2*-3**2", "(1+2)*3 % 4", "7//2")]
    ['-4', '0.5', '-18', '1', '3']
    >>> calc.run("(" * 5000 + "1" + ")" * 5000).text
    'calculator error: parentheses nested deeper than 100'
    """

    name = "calculator"
    description = "arithmetic: + - * / // % ** and parentheses, e.g. 12*(3+4)"
    health_call = ("6*7", "42")

    def __init__(self, *, max_exponent: int = 64, max_digits: int = 100, max_depth: int = 100,
                 max_length: int = 100_000) -> None:
        self.max_exponent = int(max_exponent)
        self.max_digits = int(max_digits)
        self.max_depth = int(max_depth)
        self.max_length = int(max_length)

    def _check(self, value):
        if isinstance(value, int) and value.bit_length() > 3.33 * self.max_digits \
                and len(str(abs(value))) > self.max_digits:
            raise ValueError(f"the answer has more than {self.max_digits} digits")
        return value

    def _apply(self, op: str, values: list) -> None:
        if op in ("u+", "u-"):
            if not values:
                raise ValueError(f"a sign without a number after it")
            values.append(values.pop() if op == "u+" else -values.pop())
            return
        if len(values) < 2:
            raise ValueError(f"'{op}' needs a number on each side")
        right, left = values.pop(), values.pop()
        if op == "**" and abs(right) > self.max_exponent:
            raise ValueError(f"exponent {right} is above {self.max_exponent}")
        if op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 \
                and left.bit_length() * right > 3.33 * self.max_digits * 4:
            raise ValueError(f"the answer has more than {self.max_digits} digits")
        values.append(self._check(_BINARY[op](left, right)))

    def evaluate(self, expression: str):
        """The value of ``expression``; a ``ValueError`` (or ``ZeroDivisionError``, ``OverflowError``) names what is wrong."""
        text = str(expression).strip()
        if not text:
            raise ValueError("the expression is empty")
        if len(text) > self.max_length:
            raise ValueError(f"the expression is longer than {self.max_length} characters")
        values: list = []
        ops: list[str] = []
        depth, pos, expect_operand = 0, 0, True
        while pos < len(text):
            found = _TOKEN.match(text, pos)
            if found is None or found.end() == pos:
                rest = text[pos:].strip()
                if not rest:
                    break
                raise ValueError(f"{_ALLOWED}, not {rest.split()[0][:20]!r}")
            pos = found.end()
            number, op = found.group("num"), found.group("op")
            if number is not None:
                if not expect_operand:
                    raise ValueError(f"two numbers in a row at {number[:20]!r}")
                digits = number.split("e")[0].split("E")[0].replace(".", "").lstrip("0")
                if len(digits) > self.max_digits:
                    raise ValueError(f"a number longer than {self.max_digits} digits")
                values.append(int(number) if number.isdigit() else float(number))
                expect_operand = False
            elif op == "(":
                if not expect_operand:
                    raise ValueError("a parenthesis right after a number (write * between them)")
                depth += 1
                if depth > self.max_depth:
                    raise ValueError(f"parentheses nested deeper than {self.max_depth}")
                ops.append(op)
            elif op == ")":
                if expect_operand:
                    raise ValueError("')' where a number was expected")
                while ops and ops[-1] != "(":
                    self._apply(ops.pop(), values)
                if not ops:
                    raise ValueError("a ')' without its '('")
                ops.pop()
                depth -= 1
            elif expect_operand:
                if op not in ("+", "-"):
                    raise ValueError(f"'{op}' where a number was expected")
                ops.append("u" + op)  # a sign binds what follows; it pops nothing
            else:
                strength = _PRECEDENCE[op]
                while ops and ops[-1] != "(" and (_PRECEDENCE[ops[-1]] > strength
                                                  or (_PRECEDENCE[ops[-1]] == strength and op != "**")):
                    self._apply(ops.pop(), values)
                ops.append(op)
                expect_operand = True
        if expect_operand:
            raise ValueError("the expression ends where a number was expected")
        while ops:
            op = ops.pop()
            if op == "(":
                raise ValueError("a '(' without its ')'")
            self._apply(op, values)
        if len(values) != 1:
            raise ValueError("not one expression")
        return values[0]

    def run(self, argument: str) -> ToolResult:
        try:
            value = self.evaluate(argument)
        except ZeroDivisionError:
            return self._fail("error", "division by zero")
        except (ValueError, TypeError, OverflowError, MemoryError) as exc:
            return self._fail("error", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
            value = int(value)
        return ToolResult(self.name, repr(value) if isinstance(value, float) else str(value))


#: the last line of a program's error output when a wall of its sandbox refused something
_WALLS = ("[Errno 30] Read-only file system", "[Errno 13] Permission denied", "[Errno 1] Operation not permitted",
          "[Errno 101] Network is unreachable", "[Errno 11] Resource temporarily unavailable",
          "[Errno 97] Address family not supported", "PermissionError")


class PythonTool(Tool):
    """Python code run in a sandbox (:mod:`offline_plugins.text.tools.sandbox`); what it prints is the answer.

    Every call is a fresh interpreter with the standard library only, in the sandbox's private
    working folder, under its limits (:class:`~offline_plugins.text.tools.sandbox.Limits`).

    Keyword Args:
        timeout: wall-clock seconds before the whole sandbox is killed (a ``"timeout"`` result).
        memory_mb: address-space limit of each process.
        max_output: characters of output kept (past them the program is stopped and its output cut).
        sandbox: a :class:`~offline_plugins.text.tools.sandbox.Sandbox`, or the name of a registered one
            (``offline-plugins list``: ``bwrap``, the default; ``unsafe-subprocess``; a plugin's).
    """

    name = "python"
    description = "Python code run in a sandbox; what it prints is the answer"
    health_call = ("print(6*7)", "42")

    def __init__(self, *, timeout: float = 5.0, memory_mb: int = 512, max_output: int = 2000,
                 sandbox: Any = None) -> None:
        if isinstance(timeout, bool) or not timeout or float(timeout) <= 0:
            raise ToolError(f"PythonTool: timeout must be positive seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self.limits = Limits(timeout=self.timeout, memory_bytes=int(memory_mb) * 2 ** 20, max_output=int(max_output))
        self.max_output = int(max_output)
        self._sandbox = sandbox if sandbox is not None else DEFAULT_SANDBOX

    @property
    def sandbox(self):
        """The :class:`~offline_plugins.text.tools.sandbox.Sandbox` the calls run in (a name is looked up once)."""
        if isinstance(self._sandbox, str):
            self._sandbox = make_sandbox(self._sandbox)
        return self._sandbox

    def check(self) -> None:
        """Refuse (:class:`~offline_plugins.text.tools.sandbox.SandboxUnavailable`) when the sandbox cannot run here,
        and mark this process non-dumpable (no process of its user reads or writes its memory through ``/proc``)."""
        self.sandbox.check()
        make_parent_undumpable()

    def run(self, argument: str) -> ToolResult:
        run = self.sandbox.run(str(argument), self.limits)
        if run.timed_out:
            return self._fail("timeout", f"no answer within {self.timeout:g} s")
        out = run.stdout
        if run.truncated:
            return ToolResult(self.name, out.strip() + f"... [cut at {self.max_output} characters]")
        if run.returncode != 0:
            lines = [line for line in run.stderr.strip().splitlines() if line.strip()]
            if run.returncode is not None and run.returncode < 0:
                try:
                    why = signal.Signals(-run.returncode).name
                except ValueError:
                    why = str(-run.returncode)
                last = f"killed by signal {why} (a limit of the sandbox, or the program's own doing)"
            else:
                last = lines[-1] if lines else f"exit code {run.returncode}"
            last = last[:300]
            if any(wall in last for wall in _WALLS):
                return self._fail("sandbox", last)
            return self._fail("error", last)
        return ToolResult(self.name, out.strip())


#: the sandbox the Python tool uses unless told otherwise
DEFAULT_SANDBOX = "bwrap"


def make_sandbox(name: str):
    """The registered sandbox called ``name`` (``offline-plugins list``, "sandboxes"), built with its defaults."""
    try:
        spec = shared_registry().sandbox(str(name))
    except Exception as exc:
        raise ToolError(f"tool_sandbox: {exc}") from None
    made = spec.load()
    made = made() if isinstance(made, type) else made

    if not isinstance(made, Sandbox):
        raise ToolError(f"sandbox {name!r} from {spec.provider or 'a plugin'} is a {type(made).__name__}, not an "
                        "offline_plugins.text.tools.sandbox.Sandbox; the plugin must register a Sandbox subclass")
    return made


def _argument(args: Any) -> str:
    """The text a tool takes from a parsed call: the raw body, or its one JSON value."""
    if isinstance(args, dict):
        if "raw" in args:
            return str(args["raw"])
        if len(args) == 1:
            return str(next(iter(args.values())))
        return str(args)
    return str(args)


def _raw_calls(response: str) -> tuple[list[tuple[str, str]], str]:
    """The calls of ``response`` with their bodies as raw text (TorchRL's block format, no JSON decoding)."""
    from torchrl.envs.llm.transforms import XMLBlockParser

    calls: list[tuple[str, str]] = []

    def keep(found) -> str:
        calls.append((found.group("name"), found.group("body")))
        return ""

    return calls, XMLBlockParser._re.sub(keep, response)


def parse_calls(response: str):
    """``(calls, malformed)``: the ``(tool, argument)`` of each complete call in ``response``, and
    whether the response also holds an opened call that does not parse (``<tool`` without its end).

    TorchRL's ``XMLBlockParser`` reads the calls; a body it cannot decode (JSON nested past the
    interpreter's recursion limit, an integer literal past Python's digit limit) is passed on as
    its raw text instead of raising:

    >>> parse_calls('<tool name="calculator">' + "[" * 5000 + "</tool>")[0][0][1][:3]
    '[[['
    """
    from torchrl.envs.llm.transforms import XMLBlockParser

    try:
        parsed = XMLBlockParser()(response)
        calls = [(c.tool, _argument(c.args)) for c in parsed["calls"]]
        rest = parsed["text"]
    except (RecursionError, ValueError, TypeError, MemoryError, OverflowError):
        calls, rest = _raw_calls(response)
    return calls, "<tool" in rest


class ToolBox:
    """The tools of an environment, by name; runs the calls a response makes.

    Nothing a response holds raises out of :meth:`run_response`: a call that cannot be read is a
    ``"malformed"`` result, a tool that raises a ``"crash"`` result; :meth:`broken` tells a tool
    that crashed because it is broken from one that a response made crash.

    Args:
        tools: the :class:`Tool` objects (names must differ).
    """

    def __init__(self, tools: Sequence[Tool]) -> None:
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ToolError(f"two tools are named {tool.name!r}; give each tool its own name")
            self.tools[tool.name] = tool

    def check(self) -> None:
        """Each tool's :meth:`Tool.check`: refuse before a run starts what cannot work here."""
        for tool in self.tools.values():
            tool.check()

    def run(self, name: str, argument: str) -> ToolResult:
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(name[:100], f"unknown tool {name[:100]!r}; the tools are {', '.join(sorted(self.tools))}",
                              ok=False, failure="unknown_tool")
        try:
            return tool.run(argument)
        except Exception as exc:  # a tool's own failure: the policy sees it, it is counted (see ``broken``)
            return ToolResult(name, f"{name} crashed: {type(exc).__name__}: {str(exc)[:300]}", ok=False,
                              failure="crash")

    def run_response(self, response: str) -> list[ToolResult]:
        """Every call ``response`` makes, run in order; a malformed call adds a ``"malformed"`` result."""
        try:
            calls, malformed = parse_calls(response)
        except Exception as exc:  # whatever a response holds, the round goes on
            return [ToolResult("", f"the tool calls could not be read ({type(exc).__name__}); write "
                                   '<tool name="NAME">ARGUMENT</tool>', ok=False, failure="malformed")]
        results = [self.run(name, argument) for name, argument in calls]
        if malformed:
            results.append(ToolResult("", 'malformed tool call: write <tool name="NAME">ARGUMENT</tool>',
                                      ok=False, failure="malformed"))
        return results

    def broken(self, names: Sequence[str], *, all_crashed: bool = False) -> Optional[str]:
        """Why one of the tools ``names`` (which crashed this round) is broken, or None.

        A tool with a ``health_call`` is broken when it does not answer it; one without is broken
        only when every call of the round crashed (``all_crashed``): then no response could tell.
        """
        for name in dict.fromkeys(names):
            tool = self.tools.get(name)
            if tool is None:
                continue
            if tool.health_call is None:
                if all_crashed:
                    return f"{name}: every call of the round crashed and the tool has no health call to tell why"
                continue
            argument, expected = tool.health_call
            result = self.run(name, argument)
            if not result.ok or result.text.strip() != expected:
                return f"{name} fails its health call {argument!r} (expected {expected!r}): {result.text[:300]}"
        return None
