"""Imports between the package's layers point one way (lazy imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "offline_plugins"

# the layers, lowest first: each may import only the layers before it (docs/architecture.md)
LAYERS = ["_lazy", "_moved", "errors", "config", "presets", "plugins", "modules", "tokens", "objectives", "torchrl_llm",
          "envs", "data", "text", "eval", "algorithms", "lightning", "kinds", "audit", "cli"]
# the text stack's own layers, lowest first (offline_plugins/text/__init__.py)
TEXT_LAYERS = ["tools", "tasks", "envs", "backends", "sources", "collectors", "data"]
WHY = {
    "modules": "networks sit below the losses; shared errors are in offline_plugins.errors",
    "envs": "environments tokenise with offline_plugins.tokens; data builds datasets from envs, not back",
    "data": "datasets are loaded by the shell and know nothing of it; text data is offline_plugins.text's",
    "text": "the text stack sits below the algorithms that build on it and the kinds that train it",
    "lightning": "the shell asks data kinds through the registry, it does not import them",
}


def _layer(path: Path) -> str:
    rel = path.relative_to(SRC).parts
    return rel[0][:-3] if len(rel) == 1 else rel[0]


def _imports(path: Path) -> list[tuple[int, str]]:
    return [(line, m) for line, m in _all_imports(path) if m.startswith("offline_plugins.")]


def test_every_module_belongs_to_a_layer():
    assert {_layer(p) for p in SRC.rglob("*.py")} - {"__init__", "__main__", "py"} <= set(LAYERS)


@pytest.mark.parametrize("layer", LAYERS)
def test_layer_imports_point_one_way(layer):
    allowed = set(LAYERS[: LAYERS.index(layer) + 1]) | {"__init__"}
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        if _layer(path) != layer:
            continue
        for line, module in _imports(path):
            target = module.split(".")[1]
            if target not in allowed:
                bad.append(f"{path.relative_to(SRC)}:{line} imports {module}")
    assert not bad, f"{layer} imports a layer above it ({WHY.get(layer, 'see docs/architecture.md')}):\n" + "\n".join(bad)


@pytest.mark.parametrize("layer", TEXT_LAYERS)
def test_text_layers_import_the_layers_before_them(layer):
    allowed = set(TEXT_LAYERS[: TEXT_LAYERS.index(layer) + 1])
    bad = [f"{path.relative_to(SRC)}:{line} imports {module}"
           for path in sorted((SRC / "text" / layer).rglob("*.py")) for line, module in _imports(path)
           if module.startswith("offline_plugins.text.") and module.split(".")[2] not in allowed]
    assert not bad, f"text/{layer} imports a text layer above it (offline_plugins/text/__init__.py):\n" + "\n".join(bad)


def test_the_old_module_paths_give_the_moved_modules():
    import importlib
    import warnings

    from offline_plugins._moved import MOVED

    for old, new in MOVED.items():  # every target exists (no import: a file or a package)
        path = SRC.joinpath(*new.split(".")[1:])
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), (old, new)
    with pytest.warns(DeprecationWarning, match="offline_plugins.envs.tasks moved to offline_plugins.text.tasks"):
        old = importlib.import_module("offline_plugins.envs.tasks")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from offline_plugins.data.rollouts import load_rollout_data
    from offline_plugins.text import tasks
    from offline_plugins.text.data import rollouts

    assert old is tasks and load_rollout_data is rollouts.load_rollout_data
    assert tasks.__spec__.name == "offline_plugins.text.tasks"  # the module keeps its own spec


def test_names_that_moved_apart_from_their_module_still_import_from_the_old_path_with_a_warning():
    import importlib
    import subprocess
    import sys

    from offline_plugins._moved import MOVED, MOVED_NAMES

    for old, names in MOVED_NAMES.items():
        assert old in MOVED, old
        for name, where in names.items():  # each target exists
            module, _, attr = where.partition(":")
            assert hasattr(importlib.import_module(module), attr), where
    # in a fresh interpreter: the first import of the old path is what installs the names
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "try:\n    from offline_plugins.data.prompts import greedy_responses\n"
            "except DeprecationWarning as w:\n    print('warned:', w)\n"
            "warnings.simplefilter('ignore')\n"
            "from offline_plugins.data.prompts import greedy_responses\n"
            "from offline_plugins.text.backends.generation import greedy_responses as new\n"
            "print(greedy_responses is new)\n"
            "import offline_plugins.data.prompts as old\n"
            "try:\n    old.no_such_name\n"
            "except AttributeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("warned: offline_plugins.data.prompts moved to offline_plugins.text.sources.prompts"), \
        out.stdout + out.stderr
    assert lines[1:] == ["True", "module 'offline_plugins.text.sources.prompts' has no attribute 'no_such_name'"], \
        out.stdout + out.stderr
    with pytest.warns(DeprecationWarning, match="offline_plugins.data.text_tasks.generate moved to "
                                                "offline_plugins.text.backends.generation.generate_texts"):
        from offline_plugins.data.text_tasks import generate  # noqa: F401


def test_the_moved_names_still_import_from_where_they_were():
    from offline_plugins.errors import DiscretizationError as E1
    from offline_plugins.objectives.common import OfflineLossError
    from offline_plugins.objectives.sequence.common import ContextLengthError, DiscretizationError
    from offline_plugins.text.data.preference import TokenizeReport, encode_example, pad_rows, pad_token_id
    from offline_plugins.tokens import TokenizeReport as T

    assert T is TokenizeReport and DiscretizationError is E1
    assert issubclass(ContextLengthError, OfflineLossError)
    assert callable(encode_example) and callable(pad_rows) and callable(pad_token_id)


def test_only_the_cli_knows_argparse():
    users = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
             if _layer(p) != "cli" and any(m == "argparse" for _, m in _all_imports(p))]
    assert not users, f"argparse outside cli/: {users}"


def _all_imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
    return found
