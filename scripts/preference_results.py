"""Preference losses on a user-style JSONL task, through the real CLI, beside a plain DPO loop.

The task is one the package does not ship: reverse a random 5-letter lowercase string
(``"rev qzkfa="`` -> ``"afkzq"``); the rejected answer is the correct one with one
character replaced. The rows are written to a JSONL file and trained on as a new user
would (``offline-plugins train ALGO --dataset pairs.jsonl --model tiny``), from the
tiny model's random initialisation (no SFT). The plain reference is a ~40-line DPO
loop on a 2-layer, 128-wide GPT-2 (``GPT2LMHeadModel`` from a ``GPT2Config``) with a
character vocabulary and AdamW at 1e-3, trained on the same training rows and scored
on the same held-out rows.

    python scripts/preference_results.py --out runs/pref-results [--algorithms dpo,ipo,simpo,orpo,kto]
        [--steps 300,1000] [--seeds 0,1,2] [--rows 800] [--threads 1]

Writes ``results.json`` (one record per run, with its command) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import time
from pathlib import Path

import torch

LETTERS = string.ascii_lowercase


def make_rows(n: int, seed: int = 0, min_len: int = 5, max_len: int = 5) -> list[dict]:
    """``n`` reverse-the-string pairs with distinct prompts; rejected = chosen with one character changed."""
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < n:
        s = "".join(rng.choice(LETTERS) for _ in range(rng.randint(min_len, max_len)))
        if s in seen:
            continue
        seen.add(s)
        good = s[::-1]
        i = rng.randrange(len(good))
        bad = good[:i] + rng.choice([c for c in LETTERS if c != good[i]]) + good[i + 1:]
        rows.append({"prompt": f"rev {s}=", "chosen": good, "rejected": bad})
    return rows


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def plain_dpo(train_rows, test_rows, *, steps=300, batch=16, beta=0.1, lr=1e-3, seed=0) -> float:
    """The plain reference: the DPO loop written in ``tests/test_preference_generalise.py``; held-out accuracy."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tests" / "test_preference_generalise.py"
    spec = importlib.util.spec_from_file_location("_preference_reference_loop", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.plain_dpo(train_rows, test_rows, seed, steps=steps, batch=batch, beta=beta, lr=lr)


def split_rows(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """The CLI's own train / held-out split of these rows (so both sides score the same pairs)."""
    from offline_plugins.text.data.preference_sources import held_out_prompts

    held = held_out_prompts([r["prompt"] for r in rows])
    return [r for r in rows if r["prompt"] not in held], [r for r in rows if r["prompt"] in held]


def cli_run(algorithm: str, data: Path, steps: int, seed: int, out: Path, threads: int, sets=()) -> dict:
    from offline_plugins.cli import main

    args = ["train", algorithm, "--dataset", str(data), "--model", "tiny", "--steps", str(steps), "--seed", str(seed),
            "--threads", str(threads), "--out", str(out), "--no-progress", "--json"]
    for s in sets:
        args += ["--set", s]
    code = main(args)
    if code != 0:
        raise SystemExit(f"offline-plugins {' '.join(args)} failed with exit code {code}")
    summary = json.loads((out / "summary.json").read_text())
    summary["command"] = "offline-plugins " + " ".join(args)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/pref-results"))
    parser.add_argument("--algorithms", default="dpo,ipo,simpo,orpo,kto")
    parser.add_argument("--steps", default="300,1000")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rows", type=int, default=800)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-plain", action="store_true")
    parser.add_argument("--set", action="append", default=[], dest="sets", help="extra --set for every CLI run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = make_rows(args.rows, seed=1234)
    data = write_jsonl(rows, args.out / "pairs.jsonl")
    train_rows, test_rows = split_rows(rows)
    steps = [int(s) for s in args.steps.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    records = []
    results_path = args.out / "results.json"
    if not args.skip_plain:
        for n in steps:
            for seed in seeds:
                t0 = time.perf_counter()
                acc = plain_dpo(train_rows, test_rows, steps=n, seed=seed)
                records.append({"algorithm": "plain-dpo (GPT-2 2x128, AdamW 1e-3)", "steps": n, "seed": seed,
                                "preference_accuracy": acc, "wall_s": round(time.perf_counter() - t0, 1),
                                "heldout_pairs": len(test_rows), "command": "plain_dpo() of tests/test_preference_generalise.py"})
                print(json.dumps(records[-1]), flush=True)
                results_path.write_text(json.dumps(records, indent=2))
    for algorithm in args.algorithms.split(","):
        for n in steps:
            for seed in seeds:
                s = cli_run(algorithm, data, n, seed, args.out / f"{algorithm}-{n}-s{seed}", args.threads, args.sets)
                records.append({k: s.get(k) for k in (
                    "algorithm", "steps", "seed", "preference_accuracy", "train_preference_accuracy",
                    "likelihood_accuracy", "kl_to_reference", "heldout_pairs", "train_pairs", "steps_per_s",
                    "train_s", "command")})
                print(json.dumps(records[-1]), flush=True)
                results_path.write_text(json.dumps(records, indent=2))
    print("\n| algorithm | steps | held-out accuracy (mean ± sd over seeds) | per seed |\n|---|---|---|---|")
    groups: dict = {}
    for r in records:
        groups.setdefault((r["algorithm"], r["steps"]), []).append(r["preference_accuracy"])
    for (a, n), accs in groups.items():
        sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
        print(f"| {a} | {n} | {statistics.mean(accs):.3f} ± {sd:.3f} | {', '.join(f'{x:.3f}' for x in accs)} |")


if __name__ == "__main__":
    main()
