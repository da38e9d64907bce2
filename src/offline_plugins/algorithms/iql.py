"""IQL, continuous and discrete: TorchRL's IQL losses, our networks and optimiser groups.

Kostrikov, Nair & Levine 2022, "Offline Reinforcement Learning with Implicit
Q-Learning", arXiv:2110.06169. Defaults are the paper's MuJoCo settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from offline_plugins.config import FineTuneConfig, TDConfig, config_field
from offline_plugins.plugins.registry import builtin_algorithm, builtin_hook

PAPER = "Kostrikov, Nair & Levine 2022, Offline Reinforcement Learning with Implicit Q-Learning, arXiv:2110.06169"


@dataclass
class IQLConfig(FineTuneConfig, TDConfig):
    actor_lr: float = config_field(3e-4, "Adam learning rate of the policy")
    critic_lr: float = config_field(3e-4, "Adam learning rate of the twin Q networks")
    value_lr: float = config_field(3e-4, "Adam learning rate of V")
    expectile: float = config_field(0.7, "expectile tau of the V regression, in (0, 1)")
    temperature: float = config_field(3.0, "inverse temperature beta of the advantage weights exp(beta A), clipped at 100")
    num_qvalue_nets: int = config_field(2, "critics in the ensemble (the minimum is used)")
    normalize_observations: bool = config_field(True, "standardise observations with dataset statistics (data layer)")
    diagnostics: bool = config_field(
        True,
        "log Q-on-data, value and advantage statistics (one extra no-grad pass), and Q minus the data's "
        "Monte-Carlo return discounted at gamma when the dataset has stored episodes",
    )


def _build(config: IQLConfig, data: Any, action_space: str, name: str):
    from offline_plugins.algorithms import _glue
    from offline_plugins.modules import networks
    from offline_plugins.modules.policies import DeterministicPolicy
    from offline_plugins.objectives.iql import DiscreteIQLLoss, IQLLoss

    _glue.check_inputs(config, data, name, action_space)
    n_obs, hidden = _glue.obs_dim(data), tuple(config.hidden)
    columns = _glue.mc_columns(data, config.gamma) if config.diagnostics else None
    kwargs = dict(
        expectile=config.expectile,
        temperature=config.temperature,
        num_qvalue_nets=config.num_qvalue_nets,
        diagnostics=config.diagnostics,
        mc_diagnostics=columns is not None,
        columns=columns,
    )
    if action_space == "continuous":
        actor = networks.make_tanh_gaussian_actor(n_obs, data.action_spec, hidden)
        qvalue = networks.make_qvalue(n_obs, _glue.action_dim(data), hidden)
        loss = IQLLoss(actor, qvalue, networks.make_value(n_obs, hidden), **kwargs)
    else:
        n = _glue.num_actions(data)
        actor = networks.make_categorical_actor(n_obs, n, hidden)
        qvalue = networks.make_discrete_qvalue(n_obs, n, hidden)
        loss = DiscreteIQLLoss(actor, qvalue, networks.make_value(n_obs, hidden), **kwargs)
    groups = [_glue.group("value", loss.value_network_params, config.value_lr, "loss_value")]
    return _glue.transition_parts(loss, DeterministicPolicy(actor), config, groups + _glue.actor_critic_groups(loss, config))


def build(config: IQLConfig, data: Any):
    """IQL on continuous actions: tanh-Gaussian actor, twin Q, V."""
    return _build(config, data, "continuous", "iql")


def build_discrete(config: IQLConfig, data: Any):
    """IQL on discrete actions: categorical actor, twin ``Q(s, .)``, V."""
    return _build(config, data, "discrete", "iql-discrete")


offline_plugins_register_algorithms = builtin_hook(
    builtin_algorithm(
        "iql", "Implicit Q-Learning: expectile V, advantage-weighted policy, no out-of-data actions",
        IQLConfig, PAPER, loss="iql:IQLLoss", build="iql:build",
    ),
    builtin_algorithm(
        "iql-discrete", "Implicit Q-Learning for discrete actions",
        IQLConfig, PAPER, loss="iql:DiscreteIQLLoss", build="iql:build_discrete", action_space="discrete",
    ),
)
