"""PRM-guided search against its compute on ``steps-arithmetic``: ``offline-plugins search`` over seeds, then a table.

    python scripts/search_results.py run --root runs/results-search --policy SFT_DIR --prm PRM_OUT --seeds 0 1 2
    python scripts/search_results.py table --root runs/results-search

``run`` calls ``offline-plugins search`` once a seed (one thread; a seed draws its own held-out prompts
and samples) into ``ROOT/sSEED.json``; ``table`` prints the rows of docs/results-history.md (exact match mean ±
std over the seeds and generated tokens per prompt, per method and compute setting) and draws
``ROOT/search.png`` (exact match against tokens, the seeds' means).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import run_table_args  # noqa: E402


def run(root: Path, policy: str, prm: str, seeds: list[int], ns: list[int], widths: list[int], prompts: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        out = root / f"s{seed}.json"
        if out.is_file():
            continue
        cmd = ["offline-plugins", "search", "--policy", policy, "--prm", prm, "--n", *map(str, ns), "--beam-width",
               *map(str, widths), "--prompts", str(prompts), "--seed", str(seed), "--threads", "1", "--out", str(out)]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)


def table(root: Path) -> None:
    from offline_plugins.cli.search import _LABELS, _plot

    runs = [json.loads(p.read_text())["results"] for p in sorted(root.glob("s*.json"))]
    if not runs:
        raise SystemExit(f"no s*.json under {root}: run first")
    keys = [(r["method"], r["n"], r["beam_width"]) for r in runs[0]]
    print(f"| method | n | beam width | exact match (mean ± std, {len(runs)} seeds) | generated tokens per prompt |")
    print("|---|---|---|---|---|")
    means = []
    for i, (method, n, width) in enumerate(keys):
        em = [100 * run[i]["exact_match"] for run in runs]
        tokens = statistics.mean(run[i]["tokens_per_prompt"] for run in runs)
        sd = statistics.stdev(em) if len(em) > 1 else 0.0
        print(f"| {_LABELS[method]} | {n} | {'-' if width is None else width} | {statistics.mean(em):.1f} ± {sd:.1f}% "
              f"| {tokens:.1f} |")
        means.append({"method": method, "exact_match": statistics.mean(em) / 100, "tokens_per_prompt": tokens})
    _plot(means, root / "search.png")
    print(f"wrote {root / 'search.png'}")


def _run_options(r) -> None:
    r.add_argument("--policy", required=True, help="the solution writer (save_pretrained folder or a run's OUT)")
    r.add_argument("--prm", required=True, help="a train prm run's OUT folder")
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--n", type=int, nargs="+", default=[2, 4, 8])
    r.add_argument("--beam-width", type=int, nargs="+", default=[2])
    r.add_argument("--prompts", type=int, default=100)


def main(argv=None) -> int:
    a = run_table_args(__doc__, "runs/results-search", _run_options, argv)
    if a.cmd == "run":
        run(a.root, a.policy, a.prm, a.seeds, a.n, a.beam_width, a.prompts)
    else:
        table(a.root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
