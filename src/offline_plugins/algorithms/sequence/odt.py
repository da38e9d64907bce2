"""Online Decision Transformer, offline phase: TorchRL's ``OnlineDTLoss`` on a stochastic DT.

Zheng, Zhang & Grover 2022, "Online Decision Transformer", arXiv:2202.05607. The
policy is a tanh-squashed Gaussian over actions; training maximises the likelihood of
the data's actions plus an entropy bonus whose temperature is tuned to a target
entropy of ``-action_dim``. This module trains the offline pre-training phase on the
same trajectory windows as ``dt`` (the online fine-tuning phase needs environment
interaction, which ``offline-plugins train`` does not do). Defaults are the paper's
gym pre-training settings (embedding 512, 4 layers, 4 heads, context 20 for training
and 5 for evaluation, lr 1e-4, weight decay 5e-4, initial temperature 0.1); the paper
uses the LAMB optimiser, we use Adam.
"""

from __future__ import annotations

from dataclasses import dataclass

from offline_plugins.algorithms.sequence import dt
from offline_plugins.algorithms.sequence.dt import DTConfig
from offline_plugins.config import config_field
from offline_plugins.plugins.registry import builtin_hook, builtin_sequence_model

__all__ = ["ODTConfig", "build"]

PAPER = "Zheng, Zhang & Grover 2022, Online Decision Transformer, arXiv:2202.05607"


@dataclass
class ODTConfig(DTConfig):
    embed_dim: int = config_field(512, "token width of the GPT")
    num_layers: int = config_field(4, "transformer blocks")
    num_heads: int = config_field(4, "attention heads per block")
    batch_size: int = config_field(5120, "steps per batch: windows x context_len (paper: 256 windows of 20)")
    weight_decay: float = config_field(5e-4, "weight decay")
    eval_context_len: int = config_field(5, "steps the evaluation policy conditions on")
    alpha_init: float = config_field(0.1, "initial entropy temperature")
    alpha_lr: float = config_field(1e-4, "learning rate of the log-temperature")


def build(config: ODTConfig, data):
    """Online DT's offline phase: stochastic DT actor, TorchRL's ``OnlineDTLoss``, rolling-context policy."""
    from torchrl.modules import ProbabilisticActor, TanhNormal

    from offline_plugins.algorithms import _glue
    from offline_plugins.modules.sequence.decision_transformer import (
        DecisionTransformerActor,
        StochasticDecisionTransformerNet,
    )
    from offline_plugins.objectives.common import check_range
    from offline_plugins.objectives.sequence.decision_transformer import OnlineDecisionTransformerLoss

    name = "odt"
    check_range(name, "alpha_init", config.alpha_init, 0.0, None)
    check_range(name, "eval_context_len", config.eval_context_len, 1, config.context_len, low_inclusive=True, high_inclusive=True)
    settings = dt.prepare(config, data, name)
    net = StochasticDecisionTransformerNet(_glue.obs_dim(data), _glue.action_dim(data), **settings["net_kwargs"])
    low, high = settings["action_bounds"]
    actor = ProbabilisticActor(
        DecisionTransformerActor(net, context_len=config.context_len, out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"],
        spec=data.action_spec,
        distribution_class=TanhNormal,
        distribution_kwargs={"low": low, "high": high},
    )
    loss = OnlineDecisionTransformerLoss(actor, alpha_init=config.alpha_init)
    alpha = _glue.group("alpha", [loss.log_alpha], config.alpha_lr, "loss_alpha")
    return dt.assemble(config, data, settings, net, loss, config.eval_context_len,
                       ("loss_log_likelihood", "loss_entropy"), [alpha])


offline_plugins_register_algorithms = builtin_hook(
    builtin_sequence_model(
        "odt", "Online Decision Transformer (offline phase): a stochastic DT with an entropy bonus",
        ODTConfig, PAPER, loss="decision_transformer:OnlineDecisionTransformerLoss", build="odt:build",
    ),
)
