"""The one place the CLI gets its plugin registry: once per process, with ``--disable`` applied."""

from __future__ import annotations

from offline_plugins.plugins import shared_registry

__all__ = ["registry_for", "disabled_names"]


def disabled_names(args) -> list[str]:
    """The plugin names of ``--disable a,b`` (none when the command has no such option)."""
    return [n.strip() for n in (getattr(args, "disable", "") or "").split(",") if n.strip()]


def registry_for(args):
    """The process's registry (:func:`offline_plugins.plugins.shared_registry`) for these arguments."""
    return shared_registry(disabled_names(args))
