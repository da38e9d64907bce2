"""Data kinds: one object per kind of training data, asked by the training shell.

The built-in kinds are ``transitions`` and ``trajectories`` (Minari datasets of an
environment's steps), ``preference-pairs`` and ``unpaired-feedback`` (text with
preference labels), ``text-rollouts`` (prompts the policy answers while it trains) and
``text-completions`` (prompt/completion rows for SFT), and ``step-labels`` (PRM steps). A plugin adds a kind with the ``offline_plugins_register_data_kinds``
hook; see :class:`DataKind` for the contract and docs/plugins.md for an example.

>>> from offline_plugins.plugins import load_registry
>>> registry = load_registry()
>>> registry.data_kind("transitions").batch_layout({"batch_size": 64})
BatchLayout(batch_size=64, sampler='random', slice_len=None)
>>> registry.data_kind("trajectories").batch_layout({"context_len": 20}).sampler
'slice'
"""

from __future__ import annotations

from offline_plugins.plugins.datakind import BatchLayout, DataKind, DataOptions, LoadedData, config_value
from offline_plugins.kinds.environment import Trajectories, Transitions
from offline_plugins.kinds.preference import PreferencePairs, UnpairedFeedback
from offline_plugins.kinds.rollouts import TextCompletions, TextRollouts
from offline_plugins.plugins.hookspecs import hookimpl

__all__ = [
    "DataKind",
    "DataOptions",
    "LoadedData",
    "BatchLayout",
    "config_value",
    "Transitions",
    "Trajectories",
    "PreferencePairs",
    "UnpairedFeedback",
    "TextRollouts",
    "TextCompletions",
    "offline_plugins_register_data_kinds",
]


@hookimpl
def offline_plugins_register_data_kinds(registry):
    """Register the built-in data kinds."""
    for kind in (Transitions(), Trajectories(), PreferencePairs(), UnpairedFeedback(), TextRollouts(),
                 TextCompletions()):
        registry.add(kind)

# step-labelled reasoning (process reward models): appended, so the kinds above keep their order
from offline_plugins.kinds.steps import StepLabels  # noqa: E402

__all__ += ["StepLabels"]


@hookimpl(specname="offline_plugins_register_data_kinds")
def _register_step_labels(registry):
    """Register the step-labels kind."""
    registry.add(StepLabels())
