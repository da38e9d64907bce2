"""An import inside a function has one of two reasons, and this test fails on any other:

* it keeps the light path light: the module is loaded by ``import offline_plugins`` or by the
  commands that list and describe what is installed (``list``, ``data list``, ``info``: the *light
  path*, which loads no third-party package but pluggy and the installed plugins), and the import
  would pull in one that the light path does not load (torch, transformers, minari, numpy...),
  directly or through the package's own modules;
* it imports an optional extra (``pyproject.toml``'s ``[project.optional-dependencies]``), which a
  user may not have installed, or another package's module for it (``torchrl.modules.llm.backends.vllm``:
  where the extra is installed, importing it starts the extra, after the settings we give it).

Everything else sits at the top of its module. The light path itself is checked in
``tests/test_plugins.py`` (no torch, transformers, minari after ``import offline_plugins``).
"""

from __future__ import annotations

import ast
import functools
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "offline_plugins"

#: the import names of the optional extras, with the distribution each comes from
OPTIONAL = {"peft": "peft", "vllm": "vllm", "aiohttp": "aiohttp", "ogbench": "ogbench", "mujoco": "gymnasium[mujoco]",
            "gymnasium_robotics": "gymnasium-robotics", "datasets": "datasets", "trl": "trl",
            "tensorboard": "tensorboard", "mlflow": "mlflow-skinny", "wandb": "wandb"}

#: the commands that list and describe what is installed, and must answer at once (no torch)
LIGHT_COMMANDS = (["list"], ["list", "--json", "--all"], ["data", "list"], ["info", "dpo"], ["info", "iql"],
                  ["info", "grpo"], ["info", "tt"])

_LIGHT_PATH = """
import contextlib, io, json, sys
import offline_plugins
from offline_plugins.cli import main
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
print(json.dumps(sorted(sys.modules)))
"""


@functools.cache
def light_path_modules() -> frozenset[str]:
    """What ``import offline_plugins`` and the :data:`LIGHT_COMMANDS` load, in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", _LIGHT_PATH, json.dumps(LIGHT_COMMANDS)], capture_output=True,
                         text=True, check=True)
    return frozenset(json.loads(out.stdout.splitlines()[-1]))


@functools.cache
def light_roots() -> frozenset[str]:
    return frozenset({m.split(".")[0] for m in light_path_modules()} | set(sys.stdlib_module_names))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def files() -> dict[str, Path]:
    return {module_name(p): p for p in SRC.rglob("*.py")}


def _resolve(module: str, names: tuple[str, ...]) -> list[str]:
    """The modules ``from module import names`` (or ``import module``) runs: the module, a name that is a
    submodule, and a name a lazy package (``offline_plugins._lazy``) imports on first use."""
    found = [module]
    if not module.startswith("offline_plugins"):
        return found
    lazy = None
    if module in files() and files()[module].name == "__init__.py":
        lazy = getattr(importlib.import_module(module), "__lazy_exports__", None)
    for name in names:
        if f"{module}.{name}" in files():
            found.append(f"{module}.{name}")
        elif lazy and name in lazy:
            found.append(lazy[name])
    return found


def _module_level_imports(tree: ast.Module) -> list[tuple[str, tuple[str, ...]]]:
    """Imports a module runs when it is imported (``if TYPE_CHECKING:`` blocks left out)."""
    found = []

    def visit(body):
        for node in body:
            if isinstance(node, ast.Import):
                found.extend((a.name, ()) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.append((node.module, tuple(a.name for a in node.names)))
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
    visit(tree.body)
    return found


@functools.cache
def third_party_reached(module: str) -> frozenset[str]:
    """Top-level packages outside offline_plugins that importing ``module`` imports (its parents' ``__init__``
    and the package's modules it imports at their top, followed through)."""
    seen, stack, roots = set(), [module], set()
    while stack:
        m = stack.pop()
        if m in seen:
            continue
        seen.add(m)
        if not m.startswith("offline_plugins"):
            roots.add(m.split(".")[0])
            continue
        parts = m.split(".")
        stack.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        if m not in files():
            continue
        for target, names in _module_level_imports(ast.parse(files()[m].read_text())):
            stack.extend(_resolve(target, names))
    return frozenset(roots)


def heavy(module: str, names: tuple[str, ...] = ()) -> bool:
    """Whether the import would load a third-party package the light path does not load."""
    return any(not third_party_reached(t) <= light_roots() for t in _resolve(module, names))


def in_function_imports(path: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    found = set()
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    found.update((node.lineno, a.name, ()) for a in node.names)
                elif isinstance(node, ast.ImportFrom):
                    found.add((node.lineno, "." * node.level + (node.module or ""), tuple(a.name for a in node.names)))
    return sorted(found)


def why_in_function(module: str, target: str, names: tuple[str, ...]) -> str | None:
    """The reason an import of ``target`` inside a function of ``module`` stays there, or None."""
    if any(part in OPTIONAL or part.split("_")[0] in OPTIONAL for part in target.split(".")):
        return "an optional extra"
    if module in light_path_modules() and heavy(target, names):
        return "keeps the light path light"
    return None


def test_every_in_function_import_has_a_reason():
    bad = []
    for module, path in sorted(files().items()):
        for line, target, names in in_function_imports(path):
            if why_in_function(module, target, names) is None:
                what = f"from {target} import {', '.join(names)}" if names else f"import {target}"
                bad.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert not bad, ("imports inside functions that neither keep the light path light nor import an optional extra; "
                     "move them to the top of their module:\n" + "\n".join(bad))


def test_the_rule_tells_the_cases_apart():
    # a light-path module may import torch (or a heavy module of ours) inside a function ...
    assert "offline_plugins.cli.train" in light_path_modules()
    assert why_in_function("offline_plugins.cli.train", "torch", ()) == "keeps the light path light"
    assert why_in_function("offline_plugins.cli.train", "offline_plugins.lightning.run", ("train",))
    # ... through a lazy package's name too, but not a light module or the standard library
    assert why_in_function("offline_plugins.cli.train", "offline_plugins.data", ("load_offline_data",))
    assert why_in_function("offline_plugins.cli.train", "offline_plugins.errors", ("UserError",)) is None
    assert why_in_function("offline_plugins.cli.train", "json", ()) is None
    # a module the light path never loads has no such reason; an optional extra is fine anywhere
    assert "offline_plugins.lightning.run" not in light_path_modules()
    assert why_in_function("offline_plugins.lightning.run", "torch", ()) is None
    assert why_in_function("offline_plugins.lightning.run", "peft", ("LoraConfig",)) == "an optional extra"
    assert why_in_function("offline_plugins.text.backends.vllm_engine", "torchrl.modules.llm.backends.vllm", ("X",))


def test_the_optional_imports_are_the_extras():
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's tomllib reads pyproject.toml")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {req.split(">")[0].split("=")[0].strip() for reqs in project["optional-dependencies"].values()
              for req in reqs}
    base = {req.split(">")[0].split("=")[0].strip() for req in project["dependencies"]}
    assert set(OPTIONAL.values()) <= extras, set(OPTIONAL.values()) - extras
    assert not set(OPTIONAL.values()) & base


@pytest.mark.parametrize("module", ["torch", "transformers", "minari", "numpy"])
def test_the_light_path_loads_no_heavy_package(module):
    assert module not in light_path_modules()
