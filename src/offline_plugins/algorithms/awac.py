"""AWAC: our loss, a tanh-Gaussian actor and twin critics.

Nair, Gupta, Dalal & Levine 2020, "AWAC: Accelerating Online Reinforcement Learning
with Offline Datasets", arXiv:2006.09359. Defaults: the paper's learning rate and
temperature, the suite-wide batch of 256 and 2x256 networks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from offline_plugins.config import FineTuneConfig, TDConfig, config_field
from offline_plugins.plugins.registry import builtin_algorithm, builtin_hook

PAPER = "Nair, Gupta, Dalal & Levine 2020, AWAC: Accelerating Online Reinforcement Learning with Offline Datasets, " \
    "arXiv:2006.09359"


@dataclass
class AWACConfig(FineTuneConfig, TDConfig):
    actor_lr: float = config_field(3e-4, "Adam learning rate of the policy")
    critic_lr: float = config_field(3e-4, "Adam learning rate of the twin critics")
    beta: float = config_field(1.0, "temperature of the advantage weights exp(A / beta)", bounds=">0")
    max_weight: float = config_field(100.0, "clip of the advantage weights")


def build(config: AWACConfig, data: Any):
    """Tanh-Gaussian actor, twin critics with Polyak targets."""
    from offline_plugins.algorithms import _glue
    from offline_plugins.modules import networks
    from offline_plugins.modules.policies import DeterministicPolicy
    from offline_plugins.objectives.awac import AWACLoss

    _glue.check_inputs(config, data, "awac", "continuous")
    n_obs, hidden = _glue.obs_dim(data), tuple(config.hidden)
    actor = networks.make_tanh_gaussian_actor(n_obs, data.action_spec, hidden)
    loss = AWACLoss(
        actor,
        networks.make_qvalue(n_obs, _glue.action_dim(data), hidden),
        beta=config.beta,
        max_weight=config.max_weight,
        columns=_glue.mc_columns(data, config.gamma),  # the diagnostics' mc_return, discounted at gamma
    )
    return _glue.transition_parts(loss, DeterministicPolicy(actor), config, _glue.actor_critic_groups(loss, config))


offline_plugins_register_algorithms = builtin_hook(
    builtin_algorithm(
        "awac", "Advantage-Weighted Actor-Critic: Bellman critics, policy by exp(A / beta)-weighted likelihood",
        AWACConfig, PAPER, loss="awac:AWACLoss", build="awac:build",
    ),
)
