"""What the Python tool's sandbox costs: one call under ``bwrap`` against the unsafe subprocess, and
GRPO on ``tool-python`` with each.

* per call: the median and 90th-percentile wall-clock milliseconds of ``PythonTool.run`` on the
  task's own demonstration program (``print(str(a*b)[::-1])``) over ``--calls`` calls, the two
  sandboxes interleaved call by call (the unsafe subprocess is the anchor: the same parent, the
  same interpreter, no namespaces);
* per training run: ``offline-plugins train grpo --dataset tool-python --set max_new_tokens=56 --set
  reference_sft_steps=130`` (the task's documented settings: a call is 52 tokens) for ``--steps``
  steps with ``--set tool_sandbox=...`` each, its ``steps_per_s`` from ``summary.json`` and the mean
  tool calls per episode from ``metrics.csv`` (the SFT reference is made once, before either is timed).

Run: ``python bench/tool_sandbox_bench.py [--calls 200] [--steps 8] [--json]``; prints a markdown
table (``docs/benchmarks.md``, "The tool sandbox") and, with ``--json``, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path


def per_call(calls: int) -> dict:
    from offline_plugins.text.tools.sandbox import BwrapSandbox, UnsafeSubprocessSandbox
    from offline_plugins.text.tools.tools import PythonTool

    tools = {"bwrap": PythonTool(timeout=10, sandbox=BwrapSandbox()),
             "unsafe-subprocess": PythonTool(timeout=10, sandbox=UnsafeSubprocessSandbox(warn=False))}
    for tool in tools.values():
        tool.check()
    times: dict[str, list[float]] = {name: [] for name in tools}
    for i in range(calls + 5):
        for name, tool in tools.items():
            start = time.perf_counter()
            result = tool.run(f"print(str({100 + i}*{457 + i})[::-1])")
            if i >= 5:  # after 5 warm-up calls each
                times[name].append((time.perf_counter() - start) * 1000)
            assert result.ok and result.text == str((100 + i) * (457 + i))[::-1], result
    return {name: {"median_ms": round(statistics.median(t), 2),
                   "p90_ms": round(statistics.quantiles(t, n=10)[-1], 2), "calls": len(t)}
            for name, t in times.items()}


def training(steps: int, threads: int) -> dict:
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="tool-sandbox-bench-") as root:
        base = [sys.executable, "-m", "offline_plugins.cli", "train", "grpo", "--dataset", "tool-python", "--seed", "0",
                "--threads", str(threads), "--no-progress", "--set", "eval_prompts=8", "--set", "max_new_tokens=56",
                "--set", "reference_sft_steps=130"]
        # the cached SFT reference first, so that neither timed run makes it
        subprocess.run([*base, "--steps", "1", "--out", str(Path(root) / "warm")], check=True, capture_output=True)
        for name in ("unsafe-subprocess", "bwrap"):
            run = Path(root) / name
            proc = subprocess.run([*base, "--steps", str(steps), "--out", str(run), "--set", f"tool_sandbox={name}"],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"train grpo with tool_sandbox={name} failed: {proc.stderr[-2000:]}")
            summary = json.loads((run / "summary.json").read_text())
            calls = _column_mean(run / "metrics.csv", "rollout/tool_calls")
            out[name] = {"steps_per_s": summary["steps_per_s"], "train_s": summary.get("train_s"),
                         "tool_calls_per_episode": calls}
    return out


def _column_mean(metrics_csv: Path, column: str):
    import csv

    with metrics_csv.open(newline="") as fh:
        values = [float(r[column]) for r in csv.DictReader(fh) if r.get(column)]
    return round(sum(values) / len(values), 3) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    calls = per_call(args.calls)
    train = training(args.steps, args.threads)
    anchor = calls["unsafe-subprocess"]
    print("| sandbox | one call, median ms | p90 ms | ratio (median) | GRPO tool-python steps/s | ratio | tool calls "
          "per episode |")
    print("|---|---|---|---|---|---|---|")
    for name in ("unsafe-subprocess", "bwrap"):
        c, t = calls[name], train[name]
        print(f"| {name} | {c['median_ms']} | {c['p90_ms']} | {c['median_ms'] / anchor['median_ms']:.2f}x | "
              f"{t['steps_per_s']} | {t['steps_per_s'] / train['unsafe-subprocess']['steps_per_s']:.2f}x | "
              f"{t['tool_calls_per_episode']} |")
    if args.json:
        print(json.dumps({"calls": calls, "train": train, "steps": args.steps}))


if __name__ == "__main__":
    main()
