"""The cost of a reward call in a worker process (``--set reward_workers=process``) against a thread
(the default), the two interleaved call by call in one run.

    python bench/reward_workers_bench.py [--calls 200] [--responses 128] [--json]

One call: :func:`offline_plugins.text.sources.prompts.score_responses` of a round's responses (``--responses``
arithmetic answers of a few characters to prompts like ``12+34=``) with an exact-match reward, through a
:class:`~offline_plugins.text.sources.prompts.RewardGuard` with a 60 s limit. The process worker is started
once before the timed calls (its start-up, a fresh interpreter importing the reward's module, is timed
apart); each call then sends the prompts and responses through a pipe and the rewards back.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def exact_match(prompts, responses, answer=None, **_):
    return [float(r.strip() == a) for r, a in zip(responses, answer)]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--responses", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    import reward_workers_bench as me  # importable by name, as a process worker needs

    from offline_plugins.text.sources.prompts import PromptSource, RewardGuard, score_responses

    rows = [{"prompt": f"{i % 90 + 10}+{i % 7}=", "answer": str(i % 90 + 10 + i % 7)} for i in range(args.responses)]
    responses = [r["answer"] if i % 3 else "0" for i, r in enumerate(rows)]
    source = PromptSource("bench", [], me.exact_match, "reward_workers_bench:exact_match", train=rows)
    guards = {"thread": RewardGuard(time_limit=60.0), "process": RewardGuard(time_limit=60.0, workers="process")}
    started = time.perf_counter()
    score_responses(source, rows, responses, guard=guards["process"])
    start_up = time.perf_counter() - started
    times: dict[str, list[float]] = {"thread": [], "process": []}
    for _ in range(5):
        for g in guards.values():
            score_responses(source, rows, responses, guard=g)
    for _ in range(args.calls):
        for name, g in guards.items():
            t = time.perf_counter()
            score_responses(source, rows, responses, guard=g)
            times[name].append(time.perf_counter() - t)
    guards["process"].close()
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    p90 = {k: sorted(v)[int(0.9 * len(v))] * 1e3 for k, v in times.items()}
    out = {"calls": args.calls, "responses": args.responses, "median_ms": med, "p90_ms": p90,
           "process_over_thread": med["process"] / med["thread"], "process_start_s": start_up}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for k in times:
            print(f"{k:8} median {med[k]:.3f} ms  p90 {p90[k]:.3f} ms")
        print(f"process / thread {out['process_over_thread']:.2f}x; the worker started in {start_up:.2f} s")
    return out


if __name__ == "__main__":
    main()
