"""What every built-in text task shares: a problem, the exact-match rule, the hashed split and the task
error (:mod:`offline_plugins.envs.tasks` and the task modules beside it import them from here).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

from offline_plugins.errors import UserError

__all__ = ["Problem", "Split", "TaskError", "exact_match", "hash_split"]

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
