"""Hook specifications every offline-plugins plugin may implement.

A plugin is a module (or object) with functions marked ``@hookimpl``. It receives a
registrar and adds records to it, rather than returning loose lists, so the host can
say which plugin provided which record.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "offline_plugins"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def offline_plugins_register_algorithms(registry):
    """Add :class:`~offline_plugins.plugins.registry.AlgorithmSpec` records.

    Args:
        registry: a registrar; call ``registry.add(spec)`` once per algorithm.
            The provider (distribution and version) is filled in by the host.
    """


@hookspec
def offline_plugins_register_datasets(registry):
    """Add :class:`~offline_plugins.plugins.registry.DatasetSpec` records.

    Args:
        registry: a registrar; call ``registry.add(spec)`` once per dataset recipe.
    """


@hookspec
def offline_plugins_register_data_kinds(registry):
    """Add :class:`~offline_plugins.kinds.DataKind` instances: new kinds of training data.

    A data kind tells the training shell how a dataset id of that kind is resolved and
    loaded, how batches are drawn, how a run is evaluated and summarised and how its
    policy is exported (docs/plugins.md, "A new kind of data"). Algorithms name it in
    ``AlgorithmSpec.data``.

    Args:
        registry: a registrar; call ``registry.add(kind)`` once per data kind.
    """


@hookspec
def offline_plugins_register_judges(registry):
    """Add :class:`~offline_plugins.plugins.registry.JudgeSpec` records: AI judges that prefer one of
    two responses, which ``--judge NAME`` picks (online DPO, ``data label``, ``data audit``).

    Args:
        registry: a registrar; call ``registry.add(spec)`` once per judge.
    """


@hookspec
def offline_plugins_register_sandboxes(registry):
    """Add :class:`~offline_plugins.plugins.registry.SandboxSpec` records: where tools run model-written
    code (``--set tool_sandbox=NAME``), e.g. a container runner or a remote execution service.

    Args:
        registry: a registrar; call ``registry.add(spec)`` once per sandbox.
    """


@hookspec
def offline_plugins_register_text_tasks(registry):
    """Add :class:`~offline_plugins.plugins.registry.TextTaskSpec` records: text tasks ``--dataset`` takes
    for the algorithms trained on their own rollouts (``grpo`` ...), listed by ``data list``.

    Args:
        registry: a registrar; call ``registry.add(spec)`` once per task.
    """


@hookspec
def offline_plugins_register_tools(registry):
    """Add :class:`~offline_plugins.plugins.registry.ToolSpec` records: tools a multi-turn task's policy
    may call (a task's ``tools`` setting names them).

    Args:
        registry: a registrar; call ``registry.add(spec)`` once per tool.
    """


@hookspec
def offline_plugins_register_rewards(registry):
    """Add :class:`~offline_plugins.plugins.registry.RewardSpec` records: reward functions ``--reward NAME``
    takes for the algorithms trained on their own rollouts (``grpo`` ...), listed by ``list``.

    Args:
        registry: a registrar; call ``registry.add(spec)`` once per reward function.
    """
