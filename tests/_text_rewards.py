"""Reward functions the online tests pass by name (``--reward _text_rewards:digit_share``), and the
prompt file they train on (the ``prompt_file`` fixture of conftest.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path


def digit_share(prompts, responses, **columns):
    """A dense reward a random policy already earns sometimes: the share of digits in the response."""
    return [sum(c.isdigit() for c in r) / max(len(r), 1) for r in responses]


def brevity(prompts, responses, **columns):
    """1.0 for a response of at most two characters, else 0.0."""
    return [1.0 if len(r.strip()) <= 2 else 0.0 for r in responses]


def length_reward(prompts, responses, **row):
    """A reward with signal from a random initialisation: shorter responses score higher (the DDP and FSDP
    runs' GRPO, tests/_llm_ddp_run.py and tests/_llm_fsdp_run.py)."""
    return [1.0 / (1.0 + len(r)) for r in responses]


def write_letter_prompts(path: Path, n: int = 220) -> Path:
    """``n`` prompts of four random letters and a colon, one JSON row each (seeded)."""
    rng = random.Random(0)
    path.write_text("".join(json.dumps({"prompt": "".join(rng.choice("abcdef") for _ in range(4)) + ":"}) + "\n"
                            for _ in range(n)))
    return path
