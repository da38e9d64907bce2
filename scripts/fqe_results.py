"""Does FQE rank a run's checkpoints as the environment does? (docs/results-history.md, issue 28)

Trains each algorithm with ``--keep-checkpoints`` (a checkpoint every ``--every`` steps, each
scored in the environment by the run's own evaluation at that step), then estimates every
kept checkpoint by ``offline-plugins eval CKPT --ope fqe`` (no environment), and reports the
Spearman rank correlation between the estimates and the environment's scores: within each
run, and over all checkpoints of all runs together (choosing among algorithms and steps at once).

  python scripts/fqe_results.py --algos iql,td3-bc,bc --seeds 0 --steps 3200 --every 400 --root runs/results-fqe
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from offline_plugins.audit import _spearman


def _train(root: Path, algo: str, dataset: str, seed: int, steps: int, every: int, episodes: int) -> Path:
    out = root / f"{algo}-s{seed}"
    if (out / "summary.json").is_file():
        return out
    cmd = [sys.executable, "-m", "offline_plugins.cli", "train", algo, "--dataset", dataset, "--steps", str(steps),
           "--seed", str(seed), "--eval-every", str(every), "--checkpoint-every", str(every), "--keep-checkpoints",
           "--eval-episodes", str(episodes), "--threads", "1", "--no-progress", "--out", str(out), "--overwrite"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def _estimate(ckpt: Path, steps: int) -> dict:
    cache = ckpt.with_suffix(".fqe.json")
    if cache.is_file():
        return json.loads(cache.read_text())
    cmd = [sys.executable, "-m", "offline_plugins.cli", "eval", str(ckpt), "--ope", "fqe", "--ope-steps", str(steps),
           "--json"]
    result = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    cache.write_text(json.dumps(result, indent=2))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algos", default="iql,td3-bc,bc")
    p.add_argument("--dataset", default="pendulum/medium-v0")
    p.add_argument("--seeds", default="0")
    p.add_argument("--steps", type=int, default=3200)
    p.add_argument("--every", type=int, default=400)
    p.add_argument("--eval-episodes", type=int, default=10)
    p.add_argument("--ope-steps", type=int, default=3000)
    p.add_argument("--root", default="runs/results-fqe")
    args = p.parse_args()
    root = Path(args.root)
    pooled_true, pooled_est, rows = [], [], []
    for algo in args.algos.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            out = _train(root, algo, args.dataset, seed, args.steps, args.every, args.eval_episodes)
            scores = {h["step"]: h["normalized_score"] for h in json.loads((out / "summary.json").read_text())["eval_history"]}
            true, est = [], []
            for ckpt in sorted((out / "checkpoints").glob("step=*.ckpt"), key=lambda c: int(c.stem.split("=")[1])):
                step = int(ckpt.stem.split("=")[1])
                r = _estimate(ckpt, args.ope_steps)
                true.append(scores[step])
                est.append(r["normalized_score_estimate"])
                print(f"{algo} s{seed} step {step}: environment {scores[step]:.1f}, FQE {est[-1]:.1f} "
                      f"(value {r['value']:.1f})", flush=True)
            rho = _spearman(true, est)
            rows.append((algo, seed, len(true), rho, statistics.fmean(true), statistics.fmean(est)))
            pooled_true += true
            pooled_est += est
    print("\n| run | checkpoints | Spearman | mean environment score | mean FQE estimate |\n|---|---|---|---|---|")
    for algo, seed, n, rho, t, e in rows:
        print(f"| {algo} s{seed} | {n} | {rho:.2f} | {t:.1f} | {e:.1f} |")
    print(f"| all together | {len(pooled_true)} | {_spearman(pooled_true, pooled_est):.2f} | "
          f"{statistics.fmean(pooled_true):.1f} | {statistics.fmean(pooled_est):.1f} |")


if __name__ == "__main__":
    main()
