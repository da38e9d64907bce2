"""Old module paths of modules that moved, kept working for code that imports them.

The text stack (with the preference and step-label data) moved from ``envs/``, ``data/`` and ``modules/``
into :mod:`offline_plugins.text`.
Importing an old path gives the module at its new path (the same module object, so
a name patched through either path is patched for both) and a ``DeprecationWarning`` naming the new
path. :func:`install` puts the finder on ``sys.meta_path``; ``import offline_plugins`` calls it.

>>> import importlib, warnings
>>> install()
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     old = importlib.import_module("offline_plugins.envs.task_base")
>>> import offline_plugins.text.tasks.base as new
>>> old is new, "offline_plugins.text.tasks.base" in str(caught[-1].message)
(True, True)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Optional, Sequence

__all__ = ["MOVED", "MOVED_NAMES", "install"]

#: old module path -> new module path
MOVED: dict[str, str] = {
    "offline_plugins.envs.task_base": "offline_plugins.text.tasks.base",
    "offline_plugins.envs.arithmetic": "offline_plugins.text.tasks.arithmetic",
    "offline_plugins.envs.word_problems": "offline_plugins.text.tasks.word_problems",
    "offline_plugins.envs.steps": "offline_plugins.text.tasks.steps",
    "offline_plugins.envs.tasks": "offline_plugins.text.tasks",
    "offline_plugins.data.text_ids": "offline_plugins.text.tasks.ids",
    "offline_plugins.envs.multiturn": "offline_plugins.text.tasks.tools",
    "offline_plugins.envs.text": "offline_plugins.text.envs.text",
    "offline_plugins.envs.tools": "offline_plugins.text.tools.tools",
    "offline_plugins.envs.sandbox": "offline_plugins.text.tools.sandbox",
    "offline_plugins.envs.gym_text": "offline_plugins.text.envs.gym_text",
    "offline_plugins.data.collector": "offline_plugins.text.collectors.collector",
    "offline_plugins.data.multiturn": "offline_plugins.text.collectors.multiturn",
    "offline_plugins.data.async_sampler": "offline_plugins.text.collectors.async_sampler",
    "offline_plugins.data.sync_check": "offline_plugins.text.collectors.sync_check",
    "offline_plugins.modules.vllm_engine": "offline_plugins.text.backends.vllm_engine",
    "offline_plugins.modules.generation": "offline_plugins.text.backends.generation",
    "offline_plugins.data.prompts": "offline_plugins.text.sources.prompts",
    "offline_plugins.data.rollouts": "offline_plugins.text.data.rollouts",
    "offline_plugins.data.text_tasks": "offline_plugins.text.data.task_data",
    "offline_plugins.data.remote": "offline_plugins.text.sources.remote",
    "offline_plugins.data.reward_source": "offline_plugins.text.sources.reward_source",
    "offline_plugins.data.preference": "offline_plugins.text.data.preference",
    "offline_plugins.data.preference_sources": "offline_plugins.text.data.preference_sources",
    "offline_plugins.data.steps": "offline_plugins.text.data.steps",
}

#: old module path -> {name it had: "new.module:name"}, for names that did not move with their module
#: (read through the old path only, with a ``DeprecationWarning``)
MOVED_NAMES: dict[str, dict[str, str]] = {
    "offline_plugins.data.prompts": {"greedy_responses": "offline_plugins.text.backends.generation:greedy_responses"},
    "offline_plugins.data.text_tasks": {"generate": "offline_plugins.text.backends.generation:generate_texts"},
    "offline_plugins.envs.multiturn": {"Calculator": "offline_plugins.text.tools.tools:Calculator",
                                       "ToolBox": "offline_plugins.text.tools.tools:ToolBox"},
    "offline_plugins.data.multiturn": {"FAILURE_KINDS": "offline_plugins.text.tools.multiturn:FAILURE_KINDS",
                                       "rollout_seed": "offline_plugins.text.sources.prompts:rollout_seed"},
}


def _moved_name(old: str, name: str) -> object:
    target, _, attr = MOVED_NAMES[old][name].partition(":")
    warnings.warn(f"{old}.{name} moved to {target}.{attr}; import it from there (the old path will go in a later "
                  "release)", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(target), attr)


def _add_moved_names(module: ModuleType, old: str) -> None:
    """Let ``module`` (imported through ``old``) answer the names :data:`MOVED_NAMES` lists for ``old``,
    through a module ``__getattr__`` that falls back to the module's own."""
    names = MOVED_NAMES.get(old)
    if not names or getattr(module.__dict__.get("__getattr__"), "_moved_from", None) == old:
        return
    previous = module.__dict__.get("__getattr__")

    def __getattr__(name: str) -> object:
        if name in names:
            return _moved_name(old, name)
        if previous is not None:
            return previous(name)
        raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")

    __getattr__._moved_from = old  # type: ignore[attr-defined]
    module.__getattr__ = __getattr__  # type: ignore[method-assign]


class _MovedLoader(importlib.abc.Loader):
    """Loads an old path as the module at its new path."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.new}; import it from there (the old path will go in a later "
                      "release)", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import machinery stamped the old path's spec on the module: give it back its own
        old = module.__spec__.name
        module.__spec__ = self._spec
        _add_moved_names(module, old)


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(new))


def install() -> None:
    """Put the finder of :data:`MOVED` on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
