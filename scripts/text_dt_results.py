"""text-dt beside expert iteration on the built-in task, from the same SFT reference, several seeds.

    OFFLINE_PLUGINS_CACHE=~/.cache/offline-plugins python scripts/text_dt_results.py run \\
        --root runs/results-text-dt --steps 1200 --seeds 0 1 2
    python scripts/text_dt_results.py table --root runs/results-text-dt

``run`` trains ``text-dt`` (and ``text-dt`` with ``low_return_weight=0.1``) and
``expert-iteration`` with their registered defaults (the same
rollout budget: 16 prompts x G = 8 per round, minibatches of 32, lr 3e-4, up to 6 new tokens)
through the CLI, one run at a time (``--threads 1``), into ``ROOT/ALGO/sSEED`` (an existing
``summary.json`` is kept unless ``--overwrite``). For each text-dt run it then scores the
exported policy (``OUT/model``) greedily on the 200 held-out prompts conditioned on each return
level and on the plain prompt (bos first, no reward token), into ``conditioning.json``: the
check that the token steers the policy (asking for return 0 should lower exact match).
``table`` prints the tables of docs/results-history.md.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import train_arithmetic  # noqa: E402
from online_results import _fmt, results_main  # noqa: E402

#: run name -> (algorithm, its --set overrides): the Decision Transformer (every row trained), the same with
#: the rows that fell short down-weighted, and expert iteration (only the rows that pass)
RUNS = {
    "text-dt": ("text-dt", []),
    "text-dt-w0.1": ("text-dt", ["low_return_weight=0.1"]),
    "expert-iteration": ("expert-iteration", []),
}
ALGOS = tuple(RUNS)


def conditioning(out: Path, n: int = 200) -> dict:
    """Greedy held-out exact match of ``out/model`` with each reward token first, and with none."""
    import torch

    from offline_plugins.algorithms.text_dt import return_token
    from offline_plugins.modules.tiny_lm import load_causal_lm
    from offline_plugins.text.data.rollouts import greedy_responses, task_prompt_source
    from offline_plugins.text.tasks import ArithmeticTask

    torch.set_num_threads(1)
    summary = json.loads((out / "summary.json").read_text())
    levels = summary.get("config", {}).get("return_levels") or [0.0, 1.0]
    model, tok = load_causal_lm(out / "model")
    model.eval()
    rows = task_prompt_source(ArithmeticTask(digits=2, ops="+"), n_held_out=n).held_out
    result = {}
    for name, prefix in [*((f"return={x:g}", return_token(x)) for x in levels), ("plain", "")]:
        responses = greedy_responses(model, tok, [prefix + r["prompt"] for r in rows], max_new_tokens=6)
        result[name] = sum(a.strip() == r["answer"] for a, r in zip(responses, rows)) / len(rows)
    return result


def run(args) -> None:
    for seed in args.seeds:
        for algo in args.algos:
            out = Path(args.root) / algo / f"s{seed}"
            if not (out / "summary.json").is_file() or args.overwrite:
                name, extra = RUNS[algo]
                train_arithmetic(name, args.steps, args.eval_every, seed, out, [*extra, *(args.set or [])],
                                 args.timeout)
            if RUNS[algo][0] == "text-dt" and (not (out / "conditioning.json").is_file() or args.overwrite):
                started = time.perf_counter()
                scores = conditioning(out)
                scores["eval_s"] = round(time.perf_counter() - started, 1)
                (out / "conditioning.json").write_text(json.dumps(scores, indent=2))
                print(f"{out}: conditioned exact match {scores}", flush=True)



def table(args) -> None:
    root = Path(args.root)
    print("| algorithm | held-out exact match before | after | gain | per seed | sampled reward, first -> last "
          "round | KL to reference | rounds | wall time per run |")
    print("|---|---|---|---|---|---|---|---|---|")
    for algo in ALGOS:
        runs = sorted((root / algo).glob("s*/summary.json"))
        if not runs:
            continue
        s = [json.loads(p.read_text()) for p in runs]
        after = [r["exact_match_after"] for r in s]
        before = [r["exact_match_before"] for r in s]
        gain = statistics.mean(after) - statistics.mean(before)
        print(f"| {algo} | {_fmt(before)} | {_fmt(after)} | {100 * gain:+.1f} | "
              f"{', '.join(f'{100 * a:.1f}' for a in after)} "
              f"| {_fmt([r['reward_mean_first_round'] for r in s], 1, 2)} -> {_fmt([r['reward_mean'] for r in s], 1, 2)} "
              f"| {_fmt([r['kl_to_reference'] for r in s], 1, 3)} | {s[0]['rounds']} "
              f"| {statistics.mean(r['wall_s'] for r in s):.0f} s |")
    header = False
    for algo in ALGOS:
        cond = sorted((root / algo).glob("s*/conditioning.json"))
        if not cond:
            continue
        c = [json.loads(p.read_text()) for p in cond]
        keys = [k for k in c[0] if k != "eval_s"]
        if not header:
            print("\n| policy (greedy, 200 held-out prompts) conditioned on | " + " | ".join(keys) + " |")
            print("|---|" + "---|" * len(keys))
            header = True
        print(f"| {algo} | " + " | ".join(f"{_fmt([x[k] for x in c])} ({', '.join(f'{100 * x[k]:.1f}' for x in c)})"
                                           for k in keys) + " |")
    print(f"\nseeds: {len(runs)}")


def main() -> None:
    results_main(__doc__, "runs/results-text-dt", run, table, pick=("--algos", ALGOS))


if __name__ == "__main__":
    main()
