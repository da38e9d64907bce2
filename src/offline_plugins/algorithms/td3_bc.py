"""TD3+BC: TorchRL's ``TD3BCLoss``, a deterministic actor, twin critics, delayed actor steps.

Fujimoto & Gu 2021, "A Minimalist Approach to Offline Reinforcement Learning",
arXiv:2106.06860. Defaults are the paper's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from offline_plugins.config import TDConfig, config_field
from offline_plugins.plugins.registry import builtin_algorithm, builtin_hook

PAPER = "Fujimoto & Gu 2021, A Minimalist Approach to Offline Reinforcement Learning, arXiv:2106.06860"


@dataclass
class TD3Fields:
    """TD3's target smoothing and delayed updates (Fujimoto et al. 2018), shared by TD3+BC and ReBRAC."""

    policy_noise: float = config_field(0.2, "std of the target policy smoothing noise, as a fraction of max action")
    noise_clip: float = config_field(0.5, "clip of that noise, as a fraction of max action")
    policy_freq: int = config_field(2, "critic steps per actor (and target) step: delayed policy updates")


@dataclass
class TD3BCConfig(TD3Fields, TDConfig):
    actor_lr: float = config_field(3e-4, "Adam learning rate of the actor")
    critic_lr: float = config_field(3e-4, "Adam learning rate of the twin critics")
    alpha: float = config_field(2.5, "alpha in lambda = alpha / mean|Q(s, mu(s))|, the weight of the Q term")
    normalize_observations: bool = config_field(True, "standardise observations with dataset statistics (data layer)")


def build(config: TD3BCConfig, data: Any):
    """Deterministic tanh actor, twin Q, actor stepped every ``policy_freq`` steps."""
    from offline_plugins.algorithms import _glue
    from offline_plugins.modules import networks
    from offline_plugins.modules.policies import DeterministicPolicy
    from offline_plugins.objectives.common import check_range
    from offline_plugins.objectives.td3_bc import TD3BCLoss

    _glue.check_inputs(config, data, "td3-bc", "continuous")
    check_range("td3-bc", "policy_freq", config.policy_freq, 1, None, low_inclusive=True)
    n_obs, hidden = _glue.obs_dim(data), tuple(config.hidden)
    actor = networks.make_deterministic_actor(n_obs, data.action_spec, hidden)
    qvalue = networks.make_qvalue(n_obs, _glue.action_dim(data), hidden)
    # the paper scales both noise terms by the action bound
    max_action = float(data.action_spec.space.high.abs().max())
    columns = _glue.mc_columns(data, config.gamma)  # the diagnostics' mc_return, discounted at gamma
    loss = TD3BCLoss(
        actor,
        qvalue,
        action_spec=data.action_spec,
        alpha=config.alpha,
        policy_noise=config.policy_noise * max_action,
        noise_clip=config.noise_clip * max_action,
        diagnostics=True,
        mc_diagnostics=columns is not None,
        columns=columns,
    )
    every = int(config.policy_freq)
    groups = _glue.actor_critic_groups(loss, config, actor_every=every)
    return _glue.transition_parts(loss, DeterministicPolicy(actor), config, groups, target_update_every=every)


offline_plugins_register_algorithms = builtin_hook(
    builtin_algorithm(
        "td3-bc", "TD3 with a behaviour-cloning term in the actor loss, lambda = alpha / mean|Q|",
        TD3BCConfig, PAPER, loss="td3_bc:TD3BCLoss", build="td3_bc:build",
    ),
)
