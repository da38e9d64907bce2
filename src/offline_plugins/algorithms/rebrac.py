"""ReBRAC: TD3+BC with actor and critic behaviour penalties, LayerNorm critics, deeper nets, large batches.

Tarasov, Kurenkov, Nikulin & Kolesnikov 2023, "Revisiting the Minimalist Approach to
Offline Reinforcement Learning", arXiv:2305.09836. Defaults are CORL's
(``algorithms/offline/rebrac.py`` ``Config``), behaviour coefficients included (1.0 and 1.0).
The paper tunes those per dataset (CORL's ``configs/offline/rebrac/hopper/medium_v2.yaml``:
0.01 and 0.01, for 1M steps on D4RL). On Pendulum medium at 0.01 the actor ran into an
action bound within the first steps and stayed there (tanh saturated; score -14.8 at every
evaluation, seed 0), while 1.0 learned (37.2 after 1600 steps; 0.1: 25.7).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from offline_plugins.algorithms.td3_bc import TD3Fields
from offline_plugins.config import FineTuneConfig, TDConfig, config_field
from offline_plugins.plugins.registry import builtin_algorithm, builtin_hook

PAPER = ("Tarasov, Kurenkov, Nikulin & Kolesnikov 2023, Revisiting the Minimalist Approach to Offline "
         "Reinforcement Learning, arXiv:2305.09836")


@dataclass
class ReBRACConfig(FineTuneConfig, TD3Fields, TDConfig):
    batch_size: int = config_field(1024, "transitions per gradient step (CORL: 1024)")
    hidden: tuple = config_field((256, 256, 256), "hidden layer widths of the actor and the critics (CORL: 3 x 256)")
    actor_lr: float = config_field(1e-3, "Adam learning rate of the actor (CORL: 1e-3)")
    critic_lr: float = config_field(1e-3, "Adam learning rate of the critics (CORL: 1e-3)")
    actor_bc_coef: float = config_field(1.0, "beta_1: weight of ||mu(s) - a||^2 in the actor loss (CORL: 1.0; hopper-medium: 0.01)")
    critic_bc_coef: float = config_field(1.0, "beta_2: weight of ||mu'(s') - a'||^2 subtracted in the target (CORL: 1.0; hopper-medium: 0.01)")
    critic_layer_norm: bool = config_field(True, "LayerNorm after every hidden activation of the critics (CORL: on)")
    normalize_q: bool = config_field(True, "divide the actor's Q term by mean|Q| (CORL: on)")
    num_critics: int = config_field(2, "critics in the ensemble; the target takes their minimum", bounds=">=2")
    normalize_observations: bool = config_field(False, "standardise observations with dataset statistics (CORL: off)")


def build(config: ReBRACConfig, data: Any):
    """Deterministic tanh actor, LayerNorm critic ensemble, the data's next actions for the critic penalty."""
    from offline_plugins.algorithms import _glue
    from offline_plugins.modules import networks
    from offline_plugins.modules.policies import DeterministicPolicy
    from offline_plugins.objectives.columns import next_actions
    from offline_plugins.objectives.common import check_range
    from offline_plugins.objectives.rebrac import ReBRACLoss

    _glue.check_inputs(config, data, "rebrac", "continuous")
    check_range("rebrac", "policy_freq", config.policy_freq, 1, None, low_inclusive=True)
    check_range("rebrac", "num_critics", config.num_critics, 2, None, low_inclusive=True)
    n_obs, hidden = _glue.obs_dim(data), tuple(config.hidden)
    actor = networks.make_deterministic_actor(n_obs, data.action_spec, hidden)
    make_q = networks.make_layer_norm_qvalue if config.critic_layer_norm else networks.make_qvalue
    qvalue = make_q(n_obs, _glue.action_dim(data), hidden)
    # the data layer stores neither the next action nor the discounted return the diagnostics read;
    # both follow from the episodes (see objectives/columns.py)
    columns = _glue.mc_columns(data, config.gamma, extra={("next", "action"): next_actions})
    max_action = float(data.action_spec.space.high.abs().max())
    loss = ReBRACLoss(
        actor,
        qvalue,
        action_spec=data.action_spec,
        actor_bc_coef=config.actor_bc_coef,
        critic_bc_coef=config.critic_bc_coef,
        normalize_q=config.normalize_q,
        num_qvalue_nets=int(config.num_critics),
        policy_noise=config.policy_noise * max_action,
        noise_clip=config.noise_clip * max_action,
        columns=columns,
        diagnostics=True,
        mc_diagnostics=columns is not None,
    )
    every = int(config.policy_freq)
    groups = _glue.actor_critic_groups(loss, config, actor_every=every)
    return _glue.transition_parts(loss, DeterministicPolicy(actor), config, groups, target_update_every=every)


offline_plugins_register_algorithms = builtin_hook(
    builtin_algorithm(
        "rebrac", "TD3+BC with behaviour penalties in the actor and the critic target, LayerNorm critics, batch 1024",
        ReBRACConfig, PAPER, loss="rebrac:ReBRACLoss", build="rebrac:build",
    ),
)
