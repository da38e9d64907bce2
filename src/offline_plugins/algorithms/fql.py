"""FQL: a flow-matching behaviour policy, a one-step policy distilled from it toward high Q, LayerNorm critics.

Park, Li & Levine 2025, "Flow Q-Learning", arXiv:2502.02538. Defaults are the reference
code's (seohongpark/fql ``agents/fql.py`` ``get_config``, networks in ``utils/networks.py``):
one Adam at 3e-4 for every network (here one group per network at that rate: their
parameters and terms are disjoint, so the steps are the same), batch 256, 4 x 512 GELU
networks with LayerNorm in the two critics only, gamma 0.99, tau 0.005 (critics only),
10 Euler steps, alpha 10, the mean of the target critics, no Q normalisation. The
evaluation policy is the one-step policy at a fresh noise draw, as the reference's
``sample_actions`` (the evaluator seeds the draws, so an evaluation repeats).

Alpha is the one hyperparameter the paper tunes per environment: :data:`OGBENCH_SETTINGS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from offline_plugins.config import TDConfig, config_field
from offline_plugins.plugins.registry import builtin_algorithm, builtin_hook

PAPER = "Park, Li & Levine 2025, Flow Q-Learning, arXiv:2502.02538"

#: The paper's settings on the state-based OGBench singletask environments (offline RL, 1M steps),
#: from the command lines in the reference code's README (seohongpark/fql, "Reproducing the main
#: results", "FQL on state-based OGBench"); the same for all five tasks of an environment. Keys
#: are the environments' names without ``-taskN``/``-v0``; values are :class:`FQLConfig` fields
#: that differ from the defaults. The paper's visual and D4RL settings are in docs/algorithms/fql.md.
OGBENCH_SETTINGS: dict[str, dict[str, Any]] = {
    "antmaze-large-navigate-singletask": {"alpha": 10.0, "q_aggregation": "min"},
    "antmaze-giant-navigate-singletask": {"alpha": 10.0, "q_aggregation": "min", "gamma": 0.995},
    "humanoidmaze-medium-navigate-singletask": {"alpha": 30.0, "gamma": 0.995},
    "humanoidmaze-large-navigate-singletask": {"alpha": 30.0, "gamma": 0.995},
    "antsoccer-arena-navigate-singletask": {"alpha": 10.0, "gamma": 0.995},
    "cube-single-play-singletask": {"alpha": 300.0},
    "cube-double-play-singletask": {"alpha": 300.0},
    "scene-play-singletask": {"alpha": 300.0},
    "puzzle-3x3-play-singletask": {"alpha": 1000.0},
    "puzzle-4x4-play-singletask": {"alpha": 1000.0},
}


@dataclass
class FQLConfig(TDConfig):
    batch_size: int = config_field(256, "transitions per gradient step (paper: 256)")
    hidden: tuple = config_field((512, 512, 512, 512), "hidden layer widths of every network (paper: 4 x 512)")
    lr: float = config_field(3e-4, "Adam learning rate of the flow, the one-step policy and the critics (paper: 3e-4)")
    alpha: float = config_field(10.0, "weight of the distillation term; tuned per environment (code default: 10; "
                                "OGBench: 10 to 1000, see OGBENCH_SETTINGS in offline_plugins.algorithms.fql)",
                                bounds=">=0")
    flow_steps: int = config_field(10, "Euler steps of the flow policy's sampler (paper: 10)", bounds=">=1")
    q_aggregation: str = config_field("mean", "mean or min of the target critics (paper: mean; min on antmaze and "
                                      "D4RL adroit)")
    normalize_q_loss: bool = config_field(False, "divide the policy's Q term by mean|Q| (paper: off; its README "
                                          "recommends on for new environments, alpha then from 0.03 to 10)")
    num_critics: int = config_field(2, "critics in the ensemble (paper: 2)", bounds=">=1")
    critic_layer_norm: bool = config_field(True, "LayerNorm after every hidden activation of the critics (paper: on)")
    actor_layer_norm: bool = config_field(False, "LayerNorm in the flow and the one-step policy (paper: off)")


def build(config: FQLConfig, data: Any):
    """Flow and one-step policies, a LayerNorm critic ensemble with Polyak targets, one optimiser group each."""
    from offline_plugins.algorithms import _glue
    from offline_plugins.modules import flow
    from offline_plugins.objectives.common import check_range
    from offline_plugins.objectives.fql import FQLLoss

    _glue.check_inputs(config, data, "fql", "continuous")
    check_range("fql", "flow_steps", config.flow_steps, 1, None, low_inclusive=True)
    check_range("fql", "num_critics", config.num_critics, 1, None, low_inclusive=True)
    n_obs, hidden = _glue.obs_dim(data), tuple(config.hidden)
    flow_policy = flow.make_flow_policy(n_obs, data.action_spec, hidden, num_steps=config.flow_steps,
                                        layer_norm=config.actor_layer_norm)
    actor = flow.make_one_step_policy(n_obs, data.action_spec, hidden, layer_norm=config.actor_layer_norm)
    qvalue = flow.make_fql_qvalue(n_obs, _glue.action_dim(data), hidden, layer_norm=config.critic_layer_norm)
    columns = _glue.mc_columns(data, config.gamma)  # the diagnostics' mc_return, discounted at gamma
    loss = FQLLoss(
        flow_policy,
        actor,
        qvalue,
        num_qvalue_nets=int(config.num_critics),
        alpha=config.alpha,
        q_aggregation=config.q_aggregation,
        normalize_q_loss=config.normalize_q_loss,
        diagnostics=True,
        mc_diagnostics=columns is not None,
        columns=columns,
    )
    groups = [
        _glue.group("flow", loss.flow_policy_params, config.lr, "loss_flow"),
        _glue.group("actor", loss.actor_network_params, config.lr, "loss_actor"),
        _glue.group("critic", loss.qvalue_network_params, config.lr, "loss_qvalue"),
    ]
    return _glue.transition_parts(loss, actor, config, groups)


offline_plugins_register_algorithms = builtin_hook(
    builtin_algorithm(
        "fql", "Flow Q-learning: a flow-matching behaviour policy distilled into a one-step policy toward high Q",
        FQLConfig, PAPER, loss="fql:FQLLoss", build="fql:build",
    ),
)
