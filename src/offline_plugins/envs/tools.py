"""Tools a text policy calls inside its response: the call format, a calculator and a Python sandbox.

The first part of multi-turn text environments (issue 29, item 1): a response is parsed for tool
calls in TorchRL's XML block format (``torchrl.envs.llm.transforms.XMLBlockParser``)::

    the product is <tool name="calculator">123*456</tool>

and each call is run by a :class:`ToolBox`, whose answer becomes the next observation of the
episode. Every way a call can go wrong ends in a defined :class:`ToolResult` (``ok=False`` and a
``failure`` of ``"malformed"``, ``"unknown_tool"``, ``"error"``, ``"timeout"`` or ``"sandbox"``) that
the environment shows the policy and counts; nothing a response does can hang the run or raise
out of it. A tool whose own code raises is a ``"crash"`` result: the policy sees it too, but a
round in which every call crashed stops the run (the tool's bug, not the policy's:
:func:`offline_plugins.data.multiturn.run_episodes`).

- :class:`Calculator` evaluates arithmetic by walking Python's ``ast`` (numbers, ``+ - * / // %``,
  ``**`` with a bounded exponent, parentheses), never ``eval``.
- :class:`PythonTool` runs code in a fresh ``python -I`` subprocess with a wall-clock limit, in a
  temporary working folder, under resource limits (memory, CPU seconds, file size) and an audit
  hook that refuses writes outside that folder, network sockets and new processes. It keeps
  well-meaning and careless code in bounds; it is not a security boundary against hostile code
  (run that in a container).

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
import ast
import dataclasses
import operator
import os
import subprocess
import sys
import tempfile
from typing import Any, Optional, Sequence

from offline_plugins.errors import UserError

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
    """A named tool: ``run(argument) -> ToolResult``."""

    name: str = ""
    description: str = ""

    @abc.abstractmethod
    def run(self, argument: str) -> ToolResult:
        """Run the call with its ``argument`` text; every failure is a :class:`ToolResult` with ``ok=False``."""

    def _fail(self, failure: str, message: str) -> ToolResult:
        return ToolResult(self.name, f"{self.name} {failure}: {message}", ok=False, failure=failure)


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class Calculator(Tool):
    """Arithmetic on numbers: ``+ - * / // % **`` and parentheses, evaluated from the syntax tree.

    Keyword Args:
        max_exponent: the largest ``|exponent|`` of ``**`` (a response asking ``9**9**9`` gets an error,
            not a hang).
        max_digits: the longest integer answer, in digits.
    """

    name = "calculator"
    description = "arithmetic: + - * / // % ** and parentheses, e.g. 12*(3+4)"

    def __init__(self, *, max_exponent: int = 64, max_digits: int = 100) -> None:
        self.max_exponent = int(max_exponent)
        self.max_digits = int(max_digits)

    def _eval(self, node: ast.AST):
        if isinstance(node, ast.Expression):
            return self._eval(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > self.max_exponent:
                raise ValueError(f"exponent {right} is above {self.max_exponent}")
            value = _BINARY[type(node.op)](left, right)
            if isinstance(value, int) and len(str(abs(value))) > self.max_digits:
                raise ValueError(f"the answer has more than {self.max_digits} digits")
            return value
        raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}")

    def run(self, argument: str) -> ToolResult:
        try:
            value = self._eval(ast.parse(str(argument).strip(), mode="eval"))
        except ZeroDivisionError:
            return self._fail("error", "division by zero")
        except (SyntaxError, ValueError, TypeError, OverflowError) as exc:
            return self._fail("error", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
            value = int(value)
        return ToolResult(self.name, repr(value) if isinstance(value, float) else str(value))


# run in the child before the user's code: resource limits, then an audit hook that refuses what a
# sandboxed snippet has no business doing (the hook cannot be removed once added)
_PRELUDE = r'''
import os, sys, resource
_box = os.path.realpath(os.getcwd())
for _lim, _val in ((resource.RLIMIT_AS, {mem}), (resource.RLIMIT_CPU, {cpu}), (resource.RLIMIT_FSIZE, {fsize})):
    try:
        resource.setrlimit(_lim, (_val, _val))
    except (ValueError, OSError):
        pass
def _guard(event, args):
    if event == "open" and len(args) > 1 and isinstance(args[1], str) and any(c in args[1] for c in "wax+"):
        path = args[0]
        if isinstance(path, (str, bytes, os.PathLike)):
            full = os.path.realpath(os.path.join(_box, os.fsdecode(path)))
            if not (full == _box or full.startswith(_box + os.sep)):
                raise PermissionError("SANDBOX: writing outside the sandbox folder: " + full)
    if event in ("socket.connect", "socket.bind", "socket.getaddrinfo", "subprocess.Popen", "os.system",
                 "os.exec", "os.posix_spawn", "os.fork", "os.spawn"):
        raise PermissionError("SANDBOX: " + event + " is not allowed")
    if event in ("os.remove", "os.rename", "os.rmdir", "shutil.rmtree", "os.mkdir") and args:
        full = os.path.realpath(os.path.join(_box, os.fsdecode(args[0])))
        if not (full == _box or full.startswith(_box + os.sep)):
            raise PermissionError("SANDBOX: " + event + " outside the sandbox folder: " + full)
sys.addaudithook(_guard)
del _guard, _lim, _val
'''


class PythonTool(Tool):
    """Python code run in a fresh, limited subprocess; what it prints is the answer.

    Keyword Args:
        timeout: wall-clock seconds before the process is killed (a ``"timeout"`` result).
        memory_mb: address-space limit of the process.
        max_output: characters of output kept (the rest is cut, saying so).
    """

    name = "python"
    description = "Python code run in a sandbox; what it prints is the answer"

    def __init__(self, *, timeout: float = 5.0, memory_mb: int = 512, max_output: int = 2000) -> None:
        if not timeout or float(timeout) <= 0:
            raise ToolError(f"PythonTool: timeout must be positive seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self.memory = int(memory_mb) * 2 ** 20
        self.max_output = int(max_output)

    def run(self, argument: str) -> ToolResult:
        prelude = _PRELUDE.format(mem=self.memory, cpu=max(1, int(self.timeout) + 1), fsize=2 ** 20)
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
        with tempfile.TemporaryDirectory(prefix="offline-plugins-tool-") as box:
            try:
                proc = subprocess.run([sys.executable, "-I", "-c", prelude + "\n" + str(argument)], cwd=box, env=env,
                                      capture_output=True, text=True, timeout=self.timeout, stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                return self._fail("timeout", f"no answer within {self.timeout:g} s")
        out = proc.stdout
        if len(out) > self.max_output:
            out = out[: self.max_output] + f"... [cut at {self.max_output} characters]"
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
            if "SANDBOX:" in proc.stderr:
                return self._fail("sandbox", last.split("SANDBOX: ", 1)[-1])
            return self._fail("error", last)
        return ToolResult(self.name, out.strip())


def _argument(args: Any) -> str:
    """The text a tool takes from a parsed call: the raw body, or its one JSON value."""
    if isinstance(args, dict):
        if "raw" in args:
            return str(args["raw"])
        if len(args) == 1:
            return str(next(iter(args.values())))
        return str(args)
    return str(args)


def parse_calls(response: str):
    """``(calls, malformed)``: the ``(tool, argument)`` of each complete call in ``response``, and
    whether the response also holds an opened call that does not parse (``<tool`` without its end)."""
    from torchrl.envs.llm.transforms import XMLBlockParser

    parsed = XMLBlockParser()(response)
    calls = [(c.tool, _argument(c.args)) for c in parsed["calls"]]
    return calls, "<tool" in parsed["text"]


class ToolBox:
    """The tools of an environment, by name; runs the calls a response makes.

    Args:
        tools: the :class:`Tool` objects (names must differ).
    """

    def __init__(self, tools: Sequence[Tool]) -> None:
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ToolError(f"two tools are named {tool.name!r}; give each tool its own name")
            self.tools[tool.name] = tool

    def run(self, name: str, argument: str) -> ToolResult:
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(name, f"unknown tool {name!r}; the tools are {', '.join(sorted(self.tools))}",
                              ok=False, failure="unknown_tool")
        try:
            return tool.run(argument)
        except Exception as exc:  # a tool's own bug: the policy sees it, it is counted (a round of them stops the run)
            return ToolResult(name, f"{name} crashed: {type(exc).__name__}: {exc}", ok=False, failure="crash")

    def run_response(self, response: str) -> list[ToolResult]:
        """Every call ``response`` makes, run in order; a malformed call adds a ``"malformed"`` result."""
        calls, malformed = parse_calls(response)
        results = [self.run(name, argument) for name, argument in calls]
        if malformed:
            results.append(ToolResult("", 'malformed tool call: write <tool name="NAME">ARGUMENT</tool>',
                                      ok=False, failure="malformed"))
        return results
