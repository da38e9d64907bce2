"""DDPM noise schedule and posterior for Diffuser (Ho et al. 2020; Janner et al. 2022, arXiv:2205.09991).

>>> import torch
>>> _ = torch.manual_seed(0)
>>> sched = DDPMSchedule(20)
>>> x0 = torch.randn(4, 8, 3)
>>> t = torch.tensor([0, 5, 10, 19])
>>> noise = torch.randn_like(x0)
>>> xt = sched.q_sample(x0, t, noise)
>>> torch.allclose(sched.predict_start_from_noise(xt, t, noise), x0, atol=1e-4)
True
>>> mean, log_var = sched.p_mean_variance(xt, t, noise)
>>> mean.shape, log_var.shape
(torch.Size([4, 8, 3]), torch.Size([4, 1, 1]))
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

__all__ = ["cosine_beta_schedule", "DDPMSchedule"]


def cosine_beta_schedule(steps: int, s: float = 0.008) -> torch.Tensor:
    """Nichol & Dhariwal's cosine schedule, as Diffuser uses: ``betas`` ``[steps]`` clipped to 0.999."""
    x = torch.linspace(0, steps, steps + 1, dtype=torch.float64)
    ac = torch.cos(((x / steps) + s) / (1 + s) * math.pi * 0.5) ** 2
    ac = ac / ac[0]
    return (1 - ac[1:] / ac[:-1]).clamp(0, 0.999).to(torch.float32)


class DDPMSchedule(nn.Module):
    """Forward noising ``q(x_t | x_0)`` and the reverse posterior ``q(x_{t-1} | x_t, x_0)``.

    Args:
        steps: diffusion steps ``T`` (Diffuser: 20 for locomotion).
    """

    def __init__(self, steps: int) -> None:
        super().__init__()
        if int(steps) < 1:
            raise ValueError(f"DDPMSchedule needs at least 1 step, got {steps}")
        betas = cosine_beta_schedule(int(steps)).to(torch.float64)
        alphas = 1 - betas
        ac = torch.cumprod(alphas, 0)
        ac_prev = torch.cat([torch.ones(1, dtype=torch.float64), ac[:-1]])
        post_var = betas * (1 - ac_prev) / (1 - ac)
        buffers = {
            "betas": betas,
            "sqrt_alphas_cumprod": ac.sqrt(),
            "sqrt_one_minus_alphas_cumprod": (1 - ac).sqrt(),
            "sqrt_recip_alphas_cumprod": (1 / ac).sqrt(),
            "sqrt_recipm1_alphas_cumprod": (1 / ac - 1).sqrt(),
            "posterior_log_variance_clipped": post_var.clamp_min(1e-20).log(),
            "posterior_mean_coef1": betas * ac_prev.sqrt() / (1 - ac),
            "posterior_mean_coef2": (1 - ac_prev) * alphas.sqrt() / (1 - ac),
        }
        for name, value in buffers.items():
            self.register_buffer(name, value.to(torch.float32))

    @property
    def steps(self) -> int:
        return self.betas.shape[0]

    @staticmethod
    def _at(buf: torch.Tensor, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return buf[t].reshape(t.shape[0], *([1] * (x.ndim - 1)))

    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """``sqrt(abar_t) x_0 + sqrt(1 - abar_t) noise``."""
        return self._at(self.sqrt_alphas_cumprod, t, x0) * x0 + self._at(self.sqrt_one_minus_alphas_cumprod, t, x0) * noise

    def predict_start_from_noise(self, xt: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return self._at(self.sqrt_recip_alphas_cumprod, t, xt) * xt - self._at(self.sqrt_recipm1_alphas_cumprod, t, xt) * noise

    def p_mean_variance(
        self,
        xt: torch.Tensor,
        t: torch.Tensor,
        model_output: torch.Tensor,
        *,
        predict_epsilon: bool = True,
        x0_low: Optional[torch.Tensor] = None,
        x0_high: Optional[torch.Tensor] = None,
    ):
        """Mean and log-variance of ``p(x_{t-1} | x_t)`` from the model's noise (or ``x_0``) prediction.

        ``x0_low``/``x0_high`` (broadcastable to ``xt``) clip the predicted clean sample
        first, as DDPM samplers do (``clip_denoised``): at the noisiest steps
        ``x_0 = (x_t - sqrt(1 - abar) eps) / sqrt(abar)`` divides by a tiny ``sqrt(abar)``.
        """
        x0 = self.predict_start_from_noise(xt, t, model_output) if predict_epsilon else model_output
        if x0_low is not None:
            x0 = torch.maximum(torch.minimum(x0, x0_high), x0_low)
        mean = self._at(self.posterior_mean_coef1, t, xt) * x0 + self._at(self.posterior_mean_coef2, t, xt) * xt
        return mean, self._at(self.posterior_log_variance_clipped, t, xt)
