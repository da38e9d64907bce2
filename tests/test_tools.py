"""Tools a text policy calls (the first part of multi-turn environments, issue 29 item 1): call
parsing, the calculator's arithmetic and refusals, the Python sandbox's time limit and walls, and
a defined result for every failure."""

from __future__ import annotations

import pytest

from offline_plugins.text.tools.tools import Calculator, PythonTool, ToolBox, ToolError, parse_calls


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
    ("__import__('os').system('ls')", "only numbers and + - * / // % ** ( ) are allowed, not \"__import__("),
    ("x + 1", "are allowed, not 'x'"),
    ("2 +", "the expression ends where a number was expected"),
    ("(" * 101 + "1" + ")" * 101, "parentheses nested deeper than 100"),
    ("9" * 101, "a number longer than 100 digits"),
    ("2 3", "two numbers in a row"),
    ("(1+2", "a '(' without its ')'"),
])
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expression, message):
    result = Calculator().run(expression)
    assert not result.ok and result.failure == "error" and message in result.text


@pytest.mark.parametrize("expression, answer", [("-2**2", "-4"), ("2**-1", "0.5"), ("2*-3**2", "-18"),
                                                ("2**3**2", "512"), ("-(-3)", "3"), ("10-4-3", "3"), ("64/4/2", "8"),
                                                ("-" * 5001 + "1", "-1"), ("1+" * 30000 + "1", "30001")])
def test_the_calculator_keeps_pythons_precedence_and_takes_inputs_of_any_length(expression, answer):
    text = Calculator().run(expression).text
    assert text == answer
    if len(expression) < 50:  # Python's own value
        assert float(text) == eval(expression)


@pytest.mark.bwrap
def test_python_answers_with_what_it_prints_and_works_in_its_own_folder():
    tool = PythonTool(timeout=10)
    assert tool.run("print(sum(range(10)))").text == "45"
    assert tool.run("open('note.txt', 'w').write('kept'); print(open('note.txt').read())").text == "kept"
    failed = tool.run("raise ValueError('boom')")
    assert (failed.ok, failed.failure, failed.text) == (False, "error", "python error: ValueError: boom")


@pytest.mark.bwrap
def test_what_the_sandbox_walls_refuse_is_a_sandbox_result():
    tool = PythonTool(timeout=10)
    for code in ("open('/usr/escape.txt', 'w').write('x')", "import socket; socket.create_connection(('1.1.1.1', 80))"):
        result = tool.run(code)
        assert (result.ok, result.failure) == (False, "sandbox"), result.text


def test_the_toolbox_gives_a_defined_result_for_every_failure():
    box = ToolBox([Calculator(), PythonTool(timeout=5, sandbox="unsafe-subprocess")])
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
