"""``offline-plugins``: list and describe installed algorithms, make data, train, evaluate.

Argument parsing and printing live in this package only (``cli/data.py``: the ``data``
commands; ``cli/train.py``: ``train`` and ``eval``; ``cli/search.py``: ``search``); the library below knows no
argparse. One plugin registry serves the whole command (``cli/registry.py``). The CLI
only parses and calls. A bad input (a :class:`~offline_plugins.errors.UserError`)
is printed as one line on stderr and exits 2; no traceback unless
``OFFLINE_PLUGINS_DEBUG=1``. Heavy imports happen inside the command that needs them.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import sys
import textwrap
import warnings
from typing import Optional, Sequence

from offline_plugins import __version__
from offline_plugins.errors import UserError
from offline_plugins.text.tools.tools import make_sandbox

__all__ = ["main", "build_parser"]

# Modules that add sub-commands: each defines ``add_parsers(subparsers)`` and must be
# cheap to import (torch and friends are imported inside the command functions).
_COMMAND_MODULES: tuple[str, ...] = (
    "offline_plugins.cli.data",
    "offline_plugins.cli.train",
    "offline_plugins.cli.search",
    "offline_plugins.cli.serve",
)

from offline_plugins.cli.registry import registry_for as _registry  # noqa: E402


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


def cmd_list(args) -> int:
    registry = _registry(args)
    algos = sorted(registry.algorithms.values(), key=lambda s: (s.family, s.name))
    if args.json:
        out = []
        for s in algos:
            d = s.to_dict()
            d.pop("config")
            out.append(d)
        payload = {
            "algorithms": out,
            "datasets": [d.to_dict() for d in sorted(registry.datasets.values(), key=lambda d: d.id)],
            "data_kinds": [k.to_dict() for _, k in sorted(registry.data_kinds.items())],
            "judges": [j.to_dict() for _, j in sorted(registry.judges.items())],
            "sandboxes": [{**x.to_dict(), "here": _sandbox_here(x)} for _, x in sorted(registry.sandboxes.items())],
            "text_tasks": [t.to_dict() for _, t in sorted(registry.text_tasks.items())],
            "tools": [t.to_dict() for _, t in sorted(registry.tools.items())],
            "rewards": [r.to_dict() for _, r in sorted(registry.rewards.items())],
            "broken": [b.to_dict() for b in registry.broken],
        }
        _print_json(payload if args.all else out)
        return 0
    if args.kinds:
        kinds = sorted(registry.data_kinds.values(), key=lambda k: k.name)
        width = max((len(k.name) for k in kinds), default=4)
        readers = {k.name: sorted(s.name for s in algos if s.data == k.name) for k in kinds}
        print(f"{'KIND':<{width}}  PROVIDER  SUMMARY")
        for k in kinds:
            print(f"{k.name:<{width}}  {k.provider} {k.version}  {k.summary}")
            print(f"{'':<{width}}  read by: {', '.join(readers[k.name]) or 'no installed algorithm'}")
        return 0
    if not algos:
        print("no algorithms installed")
    else:
        width = max(len(s.name) for s in algos)
        fam_w = max(len(s.family) for s in algos)
        data_w = max(len(s.data) for s in algos)
        print(f"{'NAME':<{width}}  {'FAMILY':<{fam_w}}  {'DATA':<{data_w}}  PROVIDER  SUMMARY")
        for s in algos:
            mark = "[experimental] " if s.experimental else ""
            print(f"{s.name:<{width}}  {s.family:<{fam_w}}  {s.data:<{data_w}}  {s.provider} {s.version}  "
                  f"{mark}{s.summary}")
    _section(registry.judges, "judges (AI feedback: --judge NAME for online-dpo, iterative-dpo, data label, data audit)")
    _section(registry.tools, "tools (what a multi-turn task's policy may call; text tasks: 'offline-plugins data list')")
    _section(registry.sandboxes, "sandboxes (where the python tool of tool-python runs model-written code: --set "
             "tool_sandbox=NAME, default bwrap)", mark=lambda x: f"[{_sandbox_here(x)}] ")
    _section(registry.rewards, "rewards (--reward NAME, or --reward KEY=NAME among several, for the algorithms "
             "trained on their own rollouts)")
    if registry.broken:
        print("\nplugins that failed to load (the others work):")
        for b in registry.broken:
            print(f"  {b.plugin} ({b.provider} {b.version}) [{b.stage}]: {b.error}")
    return 0


def _section(records: dict, title: str, mark=lambda record: "") -> None:
    """A titled block of ``offline-plugins list``: one line per record (name, provider, summary)."""
    if not records:
        return
    width = max(len(name) for name in records)
    print(f"\n{title}:")
    for name, x in sorted(records.items()):
        print(f"  {name:<{width}}  {x.provider} {x.version}  {mark(x)}{x.summary}")


def _sandbox_here(spec) -> str:
    """Whether the sandbox of ``spec`` can run on this machine: ``works here``, or why not in a few words."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            make_sandbox(spec.name).check()
    except Exception as exc:  # a plugin's sandbox that cannot even be built is shown as such, not raised
        return "cannot run here: " + str(exc).split(". ")[0].replace(f"the {spec.name!r} tool sandbox cannot run here: ", "")
    return "works here"


def _describe(args, info: dict, kind: str, rows: list) -> int:
    """``info`` as JSON, or as ``NAME (kind): summary`` and ``  key: value`` rows (the provider's before the last)."""
    if args.json:
        _print_json(info)
        return 0
    print(f"{info.get('name', info.get('id'))} ({kind}): {info['summary']}")
    rows = rows[:-1] + [("provider", f"{info['provider']} {info['version']} (plugin {info['plugin']!r})")] + rows[-1:]
    for key, value in rows:
        print(f"  {key + ':':<9} {value}")
    return 0


def cmd_info(args) -> int:
    registry = _registry(args)
    name = args.name.strip().lower()
    if args.name not in registry.algorithms and name in registry.sandboxes:
        box = registry.sandbox(args.name)
        info = {**box.to_dict(), "here": _sandbox_here(box)}
        return _describe(args, info, "tool sandbox", [
            ("sandbox", info["sandbox"]), ("here", info["here"]),
            ("use", f"--set tool_sandbox={info['name']} (tasks whose tools run code: tool-python, tools=python)")])
    if args.name not in registry.algorithms and name in registry.judges:
        info = registry.judge(args.name).to_dict()
        return _describe(args, info, "judge", [
            ("judge", info["judge"]), ("use", f"--judge {info['name']} (online-dpo, iterative-dpo), offline-plugins "
                                              f"data label DATASET --judge {info['name']} --out FILE.jsonl")])
    task = registry.resolve_text_task(args.name) if args.name not in registry.algorithms else None
    if task is not None:
        info = registry.text_task(task).to_dict()
        short = info["aliases"][0] if info["aliases"] else info["id"]
        return _describe(args, info, "text task", [
            ("task", info["task"] + (f" with {info['settings']}" if info["settings"] else "")),
            ("aliases", ", ".join(info["aliases"]) or "-"),
            ("use", f"offline-plugins train grpo --dataset {short} (any algorithm trained on its own rollouts)")])
    if args.name not in registry.algorithms and name in registry.tools:
        info = registry.tool(args.name).to_dict()
        return _describe(args, info, "tool", [
            ("tool", info["tool"]), ("use", f"a multi-turn task's tools setting: --set tools={info['name']}")])
    if args.name not in registry.algorithms and name in registry.rewards:
        info = registry.reward(args.name).to_dict()
        return _describe(args, info, "reward", [
            ("function", info["function"]),
            ("use", f"offline-plugins train grpo --dataset TASK --reward {info['name']} (or --reward KEY={info['name']} "
                    "beside other rewards, as gdpo takes them)")])
    spec = registry.algorithm(args.name)
    info = spec.to_dict()
    if args.json:
        _print_json(info)
        return 0
    print(f"{spec.name}: {spec.summary}")
    print(f"  family:   {spec.family}")
    print(f"  data:     {spec.data}" + (f" ({', '.join(spec.action_spaces)} actions)" if spec.action_spaces else ""))
    print(f"  loss:     {info['loss']}")
    print(f"  paper:    {spec.paper}")
    print(f"  provider: {spec.provider} {spec.version} (plugin {spec.plugin!r})")
    if spec.experimental:
        print(f"  status:   experimental: {spec.experimental}")
    print("  config (override with --set key=value):")
    fields = info["config"]
    if fields:
        w = max(len(f["name"]) for f in fields)
        dw = max(len(json.dumps(f["default"], default=str)) for f in fields)
        for f in fields:
            default = json.dumps(f["default"], default=str)
            print(f"    {f['name']:<{w}}  {default:<{dw}}  {f['help']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="offline-plugins",
        description="Offline RL and preference optimisation plugins for TorchRL and Lightning.",
        epilog=textwrap.dedent(
            """\
            Set OFFLINE_PLUGINS_DISABLE=name1,name2 (or --disable) to switch plugins off,
            OFFLINE_PLUGINS_DEBUG=1 to see tracebacks."""
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"offline-plugins {__version__}")
    parser.add_argument(
        "--disable", metavar="NAMES", default="", help="comma-separated plugin names to switch off"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("list", help="list installed algorithms (ours and third-party)")
    p.add_argument("--json", action="store_true", help="print JSON, one object per algorithm")
    p.add_argument(
        "--all", action="store_true",
        help="with --json: also datasets, data kinds, judges and plugins that failed to load"
    )
    p.add_argument("--kinds", action="store_true", help="list the data kinds instead, with the algorithms reading each")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("info", help="describe one algorithm (config fields, defaults, paper, provider), judge or sandbox")
    p.add_argument("name", help="algorithm, judge or sandbox name, as shown by 'offline-plugins list'")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_info)

    for module_name in _COMMAND_MODULES:
        importlib.import_module(module_name).add_parsers(sub)
    return parser


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)).rsplit(os.sep, 1)[0] + os.sep


def _show_warning(message, category, filename, lineno, file=None, line=None, _default=None) -> None:
    """Our own warnings (a category of ours, or raised from the package) as one ``offline-plugins:
    warning:`` line; others as Python prints them."""
    ours = category.__module__.startswith("offline_plugins") or \
        os.path.abspath(str(filename)).startswith(_PACKAGE_DIR)
    if ours:
        text = " ".join(str(message).split("\n"))
        print(f"offline-plugins: warning: {text}", file=file or sys.stderr)
    elif _default is not None:
        _default(message, category, filename, lineno, file, line)


def main(argv: Optional[Sequence[str]] = None) -> int:
    if not getattr(warnings.showwarning, "_offline_plugins", False):
        shown = functools.partial(_show_warning, _default=warnings.showwarning)
        shown._offline_plugins = True  # type: ignore[attr-defined]
        warnings.showwarning = shown
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        # an interruption (exit 130) is not the user's error: it says what was saved and how to go on
        kind = "" if exc.exit_code == 130 else "error: "
        print(f"offline-plugins: {kind}{exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("offline-plugins: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:
        if os.environ.get("OFFLINE_PLUGINS_DEBUG"):
            raise
        print(
            f"offline-plugins: internal error: {type(exc).__name__}: {exc} "
            "(set OFFLINE_PLUGINS_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return 1

