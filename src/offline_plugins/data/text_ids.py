"""The ids of the built-in text tasks, without importing torch (``offline-plugins data list`` and the
text-rollouts kind's ``claims`` read them; :mod:`offline_plugins.data.rollouts` loads the tasks).
"""

from __future__ import annotations

from typing import Optional

__all__ = ["BUILTIN_ROLLOUT_TASKS", "resolve_rollout_id"]


#: the built-in online tasks: id -> (summary, task settings: ``task``, a name in
#: :data:`offline_plugins.envs.tasks.TASKS` (default arithmetic), and its settings)
BUILTIN_ROLLOUT_TASKS: dict[str, tuple[str, dict]] = {
    "offline-plugins/arithmetic/v0": ("2-digit addition, exact-match reward", {"digits": 2, "ops": "+"}),
    "offline-plugins/arithmetic-length/v0": (
        "2-digit addition prompts, gold reward: response length against 6 characters (the RLHF over-optimisation "
        "study)", {"task": "arithmetic-length", "target": 6, "digits": 2, "ops": "+"}),
    "offline-plugins/tool-arithmetic/v0": (
        "3-digit multiplication with a calculator tool over up to 3 turns, exact match of the final answer",
        {"task": "tool-arithmetic", "digits": 3, "max_turns": 3}),
    "offline-plugins/tool-python/v0": (
        "the digits of a 3-digit product written backwards, with a sandboxed Python tool over up to 3 turns, exact "
        "match of the final answer", {"task": "tool-python", "digits": 3, "max_turns": 3}),
    "offline-plugins/steps-arithmetic/v0": (
        "chains of 2-3 operations on 1..9 solved one step a line, exact match of the final value (step labels "
        "are generated: the PRM's task)", {"task": "steps-arithmetic"}),
    "offline-plugins/word-problems/v0": (
        "word problems in GSM8K's shape, 2-8 steps in three tiers, solved one step a line and answered after "
        "'####' (the verifier reads the final number)", {"task": "word-problems"}),
    "offline-plugins/word-problems-calculator/v0": (
        "the word problems with a calculator tool, one call a step over up to 9 turns, then '#### N'",
        {"task": "word-problems-calculator"}),
    "offline-plugins/word-problems-python/v0": (
        "the word problems with a sandboxed Python tool, one program for the story, then '#### N'",
        {"task": "word-problems-python"}),
}
_ALIASES = {"arithmetic": "offline-plugins/arithmetic/v0", "arithmetic/v0": "offline-plugins/arithmetic/v0",
            "arithmetic-length": "offline-plugins/arithmetic-length/v0",
            "arithmetic-length/v0": "offline-plugins/arithmetic-length/v0",
            "tool-arithmetic": "offline-plugins/tool-arithmetic/v0",
            "tool-arithmetic/v0": "offline-plugins/tool-arithmetic/v0",
            "tool-python": "offline-plugins/tool-python/v0", "tool-python/v0": "offline-plugins/tool-python/v0",
            "steps-arithmetic": "offline-plugins/steps-arithmetic/v0",
            "steps-arithmetic/v0": "offline-plugins/steps-arithmetic/v0",
            **{f"{name}{v}": f"offline-plugins/{name}/v0" for name in
               ("word-problems", "word-problems-calculator", "word-problems-python") for v in ("", "/v0")}}


def resolve_rollout_id(dataset: str) -> Optional[str]:
    """The canonical id of a built-in task or a ``.jsonl`` prompt file; None otherwise.

    >>> resolve_rollout_id("arithmetic"), resolve_rollout_id("pendulum/medium-v0")
    ('offline-plugins/arithmetic/v0', None)
    >>> resolve_rollout_id("arithmetic-length")
    'offline-plugins/arithmetic-length/v0'
    """
    dataset = dataset.strip()
    if dataset in BUILTIN_ROLLOUT_TASKS:
        return dataset
    if dataset in _ALIASES:
        return _ALIASES[dataset]
    if dataset.endswith(".jsonl"):
        return dataset
    return None
