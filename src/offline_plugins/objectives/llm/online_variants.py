"""The 2026 variants of the GRPO family: GDPO, MaxRL, LUSPO and VESPO, each one hook of
:class:`~offline_plugins.objectives.llm.online.TextGRPOLoss` (or of GSPO's) over an estimator of
:mod:`offline_plugins.objectives.llm.estimators`.

=========  ============================  ======================================================
loss       hook it overrides             what changes
=========  ============================  ======================================================
GDPO       ``process_rollouts``          several rewards, each standardised in its group, summed
MaxRL      ``advantages``                ``(r - mean_g) / mean_g``: the log-likelihood's gradient
LUSPO      ``aggregate`` (of GSPO)       each response's sequence term times its length
VESPO      ``surrogate``, ``aggregate``  a smooth reshaping of the whole-sequence ratio
=========  ============================  ======================================================

The batch layout is the GRPO family's (:mod:`offline_plugins.objectives.llm.online`); GDPO reads
one more key, each response's rewards side by side at ``("next", "reward_components")``
(``[B, K]``), which the collector writes when a run is given several rewards.

MaxRL's advantage of a group with one correct response of four:

>>> import torch
>>> from offline_plugins.objectives.llm.estimators import maxrl_advantages
>>> maxrl_advantages(torch.tensor([1., 0., 0., 0.]), torch.tensor([0, 0, 0, 0]))[0].tolist()
[3.0, -1.0, -1.0, -1.0]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from tensordict import NestedKey, TensorDictBase

from offline_plugins.errors import UserError
from offline_plugins.objectives.llm.estimators import decoupled_advantages, gamma_sequence_weight, maxrl_advantages
from offline_plugins.objectives.llm.grpo import DAPOLoss, TextGRPOLoss, TextGSPOLoss

__all__ = ["RewardRangeError", "TextGDPOLoss", "TextMaxRLLoss", "TextLUSPOLoss", "TextVESPOLoss"]


class RewardRangeError(UserError, ValueError):
    """Rewards outside the range a loss is defined on (MaxRL's ``[0, 1]``)."""


class TextGDPOLoss(TextGRPOLoss):
    """GDPO: several rewards, each standardised within its prompt's group, summed with weights,
    the sum standardised over the batch; GRPO's clipped ratio and aggregation.

    Liu et al. 2026, Group reward-Decoupled Normalization Policy Optimization, arXiv:2601.05242
    (:func:`~offline_plugins.objectives.llm.estimators.decoupled_advantages`). GRPO on the summed
    reward gives the responses whose totals tie one advantage whatever each reward said (a correct
    answer without the format and a formatted wrong one); standardising each reward on its own
    keeps them apart. ``beta = 0``.

    Keyword Args:
        reward_weights (sequence of float): one weight per reward, in the order of
            ``("next", "reward_components")``. Defaults to ``None`` (all 1).
        Others as :class:`TextGRPOLoss` (``token_baseline`` must stay ``"group"``: the advantage is
        the rewards' combination, not one reward's baseline).
    """

    @dataclass
    class _AcceptedKeys(TextGRPOLoss._AcceptedKeys):
        """GRPO's keys and ``reward_components``: ``("next", "reward_components")``, ``[B, K]``."""

        reward_components: NestedKey = ("next", "reward_components")

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys
    reads = (*TextGRPOLoss.reads, "reward_components")
    default_beta = 0.0
    token_baseline_applies = False

    def __init__(self, actor_network, *, reward_weights: Optional[Sequence[float]] = None, **kwargs) -> None:
        super().__init__(actor_network, **kwargs)
        if reward_weights is not None:
            weights = list(reward_weights)
            if not weights or any(isinstance(w, bool) or not isinstance(w, (int, float)) or not w == w
                                  for w in weights):
                raise ValueError(f"{type(self).__name__}: reward_weights must be numbers, one per reward, got "
                                 f"{reward_weights!r}")
            self.register_buffer("reward_weights", torch.tensor([float(w) for w in weights]))
        else:
            self.reward_weights = None

    def process_rollouts(self, td: TensorDictBase) -> TensorDictBase:
        """Write the decoupled advantage and ``has_signal``; with ``rollout_correction`` the weights."""
        comps = self._get(td, "reward_components", "each response's rewards side by side, [B, K] (a run given "
                          "several rewards, --reward NAME=SPEC twice or more, writes them)")
        if comps.dim() != 2 or comps.shape[-1] < 2:
            raise UserError(f"{type(self).__name__} combines several rewards; the batch holds {comps.shape[-1]} per "
                            "response: give two or more, e.g. --reward correct=task --reward format=MODULE:FUNCTION")
        weights = self.reward_weights if self.reward_weights is not None else torch.ones(comps.shape[-1])
        if weights.numel() != comps.shape[-1]:
            raise UserError(f"{type(self).__name__}: {weights.numel()} reward_weights for {comps.shape[-1]} rewards; "
                            "give one weight per --reward, in their order")
        mask = self._get(td, "response_mask", "the response-token mask")
        adv, signal = decoupled_advantages(comps, self._get(td, "group", "the prompt ids"), weights.to(comps.device))
        td.set(self.tensor_keys.advantage, self._on_response(adv, mask))
        td.set("has_signal", signal)
        if self.rollout_correction is not None:
            td = self._rollout_weights(td)
        return td


class TextMaxRLLoss(TextGRPOLoss):
    """MaxRL: the advantage ``(r - mean_g) / mean_g``, which estimates the gradient of the log of each
    prompt's success probability (maximum likelihood) where GRPO's estimates the probability's.

    Maximum Likelihood Reinforcement Learning, arXiv:2602.02710
    (:func:`~offline_plugins.objectives.llm.estimators.maxrl_advantages`): with binary rewards the
    update is the mean score of the correct responses minus the group's mean score, so a prompt
    the policy rarely answers weighs ``1 / p`` times what it weighs in REINFORCE, and a prompt it
    always answers nothing. Rewards must lie in ``[0, 1]`` (a :class:`RewardRangeError` otherwise);
    GRPO's clipped ratio and aggregation, ``beta = 0``.
    """

    default_beta = 0.0

    def advantages(self, rewards: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = torch.aminmax(rewards.detach())
        if bool((lo < 0) | (hi > 1)):  # once a round: the check that the estimator means what it says
            raise RewardRangeError(
                f"{type(self).__name__}: MaxRL's advantage is defined for rewards in [0, 1] (success, or a success "
                f"probability), and this round's lie in [{float(lo):.3g}, {float(hi):.3g}]; train on a verifier's "
                "0/1 reward (drop a format or penalty reward), or use grpo for other rewards")
        return maxrl_advantages(rewards, groups)


class TextLUSPOLoss(TextGSPOLoss):
    """LUSPO: GSPO with each response's sequence term weighted by its length.

    Liu et al. 2026, Length-Unbiased Sequence Policy Optimization, arXiv:2602.05261. GSPO averages
    one clipped sequence term per response, so a long response's tokens share the weight a short
    one's get alone, and training drifts to shorter answers; LUSPO multiplies each response's term
    by its length ``|o_i|``, so every token weighs the same: ``1/G sum_i |o_i| min(s_i A_i, clip(s_i) A_i)``.
    GSPO's ratio, clip and ``beta``.
    """

    def aggregate(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Each response's token sum (its sequence term times its length), averaged over responses."""
        return (per_token * mask.to(per_token.dtype)).sum(-1).mean()


class TextVESPOLoss(TextGRPOLoss):
    """VESPO: REINFORCE weighted by a smooth reshaping of each response's whole importance ratio.

    Shen et al. 2026, Variational Sequence-level Soft Policy Optimization, arXiv:2602.10693. Per
    response token ``sg(phi(w)) * A * log pi``, ``w = prod_t pi / pi_sample`` over the response,
    ``phi(w) = w^k exp(lambda (1 - w))`` with ``(k, lambda)`` chosen by the sign of the advantage
    (:func:`~offline_plugins.objectives.llm.estimators.gamma_sequence_weight`), averaged over all
    response tokens of the batch (verl's ``token-mean``, VESPO's recipe). ``phi(1) = 1``: on-policy it is
    GRPO's gradient; a stale response whose ratio exploded or vanished weighs little, where a hard
    clip keeps a fixed edge. The value uses ``log(pi / pi_sample)`` for ``log pi`` (the same gradient,
    0 on-policy), as CISPO here. Defaults ``k_pos = 2``, ``lam_pos = 3``, ``k_neg = 3``,
    ``lam_neg = 2`` (the paper's released training scripts), ``beta = 0``; ``clip_epsilon`` unused;
    ``clip_fraction`` counts the tokens of responses whose weight fell below one half.
    """

    default_beta = 0.0
    aggregate = DAPOLoss.aggregate

    def __init__(self, actor_network, *, k_pos: float = 2.0, lam_pos: float = 3.0, k_neg: float = 3.0,
                 lam_neg: float = 2.0, **kwargs) -> None:
        super().__init__(actor_network, **kwargs)
        for name, value, low in (("k_pos", k_pos, 0.0), ("k_neg", k_neg, 0.0), ("lam_pos", lam_pos, None),
                                 ("lam_neg", lam_neg, None)):
            bad = isinstance(value, bool) or not isinstance(value, (int, float))
            if bad or (value < low if low is not None else not value > 0):
                raise ValueError(f"{type(self).__name__}: {name} must be a number "
                                 f"{'>= 0' if low is not None else '> 0'}, got {value!r}")
        self.shape = {"k_pos": float(k_pos), "lam_pos": float(lam_pos), "k_neg": float(k_neg),
                      "lam_neg": float(lam_neg)}

    def surrogate(self, log_ratio, advantage, mask=None, log_probs=None):
        """``sg(phi(w)) * A * l`` on each token, and which responses' weight fell below one half."""
        if mask is None:
            raise ValueError(f"{type(self).__name__} needs the response mask (forward passes it)")
        phi = gamma_sequence_weight(log_ratio, mask, advantage, **self.shape).unsqueeze(-1)
        return phi * advantage * log_ratio, (phi < 0.5).expand_as(log_ratio)
