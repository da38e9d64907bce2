"""The plugin host: hook specifications, records, discovery.

>>> from offline_plugins.plugins import hookimpl, AlgorithmSpec, load_registry
"""

from offline_plugins.plugins.hookspecs import hookimpl, hookspec
from offline_plugins.plugins.manager import (
    DISABLE_ENV,
    ENTRY_POINT_GROUP,
    forget_shared_registries,
    load_registry,
    make_plugin_manager,
    shared_registry,
)
from offline_plugins.plugins.registry import (
    AlgorithmSpec,
    BrokenPlugin,
    DatasetSpec,
    DuplicateNameError,
    JudgeSpec,
    RewardSpec,
    SandboxSpec,
    TextTaskSpec,
    ToolSpec,
    PluginError,
    Registry,
    UnknownNameError,
)

__all__ = [
    "hookimpl",
    "hookspec",
    "AlgorithmSpec",
    "DatasetSpec",
    "JudgeSpec",
    "SandboxSpec",
    "TextTaskSpec",
    "ToolSpec",
    "RewardSpec",
    "BrokenPlugin",
    "Registry",
    "PluginError",
    "DuplicateNameError",
    "UnknownNameError",
    "load_registry",
    "shared_registry",
    "forget_shared_registries",
    "make_plugin_manager",
    "ENTRY_POINT_GROUP",
    "DISABLE_ENV",
]
