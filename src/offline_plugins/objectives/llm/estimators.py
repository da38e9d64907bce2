"""The estimators the text losses share, as plain functions of tensors: advantages, baselines,
KL estimates, sequence weights and masks.

The GRPO family (:mod:`offline_plugins.objectives.llm.online`,
:mod:`offline_plugins.objectives.llm.online_variants`), PPO-RLHF and text-DT call these; each
takes rewards, prompt ids and per-token log-probs as the rollout rows hold them (``[B]`` per
response, ``[B, T]`` per token with the response-token mask) and returns tensors of the same
layout, with no host synchronisation.

The seeds' worked example 5.6.2(a), GRPO's group-standardised advantages (population std):

>>> import torch
>>> group_advantages(torch.tensor([1., 0., 1., 0.]), torch.tensor([0, 0, 0, 0]))[0]
tensor([ 1., -1.,  1., -1.])

MaxRL's advantage of the same group, relative to its mean (0.5):

>>> maxrl_advantages(torch.tensor([1., 0., 1., 0.]), torch.tensor([0, 0, 0, 0]))[0]
tensor([ 1., -1.,  1., -1.])
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = [
    "masked_whiten",
    "group_statistics",
    "group_advantages",
    "maxrl_advantages",
    "decoupled_advantages",
    "optimal_token_advantages",
    "overlong_penalty",
    "k3_kl",
    "unbiased_kl",
    "off_policy_sequence_mask",
    "gamma_sequence_weight",
]


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / std`` over the masked entries (population std), as TRL's ``masked_whiten``; 0 off the mask.

    >>> masked_whiten(torch.tensor([[1., 3., 9.]]), torch.tensor([[1, 1, 0]]).bool()).tolist()
    [[-1.0, 1.0, 0.0]]
    """
    m = mask.to(x.dtype)
    n = m.sum().clamp_min(1)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / n
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros_like(out))


def group_statistics(rewards: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mean, std, size)`` of each row's group, per row (``[B]`` each; population std).

    >>> mean, std, size = group_statistics(torch.tensor([1., 0., 4.]), torch.tensor([7, 7, 3]))
    >>> mean.tolist(), std.tolist(), size.tolist()
    ([0.5, 0.5, 4.0], [0.5, 0.5, 0.0], [2.0, 2.0, 1.0])
    """
    rewards = rewards.reshape(-1).to(torch.float32)
    groups = groups.reshape(-1)
    _, inverse = torch.unique(groups, return_inverse=True)
    n_groups = groups.numel()  # an upper bound on the number of groups: no host sync for the max
    n = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device).index_add(0, inverse, torch.ones_like(rewards))
    mean = torch.zeros_like(n).index_add(0, inverse, rewards) / n.clamp_min(1)
    centred = rewards - mean[inverse]
    var = torch.zeros_like(n).index_add(0, inverse, centred**2) / n.clamp_min(1)
    return mean[inverse], var.sqrt()[inverse], n[inverse]


def group_advantages(
    rewards: torch.Tensor,
    groups: torch.Tensor,
    *,
    scale: bool = True,
    leave_one_out: bool = False,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantage, has_signal)`` per row: each reward against the other rewards of its group.

    * ``scale=True`` (GRPO, Shao et al. 2024, arXiv:2402.03300): ``(r - mean_g) / std_g`` with
      the **population** std (divide by ``G``), as the seeds' example 5.6.2(a);
    * ``scale=False`` (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783): ``r - mean_g``;
    * ``leave_one_out=True`` (RLOO, Ahmadian et al. 2024, arXiv:2402.14740):
      ``r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_g)``, unscaled.

    A group whose rewards are all equal (std below ``eps``) carries no signal: its
    advantages are exactly 0 (never NaN) and ``has_signal`` is False for its rows.
    Groups may have different sizes; a group of one row has no signal.

    >>> a, s = group_advantages(torch.tensor([1., 0., 1., 1.]), torch.tensor([0, 0, 1, 1]), leave_one_out=True)
    >>> a.tolist(), s.tolist()
    ([1.0, -1.0, 0.0, 0.0], [True, True, False, False])
    """
    rewards = rewards.reshape(-1).to(torch.float32)
    mean, std, size = group_statistics(rewards, groups)
    centred = rewards - mean
    signal = (std > eps) & (size > 1)
    if leave_one_out:
        adv = centred * size / (size - 1).clamp_min(1)
    elif scale:
        adv = centred / std.clamp_min(eps)
    else:
        adv = centred
    return torch.where(signal, adv, torch.zeros_like(adv)), signal


def maxrl_advantages(rewards: torch.Tensor, groups: torch.Tensor, *, eps: float = 1e-6
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """MaxRL's advantage: ``(r - mean_g) / mean_g`` (Maximum Likelihood
    Reinforcement Learning, arXiv:2602.02710).

    With binary rewards ``mean_g = K / G`` (``K`` of the ``G`` responses correct), so
    ``(1 / G) sum_i A_i grad log pi_i = (1 / K) sum_{correct} grad log pi_i - (1 / G) sum_i grad log pi_i``:
    the average score of the correct responses (an estimate of ``grad log p``, the gradient of the
    log of the prompt's success probability, where REINFORCE estimates ``grad p``) minus the
    group's mean score as a control variate. A prompt answered rarely gets ``1 / p`` times the
    weight it gets in REINFORCE. A group with no correct response, or all correct, has no signal.
    Rewards must be in ``[0, 1]`` (a success probability's estimate); the loss checks.

    >>> a, s = maxrl_advantages(torch.tensor([1., 0., 0., 0., 1., 1.]), torch.tensor([0, 0, 0, 0, 1, 1]))
    >>> a.tolist(), s.tolist()
    ([3.0, -1.0, -1.0, -1.0, 0.0, 0.0], [True, True, True, True, False, False])
    """
    rewards = rewards.reshape(-1).to(torch.float32)
    mean, std, size = group_statistics(rewards, groups)
    signal = (std > eps) & (size > 1) & (mean > eps)
    adv = (rewards - mean) / mean.clamp_min(eps)
    return torch.where(signal, adv, torch.zeros_like(adv)), signal


def decoupled_advantages(components: torch.Tensor, groups: torch.Tensor, weights: Sequence[float] | torch.Tensor,
                         *, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO's advantage from several rewards (Liu et al. 2026, Group reward-Decoupled Normalization
    Policy Optimization, arXiv:2601.05242): each reward standardised within its group on its own
    (GRPO's advantage of that reward alone), combined with ``weights``, and the sum standardised
    over the batch of responses.

    Summing the rewards first (GRPO) gives two responses the same advantage whenever their
    totals tie, whatever each reward said; standardising each first keeps them apart. A group
    has signal where any of its rewards differs; the batch standardisation runs over all rows.

    Args:
        components: ``[B, K]`` the ``K`` rewards of each response.
        groups: ``[B]`` prompt ids.
        weights: ``K`` weights.

    >>> comps = torch.tensor([[1., 0.], [1., 1.], [0., 1.], [0., 0.]])  # correct, formatted
    >>> a, s = decoupled_advantages(comps, torch.tensor([0, 0, 0, 0]), [1.0, 1.0])
    >>> [round(v, 4) for v in a.tolist()], s.tolist()
    ([0.0, 1.4142, 0.0, -1.4142], [True, True, True, True])
    """
    comps = components.to(torch.float32)
    if comps.dim() != 2:
        raise ValueError(f"decoupled_advantages: components must be [B, K], got shape {tuple(comps.shape)}")
    w = torch.as_tensor(weights, dtype=comps.dtype, device=comps.device).reshape(-1)
    if w.numel() != comps.shape[1]:
        raise ValueError(f"decoupled_advantages: {w.numel()} weights for {comps.shape[1]} rewards")
    total = torch.zeros(comps.shape[0], dtype=comps.dtype, device=comps.device)
    signal = torch.zeros(comps.shape[0], dtype=torch.bool, device=comps.device)
    for k in range(comps.shape[1]):
        adv, sig = group_advantages(comps[:, k], groups, scale=True, eps=eps)
        total = total + w[k] * adv
        signal = signal | sig
    centred = total - total.mean()
    std = centred.pow(2).mean().sqrt()
    return torch.where(std > eps, centred / std.clamp_min(eps), torch.zeros_like(centred)), signal


def optimal_token_advantages(returns: torch.Tensor, sample_log_probs: torch.Tensor, sum_p2: torch.Tensor,
                             mask: torch.Tensor, groups: torch.Tensor, *, weights: torch.Tensor | None = None,
                             eps: float = 1e-8) -> torch.Tensor:
    """The optimal token baseline's advantage, ``G_t - B_t`` per response token (Li et al. 2026, The
    Optimal Token Baseline, arXiv:2602.07078).

    The baseline minimising the variance of the policy gradient weighs each response by the
    squared norm of its score so far. For a softmax policy the squared norm of token ``j``'s
    score with respect to its logits is ``1 - 2 p_j + sum_v p_v^2`` (the paper's logit-gradient
    proxy, read from one forward pass); ``W_t`` is its sum over the response's tokens up to
    ``t``. Within a prompt's group, at each position ``t``:
    ``B_t = sum_i G_{i,t} W_{i,t} / sum_i W_{i,t}`` over the responses that reach ``t``. Where only
    one response of the group reaches ``t`` its baseline is 0 (it would be its own return, and
    cancel its signal), as the reference implementation does for the longest response.

    Args:
        returns: ``[B, T]`` each token's return (the reward still to come; an outcome reward's
            return is the reward on every response token).
        sample_log_probs: ``[B, T]`` the sampled tokens' log-probs (``p_j``).
        sum_p2: ``[B, T]`` ``sum_v p_v^2`` of the distribution each token was drawn from.
        mask: ``[B, T]`` response tokens. Rows of a group are aligned position by position (they
            share their prompt).
        groups: ``[B]`` prompt ids.
        weights: ``[B, T]`` optional importance weights; ``W`` then sums ``w^2 (1 - 2p + sum p^2)``.

    Returns:
        ``[B, T]`` advantages, 0 off the mask.

    Two responses of one prompt, rewards 1 and 0; the second drew less likely tokens, so its
    score is larger and the baseline leans to its return (0):

    >>> lp = torch.log(torch.tensor([[0.9, 0.9], [0.5, 0.5]]))
    >>> adv = optimal_token_advantages(torch.tensor([[1., 1.], [0., 0.]]), lp, torch.full((2, 2), 0.82),
    ...                                torch.ones(2, 2, dtype=torch.bool), torch.tensor([0, 0]))
    >>> [[round(v, 3) for v in row] for row in adv.tolist()]
    [[0.976, 0.976], [-0.024, -0.024]]
    """
    m = mask.to(torch.float32)
    p = sample_log_probs.detach().to(torch.float32).exp()
    energy = (1 - 2 * p + sum_p2.detach().to(torch.float32)).clamp_min(0)
    if weights is not None:
        energy = energy * weights.detach().to(torch.float32) ** 2
    w_cum = (energy * m).cumsum(-1) * m
    g = returns.detach().to(torch.float32) * m
    _, inverse = torch.unique(groups.reshape(-1), return_inverse=True)
    n_groups = inverse.numel()
    shape = (n_groups, m.shape[-1])
    num = torch.zeros(shape, device=m.device).index_add(0, inverse, g * w_cum)
    den = torch.zeros(shape, device=m.device).index_add(0, inverse, w_cum)
    present = torch.zeros(shape, device=m.device).index_add(0, inverse, m)
    baseline = torch.where(present >= 2, num / (den + eps), torch.zeros_like(num))[inverse]
    return (g - baseline) * m


def overlong_penalty(lengths: torch.Tensor, *, max_length: int, cache: int) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13).

    0 for responses up to ``max_length - cache`` tokens, falling linearly to -1 at
    ``max_length``, -1 beyond.

    >>> overlong_penalty(torch.tensor([4, 6, 7, 8, 9]), max_length=8, cache=2).tolist()
    [0.0, 0.0, -0.5, -1.0, -1.0]
    """
    lengths = lengths.to(torch.float32)
    if cache <= 0:
        return torch.where(lengths > max_length, -torch.ones_like(lengths), torch.zeros_like(lengths))
    soft = ((max_length - cache) - lengths) / cache
    return soft.clamp(-1.0, 0.0)


def k3_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: ``exp(d) - d - 1``, ``d = ref - logp``.

    Non-negative, unbiased when the tokens are drawn from ``pi``, and what GRPO adds to its loss
    (arXiv:2402.03300, eq. 4).

    >>> k3_kl(torch.tensor([-1.0]), torch.tensor([-1.0])).item()
    0.0
    """
    d = ref_log_probs - log_probs
    return torch.expm1(d) - d


def unbiased_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, sample_log_probs: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3.2's KL estimate for tokens drawn from the sampling policy, not the current one
    (DeepSeek-AI 2025, DeepSeek-V3.2, arXiv:2512.02556, sec. 3.1): k3 times ``pi / pi_sample``.

    Once the policy has moved from the policy that sampled the round (the second epoch on a
    round, a stale or mismatched sampler), k3's gradient is no longer the KL's; weighting it by
    the importance ratio, with the gradient through both, makes it
    ``rho * log(pi / pi_ref) * grad log pi``, whose expectation under ``pi_sample`` is the gradient
    of ``KL(pi || pi_ref)``. On-policy (``rho = 1``) it equals :func:`k3_kl`.

    >>> lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    >>> bool(torch.isclose(unbiased_kl(lp, ref, lp), k3_kl(lp, ref)))
    True
    """
    return (log_probs - sample_log_probs.detach()).exp() * k3_kl(log_probs, ref_log_probs)


def _per_response(advantage: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """A response's advantage ``[B]``: as given (``[B]``), or its mean over its tokens (``[B, T]``)."""
    advantage = advantage.detach().to(torch.float32)
    if advantage.dim() == 1:
        return advantage
    return (advantage.reshape(m.shape) * m).sum(-1) / m.sum(-1).clamp_min(1)


def off_policy_sequence_mask(log_probs: torch.Tensor, sample_log_probs: torch.Tensor, advantage: torch.Tensor,
                             mask: torch.Tensor, delta: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (arXiv:2512.02556, sec. 3.1): per response, False
    where its advantage (``[B]``, or ``[B, T]`` averaged over its tokens) is negative and its mean ``log(pi_sample / pi)`` over its tokens exceeds
    ``delta``, True elsewhere (``[B]``).

    A response the policy has moved far from and that is to be pushed down teaches little and
    destabilises; a positive one is kept whatever its divergence.

    >>> lp = torch.log(torch.tensor([[0.1, 0.1], [0.1, 0.1], [0.5, 0.5]]))
    >>> sample = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]))
    >>> off_policy_sequence_mask(lp, sample, torch.tensor([-1., 1., -1.]), torch.ones(3, 2, dtype=torch.bool),
    ...                          delta=1.0).tolist()
    [False, True, True]
    """
    m = mask.to(torch.float32)
    n = m.sum(-1).clamp_min(1)
    drift = ((sample_log_probs.detach() - log_probs.detach()).to(torch.float32) * m).sum(-1) / n
    return ~((_per_response(advantage, m) < 0) & (drift > delta))


def gamma_sequence_weight(log_ratio: torch.Tensor, mask: torch.Tensor, advantage: torch.Tensor, *,
                          k_pos: float, lam_pos: float, k_neg: float, lam_neg: float) -> torch.Tensor:
    """VESPO's reshaped weight of each response (Shen et al. 2026, VESPO, arXiv:2602.10693),
    ``phi(w) = w^k exp(lambda (1 - w))``, ``[B]``, detached.

    ``w = exp(sum_t log(pi / pi_sample))`` is the response's whole importance ratio (the product
    of its tokens', no length normalisation), clamped in log space to ``[-20, 20]``; ``(k, lambda)``
    are ``(k_pos, lam_pos)`` where the response's advantage (``[B]``, or ``[B, T]`` averaged over its tokens) is not negative and ``(k_neg, lam_neg)``
    elsewhere. ``phi(1) = 1`` (on-policy it is REINFORCE), it peaks at ``w = k / lambda`` and falls to
    0 as ``w -> 0`` or ``w -> inf``, so a stale response with an exploding or vanishing ratio
    weighs little instead of being clipped at a fixed edge.

    >>> lr = torch.tensor([[0.0, 0.0], [0.2, 0.3]])
    >>> phi = gamma_sequence_weight(lr, torch.ones(2, 2, dtype=torch.bool), torch.tensor([1., 1.]),
    ...                             k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0)
    >>> [round(v, 4) for v in phi.tolist()]
    [1.0, 0.3882]
    """
    m = mask.to(torch.float32)
    log_w = ((log_ratio.detach().to(torch.float32) * m).sum(-1)).clamp(-20.0, 20.0)
    positive = _per_response(advantage, m) >= 0
    k = torch.where(positive, torch.full_like(log_w, float(k_pos)), torch.full_like(log_w, float(k_neg)))
    lam = torch.where(positive, torch.full_like(log_w, float(lam_pos)), torch.full_like(log_w, float(lam_neg)))
    return torch.exp(k * log_w + lam * (1 - log_w.exp()))
