"""Built-in verifiable text tasks by name: the arithmetic tasks (:mod:`offline_plugins.text.tasks.arithmetic`) and
the word problems (:mod:`offline_plugins.text.tasks.word_problems`), each a seeded problem maker with its verifier;
:mod:`offline_plugins.text.data.task_data` turns a task into SFT data and preference pairs.

>>> make_task("word-problems", tiers=("easy",)).name
'word-problems-easy'
"""

from __future__ import annotations

from typing import Any

from offline_plugins.text.tasks.arithmetic import CHARSET, ArithmeticTask, LengthTask, length_reward
from offline_plugins.text.tasks.base import Problem, TaskError, exact_match, hash_split
from offline_plugins.text.tasks.word_problems import WORD_PROBLEM_TASKS

__all__ = ["CHARSET", "Problem", "ArithmeticTask", "LengthTask", "TASKS", "TaskError", "exact_match", "hash_split",
           "length_reward", "make_task"]

#: the built-in tasks by name (``make_task``)
TASKS: dict[str, type] = {"arithmetic": ArithmeticTask, "arithmetic-length": LengthTask}


def make_task(task: str = "arithmetic", **settings: Any):
    """A built-in task from its name in :data:`TASKS` and its settings.

    >>> make_task("arithmetic-length", target=6).name
    'arithmetic-2d+-length6'
    >>> make_task("length")
    Traceback (most recent call last):
    ...
    offline_plugins.text.tasks.base.TaskError: unknown task 'length'; use one of arithmetic, arithmetic-length, word-problems, word-problems-calculator, word-problems-python
    """
    cls = TASKS.get(task) or WORD_PROBLEM_TASKS.get(task)
    if cls is None:
        raise TaskError(f"unknown task {task!r}; use one of {', '.join([*TASKS, *WORD_PROBLEM_TASKS])}")
    try:
        return cls(**settings)
    except TypeError as exc:
        raise TaskError(f"task {task!r}: {exc}; its settings are {', '.join(cls.__dataclass_fields__)}") from None
