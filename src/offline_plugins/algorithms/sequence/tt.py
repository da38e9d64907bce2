"""Trajectory Transformer: discretised (s, a, r, V) windows, token cross-entropy, beam-search planning.

Janner, Li & Levine 2021, "Offline Reinforcement Learning as One Big Sequence
Modeling Problem", arXiv:2106.02039. Training defaults follow the reference (100
quantile bins per dimension, windows of 10 transitions, 4 heads, lr 6e-4, action
tokens weighted 5, discount 0.99, termination penalty -100) at a size one CPU core
trains in minutes: GPT width 64 with 2 layers (reference: 128, 4), 64 windows per
batch (reference: 256) and 100 warm-up steps (reference: 1000); 5000 steps take about
7 minutes of training on one core. Planning defaults are smaller than the reference's
(beam 128, horizon 15, context 5). The reference's sizes, for a GPU:
``--set embed_dim=128 --set num_layers=4 --set batch_size=2560 --set warmup_steps=1000
--set beam_width=128 --set horizon=15 --set max_context_transitions=5`` (a plan longer
than the training window re-reads a cropped window at every token, as the reference
does, instead of using the key/value cache).

Weight decay 0.1 applies to the weight matrices only (minGPT's grouping, which the
reference uses); the learning-rate warm-up is a factory in
``parts.lr_schedulers``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from offline_plugins.algorithms.sequence.dt import make_warmup_scheduler
from offline_plugins.config import config_field
from offline_plugins.plugins.registry import builtin_hook, builtin_sequence_model

__all__ = ["TTConfig", "build"]

PAPER = "Janner, Li & Levine 2021, Offline Reinforcement Learning as One Big Sequence Modeling Problem, arXiv:2106.02039"


@dataclass
class TTConfig:
    slice_len: int = config_field(10, "transitions per training window")
    batch_size: int = config_field(640, "steps per batch: windows x slice_len (reference: 2560, 256 windows of 10)")
    bins: int = config_field(100, "tokens per dimension")
    discretizer: str = config_field("quantile", "bin edges per dimension: 'quantile' (equal mass) or 'uniform' (equal width)")
    max_bin_error: float = config_field(0.1, "refuse bins whose median round-trip error exceeds this many standard deviations")
    embed_dim: int = config_field(64, "token width of the GPT (reference: 128)")
    num_layers: int = config_field(2, "transformer blocks (reference: 4)")
    num_heads: int = config_field(4, "attention heads per block")
    dropout: float = config_field(0.1, "dropout on embeddings, attention and residuals")
    lr: float = config_field(6e-4, "learning rate after warm-up")
    weight_decay: float = config_field(0.1, "AdamW's decoupled weight decay of the weight matrices (not biases, norms, "
                                       "embeddings)")
    adam_beta2: float = config_field(0.95, "Adam's second-moment decay (the reference's minGPT: 0.95)")
    decoupled_weight_decay: bool = config_field(True, "AdamW's decoupled decay (the reference); false: Adam's L2 term "
                                                "added to the gradient (the package before session 17)")
    warmup_steps: int = config_field(100, "linear learning-rate warm-up steps (reference: 1000)")
    max_grad_norm: float = config_field(1.0, "clip the gradient to this norm")
    action_weight: float = config_field(5.0, "cross-entropy weight of action tokens")
    reward_weight: float = config_field(1.0, "cross-entropy weight of reward tokens")
    value_weight: float = config_field(1.0, "cross-entropy weight of value tokens")
    gamma: float = config_field(0.99, "discount of the value tokens and of planning")
    termination_penalty: float = config_field(-100.0, "added to the reward of terminal steps")
    horizon: int = config_field(5, "planned transitions per action (reference: 15)")
    beam_width: int = config_field(32, "plans kept per planning step (reference: 128)")
    n_expand: int = config_field(2, "samples per plan per planning step")
    max_context_transitions: int = config_field(3, "transitions the model sees while planning (reference: 5)")
    cdf_act: float = config_field(0.6, "probability mass of the least likely action tokens dropped while planning")
    plan_every: int = config_field(1, "plan every k-th step, executing the best plan's actions in between (1: the reference)")
    drop_short_episodes: bool = config_field(False, "train on the episodes of at least slice_len steps only")
    normalize_observations: bool = config_field(False, "standardise observations (no need: bins are per dimension)")


def _decay_split(module):
    """minGPT's split: Linear weights and the per-dimension heads decay; the rest does not."""
    import torch

    decay, no_decay = [], []
    names = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Linear)}
    for pname, p in module.named_parameters():
        if not p.requires_grad:
            continue
        (decay if id(p) in names or pname.endswith("head_weight") else no_decay).append(p)
    return decay, no_decay


def build(config: TTConfig, data: Any):
    """Trajectory Transformer on continuous actions."""
    import torch
    from tensordict.nn import TensorDictModule

    from offline_plugins.algorithms import _glue
    from offline_plugins.algorithms.base import AlgorithmParts
    from offline_plugins.algorithms.sequence import _common
    from offline_plugins.modules.sequence.discretizer import Discretizer
    from offline_plugins.modules.sequence.trajectory_transformer import (
        TrajectoryTransformerNet,
        TrajectoryTransformerPlanner,
    )
    from offline_plugins.objectives.common import check_range
    from offline_plugins.objectives.sequence.trajectory_transformer import TrajectoryTransformerLoss

    name = "tt"
    _glue.check_inputs(config, data, name, "continuous")
    for field in ("embed_dim", "num_layers", "num_heads", "horizon", "beam_width", "n_expand", "max_context_transitions", "warmup_steps"):
        check_range(name, field, getattr(config, field), 1, None, low_inclusive=True)
    check_range(name, "plan_every", config.plan_every, 1, config.horizon, low_inclusive=True, high_inclusive=True)
    check_range(name, "cdf_act", config.cdf_act, 0.0, 1.0, low_inclusive=True)
    check_range(name, "max_bin_error", config.max_bin_error, 0.0, None)
    K = int(config.slice_len)
    _common.check_batch_windows(config, data, name, K, "slice_len", 256)
    _common.add_discounted_return(data, config.gamma, config.termination_penalty)

    S, A = _glue.obs_dim(data), _glue.action_dim(data)
    td = data.td
    reward = td.get(("next", "reward")) + config.termination_penalty * td.get(("next", "terminated")).to(torch.float32)
    table = torch.cat([td.get("observation"), td.get("action").to(torch.float32), reward, td.get("discounted_return_to_go")], -1)
    discretizer = Discretizer.fit(table, config.bins, config.discretizer)
    names = [f"observation[{i}]" for i in range(S)] + [f"action[{i}]" for i in range(A)] + ["reward", "value"]
    discretizer.check_resolution(table, names, config.max_bin_error)

    net = TrajectoryTransformerNet(
        S + A + 2,
        config.bins,
        embed_dim=config.embed_dim,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        dropout=config.dropout,
        max_transitions=max(K, config.max_context_transitions),
    )
    loss = TrajectoryTransformerLoss(
        TensorDictModule(net, ["tokens"], ["logits"]),
        discretizer,
        window=K,
        action_weight=config.action_weight,
        reward_weight=config.reward_weight,
        value_weight=config.value_weight,
        termination_penalty=config.termination_penalty,
    )
    stats = getattr(data, "stats", None)
    planner = TrajectoryTransformerPlanner(
        net,
        discretizer,
        S,
        A,
        horizon=config.horizon,
        beam_width=config.beam_width,
        n_expand=config.n_expand,
        max_context_transitions=config.max_context_transitions,
        discount=config.gamma,
        cdf_act=config.cdf_act,
        plan_every=config.plan_every,
        reward_scale=getattr(stats, "reward_scale", 1.0),
        reward_shift=getattr(stats, "reward_shift", 0.0),
    )
    decay, no_decay = _decay_split(net)
    return AlgorithmParts(
        loss=loss,
        policy=planner,
        optimizers=[
            # AdamW as the reference's minGPT: decay decoupled from the gradient, on weight matrices only
            _glue.group("model", decay, config.lr, "loss_model", weight_decay=config.weight_decay,
                        max_grad_norm=config.max_grad_norm, betas=(0.9, config.adam_beta2),
                        decoupled_weight_decay=bool(config.decoupled_weight_decay)),
            _glue.group("model_no_decay", no_decay, config.lr, "loss_model", max_grad_norm=config.max_grad_norm,
                        betas=(0.9, config.adam_beta2)),
        ],
        lr_schedulers=[functools.partial(make_warmup_scheduler, warmup_steps=config.warmup_steps)],
        extra={"planner": planner},
    )


offline_plugins_register_algorithms = builtin_hook(
    builtin_sequence_model(
        "tt", "Trajectory Transformer: a GPT over discretised (s, a, r, V) tokens, acting by beam-search planning",
        TTConfig, PAPER, loss="trajectory_transformer:TrajectoryTransformerLoss", build="tt:build",
        experimental="on Pendulum medium it scores 44.1 +- 2.0 over 3 seeds, level with a plain reference's 46.9 "
                     "+- 0.2 and BC's 41.1, and gains nothing by planning on medium-replay (docs/algorithms/tt.md, "
                     "'The gap to the plain reference')",
    ),
)
