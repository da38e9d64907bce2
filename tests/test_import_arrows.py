"""Imports between the package's layers point one way (lazy imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "offline_plugins"

# layer -> the layers it must not import, with why
FORBIDDEN = {
    "modules": ({"objectives", "data", "envs", "algorithms", "kinds", "lightning", "cli", "eval"},
                "networks sit below the losses; shared errors are in offline_plugins.errors"),
    "objectives": ({"data", "envs", "algorithms", "kinds", "lightning", "cli", "eval"},
                   "a loss reads a batch, not a dataset or a trainer"),
    "envs": ({"data", "algorithms", "kinds", "lightning", "cli"},
             "environments tokenise with offline_plugins.tokens; data builds datasets from envs, not back"),
    "data": ({"algorithms", "kinds", "lightning", "cli"},
             "datasets are loaded by the shell, and know nothing of it"),
    "eval": ({"algorithms", "kinds", "lightning", "cli"}, "scoring a policy needs no trainer"),
    "tokens": ({"data", "envs", "objectives", "algorithms", "kinds", "lightning", "cli"}, "a leaf both sides import"),
    "errors": ({"modules", "objectives", "data", "envs", "algorithms", "kinds", "lightning", "cli", "eval"}, "a leaf"),
}


def _layer(path: Path) -> str:
    rel = path.relative_to(SRC).parts
    return rel[0][:-3] if len(rel) == 1 else rel[0]


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
    return [(line, m) for line, m in found if m.startswith("offline_plugins.")]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_point_one_way(layer):
    forbidden, why = FORBIDDEN[layer]
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        if _layer(path) != layer:
            continue
        for line, module in _imports(path):
            target = module.split(".")[1]
            if target in forbidden:
                bad.append(f"{path.relative_to(SRC)}:{line} imports {module}")
    assert not bad, f"{layer} must not import {sorted(forbidden)} ({why}):\n" + "\n".join(bad)


def test_the_moved_names_still_import_from_where_they_were():
    from offline_plugins.data.preference import TokenizeReport, encode_example, pad_rows, pad_token_id
    from offline_plugins.errors import DiscretizationError as E1
    from offline_plugins.objectives.common import OfflineLossError
    from offline_plugins.objectives.sequence.common import ContextLengthError, DiscretizationError
    from offline_plugins.tokens import TokenizeReport as T

    assert T is TokenizeReport and DiscretizationError is E1
    assert issubclass(ContextLengthError, OfflineLossError)
    assert callable(encode_example) and callable(pad_rows) and callable(pad_token_id)
