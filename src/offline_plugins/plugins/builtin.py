"""The plugins shipped inside offline-plugins, registered explicitly by the host.

Each entry maps a plugin name (what ``OFFLINE_PLUGINS_DISABLE`` takes) to the module
that holds its ``@hookimpl`` functions. These modules must import no torch at module
level, so that listing algorithms stays fast.
"""

from __future__ import annotations

BUILTIN_PLUGINS: dict[str, str] = {
    "offline_plugins.kinds": "offline_plugins.kinds",
    "offline_plugins.algorithms.bc": "offline_plugins.algorithms.bc",
    "offline_plugins.algorithms.iql": "offline_plugins.algorithms.iql",
    "offline_plugins.algorithms.td3_bc": "offline_plugins.algorithms.td3_bc",
    "offline_plugins.algorithms.cql": "offline_plugins.algorithms.cql",
    "offline_plugins.algorithms.bcq": "offline_plugins.algorithms.bcq",
    "offline_plugins.algorithms.awac": "offline_plugins.algorithms.awac",
    "offline_plugins.algorithms.rebrac": "offline_plugins.algorithms.rebrac",
    "offline_plugins.algorithms.edac": "offline_plugins.algorithms.edac",
    "offline_plugins.algorithms.cal_ql": "offline_plugins.algorithms.cal_ql",
    "offline_plugins.algorithms.fql": "offline_plugins.algorithms.fql",
    "offline_plugins.algorithms.sequence.dt": "offline_plugins.algorithms.sequence.dt",
    "offline_plugins.algorithms.sequence.odt": "offline_plugins.algorithms.sequence.odt",
    "offline_plugins.algorithms.sequence.tt": "offline_plugins.algorithms.sequence.tt",
    "offline_plugins.algorithms.sequence.diffuser": "offline_plugins.algorithms.sequence.diffuser",
    "offline_plugins.algorithms.sequence.ad": "offline_plugins.algorithms.sequence.ad",
    "offline_plugins.algorithms.preference": "offline_plugins.algorithms.preference",
    "offline_plugins.algorithms.online": "offline_plugins.algorithms.online",
    "offline_plugins.algorithms.ppo_rlhf": "offline_plugins.algorithms.ppo_rlhf",
    "offline_plugins.algorithms.online_dpo": "offline_plugins.algorithms.online_dpo",
    "offline_plugins.algorithms.text_dt": "offline_plugins.algorithms.text_dt",
    "offline_plugins.algorithms.distill": "offline_plugins.algorithms.distill",
    "datasets": "offline_plugins.data.recipes",
    "offline_plugins.algorithms.prm": "offline_plugins.algorithms.prm",
    "offline_plugins.algorithms.prm_rl": "offline_plugins.algorithms.prm_rl",
    "judges": "offline_plugins.plugins.judges",
    "sandboxes": "offline_plugins.plugins.sandboxes",
    "text-tasks": "offline_plugins.plugins.text_tasks",
}
