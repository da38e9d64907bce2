"""Overlapped rollouts (``--set async_rollouts=true``) against the synchronous loop: steps/s and the
reward curve at equal steps, GRPO on the built-in ``small`` model, several seeds.

Each seed trains GRPO twice through the shell from the same start, once sampling and training in turn
(the anchor, one process) and once sampling the next round in a worker process while the current one
trains (``max_staleness`` unset: the whole round overlapped), each with ``--threads 1``, so on a
2-core machine the trainer and the sampler each hold a core. The task is a prompt file scored by a
dense reward a random policy already earns sometimes (the share of digits in the response), from
``small``'s random initialisation: what is measured is the loop, not a task. Reported per seed and
as the mean: the training wall time and steps/s (the summary's ``wall_s``, start-up excluded), the
first and last rounds' mean reward, and the mean reward of each quarter of the run's rounds.

Run: ``python bench/async_rollouts_bench.py [--steps 120] [--seeds 0 1 2] [--root runs/bench-async]
[--plot curve.png]``; prints a markdown table and a JSON line (``--plot-only --plot PNG`` redraws the
curves of runs already in ``--root``). Needs 2 free cores for the overlap to show.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SETTINGS = {"group_size": 8, "prompts_per_round": 8, "batch_size": 16, "max_new_tokens": 16, "eval_prompts": 16,
            "lr": 1e-3}


def digit_share(prompts, responses, **columns):
    """The share of digits in the response."""
    return [sum(c.isdigit() for c in r) / max(len(r), 1) for r in responses]


def _prompts(path: Path) -> Path:
    rng = random.Random(0)
    path.write_text("".join(json.dumps({"prompt": "Write: " + "".join(rng.choice("abcdefgh") for _ in range(6))})
                            + "\n" for _ in range(400)))
    return path


def _run(prompts: Path, out: Path, seed: int, steps: int, overlapped: bool) -> dict:
    from offline_plugins.lightning.run import train_algorithm

    extra = {"async_rollouts": True} if overlapped else {"rollout_correction": 2.0}
    summary = train_algorithm("grpo", str(prompts), model="small", steps=steps, seed=seed, out_dir=out,
                              progress=False, threads=1, reward="async_rollouts_bench:digit_share", eval_every=0,
                              log_every=1, overwrite=True, overrides={**SETTINGS, **extra})
    rewards = [float(r["rollout/reward_mean"]) for r in csv.DictReader(open(out / "metrics.csv"))
               if r.get("rollout/reward_mean")]
    lags = [float(r["rollout/sampler_lag_steps"]) for r in csv.DictReader(open(out / "metrics.csv"))
            if r.get("rollout/sampler_lag_steps")]
    q = max(len(rewards) // 4, 1)
    return {"wall_s": summary["wall_s"], "steps_per_s": steps / summary["wall_s"], "rewards": rewards,
            "quarters": [statistics.fmean(rewards[i * q:(i + 1) * q]) for i in range(4) if rewards[i * q:(i + 1) * q]],
            "max_lag": max(lags) if lags else 0.0}


def plot(root: Path, seeds: list, out: Path) -> None:
    """The rollouts' mean reward per round of each loop (mean over seeds, band min-max) against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for mode, label in (("sync", "synchronous (anchor)"), ("async", "overlapped")):
        curves = []
        for seed in seeds:
            rows = [r for r in csv.DictReader(open(root / f"{mode}-s{seed}" / "metrics.csv"))
                    if r.get("rollout/reward_mean")]
            curves.append([(int(r["step"]), float(r["rollout/reward_mean"])) for r in rows])
        n = min(len(c) for c in curves)
        steps = [curves[0][i][0] for i in range(n)]
        values = [[c[i][1] for c in curves] for i in range(n)]
        ax.plot(steps, [statistics.fmean(v) for v in values], label=label)
        ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], alpha=0.2)
    ax.set_xlabel("gradient step")
    ax.set_ylabel("rollouts' mean reward")
    ax.set_title(f"GRPO on small: overlapped against synchronous rounds ({len(seeds)} seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--root", default="runs/bench-async")
    parser.add_argument("--plot", default=None, metavar="PNG", help="also draw the reward curves into this file")
    parser.add_argument("--plot-only", action="store_true", help="draw --plot from the runs already in --root")
    args = parser.parse_args(argv)
    if args.plot_only:
        plot(Path(args.root), args.seeds, Path(args.plot))
        return
    import torch

    torch.set_num_threads(1)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    prompts = _prompts(root / "prompts.jsonl")
    results: dict = {"sync": [], "async": []}
    for seed in args.seeds:
        for mode in ("sync", "async"):
            r = _run(prompts, root / f"{mode}-s{seed}", seed, args.steps, mode == "async")
            results[mode].append(r)
            print(f"seed {seed} {mode}: {r['steps_per_s']:.2f} steps/s, reward {r['rewards'][0]:.3f} -> "
                  f"{r['rewards'][-1]:.3f}, quarters {[round(x, 3) for x in r['quarters']]}", flush=True)
    rows = ["| loop | steps/s (mean over seeds) | per seed | reward by quarter of the run (mean over seeds) "
            "| last round's reward | largest lag (steps) |", "|---|---|---|---|---|---|"]
    for mode, label in (("sync", "synchronous (anchor)"), ("async", "overlapped")):
        rs = results[mode]
        quarters = [statistics.fmean(r["quarters"][i] for r in rs) for i in range(len(rs[0]["quarters"]))]
        rows.append(f"| {label} | {statistics.fmean(r['steps_per_s'] for r in rs):.2f} | "
                    + ", ".join(f"{r['steps_per_s']:.2f}" for r in rs) + " | "
                    + " / ".join(f"{q:.3f}" for q in quarters) + " | "
                    + f"{statistics.fmean(r['rewards'][-1] for r in rs):.3f} | {max(r['max_lag'] for r in rs):.0f} |")
    ratio = statistics.fmean(r["steps_per_s"] for r in results["async"]) / statistics.fmean(
        r["steps_per_s"] for r in results["sync"])
    print("\n".join(rows))
    print(f"overlapped / synchronous steps/s: {ratio:.2f}x")
    if args.plot:
        plot(root, args.seeds, Path(args.plot))
    print(json.dumps({"steps": args.steps, "seeds": args.seeds, "ratio": ratio,
                      **{m: [{k: v for k, v in r.items() if k != "rewards"} for r in rs] for m, rs in results.items()}}))


if __name__ == "__main__":
    main()
