"""Diffuser: a temporal U-Net denoising (action, state) windows, a return model, value-guided inpainting plans.

Janner, Du, Tenenbaum & Levine 2022, "Planning with Diffusion for Flexible Behavior
Synthesis", arXiv:2205.09991. Training defaults are the reference's locomotion
settings (horizon 32, 20 diffusion steps, U-Net width 32, lr 2e-4, 32 windows per
batch, first-action weight 10, EMA decay 0.995, discount 0.99, termination penalty
-100, a denoiser that predicts the clean window) with a smaller U-Net (multipliers
(1, 2, 4): 1.0M parameters, not (1, 2, 4, 8): 3.7M), so that 5000 steps train in
about 7 minutes on one CPU core.

The planner's defaults are unguided: one plan per step, no value guidance. On
Pendulum medium (2000 steps, seed 0, 10 episodes) the unguided planner scored 47.2,
16 plans ranked by the return model 39.9, and 16 plans guided with the reference's
scale 0.1 16.1 at 14 times the planning time. The return model is still trained, so
guidance is a ``--set`` away; the reference's planner and sizes are
``--set dim_mults=[1,2,4,8] --set n_samples=64 --set guide_scale=0.1`` (a GPU's work).

For goal-reaching data (an env that declares its goal: the point maze of
``offline_plugins.envs.maze``) every plan also ends at the goal: the position part of
the last planned state is inpainted with it at every denoising step, and the training
windows with their own last position, as the reference's maze2d planner does (section
5.1); ``goal_inpainting=false`` plans from the start only. The planner still executes
the first planned action and replans every step: the reference's maze2d code plans once
and follows the planned states with a PD controller, which needs to know that the
observation is (position, velocity) and the action a force; the planned action keeps
the planner the same for every env, and replanning corrects what the action misses.

The return model regresses the standardised target ``(G - mean) / std`` (the data's
discounted returns' statistics, kept as buffers); the planner reads its values back in
return units.

The denoiser predicts the clean window, as the reference does for locomotion: at
these budgets a noise-predicting denoiser (``predict_epsilon=true``) has not learnt
the data's actions (Pendulum medium, 1000 steps: its unguided first action is as far
from the data's as answering 0, 1.19 against 1.26; the clean-window one's scores as BC).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from offline_plugins.config import ConfigError, config_field
from offline_plugins.plugins.registry import builtin_hook, builtin_sequence_model

__all__ = ["DiffuserConfig", "build"]

PAPER = "Janner, Du, Tenenbaum & Levine 2022, Planning with Diffusion for Flexible Behavior Synthesis, arXiv:2205.09991"


@dataclass
class DiffuserConfig:
    slice_len: int = config_field(32, "planning horizon = steps per training window")
    batch_size: int = config_field(1024, "steps per batch: windows x slice_len (reference: 32 windows of 32)")
    n_diffusion_steps: int = config_field(20, "denoising steps")
    dim: int = config_field(32, "channels of the U-Net's first level")
    dim_mults: tuple = config_field((1, 2, 4), "channel multiplier per U-Net level (reference: [1, 2, 4, 8]; slice_len must divide by 2^(levels-1))")
    lr: float = config_field(2e-4, "learning rate of the denoiser")
    value_lr: float = config_field(2e-4, "learning rate of the return model")
    action_weight: float = config_field(10.0, "loss weight of the first step's action")
    predict_epsilon: bool = config_field(False, "the denoiser predicts the noise (false: the clean window, the reference; learns far faster)")
    ema_tau: float = config_field(0.005, "the planner uses an average of the denoiser: target <- (1 - tau) target + tau online (0: none)")
    gamma: float = config_field(0.99, "discount of the return model's target")
    termination_penalty: float = config_field(-100.0, "added to the reward of terminal steps in the return target")
    n_samples: int = config_field(1, "plans sampled per action, the best by the return model acts (reference: 64)")
    guide_scale: float = config_field(0.0, "step size of the value guidance (0: unguided, the default here; reference: 0.1)")
    n_guide_steps: int = config_field(2, "guidance steps per denoising step")
    t_stopgrad: int = config_field(2, "no guidance at the last t_stopgrad denoising steps")
    clip_denoised: bool = config_field(True, "clip each reverse step's predicted clean plan to the data's range per channel (the reference's clip_denoised)")
    plan_every: int = config_field(1, "plan every k-th step, executing the best plan's actions in between (1: the reference)")
    drop_short_episodes: bool = config_field(False, "train on the episodes of at least slice_len steps only")
    normalize_observations: bool = config_field(True, "standardise observations with dataset statistics (data layer)")
    goal_inpainting: bool = config_field(True, "where the dataset declares a goal (the point maze), every plan ends at its position: inpainted at the last step (false: the start only)")


def build(config: DiffuserConfig, data: Any):
    """Diffuser on continuous actions: denoiser, return model, and the guided planner as policy."""
    import torch
    from tensordict.nn import TensorDictModule, TensorDictSequential

    from offline_plugins.algorithms import _glue
    from offline_plugins.algorithms.base import AlgorithmParts
    from offline_plugins.algorithms.sequence import _common
    from offline_plugins.envs.maze import maze_goal
    from offline_plugins.modules.sequence.diffuser import DiffuserPlanner
    from offline_plugins.modules.sequence.diffusion import DDPMSchedule
    from offline_plugins.modules.sequence.unet import TemporalUnet, ValueUnet
    from offline_plugins.objectives.common import check_range
    from offline_plugins.objectives.sequence.diffuser import (
        Affine,
        DiffuserLoss,
        DiffuserValueLoss,
        DiffuserWithValueLoss,
        GoalInpaintingPlanner,
    )

    name = "diffuser"
    _glue.check_inputs(config, data, name, "continuous")
    for field in ("n_diffusion_steps", "dim", "n_samples"):
        check_range(name, field, getattr(config, field), 1, None, low_inclusive=True)
    for field in ("n_guide_steps", "t_stopgrad"):
        check_range(name, field, getattr(config, field), 0, None, low_inclusive=True)
    check_range(name, "plan_every", config.plan_every, 1, config.slice_len, low_inclusive=True, high_inclusive=True)
    check_range(name, "ema_tau", config.ema_tau, 0.0, 1.0, low_inclusive=True, high_inclusive=True)
    mults = tuple(int(m) for m in config.dim_mults)
    if not mults or min(mults) < 1:
        raise ConfigError(f"{name}: dim_mults={mults} must be positive multipliers, e.g. [1, 2, 4, 8]")
    H = int(config.slice_len)
    stride = 2 ** (len(mults) - 1)
    if H % stride:
        raise ConfigError(
            f"{name}: slice_len={H} must be divisible by {stride} (the U-Net halves it {len(mults) - 1} times); "
            f"use --set slice_len={max(stride, H // stride * stride)} or fewer dim_mults"
        )
    _common.check_batch_windows(config, data, name, H, "slice_len", 32)
    _common.add_discounted_return(data, config.gamma, config.termination_penalty)

    S, A = _glue.obs_dim(data), _glue.action_dim(data)
    table = torch.cat([data.td.get("action").to(torch.float32), data.td.get("observation")], -1)
    loc, scale = table.mean(0), table.std(0).clamp_min(1e-3)
    goal = maze_goal(data.env_id) if config.goal_inpainting else None
    G = 0 if goal is None else len(goal)
    returns = data.td.get("discounted_return_to_go")
    value_loc, value_scale = returns.mean(), returns.std().clamp_min(1e-6)
    schedule = DDPMSchedule(config.n_diffusion_steps)
    keys = ["noisy_trajectory", "diffusion_step"]
    denoiser = TensorDictModule(TemporalUnet(S + A, dim=config.dim, dim_mults=mults), keys, ["model_output"])
    value = TensorDictModule(ValueUnet(S + A, dim=config.dim, dim_mults=mults), keys, ["value"])
    ema = config.ema_tau > 0
    diffusion_loss = DiffuserLoss(
        denoiser,
        schedule,
        window=H,
        loc=loc,
        scale=scale,
        action_weight=config.action_weight,
        predict_epsilon=config.predict_epsilon,
        ema=ema,
        goal_dims=G,
    )
    value_loss = DiffuserValueLoss(value, schedule, window=H, loc=loc, scale=scale, goal_dims=G,
                                   value_loc=value_loc, value_scale=value_scale)
    loss = DiffuserWithValueLoss(diffusion_loss, value_loss)
    # made before the planner touches the target parameters, which TorchRL warns about otherwise
    target_updater = _glue.soft_updater(diffusion_loss, config.ema_tau) if ema else None
    # the goal in the units the planner reads observations in (the data layer's normalisation)
    st, planner_kwargs = data.stats, {}
    if goal is not None:
        planner_kwargs["goal"] = (torch.as_tensor(goal, dtype=torch.float32) - st.obs_loc[:G]) / st.obs_scale[:G]
    planner = (DiffuserPlanner if goal is None else GoalInpaintingPlanner)(
        denoiser,
        TensorDictSequential(value, TensorDictModule(Affine(value_loc, value_scale), ["value"], ["value"])),
        schedule,
        observation_dim=S,
        action_dim=A,
        horizon=H,
        loc=loc,
        scale=scale,
        low=table.amin(0) if config.clip_denoised else None,
        high=table.amax(0) if config.clip_denoised else None,
        n_samples=config.n_samples,
        guide_scale=config.guide_scale,
        n_guide_steps=config.n_guide_steps,
        t_stopgrad=config.t_stopgrad,
        plan_every=config.plan_every,
        predict_epsilon=config.predict_epsilon,
        denoiser_params=diffusion_loss.target_model_network_params if ema else None,
        **planner_kwargs,
    )
    return AlgorithmParts(
        loss=loss,
        policy=planner,
        optimizers=[
            _glue.group("diffusion", diffusion_loss.model_network_params, config.lr, "loss_diffusion"),
            _glue.group("value", value_loss.value_network_params, config.value_lr, "loss_value"),
        ],
        target_updater=target_updater,
        extra={"planner": planner},
    )


offline_plugins_register_algorithms = builtin_hook(
    builtin_sequence_model(
        "diffuser", "Diffuser: a temporal U-Net denoises (action, state) plans, guided by a return model",
        DiffuserConfig, PAPER, loss="diffuser:DiffuserWithValueLoss", build="diffuser:build",
        experimental="unguided it imitates the data (51.6 +- 2.9 on Pendulum medium, above BC), but return "
                     "guidance makes plans worse, it gains nothing by planning on medium-replay, and its goal-inpainted "
                     "plans do not solve the point maze at 3000 steps (docs/results-history.md, 'Sequence models' and "
                     "the maze section)",
    ),
)
