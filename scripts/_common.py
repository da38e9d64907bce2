"""What the results scripts share: running a training command and the ``run`` / ``table`` command line.

A script imports it after putting its own folder first on ``sys.path`` (as it does for its siblings).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable


def held_out(line: str) -> bool:
    """The line of a training run's output that the scripts echo: its held-out score."""
    return "held-out" in line


def run_logged(cmd: list[str], timeout: int, shows: Callable[[str], bool] = held_out) -> None:
    """Print ``cmd`` and run it with its output captured; print the last line of the output that ``shows``
    picks (or the output's last 2000 characters when none), and exit with its code when it failed."""
    print(" ".join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if shows(line)]
    print(lines[-1] if lines else (done.stdout + done.stderr)[-2000:], flush=True)
    if done.returncode:
        sys.exit(done.returncode)


def train_arithmetic(algorithm: str, steps: int, eval_every: int, seed: int, out: Path, sets: list[str],
                     timeout: int, shows: Callable[[str], bool] = held_out) -> None:
    """``offline-plugins train ALGORITHM --dataset arithmetic --model tiny`` (one thread) into ``out``, each of
    ``sets`` as a ``--set``, through :func:`run_logged`."""
    cmd = ["offline-plugins", "train", algorithm, "--dataset", "arithmetic", "--model", "tiny", "--steps", str(steps),
           "--eval-every", str(eval_every), "--seed", str(seed), "--threads", "1", "--no-progress", "--out", str(out),
           "--overwrite"]
    for kv in sets:
        cmd += ["--set", kv]
    run_logged(cmd, timeout, shows)


def run_unless_done(cmd: list[str], out: Path) -> None:
    """Print ``cmd`` and run it (stopping on failure), unless ``out`` already holds a ``summary.json``."""
    if (out / "summary.json").is_file():
        return
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def run_table_args(doc: str, root: str, run_options: Callable[[argparse.ArgumentParser], None],
                   argv=None) -> argparse.Namespace:
    """The parsed ``run`` / ``table`` command line: both take ``--root`` (a ``Path``, default ``root``),
    ``run_options`` adds ``run``'s other options; the description is ``doc``'s first line."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--root", type=Path, default=Path(root))
    run_options(r)
    t = sub.add_parser("table")
    t.add_argument("--root", type=Path, default=Path(root))
    return p.parse_args(argv)


def fmt(values, scale=100.0, digits=1) -> str:
    """``values`` times ``scale``: the one value, or mean ± standard deviation over seeds."""
    values = [v * scale for v in values]
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def results_main(doc: str, root: str, run, table, *, pick: tuple[str, dict], steps: bool = True) -> None:
    """The ``run`` / ``table`` command line of the online results scripts (distillation's, the judge's,
    online DPO's): ``pick`` is the option naming what to run (``("--methods", METHODS)``)."""
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
