"""The ids of the text tasks, without importing torch (``offline-plugins data list`` and the
text-rollouts kind's ``claims`` read them; :mod:`offline_plugins.text.data.rollouts` loads the tasks).

The tasks are registered records (:class:`~offline_plugins.plugins.registry.TextTaskSpec`,
``offline_plugins_register_text_tasks``): the built-in ones by :mod:`offline_plugins.plugins.text_tasks`,
a plugin's beside them.
"""

from __future__ import annotations

from typing import Any, Optional

from offline_plugins.plugins import shared_registry

__all__ = ["text_tasks", "resolve_rollout_id", "text_task_names"]


def _registry(registry: Any = None):
    if registry is not None:
        return registry

    return shared_registry()


def text_tasks(registry: Any = None) -> dict:
    """Every registered text task: id -> :class:`~offline_plugins.plugins.registry.TextTaskSpec`."""
    return dict(_registry(registry).text_tasks)


def text_task_names(registry: Any = None) -> str:
    """The registered tasks' short names, for an error message: ``arithmetic, tool-arithmetic, ...``."""
    return ", ".join(spec.aliases[0] if spec.aliases else spec.id for spec in text_tasks(registry).values())


def resolve_rollout_id(dataset: str, registry: Any = None) -> Optional[str]:
    """The canonical id of a registered text task (its id or an alias) or a ``.jsonl`` prompt file;
    None otherwise.

    >>> resolve_rollout_id("arithmetic"), resolve_rollout_id("pendulum/medium-v0")
    ('offline-plugins/arithmetic/v0', None)
    >>> resolve_rollout_id("arithmetic-length")
    'offline-plugins/arithmetic-length/v0'
    """
    dataset = dataset.strip()
    found = _registry(registry).resolve_text_task(dataset)
    if found is not None:
        return found
    if dataset.endswith(".jsonl"):
        return dataset
    return None
