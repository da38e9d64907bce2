"""GRPO and its variants as TorchRL loss modules: GRPO, DAPO, Dr. GRPO, RLOO, CISPO, GSPO, SAPO, GMPO
and DPPO (the 2026 variants, GDPO, MaxRL, LUSPO and VESPO, are in
:mod:`offline_plugins.objectives.llm.online_variants`; REINFORCE++ in
:mod:`offline_plugins.objectives.llm.reinforce`; SFT and expert iteration in
:mod:`offline_plugins.objectives.llm.sft`; all re-exported by :mod:`offline_plugins.objectives.llm.online`).

Every loss reads one batch of rollouts in the TED text layout (DESIGN.md), the rows a
rollout collector (:mod:`offline_plugins.text.data.rollouts`) writes into a TorchRL replay
buffer:

=========================================  ==========================================================
``("tokens", "full")`` ``[B, T]``          prompt + response, right-padded
``("masks", "all_attention_mask")``        real tokens
``("masks", "all_assistant_mask")``        response tokens (the ones the policy chose)
``("log_probs", "full")``                  the sampling policy's per-token log-probs (PPO's old policy)
``("next", "ref_log_probs", "full")``      the reference's per-token log-probs
``("next", "reward")`` ``[B, 1]``          the task's reward
``"group"`` ``[B]``                        prompt id: rows of a group answer the same prompt
``"advantage"`` ``[B, T, 1]``              the row's advantage on its response tokens, 0 elsewhere
=========================================  ==========================================================

The advantage is written once per batch of rollouts by the loss's own estimator
(:meth:`TextGRPOLoss.process_rollouts`: rewards -> advantages, which each variant overrides),
so the same buffer serves several optimisation epochs, each step a PPO-style clipped
ratio against the sampling log-probs. TorchRL's own ``torchrl.objectives.llm.GRPOLoss``
reads these rows unchanged (``tests/test_online_losses.py``).

Why our own loss beside TorchRL's ``GRPOLoss``: TorchRL's computes the current log-probs
from a distribution its LLM wrapper builds (``get_dist``: a full-vocabulary
``[B, T, V]`` distribution, for its entropy bonus), so it needs a ``TransformersWrapper``
actor; ours reads the gathered log-probs of :class:`~offline_plugins.modules.causal_lm.CausalLMLogProbs`
(the actor the preference losses use). TorchRL's k3 KL term averages over every
position of the padded batch (``(diff.expm1() - diff).mean()``, with padding counted as
zero), so its size depends on the padding; ours averages over response tokens. And the
variants here differ in the advantage estimator and the aggregation, each one hook.

Advantages on the seeds' worked example 5.6.2(a), population std:

>>> import torch
>>> group_advantages(torch.tensor([1., 0., 1., 0.]), torch.tensor([0, 0, 0, 0]))[0]
tensor([ 1., -1.,  1., -1.])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase

from offline_plugins.objectives.llm.estimators import (  # noqa: F401 - group_advantages, overlong_penalty: re-exported
    group_advantages,
    k3_kl,
    off_policy_sequence_mask,
    optimal_token_advantages,
    overlong_penalty,
    unbiased_kl,
)
from offline_plugins.objectives.llm.rollout import GroupAdvantageLoss, RolloutLoss

#: the baselines of the GRPO family's advantage (``token_baseline``)
TOKEN_BASELINES = ("group", "optimal")

__all__ = ["TOKEN_BASELINES", "TextGRPOLoss", "DAPOLoss", "DrGRPOLoss", "RLOOLoss", "TextCISPOLoss", "TextGSPOLoss",
           "TextSAPOLoss", "TextGMPOLoss", "TextDPPOLoss"]


class TextGRPOLoss(GroupAdvantageLoss):
    """GRPO: group-normalised advantages, a clipped ratio, k3 KL to the reference.

    Shao et al. 2024, DeepSeekMath, arXiv:2402.03300. Per response token,
    ``min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) - beta * KL_k3`` with
    ``rho = pi / pi_sample``; averaged over each response's tokens, then over responses
    (the paper's ``1/G sum_i 1/|o_i| sum_t``).

    Args:
        actor_network: writes per-token log-probs at ``("log_probs", "full")`` from
            ``("tokens", "full")`` (e.g. :class:`~offline_plugins.modules.causal_lm.CausalLMLogProbs`).
            The loss writes them at its ``log_probs`` key instead (the batch's entry there
            is the sampling policy's).

    Keyword Args:
        clip_epsilon (float or (low, high)): ratio clipping. Defaults to ``0.2``.
        beta (float): weight of the k3 KL to the reference. Defaults to ``0.04`` (the paper's).
        length_normalizer (int, optional): Dr. GRPO's constant normaliser; unused here.
        rollout_correction (float, optional): correct for a sampler whose log-probs differ from
            the trainer's (another engine, another precision): :meth:`process_rollouts` scores the
            round once with the trainer's own forward, the ratio ``rho`` is taken against those
            log-probs, and each token's term is weighted by the truncated importance weight
            ``min(pi_trainer / pi_sample, cap)`` (TIS; TRL's ``vllm_importance_sampling_cap``,
            verl's rollout correction). The weights' effective sample size and the sampler's
            k1 KL to the trainer are logged (``rollout_ess``, ``rollout_mismatch_kl``). Defaults
            to ``None`` (off: the sampler's log-probs are the trainer's).
        token_baseline (str): ``"group"`` (the loss's own per-response advantage) or ``"optimal"``: the
            optimal token baseline (:func:`~offline_plugins.objectives.llm.estimators.optimal_token_advantages`;
            Li et al. 2026, arXiv:2602.07078), a baseline per position of each prompt's group weighted
            by each response's score norm so far, written per token in place of the group's. It reads
            the full-vocabulary distribution of every sampled token: :meth:`process_rollouts` runs one
            more forward of the policy (``actor_network.logits``). Defaults to ``"group"``.
        unbiased_kl (bool): the KL term is DeepSeek-V3.2's estimate, k3 weighted by ``pi / pi_sample``
            (:func:`~offline_plugins.objectives.llm.estimators.unbiased_kl`), whose gradient stays the
            KL's once the policy has moved from the sampler. Defaults to ``False`` (k3).
        off_policy_mask (float, optional): DeepSeek-V3.2's off-policy sequence masking with threshold
            ``delta``: a response with a negative advantage whose mean ``log(pi_sample / pi)`` exceeds
            ``delta`` is left out of the objective
            (:func:`~offline_plugins.objectives.llm.estimators.off_policy_sequence_mask`; the share left
            out is logged as ``masked_sequences``). Defaults to ``None`` (off).

    Examples:
        >>> import torch
        >>> from offline_plugins.modules.causal_lm import CausalLMLogProbs
        >>> from offline_plugins.objectives.llm.online import TextGRPOLoss
        >>> loss = TextGRPOLoss(CausalLMLogProbs(torch.nn.Embedding(6, 6)))
        >>> tokens = torch.randint(0, 6, (4, 5))
        >>> td = loss.process_rollouts(_example_rollouts(tokens, [1., 0., 1., 0.], [0, 0, 0, 0]))
        >>> td["advantage"][:, -1, 0].tolist()
        [1.0, -1.0, 1.0, -1.0]
        >>> out = loss(td)
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_kl', 'loss_objective']
    """

    @dataclass
    class _AcceptedKeys(RolloutLoss._AcceptedKeys):
        """The text keys of :class:`~offline_plugins.objectives.llm.rollout.RolloutLoss`, plus ``log_probs``:
        where the actor writes the current log-probs, ``("log_probs", "current")``."""

        log_probs: NestedKey = ("log_probs", "current")
        #: the trainer's log-probs of the sampled tokens at the round's start (``rollout_correction``)
        trainer_log_probs: NestedKey = ("log_probs", "trainer")
        #: the truncated importance weight of each token (``rollout_correction``)
        rollout_weight: NestedKey = "rollout_weight"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys
    #: whether the KL to the reference is a loss term (RLOO puts it in the reward instead)
    kl_as_term: bool = True
    #: whether the advantage is a per-response one that ``token_baseline="optimal"`` may replace
    token_baseline_applies: bool = True
    default_clip = 0.2
    default_beta = 0.04

    def __init__(
        self,
        actor_network: Optional[torch.nn.Module],
        *,
        clip_epsilon=None,
        beta: Optional[float] = None,
        length_normalizer: Optional[int] = None,
        rollout_correction: Optional[float] = None,
        token_baseline: str = "group",
        unbiased_kl: bool = False,
        off_policy_mask: Optional[float] = None,
    ) -> None:
        super().__init__()
        self.actor_network = actor_network
        name = type(self).__name__
        if token_baseline not in TOKEN_BASELINES:
            raise ValueError(f"{name}: token_baseline must be one of {', '.join(TOKEN_BASELINES)}, got "
                             f"{token_baseline!r}")
        if token_baseline == "optimal" and not self.token_baseline_applies:
            raise ValueError(f"{name}: token_baseline='optimal' replaces a per-response group advantage, which "
                             f"{name} does not use (it writes its own); leave token_baseline='group'")
        self.token_baseline = token_baseline
        self.unbiased_kl = bool(unbiased_kl)
        if off_policy_mask is not None and (isinstance(off_policy_mask, bool)
                                            or not isinstance(off_policy_mask, (int, float)) or off_policy_mask < 0):
            raise ValueError(f"{name}: off_policy_mask is the threshold on a response's mean log(pi_sample / pi), a "
                             f"number >= 0 or None, got {off_policy_mask!r}")
        self.off_policy_mask = None if off_policy_mask is None else float(off_policy_mask)
        if rollout_correction is not None and not (isinstance(rollout_correction, (int, float))
                                                   and not isinstance(rollout_correction, bool)
                                                   and float(rollout_correction) >= 1):
            raise ValueError(f"{type(self).__name__}: rollout_correction is the importance weight's cap, a number "
                             f">= 1 (2-3 in TRL and verl) or None, got {rollout_correction!r}")
        self.rollout_correction = None if rollout_correction is None else float(rollout_correction)
        if self.rollout_correction is not None:
            self.reads = (*type(self).reads, "trainer_log_probs", "rollout_weight")
        clip = self.default_clip if clip_epsilon is None else clip_epsilon
        low, high = (clip, clip) if isinstance(clip, (int, float)) else tuple(clip)
        if not (0 < float(low) < 1 and float(high) > 0):
            raise ValueError(f"{type(self).__name__}: clip_epsilon must be in (0, 1), got {clip_epsilon!r}")
        self.register_buffer("clip_low", torch.tensor(float(low)))
        self.register_buffer("clip_high", torch.tensor(float(high)))
        self.register_buffer("beta", torch.tensor(float(self.default_beta if beta is None else beta)))
        self.length_normalizer = length_normalizer
        # a python flag, so forward needs no host sync to know whether the KL term exists
        self.has_kl_term = self.kl_as_term and float(self.beta) > 0

    @property
    def out_keys(self):
        keys = ["loss_objective", "loss_kl", "kl_to_reference", "clip_fraction", "ratio_mean"]
        keys += ["rollout_ess", "rollout_mismatch_kl"] if self.rollout_correction is not None else []
        return keys + (["masked_sequences"] if self.off_policy_mask is not None else [])

    def process_rollouts(self, td: TensorDictBase) -> TensorDictBase:
        """The advantages, and with ``rollout_correction`` the trainer's log-probs of the round and
        each token's truncated importance weight ``min(exp(lp_trainer - lp_sample), cap)``."""
        td = super().process_rollouts(td)
        if self.rollout_correction is not None:
            td = self._rollout_weights(td)
        if self.token_baseline == "optimal":
            td = self._optimal_token_baseline(td)
        return td

    def _rollout_weights(self, td: TensorDictBase) -> TensorDictBase:
        k = self.tensor_keys
        tokens, attn, mask = self._text(td)
        mask = mask.bool()
        with torch.no_grad():
            trainer = self._log_probs(td, tokens, attn)
        sample = self._get(td, "sample_log_probs", "the sampling policy's log-probs")
        log_w = torch.where(mask, trainer - sample, torch.zeros_like(trainer))
        td.set(k.trainer_log_probs, trainer)
        td.set(k.rollout_weight, torch.where(mask, log_w.exp().clamp(max=self.rollout_correction),
                                             torch.zeros_like(trainer)))
        return td

    def _optimal_token_baseline(self, td: TensorDictBase) -> TensorDictBase:
        """Replace the advantage by the optimal token baseline's (``token_baseline="optimal"``)."""
        k = self.tensor_keys
        tokens, attn, mask = self._text(td)
        mask = mask.bool()
        logits_of = getattr(self.actor_network, "logits", None)
        if logits_of is None:
            raise ValueError(f"{type(self).__name__}: token_baseline='optimal' reads the policy's full distribution "
                             f"at each sampled token, and the actor {type(self.actor_network).__name__} has no "
                             "logits(tokens, attention_mask) (CausalLMLogProbs has)")
        with torch.no_grad():
            logits = logits_of(tokens, attn)[..., :-1, :].float()
            sum_p2 = torch.nn.functional.pad(logits.softmax(-1).pow(2).sum(-1), (1, 0))  # position t: the next token's
        dense = td.get(k.token_reward, None)
        if dense is not None:  # a multi-turn episode's rewards where earned: what is still to come
            returns = dense.to(torch.float32).flip(-1).cumsum(-1).flip(-1)
        else:
            returns = self.rollout_rewards(td).unsqueeze(-1).expand(mask.shape)
        sample = self._get(td, "sample_log_probs", "the sampling policy's log-probs")
        weights = td.get(k.rollout_weight, None) if self.rollout_correction is not None else None
        adv = optimal_token_advantages(returns, sample, sum_p2, mask, self._get(td, "group", "the prompt ids"),
                                       weights=weights)
        td.set(k.advantage, adv.unsqueeze(-1))
        return td

    def _log_probs(self, td: TensorDictBase, tokens: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        if getattr(self.actor_network, "shared_prefix", False):  # a group's responses share their prompt's forward
            return self.actor_network.log_probs(tokens, attn, self._get(td, "response_mask", "the response-token mask"))
        if hasattr(self.actor_network, "log_probs"):
            return self.actor_network.log_probs(tokens, attn)
        k = self.tensor_keys
        return self.actor_network(td.select(k.tokens, k.attention_mask).clone()).get(("log_probs", "full"))

    def advantages(self, rewards: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(advantage [B], has_signal [B])``: GRPO's group-standardised reward (population std)."""
        return group_advantages(rewards, groups, scale=True)

    # -- the objective --------------------------------------------------------
    def aggregate(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """GRPO: mean over each response's tokens, then over responses."""
        m = mask.to(per_token.dtype)
        return ((per_token * m).sum(-1) / m.sum(-1).clamp_min(1)).mean()

    def importance_log_ratio(self, log_probs: torch.Tensor, sample_log_probs: torch.Tensor,
                             mask: torch.Tensor) -> torch.Tensor:
        """``log(pi / pi_sample)`` per response token, 0 elsewhere: GRPO's token-level ratio."""
        return torch.where(mask, log_probs - sample_log_probs, torch.zeros_like(log_probs))

    def surrogate(self, log_ratio: torch.Tensor, advantage: torch.Tensor, mask: Optional[torch.Tensor] = None,
                  log_probs: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """PPO's clipped surrogate per token and whether each token was clipped. ``mask`` (the response
        tokens) and ``log_probs`` (the current per-token log-probs) are there for the variants whose
        objective needs them (GMPO's sequence mean, DPPO's probabilities)."""
        ratio = log_ratio.exp()
        clipped = ratio.clamp(1 - self.clip_low, 1 + self.clip_high)
        gain = torch.minimum(ratio * advantage, clipped * advantage)
        return gain, (ratio * advantage) > (clipped * advantage)

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        k = self.tensor_keys
        tokens, attn, mask = self._text(tensordict)
        mask = mask.bool()
        sample_lp = self._get(tensordict, "sample_log_probs", "the sampling policy's log-probs")
        advantage = self._get(tensordict, "advantage", "the advantages (written by loss.process_rollouts)")
        advantage = advantage.reshape(mask.shape)
        lp = self._log_probs(tensordict, tokens, attn)
        weight = None
        if self.rollout_correction is not None:
            # the ratio against the trainer's own log-probs of the round, the sampler's mismatch in the weight
            weight = self._get(tensordict, "rollout_weight", "the rollout weights (written by loss.process_rollouts "
                               "with rollout_correction)")
            old_lp = self._get(tensordict, "trainer_log_probs", "the trainer's log-probs of the round")
        log_ratio = self.importance_log_ratio(lp, sample_lp if weight is None else old_lp, mask)
        gain, clipped = self.surrogate(log_ratio, advantage, mask=mask, log_probs=lp)
        if weight is not None:
            gain = gain * weight.detach()
        keep = None
        if self.off_policy_mask is not None:  # against the sampler's own log-probs, whatever the ratio is taken to
            keep = off_policy_sequence_mask(lp, sample_lp, advantage, mask, self.off_policy_mask)
            gain = gain * keep.unsqueeze(-1).to(gain.dtype)
        m = mask.to(lp.dtype)
        out = TensorDict({"loss_objective": -self.aggregate(gain, mask)}, [])
        ref = tensordict.get(k.ref_log_probs, None)
        if ref is not None:
            per_token = (unbiased_kl(lp, ref, sample_lp if weight is None else old_lp) if self.unbiased_kl
                         else k3_kl(lp, ref))
            kl = torch.where(mask, per_token, torch.zeros_like(lp))
            if self.has_kl_term:
                out.set("loss_kl", self.beta * self.aggregate(kl, mask))
            with torch.no_grad():
                out.set("kl_to_reference", (kl.sum(-1)).mean().detach())
        with torch.no_grad():
            n = m.sum().clamp_min(1)
            out.set("clip_fraction", (clipped.to(lp.dtype) * m).sum() / n)
            out.set("ratio_mean", (log_ratio.exp() * m).sum() / n)
            if weight is not None:
                w = weight * m
                out.set("rollout_ess", w.sum() ** 2 / (n * (w * w).sum()).clamp_min(1e-12))
                out.set("rollout_mismatch_kl", ((sample_lp - old_lp) * m).sum() / n)
            if keep is not None:
                out.set("masked_sequences", 1 - keep.to(lp.dtype).mean())
        return out


class DAPOLoss(TextGRPOLoss):
    """DAPO: clip-higher, token-level aggregation, dynamic sampling, overlong penalty.

    Yu et al. 2025, DAPO, arXiv:2503.14476. The ratio is clipped to ``[1 - 0.2, 1 + 0.28]``;
    the loss averages over all response tokens of the batch (long responses weigh by
    their length); groups whose rewards are all equal are dropped and more prompts sampled
    (the collector reads ``dynamic_sampling``); a response within ``overlong_cache``
    tokens of ``max_new_tokens`` is penalised (:func:`overlong_penalty`). No KL term
    (``beta = 0``), as in the paper.

    Keyword Args:
        max_new_tokens, overlong_cache: the overlong penalty's length budget and its soft zone
            (``overlong_cache = 0``: no penalty). Others as :class:`TextGRPOLoss`.
    """

    dynamic_sampling = True
    default_clip = (0.2, 0.28)
    default_beta = 0.0

    def __init__(self, actor_network, *, max_new_tokens: int = 8, overlong_cache: int = 0, **kwargs) -> None:
        super().__init__(actor_network, **kwargs)
        self.max_new_tokens = int(max_new_tokens)
        self.overlong_cache = int(overlong_cache)

    def aggregate(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Token-level: the sum over every response token of the batch over their number."""
        m = mask.to(per_token.dtype)
        return (per_token * m).sum() / m.sum().clamp_min(1)

    def rollout_rewards(self, td: TensorDictBase) -> torch.Tensor:
        reward = super().rollout_rewards(td)
        if self.overlong_cache <= 0:
            return reward
        lengths = self._get(td, "response_mask", "the response-token mask").sum(-1)
        return reward + overlong_penalty(lengths, max_length=self.max_new_tokens, cache=self.overlong_cache)


class DrGRPOLoss(TextGRPOLoss):
    """Dr. GRPO: GRPO without the std scaling and with a constant length normaliser.

    Liu et al. 2025, Understanding R1-Zero-Like Training, arXiv:2503.20783: dividing by the
    group's std up-weights easy and hard prompts, and dividing by each response's length
    favours long wrong answers; Dr. GRPO uses ``r - mean_g`` and divides each response's
    token sum by one constant (``length_normalizer``, the generation budget).
    """

    default_beta = 0.0

    def advantages(self, rewards, groups):
        return group_advantages(rewards, groups, scale=False)

    def aggregate(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Each response's token sum over the constant ``length_normalizer``, averaged over responses."""
        norm = float(self.length_normalizer or per_token.shape[-1])
        return ((per_token * mask.to(per_token.dtype)).sum(-1) / norm).mean()


class RLOOLoss(TextGRPOLoss):
    """RLOO: REINFORCE with the leave-one-out baseline, the KL to the reference in the reward.

    Ahmadian et al. 2024, Back to Basics, arXiv:2402.14740. Each response's reward is
    ``r - beta * sum_t (log pi_sample - log pi_ref)`` (the sequence-level KL, from the
    sampling log-probs), its advantage that reward minus the mean of the other ``G - 1`` of
    its group, unscaled. The update keeps PPO's clipped ratio so the buffer serves several
    epochs (TRL's RLOO trainer does the same). ``beta`` defaults to ``0.05``.
    """

    default_beta = 0.05

    kl_as_term = False

    def rollout_rewards(self, td: TensorDictBase) -> torch.Tensor:
        return _minus_sequence_kl(self, td, super().rollout_rewards(td))

    def advantages(self, rewards, groups):
        return group_advantages(rewards, groups, leave_one_out=True)


class TextCISPOLoss(TextGRPOLoss):
    """CISPO: the clipped, detached importance weight times the log-prob, every token kept.

    MiniMax 2025, MiniMax-M1, arXiv:2506.13585 (its CISPO objective). Per response token
    ``sg(clip(rho, 1 - eps_low, 1 + eps_high)) * A * log pi`` with ``rho = pi / pi_sample``,
    summed over every response token of the batch over their number (the paper's
    ``1 / sum_i |o_i|``, DAPO's aggregation). Where PPO's ``min`` zeroes the gradient of a
    clipped token, CISPO only caps its weight, so rare tokens with a large ratio still learn.
    The value uses ``log(pi / pi_sample)`` for ``log pi``: the same gradient, and 0 on-policy.

    Defaults: ``clip_epsilon = 0.2`` (TorchRL's ``CISPOLoss``, which inherits ``GRPOLoss``'s
    ``[0.8, 1.2]``; the paper sets no lower bound and tunes only the upper one:
    ``clip_epsilon=(0.99, eps_high)``); ``beta = 0`` (the paper's objective has no KL term; TorchRL's
    ``CISPOLoss`` adds none unless ``kl_to_ref_coeff`` is set). Not TorchRL's ``CISPOLoss``: that one returns
    ``-clip(rho) * A`` without the detach, whose gradient is 0 wherever the weight is clipped.
    """

    default_beta = 0.0
    aggregate = DAPOLoss.aggregate

    def surrogate(self, log_ratio, advantage, mask=None, log_probs=None):
        """``sg(clip(rho)) * A * log_ratio`` and whether each token's weight was clipped."""
        ratio = log_ratio.detach().exp()
        weight = ratio.clamp(1 - self.clip_low, 1 + self.clip_high)
        return weight * advantage * log_ratio, weight != ratio


class TextGSPOLoss(TextGRPOLoss):
    """GSPO: one importance ratio per response, the geometric mean of its tokens' ratios, clipped.

    Zheng et al. 2025, Group Sequence Policy Optimization, arXiv:2507.18071:
    ``s_i = exp(1/|o_i| sum_t log(pi / pi_sample))``, the objective
    ``1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)``. ``s_i`` is written on
    each of the response's tokens, so GRPO's surrogate and aggregation (token mean per response,
    then mean over responses) give exactly that sum (TRL's ``importance_sampling_level="sequence"``
    does the same). Defaults from the paper (v2, section 5.1), as TRL's paper index quotes them:
    ``clip_epsilon = (3e-4, 4e-4)``, ``beta = 0``. On-policy (one pass, ratio 1) it is GRPO's
    gradient with the same advantages; the two differ once the policy has moved.
    """

    default_clip = (3e-4, 4e-4)
    default_beta = 0.0

    def importance_log_ratio(self, log_probs, sample_log_probs, mask):
        """``log s_i``, the mean over the response's tokens, on each of its tokens (0 elsewhere)."""
        per_token = super().importance_log_ratio(log_probs, sample_log_probs, mask)
        m = mask.to(per_token.dtype)
        per_row = per_token.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1)
        return per_row * m


class TextSAPOLoss(TextGRPOLoss):
    """SAPO: a soft gate of the ratio in place of PPO's hard clip.

    Soft Adaptive Policy Optimization (Qwen team, 2025), arXiv:2511.20347. Per response token
    ``f(rho) A`` with ``f(rho) = 4 / tau * sigmoid(tau (rho - 1))``, ``tau = tau_pos`` where
    ``A > 0`` and ``tau_neg`` elsewhere; GRPO's aggregation and advantages. The gate's gradient
    weight ``4 sigma (1 - sigma) rho`` is 1 on-policy (GRPO's gradient) and falls smoothly as the
    ratio moves away, where PPO's clip cuts it to 0 at a fixed edge. Defaults ``tau_pos = 1.0``,
    ``tau_neg = 1.05``, ``beta = 0`` (the values verl and ms-swift ship for SAPO). ``clip_epsilon``
    is unused; ``clip_fraction`` counts the tokens whose gradient weight fell below one half.
    """

    default_beta = 0.0

    def __init__(self, actor_network, *, tau_pos: float = 1.0, tau_neg: float = 1.05, **kwargs) -> None:
        super().__init__(actor_network, **kwargs)
        for name, tau in (("tau_pos", tau_pos), ("tau_neg", tau_neg)):
            if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0:
                raise ValueError(f"{type(self).__name__}: {name} must be a positive temperature, got {tau!r}")
        self.register_buffer("tau_pos", torch.tensor(float(tau_pos)))
        self.register_buffer("tau_neg", torch.tensor(float(tau_neg)))

    def surrogate(self, log_ratio, advantage, mask=None, log_probs=None):
        """``4 / tau * sigmoid(tau (rho - 1)) * A`` and whether the gate's gradient weight is below 1/2."""
        ratio = log_ratio.exp()
        tau = torch.where(advantage > 0, self.tau_pos, self.tau_neg)
        gate = torch.sigmoid(tau * (ratio - 1))
        weight = 4 * gate * (1 - gate) * ratio
        return gate * (4 / tau) * advantage, weight.detach() < 0.5


class TextGMPOLoss(TextGRPOLoss):
    """GMPO: the geometric mean of the tokens' clipped ratios, one per response.

    Zhao et al. 2025, Geometric-Mean Policy Optimization, arXiv:2507.20673. Each token's log-ratio
    ``l_t = log(pi / pi_sample)`` is clipped in log space on the side the advantage's sign makes
    PPO's trust region (above ``clip_high`` where ``A > 0``, below ``-clip_low`` where ``A < 0``),
    and the response's objective is ``A * exp(mean_t l_t)``: the geometric mean of its ratios,
    which one outlier token moves far less than GRPO's arithmetic mean. Written on each response
    token, GRPO's aggregation (token mean per response, then mean) gives that per-response value.
    Defaults: ``clip_epsilon = (0.4, 0.4)`` in log space (ratios in ``(e^-0.4, e^0.4)``, the paper's
    section 4, as TRL's ``GMPOConfig``), ``beta = 0``.
    """

    default_clip = (0.4, 0.4)
    default_beta = 0.0

    def surrogate(self, log_ratio, advantage, mask=None, log_probs=None):
        """``A * exp(mean_t l_t)`` with the one-sided clip in log space, on each response token."""
        if mask is None:
            raise ValueError(f"{type(self).__name__} needs the response mask (forward passes it)")
        m = mask.to(log_ratio.dtype)
        sign = torch.sign(advantage)
        clipped_l = log_ratio.clamp(-self.clip_low, self.clip_high)
        kept = sign * torch.minimum(sign * log_ratio, sign * clipped_l)
        mean_l = (kept * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1)
        # the response's advantage is the same on each of its tokens: its mean over them
        adv = (advantage * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1)
        return (adv * mean_l.exp()) * m, kept != log_ratio


class TextDPPOLoss(TextGRPOLoss):
    """DPPO (Binary-TV): a trust region on the change of each token's probability, not its ratio.

    Rethinking the Trust Region in LLM Reinforcement Learning (2026), arXiv:2602.04879
    (verl's ``dppo_tv`` policy loss). A token counts where its probability moved less than the
    threshold in the direction the advantage pushes it (``p - p_sample <= tv_high`` where ``A > 0``,
    ``>= -tv_low`` where ``A < 0``); the objective is ``sg(min(rho, cap)) * A * log pi`` on the tokens
    that count and 0 on the others. Where the ratio clip of PPO over-penalises rare tokens
    (1e-5 -> 1e-3 is a ratio of 100) and under-penalises frequent ones (0.99 -> 0.8 is a ratio of
    0.81), the probability change is what the trust region bounds. The value uses
    ``log(pi / pi_sample)`` for ``log pi`` (the same gradient, 0 on-policy), as CISPO here.
    Defaults: ``clip_epsilon = (0.15, 0.15)`` the TV thresholds, ``cap = 20`` (verl's recipe and its loss's
    default), ``beta = 0``; GRPO's advantages and aggregation.
    """

    default_clip = (0.15, 0.15)
    default_beta = 0.0

    def __init__(self, actor_network, *, cap: float = 20.0, **kwargs) -> None:
        super().__init__(actor_network, **kwargs)
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap >= 1:
            raise ValueError(f"{type(self).__name__}: cap truncates the importance weight, a number >= 1, got {cap!r}")
        self.register_buffer("cap", torch.tensor(float(cap)))

    def surrogate(self, log_ratio, advantage, mask=None, log_probs=None):
        """``sg(min(rho, cap)) * A * l`` on the tokens inside the TV region, and which were outside."""
        if log_probs is None:
            raise ValueError(f"{type(self).__name__} needs the current log-probs (forward passes them)")
        p = log_probs.detach().exp()
        p_sample = (log_probs.detach() - log_ratio.detach()).exp()
        moved = p - p_sample
        inside = torch.where(advantage > 0, moved <= self.clip_high, moved >= -self.clip_low)
        weight = log_ratio.detach().exp().clamp(max=self.cap)
        return torch.where(inside, weight * advantage * log_ratio, torch.zeros_like(log_ratio)), ~inside


def _minus_sequence_kl(loss: TextGRPOLoss, td: TensorDictBase, reward: torch.Tensor) -> torch.Tensor:
    """``r - beta * sum_t (log pi_sample - log pi_ref)`` over each response's tokens (the reward as is
    without reference log-probs): RLOO's and REINFORCE++-baseline's KL in the reward."""
    ref = td.get(loss.tensor_keys.ref_log_probs, None)
    if ref is None:
        return reward
    mask = loss._get(td, "response_mask", "the response-token mask").to(reward.dtype)
    sample = loss._get(td, "sample_log_probs", "the sampling policy's log-probs")
    return reward - loss.beta * ((sample - ref) * mask).sum(-1)


def _example_rollouts(tokens: torch.Tensor, rewards, groups) -> TensorDict:
    """A batch of rollouts for the doctests: the last two tokens of each row are the response."""
    b, t = tokens.shape
    resp = torch.zeros(b, t, dtype=torch.bool)
    resp[:, -2:] = True
    return TensorDict(
        {
            "tokens": {"full": tokens},
            "masks": {"all_attention_mask": torch.ones(b, t, dtype=torch.bool), "all_assistant_mask": resp},
            "log_probs": {"full": torch.full((b, t), -1.8)},
            "next": {"reward": torch.tensor(rewards).reshape(b, 1), "ref_log_probs": {"full": torch.full((b, t), -1.8)}},
            "group": torch.tensor(groups),
        },
        [b],
    )
