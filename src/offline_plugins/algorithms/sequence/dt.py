"""Decision Transformer: TorchRL's ``DTLoss`` on windows of the shared storage, our GPT, a rolling-context policy.

Chen et al. 2021, "Decision Transformer: Reinforcement Learning via Sequence
Modeling", arXiv:2106.01345. Defaults are the reference gym settings: context 20,
embedding 128, 3 layers, 1 head, dropout 0.1, 64 windows per batch, AdamW-like
lr 1e-4 with weight decay 1e-4, 10k linear warm-up steps, gradient norm 0.25,
returns-to-go divided by 1000 for locomotion.

The learning-rate warm-up is a factory in ``parts.lr_schedulers``:
``[factory(optimizer) -> torch.optim.lr_scheduler.LRScheduler]``, stepped once per
gradient step.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any, Optional

from offline_plugins.config import ConfigError, config_field
from offline_plugins.objectives.sequence.common import TargetReturnWarning
from offline_plugins.plugins.registry import builtin_hook, builtin_sequence_model

__all__ = ["DTConfig", "build", "prepare", "assemble", "warmup_factor", "make_warmup_scheduler", "auto_return_scale", "check_target_return"]

PAPER = "Chen et al. 2021, Decision Transformer: Reinforcement Learning via Sequence Modeling, arXiv:2106.01345"


@dataclass
class DTConfig:
    context_len: int = config_field(20, "steps K of (return-to-go, state, action) the transformer sees")
    batch_size: int = config_field(1280, "steps per batch: windows x context_len (reference: 64 windows of 20)")
    embed_dim: int = config_field(128, "token width of the GPT")
    num_layers: int = config_field(3, "transformer blocks")
    num_heads: int = config_field(1, "attention heads per block")
    dropout: float = config_field(0.1, "dropout on embeddings, attention and residuals")
    lr: float = config_field(1e-4, "learning rate after warm-up")
    weight_decay: float = config_field(1e-4, "weight decay")
    warmup_steps: int = config_field(10_000, "linear learning-rate warm-up from lr/warmup_steps to lr")
    max_grad_norm: float = config_field(0.25, "clip the gradient to this norm")
    max_ep_len: int = config_field(1000, "timesteps with their own embedding (later ones share the last)")
    return_scale: Optional[float] = config_field(
        None, "returns-to-go are divided by this (None: the power of ten below the largest |episode return|, 1000 for locomotion)"
    )
    target_return: Optional[float] = config_field(
        None, "return the policy conditions on, in environment units (None: the dataset's best episode return)"
    )
    drop_short_episodes: bool = config_field(False, "train on the episodes of at least context_len steps only")
    normalize_observations: bool = config_field(True, "standardise observations with dataset statistics (data layer)")


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Multiplier of the learning rate at ``step``: ``min(1, (step + 1) / warmup_steps)``.

    >>> [warmup_factor(s, 4) for s in (0, 1, 3, 10)]
    [0.25, 0.5, 1.0, 1.0]
    """
    return min(1.0, (step + 1) / max(1, warmup_steps))


def make_warmup_scheduler(optimizer, warmup_steps: int):
    """``LambdaLR`` with the linear warm-up of the reference implementation."""
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(warmup_factor, warmup_steps=warmup_steps))


def auto_return_scale(episode_returns) -> float:
    """The power of ten at or below the largest absolute episode return (1000 for MuJoCo locomotion).

    >>> auto_return_scale([-1500.0, -150.0]), auto_return_scale([3200.0]), auto_return_scale([0.5])
    (1000.0, 1000.0, 1.0)
    """
    biggest = max(abs(float(r)) for r in episode_returns)
    return float(10 ** math.floor(math.log10(biggest))) if biggest >= 1 else 1.0


def check_target_return(target: float, episode_returns, algorithm: str = "dt") -> None:
    """Warn (``TargetReturnWarning``) when ``target`` has the wrong sign or scale for the data's returns."""
    returns = [float(r) for r in episode_returns]
    best, worst = max(returns), min(returns)
    spread = max(best - worst, abs(best), 1e-8)
    data_range = f"the dataset's episode returns lie in [{worst:.4g}, {best:.4g}]"
    if target * best < 0:
        warnings.warn(
            f"{algorithm}: target_return={target:.4g} has the opposite sign of the dataset's best return ({best:.4g}); "
            f"{data_range}; use a target near the best return, e.g. --set target_return={best:.4g}",
            TargetReturnWarning,
            stacklevel=3,
        )
    elif target > best + spread or target < worst:
        warnings.warn(
            f"{algorithm}: target_return={target:.4g} is far outside the data: {data_range} "
            f"(is it in another reward scale?); the policy was never trained on returns-to-go like it; "
            f"use a target between the best return and twice it, e.g. --set target_return={best:.4g}",
            TargetReturnWarning,
            stacklevel=3,
        )


def prepare(config: DTConfig, data: Any, name: str) -> dict:
    """Check ``config`` against ``data``, add ``step_count`` to the storage, and resolve the
    automatic settings: ``net_kwargs``, ``action_bounds``, ``return_scale``, ``target_return``."""
    import torch

    from offline_plugins.algorithms import _glue
    from offline_plugins.algorithms.sequence import _common
    from offline_plugins.modules.networks import action_bounds
    from offline_plugins.objectives.common import check_range

    _glue.check_inputs(config, data, name, "continuous")
    for field in ("embed_dim", "num_layers", "num_heads", "warmup_steps", "max_ep_len"):
        check_range(name, field, getattr(config, field), 1, None, low_inclusive=True)
    check_range(name, "dropout", config.dropout, 0.0, 1.0, low_inclusive=True)
    if config.embed_dim % config.num_heads:
        raise ConfigError(f"{name}: embed_dim={config.embed_dim} must be a multiple of num_heads={config.num_heads}")
    K = int(config.context_len)
    _common.check_batch_windows(config, data, name, K, "context_len", 64, " (windows x steps)")
    _common.add_step_count(data)
    returns = torch.as_tensor(data.episode_returns).tolist()
    return_scale = float(config.return_scale) if config.return_scale is not None else auto_return_scale(returns)
    check_range(name, "return_scale", return_scale, 0.0, None)
    target = float(config.target_return) if config.target_return is not None else max(returns)
    check_target_return(target, returns, name)
    low, high = action_bounds(data.action_spec)
    net_kwargs = dict(
        embed_dim=config.embed_dim,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        dropout=config.dropout,
        context_len=K,
        max_ep_len=config.max_ep_len,
        return_scale=return_scale,
        action_low=low,
        action_high=high,
    )
    return {"net_kwargs": net_kwargs, "action_bounds": (low, high), "return_scale": return_scale, "target_return": target}


def assemble(config: DTConfig, data: Any, settings: dict, net, loss, context_len: int, loss_keys: tuple, groups=()):
    """The parts of a Decision Transformer: ``loss``; the rolling-context policy over ``net``, which
    conditions on ``context_len`` steps and :func:`prepare`'s ``settings["target_return"]``; the
    actor's optimiser (on ``loss_keys``, with ``config``'s weight decay and gradient clipping),
    then ``groups``; the learning-rate warm-up."""
    from offline_plugins.algorithms import _glue
    from offline_plugins.algorithms.base import AlgorithmParts
    from offline_plugins.modules.sequence.decision_transformer import DecisionTransformerPolicy

    stats = getattr(data, "stats", None)
    policy = DecisionTransformerPolicy(
        net,
        context_len=context_len,
        target_return=settings["target_return"],
        reward_scale=getattr(stats, "reward_scale", 1.0),
        reward_shift=getattr(stats, "reward_shift", 0.0),
    )
    actor = _glue.group("actor", loss.actor_network_params, config.lr, *loss_keys,
                        weight_decay=config.weight_decay, max_grad_norm=config.max_grad_norm,
                        decoupled_weight_decay=True)  # AdamW, as the reference
    return AlgorithmParts(
        loss=loss,
        policy=policy,
        optimizers=[actor, *groups],
        lr_schedulers=[functools.partial(make_warmup_scheduler, warmup_steps=config.warmup_steps)],
        extra={"target_return": settings["target_return"], "return_scale": settings["return_scale"]},
    )


def build(config: DTConfig, data: Any):
    """Decision Transformer on continuous actions: our GPT actor, TorchRL's ``DTLoss``, the rolling-context policy."""
    from offline_plugins.algorithms import _glue
    from offline_plugins.modules.sequence.decision_transformer import DecisionTransformerActor, DecisionTransformerNet
    from offline_plugins.objectives.sequence.decision_transformer import DecisionTransformerLoss

    settings = prepare(config, data, "dt")
    K = int(config.context_len)
    net = DecisionTransformerNet(_glue.obs_dim(data), _glue.action_dim(data), **settings["net_kwargs"])
    loss = DecisionTransformerLoss(DecisionTransformerActor(net, context_len=K), diagnostics=True)
    # the actor reads the data's "action" as tokens, so it writes its prediction beside it
    loss.set_keys(action_pred="action_pred")
    return assemble(config, data, settings, net, loss, K, ("loss",))


offline_plugins_register_algorithms = builtin_hook(
    builtin_sequence_model(
        "dt", "Decision Transformer: a GPT over (return-to-go, state, action) that acts by conditioning on a return",
        DTConfig, PAPER, loss="decision_transformer:DecisionTransformerLoss", build="dt:build",
    ),
)
