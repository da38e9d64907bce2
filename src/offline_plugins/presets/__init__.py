"""Named presets: the published settings of an algorithm for a benchmark, as config overrides.

``--set preset=NAME`` (or ``preset: NAME`` in a ``--config`` file) applies ``NAME.yaml`` of this
folder for the run's algorithm first; ``--config`` and the other ``--set`` keys still override it.
A preset file maps algorithm names to their overrides and says in its comments where each value
comes from.

>>> sorted(presets())[:2]
['ogbench-cube-single', 'ogbench-puzzle-3x3']
>>> preset("ogbench-cube-single", "rebrac")["actor_bc_coef"]
1.0
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from offline_plugins.config import load_config_file
from offline_plugins.errors import UserError

__all__ = ["presets", "preset"]

_FOLDER = Path(__file__).parent


def presets() -> dict[str, Path]:
    """Every shipped preset: name -> its YAML file."""
    return {p.stem: p for p in sorted(_FOLDER.glob("*.yaml"))}


def preset(name: str, algorithm: str) -> dict[str, Any]:
    """The overrides preset ``name`` holds for ``algorithm``; a clear error when either is unknown."""
    known = presets()
    if name not in known:
        raise UserError(f"unknown preset {name!r}; the presets are {', '.join(known)} "
                        "(files of offline_plugins/presets; or pass your own settings with --config FILE.yaml)")
    table = load_config_file(known[name])
    if algorithm not in table:
        raise UserError(f"preset {name!r} holds settings for {', '.join(sorted(table))}, not for {algorithm!r} "
                        f"(its file says why: {known[name]}); drop preset= or pass the settings with --set")
    return dict(table[algorithm] or {})
