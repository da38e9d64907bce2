"""Soak check: long runs whose memory, open files, child processes and speed should stay flat.

    python bench/soak.py [--out /tmp/soak] [--budget-s 7200] [--only grpo-tool-python,dpo,iql] [--json]

Each run is an ordinary ``offline-plugins train`` command in a child process (one thread), bounded by
its share of ``--budget-s`` (killed past it: the figures then cover what ran). Every ``--every`` seconds
the sampler reads, from ``/proc``:

* the resident set of the run's process tree (``VmRSS`` of the trainer and its children, MiB);
* the trainer's open file descriptors;
* its child processes (a tool sandbox's, a reward worker's);
* the last gradient step its progress bar showed (steps/s between samples).

A run is flat when, after its first quarter (warm-up: caches, the first checkpoint, the allocator),
the median RSS of its last quarter exceeds the third quarter's by less than a quarter of ``--rss-band``
MiB (a leak keeps growing; a one-time allocation such as the first evaluation is a step) and the
second quarter's by less than the band (or 10 %), the median open files and child processes exceed
the second quarter's by at most ``--fd-band``, and the last quarter's steps/s is at least 75 % of
the second quarter's. Peaks (an evaluation, a checkpoint being written) are
reported beside the medians. The runs (the issue's list):

* ``grpo-tool-python``: GRPO on the multi-turn Python-tool task, 2,000 rounds (one update per round,
  8 episodes), each Python call a fresh bwrap sandbox;
* ``dpo``: DPO on the built-in preference set, 50,000 steps;
* ``iql``: IQL on Pendulum medium-replay, 200,000 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

RUNS = {
    "grpo-tool-python": ["grpo", "--dataset", "tool-python", "--steps", "2000", "--set", "group_size=2",
                         "--set", "prompts_per_round=4", "--set", "batch_size=8", "--set", "eval_prompts=20",
                         "--eval-every", "500", "--checkpoint-every", "500"],
    "dpo": ["dpo", "--dataset", "arithmetic/preference-v0", "--model", "tiny", "--steps", "50000",
            "--eval-every", "10000", "--checkpoint-every", "10000"],
    "iql": ["iql", "--dataset", "pendulum/medium-replay-v0", "--steps", "200000", "--eval-every", "50000",
            "--checkpoint-every", "50000"],
}


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
        except OSError:
            pass
    return out


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _last_step(log: Path) -> int:
    """The step the run's progress bar (``train: ... 2088/200000 [...``) last showed in its log."""
    try:
        with log.open("rb") as fh:
            fh.seek(max(fh.seek(0, 2) - 8192, 0))
            tail = fh.read().decode("utf-8", "replace")
    except OSError:
        return 0
    found = re.findall(r"train[^\r\n|]*\|[^|]*\|\s*(\d+)/(\d+)", tail)
    return int(found[-1][0]) if found else 0


def sample(proc: subprocess.Popen, log: Path, limit_s: float, every: float) -> list[dict]:
    samples, started = [], time.monotonic()
    while proc.poll() is None:
        t = time.monotonic() - started
        if t > limit_s:
            proc.send_signal(signal.SIGINT)  # the run stops cleanly at its next step and keeps its files
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            break
        tree = _tree(proc.pid)
        try:
            fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
        except OSError:
            fds = 0
        samples.append({"t": round(t, 1), "rss_mib": round(sum(_rss_mib(p) for p in tree), 1), "fds": fds,
                        "children": len(tree) - 1, "step": _last_step(log)})
        time.sleep(every)
    return samples


def verdict(samples: list[dict], rss_band: float, fd_band: int) -> dict:
    """Flatness after the first quarter of the samples (see the module's docstring): the medians of
    the second and the last quarter are compared, so a transient (an evaluation, a checkpoint being
    written) is reported as the peak but is not a trend."""
    import statistics

    n = len(samples)
    if n < 8:
        return {"flat": None, "why": f"only {n} samples"}
    q = n // 4
    second, third, last = samples[q:2 * q], samples[2 * q:3 * q], samples[3 * q:]
    med = lambda part, key: statistics.median(s[key] for s in part)  # noqa: E731
    rss0, rss_third, rss1 = med(second, "rss_mib"), med(third, "rss_mib"), med(last, "rss_mib")

    def rate(part):
        dt = part[-1]["t"] - part[0]["t"]
        return (part[-1]["step"] - part[0]["step"]) / dt if dt > 0 else 0.0

    r2, r4 = rate(second), rate(last)
    checks = {
        "rss_median_second_quarter_mib": round(rss0, 1), "rss_median_last_quarter_mib": round(rss1, 1),
        "rss_median_third_quarter_mib": round(rss_third, 1),
        "rss_peak_mib": round(max(s["rss_mib"] for s in samples[q:]), 1),
        # a leak keeps growing: a one-time allocation (the first evaluation) is a step, not a trend
        "rss_ok": rss1 - rss_third < rss_band / 4 and rss1 - rss0 < max(rss_band, 0.1 * rss0),
        "fds_median_second_quarter": med(second, "fds"), "fds_median_last_quarter": med(last, "fds"),
        "fds_peak": max(s["fds"] for s in samples[q:]),
        "fds_ok": med(last, "fds") <= med(second, "fds") + fd_band,
        "children_median_second_quarter": med(second, "children"), "children_median_last_quarter": med(last, "children"),
        "children_peak": max(s["children"] for s in samples[q:]),
        "children_ok": med(last, "children") <= med(second, "children") + fd_band,
        "steps_per_s_second_quarter": round(r2, 2), "steps_per_s_last_quarter": round(r4, 2),
        "speed_ok": r2 == 0 or r4 >= 0.75 * r2,  # a slowdown; a faster end is other load leaving the machine
    }
    checks["flat"] = all(checks[k] for k in ("rss_ok", "fds_ok", "children_ok", "speed_ok"))
    return checks


def rejudge(folder: Path, rss_band: float, fd_band: int) -> dict:
    """The verdicts of a finished soak (its ``*.samples.json``) again, by :func:`verdict`."""
    report = json.loads((folder / "soak.json").read_text())
    for name, run in report["runs"].items():
        samples = json.loads((folder / f"{name}.samples.json").read_text())
        keep = {k: run[k] for k in ("command", "exit_code", "wall_s", "last_step", "samples") if k in run}
        report["runs"][name] = {**keep, **verdict(samples, rss_band, fd_band)}
    (folder / "soak.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/soak"))
    parser.add_argument("--budget-s", type=float, default=7200.0, help="seconds for all the runs together")
    parser.add_argument("--only", default=",".join(RUNS))
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--rss-band", type=float, default=64.0, help="MiB the RSS may grow after the warm-up")
    parser.add_argument("--fd-band", type=int, default=4)
    parser.add_argument("--rejudge", action="store_true", help="recompute the verdicts of --out's samples only")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.rejudge:
        report = rejudge(args.out, args.rss_band, args.fd_band)
        print(json.dumps(report, indent=1))
        return report
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        parser.error(f"unknown runs {unknown}; choose from {', '.join(RUNS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    report: dict = {"budget_s": args.budget_s, "every_s": args.every, "runs": {}}
    share = args.budget_s / len(names)
    for name in names:
        out = args.out / name
        cmd = [sys.executable, "-m", "offline_plugins.cli", "train", *RUNS[name], "--threads", "1",
               "--out", str(out), "--overwrite"]
        started = time.monotonic()
        with (args.out / f"{name}.log").open("w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            samples = sample(proc, args.out / f"{name}.log", share, args.every)
            proc.wait()
        report["runs"][name] = {"command": " ".join(["offline-plugins", "train", *RUNS[name], "--threads", "1"]),
                                "exit_code": proc.returncode, "wall_s": round(time.monotonic() - started, 1),
                                "last_step": samples[-1]["step"] if samples else 0, "samples": len(samples),
                                **verdict(samples, args.rss_band, args.fd_band)}
        (args.out / f"{name}.samples.json").write_text(json.dumps(samples))
        (args.out / "soak.json").write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for name, r in report["runs"].items():
            print(f"{name}: {r['last_step']} steps in {r['wall_s']} s, flat={r.get('flat')}, RSS "
                  f"{r.get('rss_median_second_quarter_mib')}->{r.get('rss_median_last_quarter_mib')} MiB, fds "
                  f"{r.get('fds_median_second_quarter')}->{r.get('fds_median_last_quarter')}, steps/s "
                  f"{r.get('steps_per_s_second_quarter')}->{r.get('steps_per_s_last_quarter')}")
    return report


if __name__ == "__main__":
    main()
