"""The scripts under ``scripts/`` import what their siblings define (a retired or renamed script must not
leave another one failing at its first line)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _defined(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


@pytest.mark.parametrize("script", sorted(SCRIPTS.glob("*.py")), ids=lambda p: p.name)
def test_a_script_imports_only_what_its_siblings_define(script):
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            sibling = SCRIPTS / f"{node.module}.py"
            if not sibling.is_file():  # a package: the next test checks it exists
                continue
            missing = {a.name for a in node.names} - _defined(sibling)
            assert not missing, f"{script.name} imports {sorted(missing)} from {sibling.name}, which has none of them"


def test_no_script_imports_a_retired_sibling():
    """``from online_results import ...`` once outlived ``online_results.py``: every ``from X import`` of a
    name that is not an installed package names a script that exists."""
    import importlib.util

    for script in SCRIPTS.glob("*.py"):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and "." not in node.module:
                found = (SCRIPTS / f"{node.module}.py").is_file() or importlib.util.find_spec(node.module) is not None
                assert found, f"{script.name}: from {node.module} import ...: no scripts/{node.module}.py and no such package"
