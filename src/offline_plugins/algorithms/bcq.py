"""BCQ, continuous and discrete: our losses, networks and optimiser groups.

Continuous: Fujimoto, Meger & Precup 2019, arXiv:1812.02900 (defaults from the
paper's code, except the suite-wide batch of 256; the paper used 100). Discrete:
Fujimoto, Conti, Ghavamzadeh & Pineau 2019, arXiv:1910.01708 (its non-Atari settings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from offline_plugins.config import TDConfig, config_field
from offline_plugins.plugins.registry import builtin_algorithm, builtin_hook

PAPER = "Fujimoto, Meger & Precup 2019, Off-Policy Deep Reinforcement Learning without Exploration, arXiv:1812.02900"
PAPER_DISCRETE = (
    "Fujimoto, Conti, Ghavamzadeh & Pineau 2019, Benchmarking Batch Deep Reinforcement Learning Algorithms, "
    "arXiv:1910.01708"
)


@dataclass
class BCQConfig(TDConfig):
    actor_lr: float = config_field(1e-3, "Adam learning rate of the perturbation model")
    critic_lr: float = config_field(1e-3, "Adam learning rate of the twin critics")
    vae_lr: float = config_field(1e-3, "Adam learning rate of the conditional VAE")
    batch_size: int = config_field(256, "transitions per gradient step (the paper used 100)")
    hidden: tuple = config_field((400, 300), "hidden layer widths of the perturbation model and critics")
    vae_hidden: tuple = config_field((750, 750), "hidden layer widths of the VAE encoder and decoder")
    phi: float = config_field(0.05, "perturbation bound Phi, as a fraction of the action range's half-width")
    lmbda: float = config_field(0.75, "weight of the critics' minimum in the soft clipped double-Q target, in [0, 1]")
    num_samples: int = config_field(10, "VAE samples per next state in the backup")
    eval_samples: int = config_field(100, "VAE samples per state when acting")
    kl_weight: float = config_field(0.5, "weight of the VAE's KL term")


@dataclass
class DiscreteBCQConfig(TDConfig):
    lr: float = config_field(3e-4, "Adam learning rate of the Q network and the behaviour classifier")
    threshold: float = config_field(0.3, "allow actions with G(a|s) / max G > threshold, in [0, 1)")
    logit_reg: float = config_field(1e-2, "L2 penalty on the classifier's logits")


def build(config: BCQConfig, data: Any):
    """VAE behaviour model, perturbation model and twin critics, each with its optimiser."""
    from offline_plugins.algorithms import _glue
    from offline_plugins.modules import networks
    from offline_plugins.objectives.bcq import BCQLoss, BCQPolicy
    from offline_plugins.objectives.common import check_range

    _glue.check_inputs(config, data, "bcq", "continuous")
    check_range("bcq", "phi", config.phi, 0.0, None, low_inclusive=True)
    check_range("bcq", "eval_samples", config.eval_samples, 1, None, low_inclusive=True)
    n_obs, hidden = _glue.obs_dim(data), tuple(config.hidden)
    loss = BCQLoss(
        networks.make_perturbation(n_obs, data.action_spec, hidden, phi=config.phi),
        networks.make_qvalue(n_obs, _glue.action_dim(data), hidden),
        networks.make_vae(n_obs, data.action_spec, tuple(config.vae_hidden)),
        lmbda=config.lmbda,
        num_samples=config.num_samples,
        kl_weight=config.kl_weight,
        columns=_glue.mc_columns(data, config.gamma),  # the diagnostics' mc_return, discounted at gamma
    )
    groups = [_glue.group("vae", loss.vae_network_params, config.vae_lr, "loss_vae")]
    policy = BCQPolicy(loss, num_samples=config.eval_samples)
    return _glue.transition_parts(loss, policy, config, groups + _glue.actor_critic_groups(loss, config))


def build_discrete(config: DiscreteBCQConfig, data: Any):
    """Q network and behaviour classifier (separate MLPs), Polyak-averaged target Q."""
    from tensordict.nn import TensorDictModule

    from offline_plugins.algorithms import _glue
    from offline_plugins.modules import networks
    from offline_plugins.objectives.bcq import DiscreteBCQLoss, DiscreteBCQPolicy

    _glue.check_inputs(config, data, "bcq-discrete", "discrete")
    n_obs, n, hidden = _glue.obs_dim(data), _glue.num_actions(data), tuple(config.hidden)
    qnet = TensorDictModule(networks.mlp(n_obs, n, hidden), ["observation"], ["action_value"])
    classifier = TensorDictModule(networks.mlp(n_obs, n, hidden), ["observation"], ["imitation_logits"])
    loss = DiscreteBCQLoss(qnet, classifier, threshold=config.threshold, logit_reg=config.logit_reg,
                           columns=_glue.mc_columns(data, config.gamma))
    groups = [
        _glue.group("critic", loss.value_network_params, config.lr, "loss_qvalue"),
        _glue.group("imitation", loss.imitation_network_params, config.lr, "loss_imitation"),
    ]
    return _glue.transition_parts(loss, DiscreteBCQPolicy(loss), config, groups)


offline_plugins_register_algorithms = builtin_hook(
    builtin_algorithm(
        "bcq", "Batch-Constrained Q-learning: VAE behaviour model, perturbation model, twin critics",
        BCQConfig, PAPER, loss="bcq:BCQLoss", build="bcq:build",
    ),
    builtin_algorithm(
        "bcq-discrete", "Discrete BCQ: double DQN restricted to actions a behaviour classifier deems likely",
        DiscreteBCQConfig, PAPER_DISCRETE, loss="bcq:DiscreteBCQLoss", build="bcq:build_discrete", action_space="discrete",
    ),
)
