"""Steps/s of ``offline-plugins train ppo-rlhf`` (the Lightning shell) on the tiny model.

Two runs of the same settings, ``steps`` and ``2 * steps`` gradient steps, on a prompt file with a
dense reward (the share of digits in the response); steps/s is ``steps / (t_2N - t_N)``, so the
setup and the final evaluation cancel. TRL's PPO trainer is looked up where TRL versions have
kept it (``trl.PPOTrainer``, ``trl.experimental.ppo.PPOTrainer``); the installed TRL and what
was found are reported: TRL 1.16.0 has neither, so nothing is timed against it.

    python bench/ppo_rlhf_bench.py [--steps 24] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path


def digit_share(prompts, responses, **_):
    return [sum(c.isdigit() for c in r) / max(len(r), 1) for r in responses]


def ppo_rlhf_steps_per_s(steps: int = 24, *, threads: int = 1, settings: dict | None = None) -> dict:
    """``{"steps_per_s", "responses_per_s", "settings"}`` of ppo-rlhf through the training shell."""
    from offline_plugins.lightning.run import train_algorithm

    settings = settings or {"group_size": 2, "prompts_per_round": 16, "batch_size": 8, "ppo_epochs": 2,
                            "max_new_tokens": 4, "eval_prompts": 10}
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": "".join(rng.choice("abcdef") for _ in range(4)) + ":"})
                                   + "\n" for _ in range(220)))
        walls = []
        for n in (steps, steps, 2 * steps):  # the first run pays the imports and model building: dropped
            t = time.perf_counter()
            train_algorithm("ppo-rlhf", str(prompts), steps=n, seed=0, out_dir=Path(tmp) / f"run{len(walls)}", progress=False,
                  threads=threads, reward=f"{__name__}:digit_share", eval_every=0, overrides=dict(settings))
            walls.append(time.perf_counter() - t)
    walls = walls[1:]
    rate = steps / max(walls[1] - walls[0], 1e-9)
    rows_per_step = settings["batch_size"]
    return {"steps_per_s": rate, "rollouts_trained_per_s": rate * rows_per_step, "settings": settings,
            "walls_s": walls}


def trl_ppo_trainer() -> dict:
    """Which TRL is installed and whether it ships a PPO trainer (``None``: not installed)."""
    try:
        import trl
    except ImportError:
        return {"trl": None, "ppo_trainer": None}
    import importlib
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    for module, name in (("trl", "PPOTrainer"), ("trl.experimental.ppo", "PPOTrainer")):
        try:
            if hasattr(importlib.import_module(module), name):
                return {"trl": trl.__version__, "ppo_trainer": f"{module}.{name}"}
        except ImportError:
            continue
    return {"trl": trl.__version__, "ppo_trainer": None}


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    sys.modules.setdefault("ppo_rlhf_bench", sys.modules[__name__])
    found = trl_ppo_trainer()
    print(json.dumps({"ppo_rlhf": ppo_rlhf_steps_per_s(a.steps, threads=a.threads), "trl_ppo": found}))


if __name__ == "__main__":
    main()
