"""Tools a text policy calls (the first part of multi-turn environments, issue 29 item 1): call
parsing, the calculator's arithmetic and refusals, the Python sandbox's time limit and walls, and
a defined result for every failure."""

from __future__ import annotations

import time

import pytest

from offline_plugins.envs.tools import Calculator, PythonTool, ToolBox, ToolError, parse_calls


def test_calls_are_parsed_in_order_with_their_raw_or_json_argument():
    calls, malformed = parse_calls('a <tool name="python">print(1)</tool> b <tool name="calculator">{"x": "2+3"}</tool>')
    assert calls == [("python", "print(1)"), ("calculator", "2+3")] and not malformed
    assert parse_calls("no call here") == ([], False)
    assert parse_calls('<tool name="calculator">2+2') == ([], True)


@pytest.mark.parametrize("expression, answer", [("12*(3+4)", "84"), ("7/2", "3.5"), ("2**10", "1024"), ("-3+10//4", "-1"),
                                                ("17 % 5", "2"), ("1.5*2", "3")])
def test_the_calculator_answers_arithmetic(expression, answer):
    result = Calculator().run(expression)
    assert result.ok and result.text == answer


@pytest.mark.parametrize("expression, message", [
    ("1/0", "division by zero"),
    ("9**9**9", "exponent 387420489 is above 64"),
    ("__import__('os').system('ls')", "only numbers and + - * / // % ** ( ) are allowed, not Call"),
    ("x + 1", "not Name"),
    ("2 +", "invalid syntax"),
])
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expression, message):
    result = Calculator().run(expression)
    assert not result.ok and result.failure == "error" and message in result.text


def test_python_answers_with_what_it_prints_and_works_in_its_own_folder():
    tool = PythonTool(timeout=10)
    assert tool.run("print(sum(range(10)))").text == "45"
    assert tool.run("open('note.txt', 'w').write('kept'); print(open('note.txt').read())").text == "kept"
    failed = tool.run("raise ValueError('boom')")
    assert (failed.ok, failed.failure, failed.text) == (False, "error", "python error: ValueError: boom")


def test_a_hanging_call_is_stopped_at_its_time_limit():
    start = time.perf_counter()
    result = PythonTool(timeout=1.0).run("while True:\n    pass")
    assert time.perf_counter() - start < 5.0
    assert (result.ok, result.failure) == (False, "timeout")
    assert result.text == "python timeout: no answer within 1 s"


@pytest.mark.parametrize("code, what", [
    ("open('/tmp/offline-plugins-escape.txt', 'w').write('x')", "writing outside the sandbox folder"),
    ("import os; os.remove('/tmp/offline-plugins-never-there')", "os.remove outside the sandbox folder"),
    ("import socket; socket.create_connection(('127.0.0.1', 9))", "is not allowed"),
    ("import subprocess; subprocess.run(['true'])", "subprocess.Popen is not allowed"),
])
def test_the_sandbox_refuses_writes_outside_it_the_network_and_new_processes(code, what, tmp_path):
    result = PythonTool(timeout=10).run(code)
    assert (result.ok, result.failure) == (False, "sandbox") and what in result.text


def test_the_toolbox_gives_a_defined_result_for_every_failure():
    box = ToolBox([Calculator(), PythonTool(timeout=5)])
    results = box.run_response('<tool name="calc">1+1</tool> then <tool name="calculator">6*7</tool> <tool name="x')
    assert [(r.tool, r.ok, r.failure) for r in results] == [("calc", False, "unknown_tool"), ("calculator", True, None),
                                                            ("", False, "malformed")]
    assert "the tools are calculator, python" in results[0].text
    assert results[1].text == "42"

    class Broken(Calculator):
        name = "broken"

        def run(self, argument):
            raise RuntimeError("the tool's own bug")

    crashed = ToolBox([Broken()]).run("broken", "1")
    assert (crashed.ok, crashed.failure) == (False, "crash") and "RuntimeError: the tool's own bug" in crashed.text


def test_tools_set_up_wrongly_are_refused_by_name():
    with pytest.raises(ToolError, match="two tools are named 'calculator'"):
        ToolBox([Calculator(), Calculator()])
    with pytest.raises(ToolError, match="timeout must be positive seconds, got 0"):
        PythonTool(timeout=0)
