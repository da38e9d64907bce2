"""Diffuser losses: the DDPM denoising loss on (action, state) windows and the return model's regression.

Janner, Du, Tenenbaum & Levine 2022, "Planning with Diffusion for Flexible Behavior
Synthesis", arXiv:2205.09991. TorchRL has no diffusion planner. A window of ``H``
steps is the array ``[a_t, s_t]`` of shape ``[H, act_dim + obs_dim]`` (actions
first, as in the reference), standardised per dimension with the dataset's
statistics. As in the reference, the first state of the noised window is replaced
by its clean value (the planner conditions on it the same way); for goal-reaching
data (``goal_dims``) the first entries of the last state too (the reference's maze2d
conditions both ends of the plan).

>>> import torch
>>> from tensordict import TensorDict
>>> from tensordict.nn import TensorDictModule
>>> from offline_plugins.modules.sequence.diffusion import DDPMSchedule
>>> from offline_plugins.modules.sequence.unet import TemporalUnet, ValueUnet
>>> batch = TensorDict({"observation": torch.randn(16, 3), "action": torch.randn(16, 1),
...     "discounted_return_to_go": torch.randn(16, 1)}, [16])
>>> sched = DDPMSchedule(10)
>>> denoiser = TensorDictModule(TemporalUnet(4, dim=8, dim_mults=(1, 2)), ["noisy_trajectory", "diffusion_step"], ["model_output"])
>>> value = TensorDictModule(ValueUnet(4, dim=8, dim_mults=(1, 2)), ["noisy_trajectory", "diffusion_step"], ["value"])
>>> loss = DiffuserWithValueLoss(DiffuserLoss(denoiser, sched, window=8), DiffuserValueLoss(value, sched, window=8))
>>> out = loss(batch)  # two windows of 8 steps
>>> sorted(k for k in out.keys() if k.startswith("loss_"))
['loss_diffusion', 'loss_value']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import TensorDict, TensorDictBase, TensorDictParams
from tensordict.nn import TensorDictModule
from tensordict.utils import NestedKey
from torchrl.objectives import LossModule

from offline_plugins.modules.sequence.decision_transformer import windows
from offline_plugins.modules.sequence.diffuser import DiffuserPlanner
from offline_plugins.modules.sequence.diffusion import DDPMSchedule
from offline_plugins.objectives.common import check_batch_keys, check_range

__all__ = ["DiffuserLoss", "DiffuserValueLoss", "DiffuserWithValueLoss", "trajectory_windows", "apply_conditioning",
           "Affine", "GoalInpaintingPlanner"]


def trajectory_windows(tensordict: TensorDictBase, window: int, keys, loc, scale, owner: str) -> torch.Tensor:
    """``[B, H, act_dim + obs_dim]`` standardised ``[action, observation]`` windows of a batch."""
    w = windows(tensordict, window, owner)
    x = torch.cat([w.get(keys.action).to(torch.float32), w.get(keys.observation)], -1)
    if loc is not None:
        x = (x - loc) / scale
    return x


def apply_conditioning(
    x: torch.Tensor, first_state: torch.Tensor, action_dim: int, last: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``x`` with its first state set to ``first_state`` (inpainting: the plan starts where the agent is)
    and, given ``last`` ``[..., G]``, the first ``G`` entries of its last state set to it (where the plan ends)."""
    x = x.clone()
    x[:, 0, action_dim:] = first_state
    if last is not None:
        x[:, -1, action_dim : action_dim + last.shape[-1]] = last
    return x


class Affine(torch.nn.Module):
    """``x * scale + loc`` with ``loc`` and ``scale`` as buffers: un-standardises a network's output."""

    def __init__(self, loc, scale) -> None:
        super().__init__()
        self.register_buffer("loc", torch.as_tensor(loc, dtype=torch.float32))
        self.register_buffer("scale", torch.as_tensor(scale, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.loc


class GoalInpaintingPlanner(DiffuserPlanner):
    """Diffuser's planner for goal-reaching data: every plan starts at the current state and ends at the goal.

    As the reference's maze2d planner (Janner et al. 2022, section 5.1), after every
    denoising update the first ``len(goal)`` observation entries of the last planned
    state (the position) are set to ``goal``, as the first state is set to the current
    one; it acts as :class:`~offline_plugins.modules.sequence.diffuser.DiffuserPlanner`
    does. Lives beside the losses, whose :func:`apply_conditioning` it shares.

    Args:
        *args, **kwargs: as :class:`~offline_plugins.modules.sequence.diffuser.DiffuserPlanner`.

    Keyword Args:
        goal: ``[G]`` the goal's first ``G`` observation entries, in the units the planner
            reads observations in (standardised here with ``loc``/``scale`` as the plans are).
    """

    def __init__(self, *args, goal: torch.Tensor, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        A, G = self.act_dim, len(goal)
        goal = torch.as_tensor(goal, dtype=torch.float32)
        self.register_buffer("goal", (goal - self.loc[A : A + G]) / self.scale[A : A + G])

    def _condition(self, x: torch.Tensor, first_state: torch.Tensor) -> torch.Tensor:
        return apply_conditioning(x, first_state, self.act_dim, self.goal.expand(x.shape[0], -1))


class _WindowLoss(LossModule):
    """What both Diffuser losses share: keys, normalisation, conditioning on the first state."""

    @dataclass
    class _AcceptedKeys:
        """Keys the loss reads; rename them with ``set_keys``.

        Attributes:
            observation: Defaults to ``"observation"``.
            action: Defaults to ``"action"``.
            value: the discounted return-to-go (return model only).
                Defaults to ``"discounted_return_to_go"``.
        """

        observation: NestedKey = "observation"
        action: NestedKey = "action"
        value: NestedKey = "discounted_return_to_go"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys

    def _init_common(self, schedule: DDPMSchedule, window: int, loc, scale, goal_dims: int) -> None:
        check_range(type(self).__name__, "window", window, 1, None, low_inclusive=True)
        check_range(type(self).__name__, "goal_dims", goal_dims, 0, None, low_inclusive=True)
        self.schedule = schedule
        self.window = int(window)
        self.goal_dims = int(goal_dims)
        self.register_buffer("loc", None if loc is None else torch.as_tensor(loc, dtype=torch.float32))
        self.register_buffer("scale", None if scale is None else torch.as_tensor(scale, dtype=torch.float32))

    def _forward_value_estimator_keys(self, **kwargs) -> None:
        pass

    def _noised(self, tensordict: TensorDictBase, required) -> tuple:
        check_batch_keys(tensordict, required, type(self).__name__)
        x0 = trajectory_windows(tensordict, self.window, self.tensor_keys, self.loc, self.scale, type(self).__name__)
        act_dim = tensordict.get(self.tensor_keys.action).shape[-1]
        t = torch.randint(0, self.schedule.steps, (x0.shape[0],), device=x0.device)
        noise = torch.randn_like(x0)
        return x0, self._condition(self.schedule.q_sample(x0, t, noise), x0, act_dim), t, noise, act_dim

    def _condition(self, x: torch.Tensor, x0: torch.Tensor, act_dim: int) -> torch.Tensor:
        last = x0[:, -1, act_dim : act_dim + self.goal_dims] if self.goal_dims else None
        return apply_conditioning(x, x0[:, 0, act_dim:], act_dim, last)


class DiffuserLoss(_WindowLoss):
    """DDPM loss of a trajectory denoiser: weighted MSE of the predicted noise (or clean window).

    Args:
        denoiser_network: reads ``"noisy_trajectory"`` ``[B, H, C]`` and ``"diffusion_step"``
            ``[B]``, writes ``"model_output"`` ``[B, H, C]``
            (:class:`~offline_plugins.modules.sequence.unet.TemporalUnet`).
        schedule: the :class:`~offline_plugins.modules.sequence.diffusion.DDPMSchedule`.

    Keyword Args:
        window: steps ``H`` per window (flat ``[B*H]`` batches are reshaped).
        loc, scale: per-dimension standardisation of ``[action, observation]`` (None: none).
        action_weight: weight of the first step's action in the loss (reference: 10;
            it is the action the planner executes).
        predict_epsilon: the network predicts the noise (``True``, Ho et al.) or the
            clean window (``False``, the default and the reference's locomotion setting;
            a clean-window denoiser's first action learns the data's far sooner).
            A clean-window prediction has its first state inpainted before the loss,
            as the reference does, so only what the planner uses is fitted.
        ema: keep target parameters for an exponential moving average of the denoiser
            (stepped by TorchRL's ``SoftUpdate``; the reference plans with the average).
        goal_dims: the first ``goal_dims`` observation entries of the window's last step are
            inpainted too (goal-conditioned planning: the position in a maze; 0: the first state only).
    """

    model_network: TensorDictModule
    model_network_params: TensorDictParams
    target_model_network_params: TensorDictParams

    def __init__(
        self,
        denoiser_network: TensorDictModule,
        schedule: DDPMSchedule,
        *,
        window: int,
        loc: Optional[torch.Tensor] = None,
        scale: Optional[torch.Tensor] = None,
        action_weight: float = 10.0,
        predict_epsilon: bool = False,
        ema: bool = False,
        goal_dims: int = 0,
    ) -> None:
        super().__init__()
        check_range(type(self).__name__, "action_weight", action_weight, 0.0, None, low_inclusive=True)
        self.convert_to_functional(denoiser_network, "model_network", create_target_params=ema)
        self._init_common(schedule, window, loc, scale, goal_dims)
        self.register_buffer("action_weight", torch.tensor(float(action_weight)))
        self.predict_epsilon = bool(predict_epsilon)

    @property
    def in_keys(self):
        return [self.tensor_keys.observation, self.tensor_keys.action]

    @property
    def out_keys(self):
        return ["loss_diffusion", "first_action_error"]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        x0, xt, t, noise, act_dim = self._noised(tensordict, self.in_keys)
        td = TensorDict({"noisy_trajectory": xt, "diffusion_step": t}, [x0.shape[0]])
        with self.model_network_params.to_module(self.model_network, preserve_module_state=False):
            out = self.model_network(td).get("model_output")
        if not self.predict_epsilon:
            out = self._condition(out, x0, act_dim)
        target = noise if self.predict_epsilon else x0
        err = (out - target).pow(2)
        weights = torch.ones_like(err[:1])
        weights[:, 0, :act_dim] = self.action_weight
        loss = (err * weights).mean()
        with torch.no_grad():
            x0_hat = self.schedule.predict_start_from_noise(xt, t, out) if self.predict_epsilon else out
            first_action_error = (x0_hat[:, 0, :act_dim] - x0[:, 0, :act_dim]).abs().mean()
        return TensorDict({"loss_diffusion": loss, "first_action_error": first_action_error}, [])


class DiffuserValueLoss(_WindowLoss):
    """Regression of a return model on noised windows: ``(V(x_t, t) - G_0)^2``.

    ``G_0`` is the discounted return from the window's first step to the episode's
    end (the ``value`` key). Trained on noised windows so that its gradient can guide
    every denoising step. The network predicts the standardised target
    ``(G_0 - value_loc) / value_scale``, so that its error is measured against the returns'
    spread whatever their units; the diagnostics are in return units (an :class:`Affine`
    with the same statistics after the network gives the planner values in return units).

    Args:
        value_network: reads ``"noisy_trajectory"`` and ``"diffusion_step"``, writes
            ``"value"`` ``[B, 1]`` (:class:`~offline_plugins.modules.sequence.unet.ValueUnet`).
        schedule: the denoiser's :class:`~offline_plugins.modules.sequence.diffusion.DDPMSchedule`.

    Keyword Args:
        window, loc, scale, goal_dims: as :class:`DiffuserLoss`.
        value_loc, value_scale: mean and standard deviation of the targets in the data
            (default 0 and 1: the raw target).
    """

    value_network: TensorDictModule
    value_network_params: TensorDictParams
    target_value_network_params: TensorDictParams

    def __init__(
        self,
        value_network: TensorDictModule,
        schedule: DDPMSchedule,
        *,
        window: int,
        loc: Optional[torch.Tensor] = None,
        scale: Optional[torch.Tensor] = None,
        goal_dims: int = 0,
        value_loc: float = 0.0,
        value_scale: float = 1.0,
    ) -> None:
        super().__init__()
        check_range(type(self).__name__, "value_scale", float(value_scale), 0.0, None)
        self.convert_to_functional(value_network, "value_network", create_target_params=False)
        self._init_common(schedule, window, loc, scale, goal_dims)
        self.value_target = Affine(value_loc, value_scale)

    @property
    def in_keys(self):
        k = self.tensor_keys
        return [k.observation, k.action, k.value]

    @property
    def out_keys(self):
        return ["loss_value", "value_pred_mean", "value_target_mean", "value_error"]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        x0, xt, t, _, _ = self._noised(tensordict, self.in_keys)
        target = windows(tensordict, self.window, type(self).__name__).get(self.tensor_keys.value)[:, 0]
        td = TensorDict({"noisy_trajectory": xt, "diffusion_step": t}, [x0.shape[0]])
        with self.value_network_params.to_module(self.value_network, preserve_module_state=False):
            pred = self.value_network(td).get("value")
        target = target.to(pred.dtype)
        v = self.value_target
        loss = (pred - (target - v.loc) / v.scale).pow(2).mean()
        with torch.no_grad():
            pred = v(pred)  # return units
        return TensorDict(
            {"loss_value": loss, "value_pred_mean": pred.mean(), "value_target_mean": target.mean(),
             "value_error": (pred - target).abs().mean()}, []
        )


class DiffuserWithValueLoss(LossModule):
    """The denoiser's and the return model's losses on the same batch of windows, in one module.

    Returns ``loss_diffusion`` and ``loss_value`` (each touches only its own network)
    with both losses' diagnostics; the two can also be used separately.

    Args:
        diffusion_loss: a :class:`DiffuserLoss`.
        value_loss: a :class:`DiffuserValueLoss`.
    """

    def __init__(self, diffusion_loss: DiffuserLoss, value_loss: DiffuserValueLoss) -> None:
        super().__init__()
        self.diffusion_loss = diffusion_loss
        self.value_loss = value_loss

    def _forward_value_estimator_keys(self, **kwargs) -> None:
        pass

    @property
    def in_keys(self):
        return sorted(set(self.diffusion_loss.in_keys) | set(self.value_loss.in_keys), key=str)

    @property
    def out_keys(self):
        return [*self.diffusion_loss.out_keys, *self.value_loss.out_keys]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self.diffusion_loss(tensordict).update(self.value_loss(tensordict))
