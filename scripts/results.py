"""Run a grid of ``offline-plugins train`` runs and tabulate their summaries for docs/results-history.md.

Each (algorithm, dataset, seed) trains in its own process with ``--threads 1`` under
``ROOT/<algorithm>/<dataset>/s<seed>``; a finished run (its ``summary.json`` exists) is
skipped, so a grid can be stopped and continued. ``--jobs N`` runs N at a time.

  python scripts/results.py run --algos iql,bc --datasets pendulum/medium-v0 --seeds 0,1,2 --steps 20000
  python scripts/results.py run --algos iql --datasets pendulum/medium-v0 --steps 1600 --online-steps 1600 --root runs/ft
  python scripts/results.py table --root runs/results[,runs/other] [--metric normalized_score] [--algos A,B] [--datasets ID]
  python scripts/results.py plot --root runs/results --out docs/img/results.png

``table`` prints one markdown row per (algorithm, dataset): the mean and the standard
deviation over seeds of the final evaluation, and the seeds it found.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def _run_dir(root: Path, algo: str, dataset: str, seed: int) -> Path:
    return root / algo / dataset.replace("/", "_") / f"s{seed}"


def _one(args, algo: str, dataset: str, seed: int) -> str:
    out = _run_dir(Path(args.root), algo, dataset, seed)
    if (out / "summary.json").is_file():
        return f"skip {out} (done)"
    if out.exists():  # an unfinished run: start it again
        import shutil

        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "offline_plugins.cli", "train", algo, "--dataset", dataset, "--steps", str(args.steps),
           "--seed", str(seed), "--out", str(out), "--threads", "1", "--no-progress",
           "--eval-episodes", str(args.eval_episodes)]
    if args.eval_every is not None:
        cmd += ["--eval-every", str(args.eval_every)]
    if args.online_steps:
        cmd += ["--online-steps", str(args.online_steps)]
    if args.model:
        cmd += ["--model", args.model]
    if args.compile:
        cmd += ["--compile"]
    for kv in args.overrides:
        cmd += ["--set", kv]
    t0 = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"s{seed}.log"
    with log.open("w") as fh:
        rc = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT)
    status = "ok" if rc == 0 else f"FAILED rc={rc}, see {log}"
    return f"{algo} {dataset} s{seed}: {status} in {time.perf_counter() - t0:.0f} s"


def cmd_run(args) -> None:
    jobs = [(a, d, int(s)) for d in args.datasets.split(",") for a in args.algos.split(",") for s in args.seeds.split(",")]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for line in pool.map(lambda j: _one(args, *j), jobs):
            print(line, flush=True)


def _fmt(values: list[float], scale: float) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values) * scale
    sd = statistics.stdev(values) * scale if len(values) > 1 else 0.0
    return f"{mean:.1f} ± {sd:.1f}"


def _summaries(args):
    """``(dataset folder, summary)`` of every finished run under the comma-separated ``--root``
    folders, kept to ``--algos`` and ``--datasets`` when given."""
    algos = set(args.algos.split(",")) if args.algos else None
    datasets = {d.replace("/", "_") for d in args.datasets.split(",")} if args.datasets else None
    for root in args.root.split(","):
        for path in sorted(Path(root).glob("*/*/s*/summary.json")):
            summary, dataset = json.loads(path.read_text()), path.parent.parent.name
            if (algos is None or summary["algorithm"] in algos) and (datasets is None or dataset in datasets):
                yield dataset, summary


def cmd_table(args) -> None:
    metrics = args.metric.split(",")
    rows: dict[tuple[str, str], list[dict]] = {}
    for dataset, summary in _summaries(args):
        rows.setdefault((summary["algorithm"], dataset), []).append(summary)
    if args.pivot:
        _pivot(rows, metrics[0], args)
        return
    print("| algorithm | dataset | " + " | ".join(metrics) + " | seeds | steps |")
    print("|---|---|" + "---|" * len(metrics) + "---|---|")
    for (algo, dataset), found in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        cells = []
        for m in metrics:
            if args.at is not None:  # the evaluation at that step, from each run's history
                values = [v for s in found for t, v in _curve(s, m) if t == args.at]
            else:
                values = [s[m] for s in found if s.get(m) is not None]
            cells.append(_fmt(values, args.scale))
        seeds = ",".join(str(s["seed"]) for s in sorted(found, key=lambda s: s["seed"]))
        steps = ",".join(sorted({str(s["steps"]) for s in found}))
        print(f"| {algo} | {dataset} | " + " | ".join(cells) + f" | {seeds} | {steps} |")


def _pivot(rows: dict, metric: str, args) -> None:
    """One row per algorithm, one column per dataset: mean ± sd of ``metric`` (seeds, steps)."""
    datasets = sorted({d for _, d in rows})
    algos = sorted({a for a, _ in rows})
    print("| algorithm | " + " | ".join(datasets) + " |")
    print("|---|" + "---|" * len(datasets))
    for algo in algos:
        cells = []
        for d in datasets:
            found = rows.get((algo, d), [])
            if args.at is not None:
                values = [v for s in found for t, v in _curve(s, metric) if t == args.at]
                steps = str(args.at)
            else:
                values = [s[metric] for s in found if s.get(metric) is not None]
                steps = "/".join(sorted({str(s["steps"]) for s in found}))
            cells.append(f"{_fmt(values, args.scale)} ({len(values)}, {steps})" if values else "-")
        print(f"| {algo} | " + " | ".join(cells) + " |")


def _curve(summary: dict, metric: str) -> list[tuple[int, float]]:
    return [(h["step"], h[metric]) for h in summary.get("eval_history", []) if h.get(metric) is not None]


def cmd_plot(args) -> None:
    """One panel per dataset: the mean over seeds of ``--metric`` against steps, per algorithm (band: min-max)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict[str, dict[str, list[dict]]] = {}
    for dataset, summary in _summaries(args):
        runs.setdefault(dataset, {}).setdefault(summary["algorithm"], []).append(summary)
    if not runs:
        raise SystemExit(f"no runs under {args.root}")
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.6), squeeze=False)
    names = sorted({algo for algos in runs.values() for algo in algos})
    colors = {name: f"C{i % 10}" for i, name in enumerate(names)}  # one colour per algorithm in every panel
    for ax, (dataset, algos) in zip(axes[0], sorted(runs.items())):
        for algo, found in sorted(algos.items()):
            curves = [dict(_curve(s, args.metric)) for s in found]
            steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if not steps:
                continue
            values = [[c[t] * args.scale for c in curves] for t in steps]
            ax.plot(steps, [statistics.fmean(v) for v in values], marker="o", ms=3, color=colors[algo],
                    label=f"{algo} ({len(curves)})")
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], alpha=0.15, color=colors[algo])
        before = [s[args.baseline] for found in algos.values() for s in found if s.get(args.baseline) is not None]
        if before:
            ax.axhline(statistics.fmean(before) * args.scale, color="k", ls="--", lw=1, label="reference")
        if args.mark:
            ax.axvline(args.mark, color="grey", ls=":", lw=1, label=f"online from {args.mark}")
        ax.set_title(dataset, fontsize="medium")
        ax.set_xlabel("gradient step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(args.ylabel or args.metric)
    for ax in axes[0]:
        ax.legend(fontsize="small", loc="best")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


def _add_selection(p: argparse.ArgumentParser) -> None:
    """The options of ``table`` and ``plot`` that pick the runs and the metric."""
    p.add_argument("--root", default="runs/results", help="one folder, or several separated by commas")
    p.add_argument("--algos", default=None, help="only these algorithms (comma-separated)")
    p.add_argument("--datasets", default=None, help="only these dataset ids (comma-separated)")
    p.add_argument("--metric", default="normalized_score")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(required=True)
    p = sub.add_parser("run", help="train every (algorithm, dataset, seed) of the grid")
    p.add_argument("--algos", required=True)
    p.add_argument("--datasets", required=True)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--online-steps", type=int, default=0, help="train --online-steps (offline-to-online fine-tuning)")
    p.add_argument("--eval-episodes", type=int, default=10)
    p.add_argument("--model", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--compile", action="store_true", help="train --compile (the loss through torch.compile)")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--root", default="runs/results")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("table", help="markdown table of the runs under --root")
    _add_selection(p)
    p.add_argument("--scale", type=float, default=1.0, help="multiply values (100 for accuracies in %%)")
    p.add_argument("--at", type=int, default=None, help="report the evaluation at this step instead of the last")
    p.add_argument("--pivot", action="store_true", help="one row per algorithm, one column per dataset (first --metric; cells: mean ± sd (seeds, steps))")
    p.set_defaults(func=cmd_table)
    p = sub.add_parser("plot", help="learning curves (mean over seeds, min-max band) of the runs under --root")
    _add_selection(p)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--ylabel", default=None)
    p.add_argument("--baseline", default="exact_match_before", help="summary key drawn as a dashed line")
    p.add_argument("--mark", type=int, default=None, help="a dotted vertical line at this step (fine-tuning's switch)")
    p.add_argument("--out", required=True, help="PNG path")
    p.set_defaults(func=cmd_plot)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
