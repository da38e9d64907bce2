"""The built-in text tasks, tools and reward functions (``offline-plugins data list``, "text tasks";
``list``, "tools" and "rewards"), registered through the hooks a third-party plugin uses, and named by
import path so listing imports nothing.
"""

from __future__ import annotations

from offline_plugins.plugins.hookspecs import hookimpl
from offline_plugins.plugins.registry import RewardSpec, TextTaskSpec, ToolSpec


def _task(name: str, summary: str, factory: str, **settings) -> TextTaskSpec:
    return TextTaskSpec(f"offline-plugins/{name}/v0", summary, factory, tuple(settings.items()),
                        aliases=(name, f"{name}/v0"))


TEXT_TASKS = (
    _task("arithmetic", "2-digit addition, exact-match reward", "offline_plugins.text.tasks:make_task",
          digits=2, ops="+"),
    _task("arithmetic-length", "2-digit addition prompts, gold reward: response length against 6 characters (the "
          "RLHF over-optimisation study)", "offline_plugins.text.tasks:make_task", task="arithmetic-length",
          target=6, digits=2, ops="+"),
    _task("tool-arithmetic", "3-digit multiplication with a calculator tool over up to 3 turns, exact match of the "
          "final answer", "offline_plugins.text.tasks.tools:ToolArithmeticTask", digits=3, max_turns=3),
    _task("tool-python", "the digits of a 3-digit product written backwards, with a sandboxed Python tool over up "
          "to 3 turns, exact match of the final answer", "offline_plugins.text.tasks.tools:ToolPythonTask", digits=3,
          max_turns=3),
    _task("steps-arithmetic", "chains of 2-3 operations on 1..9 solved one step a line, exact match of the final "
          "value (step labels are generated: the PRM's task)", "offline_plugins.text.tasks.steps:StepChainTask"),
    _task("word-problems", "word problems in GSM8K's shape, 2-8 steps in three tiers, solved one step a line and "
          "answered after '####' (the verifier reads the final number)",
          "offline_plugins.text.tasks.word_problems:WordProblemTask"),
    _task("word-problems-calculator", "the word problems with a calculator tool, one call a step over up to 9 turns, "
          "then '#### N'", "offline_plugins.text.tasks.word_problems:CalculatorWordProblemTask"),
    _task("word-problems-python", "the word problems with a sandboxed Python tool, one program for the story, then "
          "'#### N'", "offline_plugins.text.tasks.word_problems:PythonWordProblemTask"),
)

TOOLS = (
    ToolSpec("calculator", "evaluates one arithmetic expression (+ - * / ** and parentheses on numbers)",
             "offline_plugins.text.tools.tools:Calculator"),
    ToolSpec("python", "runs a short Python program in the registered sandbox (--set tool_sandbox=...) and returns "
             "what it prints", "offline_plugins.text.tools.tools:PythonTool"),
)


REWARDS = (
    RewardSpec("answer-format", "1 where a response ends with a '#### N' line, else 0 (the word problems' answer "
               "form; a second reward beside the verifier's)", "offline_plugins.text.tasks.word_problems:answer_format"),
    RewardSpec("step-accuracy", "the share of a response's 'a op b = c' lines whose arithmetic holds (the working, "
               "not the answer)", "offline_plugins.text.tasks.word_problems:step_accuracy"),
)


@hookimpl
def offline_plugins_register_text_tasks(registry):
    for spec in TEXT_TASKS:
        registry.add(spec)


@hookimpl
def offline_plugins_register_tools(registry):
    for spec in TOOLS:
        registry.add(spec)


@hookimpl
def offline_plugins_register_rewards(registry):
    for spec in REWARDS:
        registry.add(spec)
