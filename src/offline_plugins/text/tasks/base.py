"""What every built-in text task shares: a problem, the exact-match rule, the hashed splits (of a task's
problems, and of a file's rows by prompt) and the task error (:mod:`offline_plugins.text.tasks` and the task modules beside it import them from here).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Literal, Sequence

from offline_plugins.errors import UserError

__all__ = ["Problem", "Split", "TaskError", "exact_match", "hash_split", "held_out_prompts"]

Split = Literal["train", "test"]


def exact_match(response: str, answer: object) -> float:
    """1.0 if ``response`` and ``answer``, each stripped of surrounding spaces, are the same text; else 0.0.

    The one exact-match rule: a task's reward, a JSONL file's reward against its ``answer``
    column, and every held-out exact-match score.

    >>> exact_match(" 119", "119"), exact_match("1190", "119")
    (1.0, 0.0)
    """
    return 1.0 if response.strip() == str(answer).strip() else 0.0


def hash_split(key: str, test_fraction: float) -> Split:
    """The split a problem belongs to, fixed by a hash of its ``key`` (its prompt, or its operands):
    ``"test"`` for a share ``test_fraction`` of keys, ``"train"`` for the rest, on any machine.

    >>> hash_split("73+46", 0.1), hash_split("73+46", 1.0)
    ('train', 'test')
    """
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little")
    return "test" if (h % 10_000) < test_fraction * 10_000 else "train"


class TaskError(UserError, ValueError):
    """A prompt the task did not make, or a bad task setting."""


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def _prompt_hash(prompt: str) -> int:
    return int.from_bytes(hashlib.blake2b(prompt.encode("utf-8"), digest_size=8).digest(), "little")


def held_out_prompts(prompts: Sequence[str], *, fraction: float = 0.1, min_rows: int = 100) -> set[str]:
    """The prompts whose rows are held out: at least ``max(min_rows, fraction * len(prompts))`` rows.

    Distinct prompts are taken in the order of a hash of their text (so the split does not
    depend on the order of the rows, and every row of a prompt lands on the same side)
    until their rows reach the target; at most half the rows are held out, so a small
    file still trains. ``prompts`` has one entry per row.

    >>> held = held_out_prompts([f"{i}+{i}=" for i in range(1000)])
    >>> len(held)
    100
    >>> len(held_out_prompts([f"{i}+{i}=" for i in range(3000)]))
    300
    """
    if not 0.0 <= fraction < 1.0:
        raise TaskError(f"the held-out fraction must be in [0, 1), got {fraction}")
    counts: dict[str, int] = {}
    for p in prompts:
        counts[p] = counts.get(p, 0) + 1
    n = len(prompts)
    target = min(max(int(min_rows), math.ceil(fraction * n)), n // 2)
    held: set[str] = set()
    covered = 0
    for p in sorted(counts, key=lambda q: (_prompt_hash(q), q)):
        if covered >= target or covered + counts[p] > n // 2:
            break
        held.add(p)
        covered += counts[p]
    return held
