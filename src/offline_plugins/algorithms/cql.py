"""CQL, continuous (fixed weight or Lagrangian) and discrete, on TorchRL's CQL losses.

Kumar, Zhou, Tucker & Levine 2020, "Conservative Q-Learning for Offline
Reinforcement Learning", arXiv:2006.04779. Continuous CQL is CQL(H) on SAC with the
paper's Gym settings; ``cql-lagrange`` learns the weight to hold the gap at a
threshold; ``cql-discrete`` is CQL(H) on a DQN backbone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from offline_plugins.config import TDConfig, config_field
from offline_plugins.plugins.registry import builtin_algorithm, builtin_hook

PAPER = "Kumar, Zhou, Tucker & Levine 2020, Conservative Q-Learning for Offline Reinforcement Learning, arXiv:2006.04779"


@dataclass
class CQLConfig(TDConfig):
    actor_lr: float = config_field(1e-4, "Adam learning rate of the policy")
    critic_lr: float = config_field(3e-4, "Adam learning rate of the twin critics")
    alpha_lr: float = config_field(3e-4, "Adam learning rate of the SAC entropy temperature and of alpha'")
    min_q_weight: float = config_field(5.0, "weight of the conservative term logsumexp Q - Q(data)")
    with_lagrange: bool = config_field(False, "learn alpha' to hold the conservative gap at lagrange_thresh")
    lagrange_thresh: float = config_field(5.0, "target gap tau of the Lagrangian (with_lagrange only)")
    num_random: int = config_field(10, "sampled actions per state (uniform, current and next policy) for logsumexp")
    temperature: float = config_field(1.0, "temperature of the logsumexp", bounds=">0")


@dataclass
class CQLLagrangeConfig(CQLConfig):
    with_lagrange: bool = config_field(True, "learn alpha' to hold the conservative gap at lagrange_thresh")


@dataclass
class DiscreteCQLConfig(TDConfig):
    lr: float = config_field(3e-4, "Adam learning rate of the Q network")
    alpha: float = config_field(1.0, "weight of the conservative term logsumexp Q - Q(data)")


def build(config: CQLConfig, data: Any):
    """CQL(H) on SAC: tanh-Gaussian actor, twin Q, entropy temperature, optional alpha'."""
    from offline_plugins.algorithms import _glue
    from offline_plugins.objectives.cql import CQLLoss

    name = "cql-lagrange" if config.with_lagrange else "cql"
    _glue.check_inputs(config, data, name, "continuous")
    return build_with(CQLLoss, config, data)


def build_with(loss_class: type, config: CQLConfig, data: Any, **loss_kwargs: Any):
    """CQL's parts around ``loss_class`` (:class:`~offline_plugins.objectives.cql.CQLLoss` or a
    subclass of it, given ``loss_kwargs`` beside the config's settings); inputs already checked."""
    from offline_plugins.algorithms import _glue
    from offline_plugins.modules import networks
    from offline_plugins.modules.policies import DeterministicPolicy

    n_obs, hidden = _glue.obs_dim(data), tuple(config.hidden)
    actor = networks.make_tanh_gaussian_actor(n_obs, data.action_spec, hidden)
    qvalue = networks.make_qvalue(n_obs, _glue.action_dim(data), hidden)
    # the data's Monte-Carlo return discounted at gamma: the diagnostics' (and Cal-QL's bound's) mc_return
    columns = _glue.mc_columns(data, config.gamma)
    loss = loss_class(
        actor,
        qvalue,
        **loss_kwargs,
        min_q_weight=config.min_q_weight,
        with_lagrange=config.with_lagrange,
        lagrange_thresh=config.lagrange_thresh,
        num_random=config.num_random,
        temperature=config.temperature,
        action_spec=data.action_spec,
        diagnostics=True,
        mc_diagnostics=columns is not None,
        columns=columns,
    )
    groups = _glue.actor_critic_groups(loss, config, "loss_qvalue", "loss_cql")
    groups.append(_glue.group("alpha", [loss.log_alpha], config.alpha_lr, "loss_alpha"))
    if config.with_lagrange:
        groups.append(_glue.group("alpha_prime", [loss.log_alpha_prime], config.alpha_lr, "loss_alpha_prime"))
    return _glue.transition_parts(loss, DeterministicPolicy(actor), config, groups)


def build_discrete(config: DiscreteCQLConfig, data: Any):
    """Discrete CQL(H): one Q network (greedy policy), Polyak-averaged target."""
    from torchrl.modules import QValueActor

    from offline_plugins.algorithms import _glue
    from offline_plugins.modules import networks
    from offline_plugins.modules.policies import DeterministicPolicy
    from offline_plugins.objectives.cql import DiscreteCQLLoss

    _glue.check_inputs(config, data, "cql-discrete", "discrete")
    n_obs, n = _glue.obs_dim(data), _glue.num_actions(data)
    qnet = QValueActor(networks.mlp(n_obs, n, tuple(config.hidden)), in_keys=["observation"], action_space="categorical")
    columns = _glue.mc_columns(data, config.gamma)
    loss = DiscreteCQLLoss(
        qnet, alpha=config.alpha, diagnostics=True, mc_diagnostics=columns is not None, columns=columns
    )
    groups = [_glue.group("critic", loss.value_network_params, config.lr, "loss_qvalue", "loss_cql")]
    return _glue.transition_parts(loss, DeterministicPolicy(qnet), config, groups)


offline_plugins_register_algorithms = builtin_hook(
    builtin_algorithm(
        "cql", "Conservative Q-Learning: SAC plus a penalty on logsumexp Q over data Q (fixed weight)",
        CQLConfig, PAPER, loss="cql:CQLLoss", build="cql:build",
    ),
    builtin_algorithm(
        "cql-lagrange", "Conservative Q-Learning with the Lagrangian weight holding the gap at a threshold",
        CQLLagrangeConfig, PAPER, loss="cql:CQLLoss", build="cql:build",
    ),
    builtin_algorithm(
        "cql-discrete", "Conservative Q-Learning on a DQN backbone for discrete actions",
        DiscreteCQLConfig, PAPER, loss="cql:DiscreteCQLLoss", build="cql:build_discrete", action_space="discrete",
    ),
)
