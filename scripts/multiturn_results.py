"""GRPO, expert iteration and REINFORCE++ on ``tool-arithmetic`` (multi-turn episodes with a calculator),
with the verifier's reward at the end or per-turn rewards beside it, several seeds.

    python scripts/multiturn_results.py run --root runs/results-multiturn --steps 60 --seeds 0 1 2
    python scripts/multiturn_results.py run --arms reinforce-pp reinforce-pp+turn grpo+turn ...
    python scripts/multiturn_results.py table --root runs/results-multiturn

``run`` trains each arm (:data:`ARMS`: an algorithm, its settings and its task; ``+turn``:
``tool_reward=0.2``, a turn whose call answered the product earns 0.2; ``python/``: ``tool-python``,
the reversed product with the Python tool) through the CLI (one thread, one run at a time)
from the SFT reference of ``--reference-steps`` steps on demonstrations that call the calculator
(made and cached by the first run, ``reference_sft_steps``), into ``ROOT/ARM/sSEED``; ``table``
prints the rows of docs/results-history.md from each run's ``summary.json`` and ``metrics.csv`` (the first
and last rounds' rollout reward and turn reward, tool calls and malformed calls per episode).
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import run_table_args, run_unless_done  # noqa: E402

#: arm -> (algorithm, its settings beside SETTINGS, task); a turn of tool-python's call is 52 tokens
PYTHON = ["max_new_tokens=56"]
ARMS = {"grpo": ("grpo", [], "tool-arithmetic"), "expert-iteration": ("expert-iteration", [], "tool-arithmetic"),
        "reinforce-pp": ("reinforce-pp", [], "tool-arithmetic"),
        "grpo+turn": ("grpo", ["tool_reward=0.2"], "tool-arithmetic"),
        "reinforce-pp+turn": ("reinforce-pp", ["tool_reward=0.2"], "tool-arithmetic"),
        "python/grpo": ("grpo", PYTHON, "tool-python"),
        "python/expert-iteration": ("expert-iteration", PYTHON, "tool-python")}
SETTINGS = ["max_new_tokens=40", "eval_prompts=200"]


def run(root: Path, steps: int, seeds: list[int], reference_steps: int, arms: list[str]) -> None:
    for arm in arms:
        algo, extra, task = ARMS[arm]
        for seed in seeds:
            out = root / arm / f"s{seed}"
            own = {e.split("=")[0] for e in extra}  # the arm's own value of a setting replaces SETTINGS'
            settings = [s for s in SETTINGS if s.split("=")[0] not in own] + extra
            sets = [a for s in settings + [f"reference_sft_steps={reference_steps}"] for a in ("--set", s)]
            run_unless_done(["offline-plugins", "train", algo, "--dataset", task, "--steps", str(steps), "--seed",
                             str(seed), "--out", str(out), "--threads", "1", "--no-progress", *sets], out)


def _rounds(out: Path) -> list[dict]:
    with open(out / "metrics.csv") as fh:
        return [r for r in csv.DictReader(fh) if r.get("rollout/reward_mean")]


def table(root: Path) -> None:
    print("| arm | seeds | held-out exact match (greedy) | rollout reward, first -> last round | "
          "turn reward / episode, last round | tool calls / episode, last round | "
          "malformed calls / episode, last round | train s |")
    print("|---|---|---|---|---|---|---|---|")
    for algo in ARMS:
        runs = sorted((root / algo).glob("s*/summary.json"))
        if not runs:
            continue
        s = [json.loads(p.read_text()) for p in runs]
        r = [_rounds(p.parent) for p in runs]

        def ms(values, pct=False):
            k = 100 if pct else 1
            m = statistics.mean(values) * k
            sd = statistics.stdev(values) * k if len(values) > 1 else 0.0
            return f"{m:.1f} ± {sd:.1f}" if pct else f"{m:.2f} ± {sd:.2f}"

        col = lambda rows, i, key: [float(x[i][key]) for x in rows]  # noqa: E731
        print(f"| {algo} | {len(s)} | {ms([x['exact_match_before'] for x in s], True)}% -> "
              f"{ms([x['exact_match_after'] for x in s], True)}% | {ms(col(r, 0, 'rollout/reward_mean'))} -> "
              f"{ms(col(r, -1, 'rollout/reward_mean'))} | {ms([float(x[-1].get('rollout/turn_reward') or 0) for x in r])} | "
              f"{ms(col(r, -1, 'rollout/tool_calls'))} | "
              f"{ms(col(r, -1, 'rollout/tool_failures_malformed'))} | "
              f"{statistics.mean(x['train_s'] for x in s):.0f} |")


def _run_options(r) -> None:
    r.add_argument("--steps", type=int, default=60)
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--reference-steps", type=int, default=130)
    r.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))


def main(argv=None) -> int:
    a = run_table_args(__doc__, "runs/results-multiturn", _run_options, argv)
    if a.cmd == "run":
        run(a.root, a.steps, a.seeds, a.reference_steps, a.arms)
    else:
        table(a.root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
