"""SAC-N and EDAC: SAC with N vmapped critics and their minimum; EDAC adds the gradient-diversity term.

An, Moon, Kim & Song 2021, "Uncertainty-Based Offline Reinforcement Learning with
Diversified Q-Ensemble", arXiv:2110.01548. Defaults are CORL's ``algorithms/offline/sac_n.py``
and ``edac.py`` ``TrainConfig`` (N = 10, eta = 1.0, 3 x 256 networks, learning rates 3e-4,
batch 256); CORL's Hopper config for EDAC uses N = 50, one ``--set num_critics=50`` away.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from offline_plugins.config import TDConfig, config_field
from offline_plugins.plugins.registry import builtin_algorithm, builtin_hook

PAPER = ("An, Moon, Kim & Song 2021, Uncertainty-Based Offline Reinforcement Learning with Diversified "
         "Q-Ensemble, arXiv:2110.01548")


@dataclass
class SACNConfig(TDConfig):
    hidden: tuple = config_field((256, 256, 256), "hidden layer widths of the actor and the critics (CORL: 3 x 256)")
    actor_lr: float = config_field(3e-4, "Adam learning rate of the actor")
    critic_lr: float = config_field(3e-4, "Adam learning rate of the critic ensemble")
    alpha_lr: float = config_field(3e-4, "Adam learning rate of the SAC entropy temperature")
    num_critics: int = config_field(10, "N: critics in the vmapped ensemble (CORL: 10; its EDAC Hopper config: 50)",
                                    bounds=">=2")


@dataclass
class EDACConfig(SACNConfig):
    eta: float = config_field(1.0, "weight of the ensemble gradient-diversity term (CORL: 1.0)",
                              bounds=">=0")


def _build(config: SACNConfig, data: Any, name: str):
    from offline_plugins.algorithms import _glue
    from offline_plugins.modules import networks
    from offline_plugins.modules.policies import DeterministicPolicy
    from offline_plugins.objectives.common import check_range
    from offline_plugins.objectives.edac import EDACLoss, SACNLoss

    _glue.check_inputs(config, data, name, "continuous")
    check_range(name, "num_critics", config.num_critics, 2, None, low_inclusive=True)
    n_obs, hidden = _glue.obs_dim(data), tuple(config.hidden)
    actor = networks.make_tanh_gaussian_actor(n_obs, data.action_spec, hidden)
    qvalue = networks.make_qvalue(n_obs, _glue.action_dim(data), hidden)
    columns = _glue.mc_columns(data, config.gamma)  # the diagnostics' mc_return, discounted at gamma
    common = dict(num_qvalue_nets=int(config.num_critics), action_spec=data.action_spec, diagnostics=True,
                  mc_diagnostics=columns is not None, columns=columns)
    if isinstance(config, EDACConfig):
        loss = EDACLoss(actor, qvalue, eta=config.eta, **common)
        critic_keys = ("loss_qvalue", "loss_diversity")
    else:
        loss = SACNLoss(actor, qvalue, **common)
        critic_keys = ("loss_qvalue",)
    groups = _glue.actor_critic_groups(loss, config, *critic_keys)
    groups.append(_glue.group("alpha", [loss.log_alpha], config.alpha_lr, "loss_alpha"))
    return _glue.transition_parts(loss, DeterministicPolicy(actor), config, groups)


def build_sac_n(config: SACNConfig, data: Any):
    """Tanh-Gaussian actor, N vmapped critics, entropy temperature."""
    return _build(config, data, "sac-n")


def build_edac(config: EDACConfig, data: Any):
    """SAC-N's parts; the critics also minimise ``loss_diversity``."""
    return _build(config, data, "edac")


offline_plugins_register_algorithms = builtin_hook(
    builtin_algorithm(
        "sac-n", "SAC with N vmapped critics; the ensemble minimum penalises uncertain actions",
        SACNConfig, PAPER, loss="edac:SACNLoss", build="edac:build_sac_n",
    ),
    builtin_algorithm(
        "edac", "SAC-N plus a term that diversifies the critics' action gradients, so fewer critics suffice",
        EDACConfig, PAPER, loss="edac:EDACLoss", build="edac:build_edac",
    ),
)
