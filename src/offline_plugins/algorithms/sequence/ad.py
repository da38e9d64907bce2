"""Algorithm Distillation: a causal transformer trained on learning histories acts as a learner in context.

Laskin et al. 2022, "In-context Reinforcement Learning with Algorithm Distillation",
arXiv:2210.14215. The data are a source learner's learning histories, one Minari
episode per task (the ``offline-plugins/bandit/histories-v0`` and
``offline-plugins/darkroom/histories-v0`` recipes); windows of ``context_len`` steps
span several of its episodes, and the model predicts the learner's action from
(observation, previous action, previous reward) tokens, with no return-to-go. At test
time the policy keeps its context across the episodes of a held-out task and improves
with no weight update; the dataset's evaluation env is that held-out family, whose
evaluation reports the mean return of each in-context episode
(``in_context_return_mean``). Defaults are sized for a CPU, not the paper's.

The learning-rate warm-up is Decision Transformer's (``dt.make_warmup_scheduler``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from offline_plugins.algorithms.sequence.dt import make_warmup_scheduler
from offline_plugins.config import ConfigError, config_field
from offline_plugins.plugins.registry import builtin_algorithm, builtin_hook

__all__ = ["ADConfig", "build", "add_previous_steps", "in_context_returns"]

PAPER = "Laskin et al. 2022, In-context Reinforcement Learning with Algorithm Distillation, arXiv:2210.14215"


@dataclass
class ADConfig:
    context_len: int = config_field(
        100, "steps of learning history the transformer sees, across episodes (bandit: all 100 pulls; dark room: 5 "
        "episodes of 20)"
    )
    batch_size: int = config_field(1000, "steps per batch: windows x context_len")
    embed_dim: int = config_field(64, "token width of the transformer")
    num_layers: int = config_field(2, "transformer blocks")
    num_heads: int = config_field(2, "attention heads per block")
    dropout: float = config_field(0.1, "dropout on embeddings, attention and residuals")
    lr: float = config_field(3e-4, "learning rate after warm-up")
    weight_decay: float = config_field(1e-4, "weight decay")
    warmup_steps: int = config_field(100, "linear learning-rate warm-up from lr/warmup_steps to lr")
    max_grad_norm: float = config_field(1.0, "clip the gradient to this norm")
    sample: bool = config_field(True, "the policy samples its action (as the learner explores); false: the argmax")
    drop_short_episodes: bool = config_field(False, "train on the histories of at least context_len steps only")


def add_previous_steps(data: Any, num_actions: int) -> None:
    """Add ``prev_action`` (int64 ``[N]``, ``num_actions`` at a history's start) and ``prev_reward``
    (``[N, 1]``, 0 there) to ``data.td`` (once)."""
    from offline_plugins.modules.sequence.algorithm_distillation import previous_steps

    td = data.td
    if td.get("prev_action", None) is None:
        action = td.get("action")
        action = action.argmax(-1) if action.ndim == 2 else action  # one-hot storage
        prev_a, prev_r = previous_steps(td.get("episode"), action, td.get(("next", "reward")), num_actions)
        td.set("prev_action", prev_a)
        td.set("prev_reward", prev_r)


def in_context_returns(policy, make_env, *, tasks: int = 10, seed: int = 0, device="cpu"):
    """``[tasks, episodes]`` numpy returns of each in-context episode of ``policy`` on ``tasks``
    tasks (``make_env``'s, reset with seeds ``seed, seed + 1, ...``), no weight update."""
    import numpy as np

    from offline_plugins.eval.rollout import evaluate_policy

    envs = []

    def make():
        envs.append(make_env())
        return envs[-1]

    evaluate_policy(policy, make, episodes=tasks, seed=seed, device=device)
    return np.asarray([env.unwrapped.episode_returns for env in envs])


def build(config: ADConfig, data: Any):
    """Algorithm Distillation on discrete actions: our causal transformer, its cross-entropy loss, the in-context policy."""
    from offline_plugins.algorithms import _glue
    from offline_plugins.algorithms.base import AlgorithmParts
    from offline_plugins.algorithms.sequence import _common
    from offline_plugins.modules.sequence.algorithm_distillation import (
        AlgorithmDistillationActor,
        AlgorithmDistillationNet,
        AlgorithmDistillationPolicy,
    )
    from offline_plugins.objectives.common import check_range
    from offline_plugins.objectives.sequence.algorithm_distillation import AlgorithmDistillationLoss

    _glue.check_inputs(config, data, "ad", "discrete")
    for field in ("embed_dim", "num_layers", "num_heads", "warmup_steps"):
        check_range("ad", field, getattr(config, field), 1, None, low_inclusive=True)
    check_range("ad", "dropout", config.dropout, 0.0, 1.0, low_inclusive=True)
    if config.embed_dim % config.num_heads:
        raise ConfigError(f"ad: embed_dim={config.embed_dim} must be a multiple of num_heads={config.num_heads}")
    K = int(config.context_len)
    _common.check_batch_windows(config, data, "ad", K, "context_len", 16, " (windows x steps)")
    n = _glue.num_actions(data)
    add_previous_steps(data, n)
    net = AlgorithmDistillationNet(_glue.obs_dim(data), n, embed_dim=config.embed_dim, num_layers=config.num_layers,
                                   num_heads=config.num_heads, dropout=config.dropout, context_len=K)
    loss = AlgorithmDistillationLoss(AlgorithmDistillationActor(net, context_len=K), diagnostics=True)
    stats = getattr(data, "stats", None)
    policy = AlgorithmDistillationPolicy(net, context_len=K, sample=config.sample,
                                         reward_scale=getattr(stats, "reward_scale", 1.0),
                                         reward_shift=getattr(stats, "reward_shift", 0.0))
    actor = _glue.group("actor", loss.actor_network_params, config.lr, "loss",
                        weight_decay=config.weight_decay, max_grad_norm=config.max_grad_norm,
                        decoupled_weight_decay=True)  # AdamW, as the reference
    return AlgorithmParts(loss=loss, policy=policy, optimizers=[actor],
                          lr_schedulers=[functools.partial(make_warmup_scheduler, warmup_steps=config.warmup_steps)])


offline_plugins_register_algorithms = builtin_hook(
    builtin_algorithm(
        "ad", "Algorithm Distillation: a transformer trained on learning histories that improves in context",
        ADConfig, PAPER, loss="sequence.algorithm_distillation:AlgorithmDistillationLoss", build="sequence.ad:build",
        family="sequence-model", data="trajectories", action_space="discrete",
    ),
)
