"""Diffuser's goal-conditioned planning (inpainting) against IQL and BC on the point maze.

    python scripts/maze_results.py run --root runs/results-maze --seeds 0
    python scripts/maze_results.py table --root runs/results-maze
    python scripts/maze_results.py guidance --root runs/results-maze --steps 2000

``guidance`` trains Diffuser on Pendulum medium (seed 0) into ``ROOT/pendulum-diffuser`` and
evaluates that one checkpoint three ways: one unguided plan, 16 plans ranked by the return
model, 16 plans guided by its gradient at the reference's scale 0.1.

``run`` trains each algorithm through the CLI (one thread, one run at a time) on
``pointmaze/umaze-v0`` into ``ROOT/ALGO/sSEED`` and skips runs already there; ``table``
prints the rows of docs/results-history.md (normalised score: 100 * (R - random) / (controller -
random), the recipe's references). ``diffuser-start`` is Diffuser with ``goal_inpainting=false``
(the plan conditioned on the current state only), the ablation that shows what the goal adds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import run_unless_done  # noqa: E402

DATASET = "pointmaze/umaze-v0"
#: name -> (algorithm, steps, --set overrides)
ARMS: dict[str, tuple[str, int, list[str]]] = {
    "diffuser": ("diffuser", 3000, ["slice_len=128"]),
    "diffuser-lr1e-3": ("diffuser", 3000, ["slice_len=128", "lr=1e-3"]),
    "diffuser-start": ("diffuser", 3000, ["slice_len=128", "goal_inpainting=false"]),
    "iql": ("iql", 10000, []),
    "bc": ("bc", 10000, []),
}


def run(root: Path, seeds: list[int], arms: list[str], episodes: int) -> None:
    for name in arms:
        algo, steps, sets = ARMS[name]
        for seed in seeds:
            out = root / name / f"s{seed}"
            run_unless_done(["offline-plugins", "train", algo, "--dataset", DATASET, "--steps", str(steps), "--seed",
                             str(seed), "--eval-episodes", str(episodes), "--eval-every", "0", "--out", str(out),
                             "--threads", "1", "--no-progress", *[a for s in sets for a in ("--set", s)]], out)


def table(root: Path) -> None:
    print("| algorithm | steps | seeds | normalised score (± over seeds; one seed: episodes) | return | train + eval s |")
    print("|---|---|---|---|---|---|")
    for name, (_, steps, _) in ARMS.items():
        runs = [json.loads(p.read_text()) for p in sorted((root / name).glob("s*/summary.json"))]
        if not runs:
            continue
        score = [r["normalized_score"] for r in runs]
        sd = statistics.stdev(score) if len(score) > 1 else runs[0]["normalized_score_std"]  # one seed: episodes
        print(f"| {name} | {steps} | {len(runs)} | {statistics.mean(score):.1f} ± {sd:.1f} | "
              f"{statistics.mean(r['return_mean'] for r in runs):.1f} | "
              f"{statistics.mean(r.get('wall_s', 0.0) for r in runs):.0f} |")


def guidance(root: Path, steps: int, episodes: int, settings: list[str]) -> None:
    from offline_plugins.lightning.checkpoints import load_trained_run

    out = root / "pendulum-diffuser"
    if not (out / "summary.json").is_file():
        subprocess.run(["offline-plugins", "train", "diffuser", "--dataset", "pendulum/medium-v0", "--steps", str(steps),
                        "--seed", "0", "--eval-every", "0", "--eval-episodes", str(episodes), "--out", str(out),
                        "--threads", "1", "--no-progress"], check=True)
    trained = load_trained_run(out / "checkpoints" / "last.ckpt")
    planner, plan = trained.module.policy, trained.plan
    losses = json.loads((out / "summary.json").read_text())["losses"]
    print(f"return model after {steps} steps: error {losses['train/value_error']:.1f} (return units), "
          f"standardised squared error {losses['train/loss_value']:.3f}")
    for n, scale in (map(float, x.split(":")) for x in settings):
        n = int(n)
        planner.n_samples, planner.guide_scale = n, scale
        planner.planning_seconds, planner.planning_calls, planner.planned_actions = 0.0, 0, 0
        r = plan.kind.evaluate(trained.module, plan.data, episodes=episodes, seed=0, device="cpu")
        print(f"| {n} | {scale} | {episodes} | {r['normalized_score']:.1f} ± {r['normalized_score_std']:.1f} | "
              f"{planner.planning_stats()['plan_ms_per_action']:.0f} |", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--root", type=Path, required=True)
    r.add_argument("--seeds", type=int, nargs="+", default=[0])
    r.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    r.add_argument("--episodes", type=int, default=10)
    t = sub.add_parser("table")
    t.add_argument("--root", type=Path, required=True)
    g = sub.add_parser("guidance")
    g.add_argument("--root", type=Path, required=True)
    g.add_argument("--steps", type=int, default=2000)
    g.add_argument("--episodes", type=int, default=10)
    g.add_argument("--settings", nargs="+", default=["1:0", "16:0", "16:0.1"], help="plans:guide_scale to evaluate")
    args = parser.parse_args(argv)
    if args.cmd == "run":
        run(args.root, args.seeds, args.arms, args.episodes)
    elif args.cmd == "guidance":
        guidance(args.root, args.steps, args.episodes, args.settings)
    else:
        table(args.root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
