"""Online RL on the built-in task: every method from the same SFT reference, several seeds.

    OFFLINE_PLUGINS_CACHE=~/.cache/offline-plugins python scripts/online_results.py run \\
        --root runs/results-online --steps 1200 --seeds 0 1 2
    python scripts/online_results.py table --root runs/results-online

``run`` trains each algorithm with its registered defaults through the CLI, one run at a
time (``--threads 1``), into ``ROOT/ALGO/sSEED``; an existing ``summary.json`` is kept (rerun
with ``--overwrite``). ``table`` prints the docs/results-history.md table: held-out greedy exact
match after training (mean ± std over seeds, and per seed), the gain over the reference,
the last round's sampled reward and KL to the reference, the share of groups without
signal, and the wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import train_arithmetic  # noqa: E402

ALGOS = ("grpo", "dapo", "dr-grpo", "rloo", "cispo", "gspo", "sapo", "gmpo", "dppo", "reinforce-pp",
         "reinforce-pp-baseline", "expert-iteration")


def run(args) -> None:
    for seed in args.seeds:  # every algorithm's seed 0 first, then seed 1...
        for algo in args.algos:
            out = Path(args.root) / algo / f"s{seed}"
            if (out / "summary.json").is_file() and not args.overwrite:
                print(f"{out}: done, kept", flush=True)
                continue
            train_arithmetic(algo, args.steps, args.eval_every, seed, out, args.set or [], args.timeout)


def _fmt(values, scale=100.0, digits=1) -> str:
    values = [v * scale for v in values]
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def table(args) -> None:
    root = Path(args.root)
    print("| algorithm | held-out exact match | gain | per seed | sampled reward, first -> last round "
          "| KL to reference | groups without signal | rounds | wall time per run |")
    print("|---|---|---|---|---|---|---|---|---|")
    for algo in ALGOS:
        runs = sorted((root / algo).glob("s*/summary.json"))
        if not runs:
            continue
        s = [json.loads(p.read_text()) for p in runs]
        after = [r["exact_match_after"] for r in s]
        before = s[0]["exact_match_before"]
        gain = statistics.mean(after) - before
        print(f"| {algo} | {_fmt(after)} | {100 * gain:+.1f} | {', '.join(f'{100 * a:.1f}' for a in after)} "
              f"| {_fmt([r['reward_mean_first_round'] for r in s], 1, 2)} -> {_fmt([r['reward_mean'] for r in s], 1, 2)} "
              f"| {_fmt([r['kl_to_reference'] for r in s], 1, 3)} | {_fmt([r['groups_without_signal'] for r in s])} % "
              f"| {s[0]['rounds']} | {statistics.mean(r['wall_s'] for r in s):.0f} s |")
    print(f"\nreference (exact_match_before): {100 * before:.1f} %, seeds: {len(s)}")


def results_main(doc: str, root: str, run, table, *, pick: tuple[str, dict], steps: bool = True) -> None:
    """The ``run`` / ``table`` command line of the online results scripts (this one, text-DT's,
    online DPO's): ``pick`` is the option naming what to run (``("--algos", ALGOS)``)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--root", default=root)
    r.add_argument(pick[0], nargs="+", default=list(pick[1]), choices=list(pick[1]))
    r.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    if steps:
        r.add_argument("--steps", type=int, default=1200)
        r.add_argument("--eval-every", type=int, default=300)
        r.add_argument("--set", action="append", help="KEY=VALUE passed to every run")
    r.add_argument("--timeout", type=int, default=900)
    r.add_argument("--overwrite", action="store_true")
    t = sub.add_parser("table")
    t.add_argument("--root", default=root)
    args = parser.parse_args()
    run(args) if args.cmd == "run" else table(args)


def main() -> None:
    results_main(__doc__, "runs/results-online", run, table, pick=("--algos", ALGOS))


if __name__ == "__main__":
    main()
