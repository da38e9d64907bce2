"""Preference-optimisation objectives as plain functions of log-probabilities.

Each function returns the per-example loss (no reduction), so a caller can weight,
mask or average it as it likes. Log-probabilities arrive as given: the caller sums
or averages them over the response tokens. The loss modules in
:mod:`offline_plugins.objectives.llm` call these same functions.

Worked example 5.6.1 of the seeds (DPO, beta 0.1, log-ratios -1 and -2):

>>> import torch
>>> logp_w = torch.tensor([-1.0], requires_grad=True)
>>> loss = dpo_loss(logp_w, torch.tensor([-2.0]), torch.zeros(1), torch.zeros(1), beta=0.1)
>>> round(loss.item(), 3)
0.644
>>> loss.sum().backward()
>>> round(logp_w.grad.item(), 4)
-0.0475
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "log1mexp",
    "bradley_terry_loss",
    "dpo_loss",
    "robust_dpo_loss",
    "ipo_loss",
    "kto_loss",
    "orpo_log_odds_ratio",
    "orpo_loss",
    "simpo_loss",
    "group_relative_advantage",
    "aggregate_rewards",
    "ENSEMBLE_AGGREGATES",
]

# an ensemble's rewards as one (defined beside the reward network, which combines its heads)
from offline_plugins.modules.causal_lm import ENSEMBLE_AGGREGATES, aggregate_rewards  # noqa: E402

_LOG_HALF = -math.log(2.0)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, accurate near 0 and for very negative ``x``.

    Mächler (2012): ``log(-expm1(x))`` near 0, where ``1 - exp(x)`` cancels, and
    ``log1p(-exp(x))`` below ``-log 2``, where ``exp(x)`` underflows gracefully.
    The value at ``x = 0`` is ``-inf`` (a response of probability one has no odds).

    >>> log1mexp(torch.tensor([-1e-10, -50.0]))
    tensor([-2.3026e+01, -1.9287e-22])
    """
    # torch.where evaluates both branches; clamp each to its safe domain so that
    # neither produces NaN gradients through the branch it does not select.
    near = torch.log(-torch.expm1(torch.minimum(x, x.new_tensor(-1e-30))))
    far = torch.log1p(-torch.exp(torch.minimum(x, x.new_tensor(_LOG_HALF))))
    return torch.where(x > _LOG_HALF, near, far)


def bradley_terry_loss(
    r_chosen: torch.Tensor, r_rejected: torch.Tensor, *, margin: float | torch.Tensor = 0.0
) -> torch.Tensor:
    """``-log sigmoid(r_chosen - r_rejected - margin)``: the reward-model objective.

    Bradley and Terry (1952); Ouyang et al. 2022 (arXiv:2203.02155). ``margin`` asks the
    chosen reward to win by at least that much (Llama-2's margin loss, arXiv:2307.09288).

    >>> round(bradley_terry_loss(torch.tensor(1.0), torch.tensor(0.0)).item(), 4)
    0.3133
    """
    return -F.logsigmoid(r_chosen - r_rejected - margin)


def _dpo_logits(
    policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta
) -> torch.Tensor:
    return beta * ((policy_chosen_logps - ref_chosen_logps) - (policy_rejected_logps - ref_rejected_logps))


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float | torch.Tensor = 0.1,
    label_smoothing: float | torch.Tensor = 0.0,
) -> torch.Tensor:
    """DPO: ``-log sigmoid(beta * (Delta_w - Delta_l))`` with ``Delta = logp - ref_logp``.

    Rafailov et al. 2023 (arXiv:2305.18290). ``label_smoothing = eps`` is conservative
    DPO (cDPO, Mitchell 2023): the label is flipped with probability ``eps``, so the
    loss is ``-(1 - eps) log sigmoid(z) - eps log sigmoid(-z)``.

    >>> round(dpo_loss(torch.tensor(-4.0), torch.tensor(-6.0), torch.tensor(0.0), torch.tensor(0.0)).item(), 3)
    0.598
    """
    z = _dpo_logits(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta)
    return -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def robust_dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float | torch.Tensor = 0.1,
    label_smoothing: float | torch.Tensor = 0.1,
) -> torch.Tensor:
    """Robust DPO: the unbiased loss under label-flip noise of rate ``eps`` < 0.5.

    Chowdhury et al. 2024 (arXiv:2403.00409):
    ``((1 - eps) * -log sigmoid(z) - eps * -log sigmoid(-z)) / (1 - 2 eps)``.

    >>> z = dict(ref_chosen_logps=torch.tensor(0.0), ref_rejected_logps=torch.tensor(0.0))
    >>> round(robust_dpo_loss(torch.tensor(-1.0), torch.tensor(-2.0), label_smoothing=0.0, **z).item(), 3)
    0.644
    """
    z = _dpo_logits(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta)
    return ((1.0 - label_smoothing) * -F.logsigmoid(z) + label_smoothing * F.logsigmoid(-z)) / (
        1.0 - 2.0 * label_smoothing
    )


def ipo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    tau: float | torch.Tensor = 0.1,
) -> torch.Tensor:
    """IPO: ``(h - 1 / (2 tau))**2`` with ``h = Delta_w - Delta_l``, a bounded regression target.

    Azar et al. 2023 (arXiv:2310.12036), eq. 17.

    >>> ipo_loss(torch.tensor(5.0), torch.tensor(0.0), torch.tensor(0.0), torch.tensor(0.0), tau=0.1)
    tensor(0.)
    """
    h = (policy_chosen_logps - ref_chosen_logps) - (policy_rejected_logps - ref_rejected_logps)
    return (h - 1.0 / (2.0 * tau)) ** 2


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    *,
    beta: float | torch.Tensor = 0.1,
    desirable_weight: float | torch.Tensor = 1.0,
    undesirable_weight: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """KTO: a prospect-theory value of the implicit reward against a KL reference point.

    Ethayarajh et al. 2024 (arXiv:2402.01306), eq. 8. With ``r = policy_logps - ref_logps``,
    a desirable example costs ``w_d * (1 - sigmoid(beta * (r - kl)))`` and an
    undesirable one ``w_u * (1 - sigmoid(beta * (kl - r)))``. ``kl`` is the reference
    point, used as given (the loss module estimates it, detaches it and clamps it at 0).

    >>> kto_loss(torch.tensor([0.0, 0.0]), torch.tensor([0.0, 0.0]), torch.tensor([True, False]), torch.tensor(0.0))
    tensor([0.5000, 0.5000])
    """
    r = policy_logps - ref_logps
    desirable = desirable.to(torch.bool)
    gain = torch.where(desirable, r - kl, kl - r)
    weight = torch.where(
        desirable,
        torch.as_tensor(desirable_weight, dtype=r.dtype, device=r.device),
        torch.as_tensor(undesirable_weight, dtype=r.dtype, device=r.device),
    )
    return weight * (1.0 - torch.sigmoid(beta * gain))


def orpo_log_odds_ratio(chosen_mean_logps: torch.Tensor, rejected_mean_logps: torch.Tensor) -> torch.Tensor:
    """``log odds(y_w) - log odds(y_l)`` with ``odds(y) = P / (1 - P)`` of length-averaged log-probs.

    >>> orpo_log_odds_ratio(torch.tensor(-1e-9), torch.tensor(-1e-9)).abs() < 1e-6
    tensor(True)
    """
    return (chosen_mean_logps - log1mexp(chosen_mean_logps)) - (
        rejected_mean_logps - log1mexp(rejected_mean_logps)
    )


def orpo_loss(
    chosen_mean_logps: torch.Tensor,
    rejected_mean_logps: torch.Tensor,
    chosen_nll: torch.Tensor,
    *,
    lam: float | torch.Tensor = 0.1,
) -> torch.Tensor:
    """ORPO: ``chosen_nll - lam * log sigmoid(log odds ratio)``; no reference model.

    Hong et al. 2024 (arXiv:2403.07691), eq. 6-7. The log odds use :func:`log1mexp`, so
    log-probs near 0 (a confident model) stay finite.

    >>> round(orpo_loss(torch.tensor(-0.5), torch.tensor(-0.5), torch.tensor(0.5), lam=1.0).item(), 4)
    1.1931
    """
    return chosen_nll - lam * F.logsigmoid(orpo_log_odds_ratio(chosen_mean_logps, rejected_mean_logps))


def simpo_loss(
    chosen_mean_logps: torch.Tensor,
    rejected_mean_logps: torch.Tensor,
    *,
    beta: float | torch.Tensor = 2.0,
    gamma: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """SimPO: ``-log sigmoid(beta * (mean_logp_w - mean_logp_l) - gamma)``; no reference model.

    Meng et al. 2024 (arXiv:2405.14734), eq. 6: length-averaged log-probs as the implicit
    reward and an absolute target margin ``gamma``.

    >>> round(simpo_loss(torch.tensor(-1.0), torch.tensor(-1.5)).item(), 4)
    0.6931
    """
    return -F.logsigmoid(beta * (chosen_mean_logps - rejected_mean_logps) - gamma)


def group_relative_advantage(rewards: torch.Tensor, groups: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's advantage: each reward standardised within its group (same prompt).

    Shao et al. 2024 (DeepSeekMath, arXiv:2402.03300): ``(r - mean_g) / std_g`` with the
    population std, as in the seeds' example 5.6.2(a). A group whose rewards are all
    equal has std 0 and no learning signal: its advantages are 0 (std below ``eps``
    counts as 0).

    >>> group_relative_advantage(torch.tensor([1., 0., 1., 0.]), torch.tensor([0, 0, 0, 0]))
    tensor([ 1., -1.,  1., -1.])
    """
    rewards = rewards.reshape(-1).to(torch.float32)
    groups = groups.reshape(-1)
    _, inverse = torch.unique(groups, return_inverse=True)
    n = torch.zeros(int(inverse.max()) + 1, dtype=rewards.dtype, device=rewards.device)
    n = n.index_add(0, inverse, torch.ones_like(rewards))
    mean = torch.zeros_like(n).index_add(0, inverse, rewards) / n
    centred = rewards - mean[inverse]
    var = torch.zeros_like(n).index_add(0, inverse, centred**2) / n
    std = var.sqrt()[inverse]
    return torch.where(std > eps, centred / std.clamp_min(eps), torch.zeros_like(centred))

