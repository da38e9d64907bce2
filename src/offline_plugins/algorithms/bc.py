"""Behaviour cloning, continuous and discrete: TorchRL's ``BCLoss`` on an MLP policy.

The baseline every offline-RL paper reports; as in Fujimoto & Gu 2021 (the BC
column of TD3+BC), a deterministic tanh actor regressed onto the data's actions
with an L2 loss; for discrete actions, a categorical policy trained by maximum
likelihood (cross-entropy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from offline_plugins.config import TransitionConfig, config_field
from offline_plugins.plugins.registry import builtin_algorithm, builtin_hook

PAPER = "Pomerleau 1991, Efficient Training of Artificial Neural Networks for Autonomous Navigation; " \
    "as the baseline of Fujimoto & Gu 2021, arXiv:2106.06860"


@dataclass
class BCConfig(TransitionConfig):
    lr: float = config_field(3e-4, "Adam learning rate of the policy")
    normalize_observations: bool = config_field(True, "standardise observations with dataset statistics (data layer)")


def _build(config: BCConfig, data: Any, action_space: str, name: str):
    from offline_plugins.algorithms import _glue
    from offline_plugins.algorithms.base import AlgorithmParts
    from offline_plugins.modules import networks
    from offline_plugins.modules.policies import DeterministicPolicy
    from offline_plugins.objectives.bc import BCLoss

    _glue.check_inputs(config, data, name, action_space)
    n_obs, hidden = _glue.obs_dim(data), tuple(config.hidden)
    if action_space == "continuous":
        actor = networks.make_deterministic_actor(n_obs, data.action_spec, hidden)
        loss = BCLoss(actor, loss_function="l2")
    else:
        actor = networks.make_categorical_actor(n_obs, _glue.num_actions(data), hidden)
        loss = BCLoss(actor, diagnostics=True)
    return AlgorithmParts(
        loss=loss,
        policy=DeterministicPolicy(actor),
        optimizers=[_glue.group("actor", loss.actor_network_params, config.lr, "loss_bc")],
        target_updater=None,
    )


def build(config: BCConfig, data: Any):
    """Deterministic tanh actor, L2 regression onto the data's actions."""
    return _build(config, data, "continuous", "bc")


def build_discrete(config: BCConfig, data: Any):
    """Categorical policy, cross-entropy against the data's action indices."""
    return _build(config, data, "discrete", "bc-discrete")


offline_plugins_register_algorithms = builtin_hook(
    builtin_algorithm(
        "bc", "Behaviour cloning: regress the policy onto the dataset's actions",
        BCConfig, PAPER, loss="bc:BCLoss", build="bc:build",
    ),
    builtin_algorithm(
        "bc-discrete", "Behaviour cloning for discrete actions (cross-entropy)",
        BCConfig, PAPER, loss="bc:BCLoss", build="bc:build_discrete", action_space="discrete",
    ),
)
