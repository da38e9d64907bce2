"""PPO-RLHF: PPO against a reward model with a per-token KL penalty to the reference.

Ouyang et al. 2022, arXiv:2203.02155 (InstructGPT); Ziegler et al. 2019,
arXiv:1909.08593 (lm-human-preferences); Stiennon et al. 2020, arXiv:2009.01325.
The seeds' RLHF step 3 (003, 5.6.3): maximise ``E[r_phi(x, y)] - beta KL(pi || pi_ref)``.

It reads the TED text rows of :mod:`offline_plugins.objectives.llm.online` (the rollout
collector's layout) and adds, in :meth:`PPORLHFLoss.process_rollouts` (run once per round):

* per-token rewards ``r_t = -beta * kl_t`` on every response token, plus the sequence
  reward ``R`` on the last response token (:func:`kl_penalised_rewards`); ``kl_t`` is
  ``k1 = log pi_sample - log pi_ref`` (TRL's PPO and lm-human-preferences) or
  ``k3 = exp(d) - d - 1``, ``d = log pi_ref - log pi_sample``;
* the old values ``V(s_t)`` of a value head, GAE advantages and returns through
  TorchRL's ``generalized_advantage_estimate`` (``gamma = 1``, ``lam = 0.95``), the
  advantages whitened over the batch's response tokens;
* the adaptive KL controller of Ziegler et al. (``kl_coef`` and the step count are
  buffers, so a checkpoint of the loss keeps the controller's state).

Why not TorchRL's ``KLRewardTransform`` and ``ClipPPOLoss`` as they are: the transform is an
environment transform that calls a reference ``LLMWrapperBase`` on ``("tokens", "full")``
of each step and adds ``-coef * (log pi - log pi_ref)`` to the reward; our collector already
holds the reference's per-token log-probs for the sampled tokens (``("next",
"ref_log_probs", "full")``), so calling the reference again would be a second forward for
the same numbers. ``ClipPPOLoss`` builds a distribution from a probabilistic actor and a
critic on TorchRL's ``[B, T]`` step layout; a text rollout is one row per response with
tokens as the time axis, masked, read by :class:`~offline_plugins.modules.causal_lm.CausalLMLogProbs`.
The GAE itself is TorchRL's (functional form, ``time_dim=-2`` over the token axis).

Defaults (TRL ``PPOConfig`` / lm-human-preferences): ``cliprange = 0.2``,
``cliprange_value = 0.2``, ``vf_coef = 0.1``, ``gamma = 1``, ``lam = 0.95``,
``kl_coef = 0.05`` (TRL; lm-human-preferences starts at 0.15 with an adaptive target of 6 nats).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase
from torchrl.objectives.value.functional import generalized_advantage_estimate

from offline_plugins.errors import UserError
from offline_plugins.objectives.llm.estimators import masked_whiten  # noqa: F401 - re-exported (its home before)
from offline_plugins.objectives.llm.rollout import RolloutLoss

__all__ = ["on_last_token", "kl_penalised_rewards", "token_gae", "masked_whiten", "AdaptiveKLController", "PPORLHFLoss",
           "KLTargetError"]


class KLTargetError(UserError, ValueError):
    """A KL target or coefficient that cannot be used."""


def on_last_token(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: each row's value ``values [B]`` on its last response token, 0 elsewhere.

    >>> on_last_token(torch.tensor([2., 3.]), torch.tensor([[0, 1, 1], [1, 1, 0]]).bool()).tolist()
    [[0.0, 0.0, 2.0], [0.0, 3.0, 0.0]]
    """
    mask = response_mask.bool()
    pos = torch.arange(mask.shape[-1], device=mask.device)
    last = torch.where(mask, pos, torch.full_like(pos, -1)).amax(-1, keepdim=True)
    return ((pos.unsqueeze(0) == last) & mask).to(values.dtype) * values.reshape(-1, 1)


def kl_penalised_rewards(reward: torch.Tensor, sample_log_probs: torch.Tensor, ref_log_probs: torch.Tensor,
                         response_mask: torch.Tensor, kl_coef, *, estimator: str = "k1"):
    """``(rewards [B, T], kl [B, T])``: ``-kl_coef * kl_t`` on response tokens, plus ``reward`` on the last one
    (a ``[B, T]`` ``reward``, dense, is added on the response tokens as it is).

    ``kl_t = log pi_sample - log pi_ref`` (k1) or ``exp(d) - d - 1``, ``d = log pi_ref - log pi_sample`` (k3).

    >>> r, kl = kl_penalised_rewards(torch.tensor([1.0]), torch.tensor([[0., -1., -2.]]),
    ...                              torch.tensor([[0., -1.5, -1.]]), torch.tensor([[0, 1, 1]]).bool(), 0.1)
    >>> [round(x, 4) for x in r[0].tolist()]
    [0.0, -0.05, 1.1]
    """
    mask = response_mask.bool()
    if estimator == "k1":
        kl = sample_log_probs - ref_log_probs
    elif estimator == "k3":
        d = ref_log_probs - sample_log_probs
        kl = torch.expm1(d) - d
    else:
        raise ValueError(f"kl estimator must be 'k1' or 'k3', got {estimator!r}")
    kl = torch.where(mask, kl, torch.zeros_like(kl))
    per_token = -kl_coef * kl
    reward = reward.to(per_token.dtype)
    if reward.dim() == 2:
        return per_token + torch.where(mask, reward, torch.zeros_like(per_token)), kl
    return per_token + on_last_token(reward, mask), kl


def token_gae(rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, *, gamma: float = 1.0,
              lmbda: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantage [B, T], returns [B, T])`` by TorchRL's GAE over the token axis, 0 off the response.

    Time step ``t`` is response token ``t``; the episode ends (done and terminated) at the
    last response token, so nothing bootstraps past it. Prompt and padding positions are
    zeroed (their terms never reach a response token: GAE runs backwards and the response
    is one contiguous block ending in ``done``).
    """
    mask = response_mask.bool()
    pos = torch.arange(mask.shape[-1], device=mask.device)
    last = torch.where(mask, pos, torch.full_like(pos, -1)).amax(-1, keepdim=True)
    done = (pos.unsqueeze(0) >= last) | ~mask  # done at the last response token and after it
    values = torch.where(mask, values, torch.zeros_like(values))
    next_values = torch.nn.functional.pad(values[:, 1:], (0, 1))
    adv, ret = generalized_advantage_estimate(
        gamma, lmbda, values.unsqueeze(-1), next_values.unsqueeze(-1), rewards.unsqueeze(-1),
        done.unsqueeze(-1), done.unsqueeze(-1), time_dim=-2)
    adv, ret = adv.squeeze(-1), ret.squeeze(-1)
    zero = torch.zeros_like(adv)
    return torch.where(mask, adv, zero), torch.where(mask, ret, zero)


class AdaptiveKLController:
    """Ziegler et al. 2019's proportional controller of the KL coefficient (TRL's ``AdaptiveKLController``).

    ``e = clip(KL / target - 1, -0.2, 0.2)``, ``beta <- beta * (1 + e * n / horizon)`` with ``n``
    the samples of the round. ``target`` must be positive.

    >>> round(AdaptiveKLController.update(torch.tensor(0.1), torch.tensor(12.0), target=6.0, n=100,
    ...                                   horizon=10000).item(), 6)  # error clipped to 0.2: 0.1 * 1.002
    0.1002
    """

    @staticmethod
    def check_target(target) -> None:
        if target is None:
            return
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not target > 0:
            raise KLTargetError(f"kl_target must be a positive number of nats (the KL the adaptive controller "
                                f"steers to), got {target!r}; fix it with --set kl_target=6.0, or unset it "
                                "(--set kl_target=null) for a fixed kl_coef")

    @staticmethod
    def update(coef: torch.Tensor, kl: torch.Tensor, *, target: float, n: int, horizon: int) -> torch.Tensor:
        error = (kl / target - 1).clamp(-0.2, 0.2)
        return coef * (1 + error * n / horizon)


class PPORLHFLoss(RolloutLoss):
    """PPO with a value head against a (learnt) reward, the KL to the reference in the reward.

    Ouyang et al. 2022, arXiv:2203.02155; Ziegler et al. 2019, arXiv:1909.08593. Per response token,
    ``loss_objective = -mean_t min(rho A, clip(rho, 1 +- eps) A)`` with ``rho = pi / pi_sample`` and
    ``A`` the whitened GAE advantage of :func:`token_gae` on :func:`kl_penalised_rewards`;
    ``loss_critic = vf_coef * 0.5 * mean_t max((V - G)^2, (clip(V, V_old +- eps_v) - G)^2)``.
    Means are over every response token of the batch (TRL's ``masked_mean``).

    Args:
        actor_network: a :class:`~offline_plugins.modules.causal_lm.CausalLMLogProbs` (``.log_probs``).
        value_network: maps ``(tokens [B, T], attention_mask [B, T])`` to values ``[B, T]``, entry ``t``
            the value of the state in which token ``t`` is chosen.

    Keyword Args:
        kl_coef (float): initial ``beta``. Defaults to ``0.05`` (TRL ``PPOConfig.kl_coef``).
        kl_target (float, optional): adaptive controller target in nats (None: fixed ``beta``).
        kl_horizon (int): the controller's horizon. Defaults to ``10000`` (lm-human-preferences).
        kl_estimator (str): ``"k1"`` or ``"k3"``. Defaults to ``"k1"``.
        clip_epsilon (float): ratio clip. Defaults to ``0.2``.
        clip_value (float): value clip. Defaults to ``0.2``.
        vf_coef (float): value-loss weight. Defaults to ``0.1``.
        gamma (float), lmbda (float): GAE. Defaults to ``1.0``, ``0.95``.
        whiten_advantages (bool): Defaults to ``True``.

    Examples:
        >>> import torch
        >>> from offline_plugins.modules.causal_lm import CausalLMLogProbs
        >>> from offline_plugins.objectives.llm.online import _example_rollouts
        >>> emb = torch.nn.Embedding(6, 1)
        >>> value = lambda tokens, attn: emb(tokens).squeeze(-1)
        >>> loss = PPORLHFLoss(CausalLMLogProbs(torch.nn.Embedding(6, 6)), value)
        >>> td = loss.process_rollouts(_example_rollouts(torch.randint(0, 6, (4, 5)), [1., 0., 1., 0.], [0, 1, 2, 3]))
        >>> sorted(k for k in loss(td).keys() if k.startswith("loss_"))
        ['loss_critic', 'loss_objective']
    """

    @dataclass
    class _AcceptedKeys(RolloutLoss._AcceptedKeys):
        """The text keys of :class:`~offline_plugins.objectives.llm.rollout.RolloutLoss`, plus ``value``
        (``"state_value"``, ``[B, T]`` old values) and ``value_target`` (``"value_target"``, GAE returns)."""

        value: NestedKey = "state_value"
        value_target: NestedKey = "value_target"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys
    reads = ("tokens", "attention_mask", "response_mask", "sample_log_probs", "ref_log_probs", "reward", "advantage",
             "value", "value_target")
    #: PPO needs no groups of responses to one prompt
    min_group_size: int = 1

    def __init__(self, actor_network: torch.nn.Module, value_network, *, kl_coef: float = 0.05,
                 kl_target: Optional[float] = None, kl_horizon: int = 10000, kl_estimator: str = "k1",
                 clip_epsilon: float = 0.2, clip_value: float = 0.2, vf_coef: float = 0.1, gamma: float = 1.0,
                 lmbda: float = 0.95, whiten_advantages: bool = True) -> None:
        super().__init__()
        AdaptiveKLController.check_target(kl_target)
        if not 0 < clip_epsilon < 1:
            raise ValueError(f"PPORLHFLoss: clip_epsilon must be in (0, 1), got {clip_epsilon!r}")
        if kl_estimator not in ("k1", "k3"):
            raise ValueError(f"PPORLHFLoss: kl_estimator must be 'k1' or 'k3', got {kl_estimator!r}")
        self.actor_network = actor_network
        self.value_network = value_network
        self.register_buffer("kl_coef", torch.tensor(float(kl_coef)))
        self.register_buffer("kl_updates", torch.zeros((), dtype=torch.long))
        self.kl_target = None if kl_target is None else float(kl_target)
        self.kl_horizon = int(kl_horizon)
        self.kl_estimator = kl_estimator
        self.register_buffer("clip_epsilon", torch.tensor(float(clip_epsilon)))
        self.register_buffer("clip_value", torch.tensor(float(clip_value)))
        self.register_buffer("vf_coef", torch.tensor(float(vf_coef)))
        self.gamma, self.lmbda = float(gamma), float(lmbda)
        self.whiten_advantages = bool(whiten_advantages)

    @property
    def out_keys(self):
        return ["loss_objective", "loss_critic", "kl_to_reference", "clip_fraction", "ratio_mean", "value_clip_fraction"]

    def score_rewards(self, td: TensorDictBase, mask: torch.Tensor) -> torch.Tensor:
        """The reward before the KL penalty: ``[B]``, on the last response token (default: the rollouts'
        rewards), or ``[B, T]``, dense (a subclass's per-step rewards); ``mask`` is the response-token mask."""
        return self.rollout_rewards(td)

    @torch.no_grad()
    def process_rollouts(self, td: TensorDictBase) -> TensorDictBase:
        """Write per-token KL-penalised rewards, old values, whitened GAE advantages and returns; step the
        adaptive KL controller on this round's KL (used from the next round on)."""
        k = self.tensor_keys
        tokens, attn, mask = self._text(td)
        mask = mask.bool()
        sample = self._get(td, "sample_log_probs", "the sampling policy's log-probs")
        ref = self._get(td, "ref_log_probs", "the reference's log-probs")
        reward = self.score_rewards(td, mask)
        rewards, kl = kl_penalised_rewards(reward, sample, ref, mask, self.kl_coef, estimator=self.kl_estimator)
        values = self.value_network(tokens, attn).to(torch.float32)
        adv, ret = token_gae(rewards, values, mask, gamma=self.gamma, lmbda=self.lmbda)
        if self.whiten_advantages:
            adv = masked_whiten(adv, mask)
        td.set(k.advantage, adv.unsqueeze(-1))
        td.set(k.value, torch.where(mask, values, torch.zeros_like(values)))
        td.set(k.value_target, ret)
        td.set("token_reward", rewards)
        td.set("has_signal", torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device))
        if self.kl_target is not None:
            seq_kl = kl.sum(-1).mean()
            self.kl_coef.copy_(AdaptiveKLController.update(self.kl_coef, seq_kl, target=self.kl_target,
                                                           n=mask.shape[0], horizon=self.kl_horizon))
            self.kl_updates.add_(1)
        return td

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        tokens, attn, mask = self._text(tensordict)
        mask = mask.bool()
        sample = self._get(tensordict, "sample_log_probs", "the sampling policy's log-probs")
        adv = self._get(tensordict, "advantage", "the advantages (written by loss.process_rollouts)")
        adv = adv.reshape(mask.shape)
        old_v = self._get(tensordict, "value", "the old values (written by loss.process_rollouts)")
        ret = self._get(tensordict, "value_target", "the returns (written by loss.process_rollouts)")
        m = mask.to(torch.float32)
        n = m.sum().clamp_min(1)
        lp = self.actor_network.log_probs(tokens, attn)
        log_ratio = torch.where(mask, lp - sample, torch.zeros_like(lp))
        ratio = log_ratio.exp()
        clipped = ratio.clamp(1 - self.clip_epsilon, 1 + self.clip_epsilon)
        gain = torch.minimum(ratio * adv, clipped * adv)
        v = self.value_network(tokens, attn).to(torch.float32)
        v_clipped = old_v + (v - old_v).clamp(-self.clip_value, self.clip_value)
        vf = torch.maximum((v - ret) ** 2, (v_clipped - ret) ** 2)
        out = TensorDict({"loss_objective": -(gain * m).sum() / n,
                          "loss_critic": self.vf_coef * 0.5 * (vf * m).sum() / n}, [])
        with torch.no_grad():
            ref = tensordict.get(self.tensor_keys.ref_log_probs, None)
            if ref is not None:
                out.set("kl_to_reference", (((lp - ref) * m).sum(-1)).mean())
            out.set("clip_fraction", (((ratio * adv) > (clipped * adv)).to(torch.float32) * m).sum() / n)
            out.set("ratio_mean", (ratio * m).sum() / n)
            out.set("value_clip_fraction", (((v - ret) ** 2 < (v_clipped - ret) ** 2).to(torch.float32) * m).sum() / n)
            out.set("kl_coef", self.kl_coef.detach().clone())
        return out


class TokenValueHead(torch.nn.Module):
    """A critic for :class:`PPORLHFLoss`: a causal LM's last hidden state, then a linear head, per token.

    Entry ``t`` of the output is the value of the state in which token ``t`` is chosen, i.e. the
    head on the hidden state of token ``t - 1`` (0 at ``t = 0``). A separate backbone from the policy, as TRL's PPO (its value model is a copy of the reward model or policy).

    Args:
        model: a transformers causal LM accepting ``output_hidden_states=True``.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.head = torch.nn.Linear(model.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=tokens, attention_mask=attention_mask.long(),
                            output_hidden_states=True).hidden_states[-1]
        v = self.head(hidden.float()).squeeze(-1)
        return torch.nn.functional.pad(v[:, :-1], (1, 0))
