"""Diffuser's planner: value-guided reverse diffusion conditioned on the current state (Janner et al. 2022).

>>> import torch
>>> from tensordict import TensorDict
>>> from tensordict.nn import TensorDictModule
>>> from offline_plugins.modules.sequence.diffusion import DDPMSchedule
>>> from offline_plugins.modules.sequence.unet import TemporalUnet, ValueUnet
>>> keys = ["noisy_trajectory", "diffusion_step"]
>>> planner = DiffuserPlanner(TensorDictModule(TemporalUnet(4, dim=8, dim_mults=(1, 2)), keys, ["model_output"]),
...     TensorDictModule(ValueUnet(4, dim=8, dim_mults=(1, 2)), keys, ["value"]), DDPMSchedule(5),
...     observation_dim=3, action_dim=1, horizon=8, n_samples=4)
>>> obs = torch.randn(2, 3)
>>> out = planner(TensorDict({"observation": obs}, [2]))
>>> out["action"].shape, torch.equal(planner.last_plan_normalized[:, 0, 1:], obs)  # loc 0, scale 1
(torch.Size([2, 1]), True)
"""

from __future__ import annotations

from typing import Optional

import torch
from tensordict import TensorDict, TensorDictBase, TensorDictParams
from tensordict.nn import TensorDictModule

from offline_plugins.modules.sequence.decision_transformer import ContextPolicy, env_rows
from offline_plugins.modules.sequence.diffusion import DDPMSchedule
from offline_plugins.modules.sequence.planning import PlannerMixin, clock_now

__all__ = ["DiffuserPlanner"]


class DiffuserPlanner(PlannerMixin, ContextPolicy):
    """Sample ``n_samples`` plans per environment, guided up the return model's gradient; act on the best.

    Each reverse step first takes ``n_guide_steps`` steps of
    ``x += guide_scale * Var_t * grad V(x, t)`` (none at the last ``t_stopgrad``
    steps), then samples ``x_{t-1} ~ p(x_{t-1} | x_t)``; after every update the first
    state of every plan is overwritten by the current state (inpainting). The plan
    with the highest return estimate gives the action: its first action.

    With ``plan_every=1`` (the reference) every step is planned from the current state
    alone; otherwise the best plan is kept and its actions executed until the next
    planning step. Call :meth:`reset` at each episode start (``.eval()`` resets too).
    Reads ``observation`` (batch ``[]`` or ``[n]``) and, with ``plan_every > 1``,
    ``env_index`` when rows drop out; writes ``action``. Planning time is in
    :meth:`planning_stats`.

    Args:
        denoiser: the trained denoiser tensordict module (``DiffuserLoss.model_network``).
        value: the trained return model (``DiffuserValueLoss.value_network``).
        schedule: their :class:`~offline_plugins.modules.sequence.diffusion.DDPMSchedule`.

    Keyword Args:
        observation_dim, action_dim: widths.
        horizon: planned steps (the training window length).
        loc, scale: the losses' standardisation of ``[action, observation]``.
        low, high: the data's per-channel range of ``[action, observation]`` (raw units);
            every reverse step clips its predicted clean plan to it, as the reference
            clips to ``[-1, 1]`` after scaling the data's range there (None: no clipping).
        n_samples: plans per environment (default 1, as ``diffuser``'s registered config; reference: 64).
        guide_scale: step size of the value guidance (default 0: unguided, as the registered config,
            under which Diffuser learned on Pendulum here, docs/results-history.md; reference: 0.1).
        n_guide_steps: guidance steps per reverse step (reference: 2).
        t_stopgrad: no guidance at diffusion steps below this (reference: 2).
        predict_epsilon: how the denoiser was trained (default: it predicts the clean plan).
        denoiser_params: parameters to plan with instead of the denoiser's own (the
            exponential moving average, ``DiffuserLoss.target_model_network_params``).
        plan_every: plan at every ``plan_every``-th step and execute the best plan's
            actions in between (1: replan every step, as the reference).
    """

    def __init__(
        self,
        denoiser: TensorDictModule,
        value: TensorDictModule,
        schedule: DDPMSchedule,
        *,
        observation_dim: int,
        action_dim: int,
        horizon: int,
        loc: Optional[torch.Tensor] = None,
        scale: Optional[torch.Tensor] = None,
        low: Optional[torch.Tensor] = None,
        high: Optional[torch.Tensor] = None,
        n_samples: int = 1,
        guide_scale: float = 0.0,
        n_guide_steps: int = 2,
        t_stopgrad: int = 2,
        predict_epsilon: bool = False,
        denoiser_params: Optional[TensorDictParams] = None,
        plan_every: int = 1,
    ) -> None:
        super().__init__()
        self._init_planning(plan_every, horizon)
        self.denoiser, self.value, self.schedule = denoiser, value, schedule
        self.obs_dim, self.act_dim, self.horizon = int(observation_dim), int(action_dim), int(horizon)
        C = self.obs_dim + self.act_dim
        self.register_buffer("loc", torch.zeros(C) if loc is None else torch.as_tensor(loc, dtype=torch.float32))
        self.register_buffer("scale", torch.ones(C) if scale is None else torch.as_tensor(scale, dtype=torch.float32))
        # standardised clipping bounds: rebuilt from the data, so not in checkpoints
        self._clip = low is not None and high is not None
        bounds = [torch.as_tensor(b, dtype=torch.float32) if b is not None else torch.zeros(C) for b in (low, high)]
        self.register_buffer("x0_low", (bounds[0] - self.loc) / self.scale, persistent=False)
        self.register_buffer("x0_high", (bounds[1] - self.loc) / self.scale, persistent=False)
        self.n_samples, self.guide_scale = int(n_samples), float(guide_scale)
        self.n_guide_steps, self.t_stopgrad = int(n_guide_steps), int(t_stopgrad)
        self.predict_epsilon = bool(predict_epsilon)
        self.denoiser_params = denoiser_params
        self.in_keys, self.out_keys = ["observation"], ["action"]
        self.last_plan_normalized: Optional[torch.Tensor] = None
        self.last_plan_values: Optional[torch.Tensor] = None
        self.reset()

    def reset(self) -> None:
        """Forget the current plan (only kept with ``plan_every > 1``)."""
        self._plans: Optional[torch.Tensor] = None  # [slots, H, C] standardised best plans
        self._age = 0

    def _call(self, module: TensorDictModule, x: torch.Tensor, t: torch.Tensor, key: str) -> torch.Tensor:
        return module(TensorDict({"noisy_trajectory": x, "diffusion_step": t}, [x.shape[0]])).get(key)

    def _condition(self, x: torch.Tensor, first_state: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[:, 0, self.act_dim :] = first_state
        return x

    def _guide(self, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            y = self._call(self.value, x, t, "value")
            (grad,) = torch.autograd.grad(y.sum(), x)
        return y.detach(), grad

    def sample(self, first_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Guided plans ``[n * n_samples, H, C]`` (standardised) from states ``[n, obs_dim]`` and their values."""
        n = first_state.shape[0] * self.n_samples
        cond = first_state.repeat_interleave(self.n_samples, 0)
        x = self._condition(torch.randn(n, self.horizon, self.obs_dim + self.act_dim, device=first_state.device), cond)
        values = None
        for i in reversed(range(self.schedule.steps)):
            t = torch.full((n,), i, dtype=torch.long, device=x.device)
            if self.guide_scale > 0 and i >= self.t_stopgrad:
                var = self.schedule.posterior_log_variance_clipped[i].exp()
                for _ in range(self.n_guide_steps):
                    values, grad = self._guide(x, t)
                    x = self._condition(x + self.guide_scale * var * grad, cond)
            with torch.no_grad():
                out = self._call(self.denoiser, x, t, "model_output")
                mean, log_var = self.schedule.p_mean_variance(
                    x,
                    t,
                    out,
                    predict_epsilon=self.predict_epsilon,
                    x0_low=self.x0_low if self._clip else None,
                    x0_high=self.x0_high if self._clip else None,
                )
                noise = torch.randn_like(x) if i > 0 else torch.zeros_like(x)
                x = self._condition(mean + (0.5 * log_var).exp() * noise, cond)
        with torch.no_grad():
            values = self._call(self.value, x, torch.zeros(n, dtype=torch.long, device=x.device), "value")
        return x, values.reshape(-1)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        start = clock_now()
        single = tensordict.batch_dims == 0
        td = tensordict.unsqueeze(0) if single else tensordict
        obs = td.get("observation")
        A, n = self.act_dim, obs.shape[0]
        rows = env_rows(td, obs, self._plans, type(self).__name__)
        if self._plans is not None and self._age < self.plan_every:
            plans, age = self._plans[rows], self._age
            self._age += 1
        else:
            first_state = (obs.to(torch.float32) - self.loc[A:]) / self.scale[A:]
            if self.denoiser_params is not None:
                with self.denoiser_params.to_module(self.denoiser):
                    all_plans, values = self.sample(first_state)
            else:
                all_plans, values = self.sample(first_state)
            best = values.reshape(n, self.n_samples).argmax(-1)
            plans = all_plans.reshape(n, self.n_samples, self.horizon, -1)[torch.arange(n, device=obs.device), best]
            self.last_plan_normalized = plans
            self.last_plan_values = values.reshape(n, self.n_samples)
            if self.plan_every > 1:
                if self._plans is None:
                    slots = n if td.get("env_index", None) is None else int(rows.max()) + 1
                    self._plans = plans.new_zeros(slots, *plans.shape[1:])
                self._plans[rows] = plans
            age, self._age = 0, 1
        action = (plans[:, age, :A] * self.scale[:A] + self.loc[:A]).to(obs.dtype)
        tensordict.set("action", action.squeeze(0) if single else action)
        self.count_planning(start, n)
        return tensordict
