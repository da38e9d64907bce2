"""The pluggy host: built-in plugins, then entry points, then ``check_pending()``.

The plugin manager is made by a factory, never at import time. Entry points are
loaded one by one (rather than with ``load_setuptools_entrypoints``) so that one
plugin that fails to import cannot stop the others, and so that two distributions
shipping the same entry-point name are reported instead of one being skipped.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
import traceback
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from typing import Iterable, Optional

import pluggy

from offline_plugins import __version__
from offline_plugins.plugins import hookspecs
from offline_plugins.plugins.builtin import BUILTIN_PLUGINS
from offline_plugins.plugins.registry import BrokenPlugin, DuplicateNameError, PluginError, Registry

__all__ = [
    "ENTRY_POINT_GROUP",
    "DISABLE_ENV",
    "PluginHost",
    "make_plugin_manager",
    "load_registry",
    "disabled_from_env",
]

ENTRY_POINT_GROUP = "offline_plugins"
DISABLE_ENV = "OFFLINE_PLUGINS_DISABLE"
_SELF = "offline-plugins"


def disabled_from_env(environ: Optional[dict] = None) -> set[str]:
    """Plugin names listed in ``OFFLINE_PLUGINS_DISABLE`` (comma separated)."""
    raw = (environ if environ is not None else os.environ).get(DISABLE_ENV, "")
    return {name.strip() for name in raw.split(",") if name.strip()}


def _short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0] if text else type(exc).__name__


@dataclass
class PluginHost:
    """A plugin manager together with what it learnt while loading."""

    pm: pluggy.PluginManager
    providers: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (dist, version)
    order: list[str] = field(default_factory=list)
    broken: list[BrokenPlugin] = field(default_factory=list)
    blocked: set[str] = field(default_factory=set)

    def _mark_broken(self, name: str, stage: str, exc: BaseException | str) -> None:
        provider, version = self.providers.get(name, ("unknown", ""))
        error = exc if isinstance(exc, str) else _short_error(exc)
        if os.environ.get("OFFLINE_PLUGINS_DEBUG") and not isinstance(exc, str):
            error += "\n" + "".join(traceback.format_exception(exc))
        self.broken.append(BrokenPlugin(name, provider, version, stage, error))

    def register(self, plugin: object, name: str, provider: str, version: str) -> None:
        self.providers[name] = (provider, version)
        try:
            self.pm.register(plugin, name=name)
        except Exception as exc:  # pluggy validation: bad hook signature
            self._mark_broken(name, "import", exc)
            return
        self.order.append(name)

    def check_pending(self) -> None:
        """``pm.check_pending()``, unregistering (and reporting) each offending plugin."""
        while True:
            try:
                self.pm.check_pending()
                return
            except pluggy.PluginValidationError as exc:
                name = self.pm.get_name(exc.plugin) or repr(exc.plugin)
                self.pm.unregister(exc.plugin)
                if name in self.order:
                    self.order.remove(name)
                self._mark_broken(name, "import", f"{exc}; is a hook name misspelt?")


def make_plugin_manager(
    disable: Optional[Iterable[str]] = None,
    *,
    builtins: Optional[dict[str, str]] = None,
    entry_points: bool = True,
) -> PluginHost:
    """Register the built-in plugins, then the ``offline_plugins`` entry points.

    Args:
        disable: plugin names to switch off, added to ``OFFLINE_PLUGINS_DISABLE``.
        builtins: name -> module of the built-in plugins (defaults to ours).
        entry_points: whether to load installed third-party plugins.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    blocked = disabled_from_env() | set(disable or ())
    host = PluginHost(pm=pm, blocked=blocked)
    for name in blocked:
        pm.set_blocked(name)

    for name, module_name in (BUILTIN_PLUGINS if builtins is None else builtins).items():
        if name in blocked:
            continue
        host.providers[name] = (_SELF, __version__)
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            host._mark_broken(name, "import", exc)
            continue
        host.register(module, name, _SELF, __version__)

    if entry_points:
        seen: dict[str, tuple[str, str]] = {}
        seen_values: set[tuple[str, str, str]] = set()
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = getattr(ep, "dist", None)
            provider = dist.name if dist is not None else "unknown"
            version = dist.version if dist is not None else ""
            key = (ep.name, ep.value, provider)
            if key in seen_values:  # the same distribution found twice on sys.path
                continue
            seen_values.add(key)
            if ep.name in seen or ep.name in host.providers:
                other, other_version = seen.get(ep.name) or host.providers[ep.name]
                host.broken.append(
                    BrokenPlugin(
                        ep.name,
                        provider,
                        version,
                        "duplicate",
                        f"plugin name {ep.name!r} is used by both {other} {other_version} and "
                        f"{provider} {version}; only the first is loaded. Rename one entry point "
                        f"or uninstall one distribution.",
                    )
                )
                continue
            seen[ep.name] = (provider, version)
            if ep.name in blocked:
                continue
            host.providers[ep.name] = (provider, version)
            try:
                plugin = ep.load()
            except Exception as exc:
                host._mark_broken(ep.name, "import", exc)
                continue
            host.register(plugin, ep.name, provider, version)

    host.check_pending()
    _warn_unknown_blocked(blocked, set(BUILTIN_PLUGINS if builtins is None else builtins) | set(host.providers)
                          | {ep.name for ep in (metadata.entry_points(group=ENTRY_POINT_GROUP) if entry_points else ())})
    return host


class UnknownPluginWarning(UserWarning):
    """``OFFLINE_PLUGINS_DISABLE`` / ``--disable`` names a plugin that is not installed."""


def _warn_unknown_blocked(blocked: set[str], known: set[str]) -> None:
    for name in sorted(blocked - known):
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        warnings.warn(
            UnknownPluginWarning(
                f"OFFLINE_PLUGINS_DISABLE/--disable names {name!r}, which is no installed plugin, so it switches "
                f"nothing off{hint} (plugin names: 'offline-plugins list --json --all', or the entry-point names)"
            ),
            stacklevel=3,
        )


def load_registry(
    disable: Optional[Iterable[str]] = None,
    *,
    strict: bool = False,
    host: Optional[PluginHost] = None,
) -> Registry:
    """Discover every installed plugin and collect what it registers.

    A plugin that fails to import or register is recorded in ``registry.broken``
    (its partial registrations removed) and the others still load. With
    ``strict=True`` the first such failure raises instead.

    >>> registry = load_registry()
    >>> isinstance(registry.algorithms, dict)
    True
    """
    host = host or make_plugin_manager(disable)
    registry = Registry()
    registry.broken.extend(host.broken)
    registry.disabled = set(host.blocked)
    hook_names = ("offline_plugins_register_data_kinds", "offline_plugins_register_algorithms",
                  "offline_plugins_register_datasets", "offline_plugins_register_judges",
                  "offline_plugins_register_sandboxes", "offline_plugins_register_text_tasks",
                  "offline_plugins_register_tools", "offline_plugins_register_rewards")
    for name in list(host.order):
        plugin = host.pm.get_plugin(name)
        if plugin is None:
            continue
        provider, version = host.providers[name]
        registry.plugins[name] = (provider, version)
        others = [p for p in host.pm.get_plugins() if p is not plugin]
        scoped = registry.scoped(provider, version, name)
        try:
            for hook_name in hook_names:
                host.pm.subset_hook_caller(hook_name, remove_plugins=others)(registry=scoped)
        except DuplicateNameError as exc:
            scoped.rollback()
            registry.broken.append(BrokenPlugin(name, provider, version, "duplicate", str(exc)))
        except Exception as exc:
            scoped.rollback()
            registry.broken.append(BrokenPlugin(name, provider, version, "register", _short_error(exc)))
    if strict and registry.broken:
        b = registry.broken[0]
        raise PluginError(f"plugin {b.plugin!r} ({b.provider} {b.version}) failed at {b.stage}: {b.error}")
    return registry


_SHARED: dict[tuple, Registry] = {}


def shared_registry(disable: Optional[Iterable[str]] = None) -> Registry:
    """The process's registry: discovered once per set of switched-off plugins, then reused.

    Every part of the package that needs a registry and was given none (the CLI's
    commands, ``train``, ``plan_run``, the dataset store) asks this, so one command
    discovers the installed plugins once. It is discovered again when ``sys.path``
    changed (a distribution added to it); after installing into a folder already on it,
    call :func:`forget_shared_registries`. :func:`load_registry` always discovers afresh.

    >>> shared_registry() is shared_registry()
    True
    """
    blocked = frozenset(disabled_from_env() | set(disable or ()))
    key = (blocked, tuple(sys.path))
    registry = _SHARED.get(key)
    if registry is None:
        registry = _SHARED[key] = load_registry(sorted(blocked))
    return registry


def forget_shared_registries() -> None:
    """Drop the cached registries (after installing or removing a plugin in this process)."""
    _SHARED.clear()
