"""On-policy distillation: a student trained toward a frozen teacher on the student's own samples.

The student samples responses (the ``text-rollouts`` round, as GRPO's); at every response
position ``t`` both models' next-token distributions given the same prefix are compared, and
the student descends the divergence, averaged over the minibatch's response tokens:

* :class:`OnPolicyDistillationLoss` (``opd``): the reverse KL
  ``KL(pi_s || pi_t) = sum_v pi_s(v) (log pi_s(v) - log pi_t(v))``, mode-seeking (Gu et al. 2024,
  MiniLLM, arXiv:2306.08543; Agarwal et al. 2024, GKD, arXiv:2306.13649, with beta = 1;
  Thinking Machines 2025, "On-Policy Distillation", per-token reverse KL on the student's samples);
* :class:`GKDLoss` (``gkd``): GKD's generalised Jensen-Shannon divergence
  ``JSD(beta) = beta KL(pi_t || m) + (1 - beta) KL(pi_s || m)``, ``m = beta pi_t + (1 - beta) pi_s``
  (arXiv:2306.13649, sec. 3.1; TRL's ``GKDTrainer.generalized_jsd_loss``): ``beta = 0`` is the
  forward KL ``KL(pi_t || pi_s)``, ``beta = 1`` the reverse KL (exactly, as TRL special-cases
  them), and ``JSD(beta) / beta -> KL(pi_t || pi_s)`` as ``beta -> 0``,
  ``JSD(beta) / (1 - beta) -> KL(pi_s || pi_t)`` as ``beta -> 1``.

Full vocabulary, not the sampled token: the teacher is a local model here, so its whole
next-token distribution costs the same forward as the sampled token's log-prob, and the
divergence at each position is then exact (no estimator variance); the generalised JSD needs
the full distributions anyway. TorchRL's ``DistillationLoss`` instead reads the teacher's
log-prob of the sampled token, written beforehand, and estimates the KL with k3 with the
gradient through the student's sampled log-probs only, which in expectation is the forward
KL's gradient (its own docstring says so); the full-vocabulary reverse KL descends the reverse
KL itself at each position (the prefix held fixed, as GKD and MiniLLM's single-step term). Its
contract (a chat ``History`` re-tokenised by a ``TransformersWrapper`` actor, precomputed
teacher log-probs) is not ours, hence names of our own.

The teacher runs under ``no_grad`` in each step's forward on the same tokens as the student;
it is held outside the module tree (not a submodule: no gradients, no checkpoint copy, never
switched to train mode) and follows the batch's device on first use. Only response tokens
count: position ``t`` of ``("masks", "all_assistant_mask")`` (and of the attention mask) selects
the distributions predicting token ``t``; prompt and padding positions weigh nothing.
"""

from __future__ import annotations

import abc
import math
from typing import Optional

import torch
from tensordict import TensorDict, TensorDictBase

from offline_plugins.modules.causal_lm import CausalLMLogProbs
from offline_plugins.objectives.llm.rollout import RolloutLoss

__all__ = ["kl_divergence", "generalized_jsd", "TextDistillationLoss", "OnPolicyDistillationLoss", "GKDLoss"]


def kl_divergence(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``KL(p || q) = sum_v p(v) (log p(v) - log q(v))`` over the last dim, from log-probabilities.

    >>> p = torch.tensor([0.5, 0.5]).log()
    >>> round(kl_divergence(p, torch.tensor([0.25, 0.75]).log()).item(), 4)  # 0.5 ln 2 + 0.5 ln(2/3)
    0.1438
    """
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def generalized_jsd(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, beta: float) -> torch.Tensor:
    """GKD's ``JSD(beta)`` per position over the last (vocabulary) dim (Agarwal et al. 2024, arXiv:2306.13649).

    ``beta * KL(t || m) + (1 - beta) * KL(s || m)`` with ``m = beta t + (1 - beta) s``;
    ``beta = 0`` gives ``KL(t || s)`` (forward) and ``beta = 1`` ``KL(s || t)`` (reverse), as TRL's
    ``generalized_jsd_loss``.

    >>> s, t = torch.tensor([0.5, 0.5]).log(), torch.tensor([0.25, 0.75]).log()
    >>> [round(generalized_jsd(s, t, b).item(), 4) for b in (0.0, 0.5, 1.0)]
    [0.1308, 0.0338, 0.1438]
    """
    if beta == 0:
        return kl_divergence(teacher_log_probs, student_log_probs)
    if beta == 1:
        return kl_divergence(student_log_probs, teacher_log_probs)
    mix = torch.logaddexp(teacher_log_probs + math.log(beta), student_log_probs + math.log1p(-beta))
    return beta * kl_divergence(teacher_log_probs, mix) + (1 - beta) * kl_divergence(student_log_probs, mix)


class TextDistillationLoss(RolloutLoss):
    """Base of the on-policy distillation losses: a divergence of the student's next-token
    distribution from a frozen teacher's, averaged over the response tokens of the minibatch.

    A variant overrides :meth:`token_divergence`.

    Args:
        actor_network: the student, a :class:`~offline_plugins.modules.causal_lm.CausalLMLogProbs`
            (its ``logits``).
        teacher: the teacher, a ``CausalLMLogProbs`` or a causal LM (wrapped); frozen and put
            in eval mode here. Its vocabulary is the student's (a larger output layer is cut to
            the student's size: rows past it are ids no token of the shared tokenizer has).

    Reads ``("tokens", "full")``, ``("masks", "all_attention_mask")``,
    ``("masks", "all_assistant_mask")`` (rename with ``set_keys``). Returns ``loss_distill``
    (the term to minimise) and ``kl_to_teacher`` (detached: the full-vocabulary reverse KL,
    mean over the response tokens, whatever the loss's divergence), TorchRL
    ``DistillationLoss``'s output names.
    """

    reads = ("tokens", "attention_mask", "response_mask")
    #: the student's own samples need no group: one response per prompt suffices
    min_group_size = 1

    def __init__(self, actor_network: torch.nn.Module, teacher: torch.nn.Module) -> None:
        super().__init__()

        self.actor_network = actor_network
        if not isinstance(teacher, CausalLMLogProbs):
            teacher = CausalLMLogProbs(teacher)
        teacher.eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        # not a submodule: no optimiser, DDP, checkpoint or train() reaches the teacher
        self.__dict__["teacher"] = teacher

    @property
    def out_keys(self):
        return ["loss_distill", "kl_to_teacher"]

    def process_rollouts(self, td: TensorDictBase) -> TensorDictBase:
        """Nothing to write once per round: the divergence is computed at each step."""
        return td

    @abc.abstractmethod
    def token_divergence(self, student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor) -> torch.Tensor:
        """The divergence at each position ``[..., T-1]`` from log-distributions ``[..., T-1, V]``."""

    def _teacher_logits(self, tokens: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        teacher = self.teacher
        weight = next(teacher.parameters(), None)
        if weight is not None and weight.device != tokens.device:  # a host-side comparison, no sync
            teacher.to(tokens.device)
        with torch.no_grad():
            return teacher.logits(tokens, attn)

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        tokens, attn, mask = self._text(tensordict)
        student = self.actor_network.logits(tokens, attn)
        teacher = self._teacher_logits(tokens, attn)
        vocab = min(student.shape[-1], teacher.shape[-1])
        # logits at t - 1 predict token t: response token t weighs the pair of distributions before it
        s = torch.log_softmax(student[..., :-1, :vocab].float(), -1)
        t = torch.log_softmax(teacher[..., :-1, :vocab].float(), -1)
        weight = (mask.bool() & attn.bool())[..., 1:].to(s.dtype)
        n = weight.sum().clamp_min(1)
        loss = (self.token_divergence(s, t) * weight).sum() / n
        with torch.no_grad():
            kl = (kl_divergence(s, t) * weight).sum() / n
        return TensorDict({"loss_distill": loss, "kl_to_teacher": kl}, [])


class OnPolicyDistillationLoss(TextDistillationLoss):
    """On-policy distillation with the per-token reverse KL ``KL(pi_student || pi_teacher)``, full vocabulary.

    Gu et al. 2024, MiniLLM, arXiv:2306.08543; Agarwal et al. 2024, GKD, arXiv:2306.13649
    (``beta = 1``); Thinking Machines 2025, "On-Policy Distillation". See the module docstring.

    Examples:
        >>> import torch
        >>> from offline_plugins.modules.causal_lm import CausalLMLogProbs
        >>> from offline_plugins.objectives.llm.online import _example_rollouts
        >>> _ = torch.manual_seed(0)
        >>> teacher = torch.nn.Embedding(6, 6)
        >>> loss = OnPolicyDistillationLoss(CausalLMLogProbs(torch.nn.Embedding(6, 6)), teacher)
        >>> out = loss(_example_rollouts(torch.randint(0, 6, (4, 5)), [0.] * 4, [0, 1, 2, 3]))
        >>> sorted(out.keys()), bool(out["loss_distill"] > 0)
        (['kl_to_teacher', 'loss_distill'], True)
        >>> bool(torch.isclose(out["loss_distill"], out["kl_to_teacher"]))
        True
    """

    def token_divergence(self, student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor) -> torch.Tensor:
        """``KL(student || teacher)`` at each position."""
        return kl_divergence(student_log_probs, teacher_log_probs)


class GKDLoss(TextDistillationLoss):
    """Generalised knowledge distillation: GKD's ``JSD(beta)`` between student and teacher, full vocabulary.

    Agarwal et al. 2024, On-Policy Distillation of Language Models: Learning from
    Self-Generated Mistakes, arXiv:2306.13649 (:func:`generalized_jsd`).

    Args:
        actor_network, teacher: as :class:`TextDistillationLoss`.

    Keyword Args:
        beta (float): the interpolation in ``[0, 1]``: 0 the forward KL, 1 the reverse KL.
            Defaults to ``0.5`` (TRL ``GKDConfig``'s default).

    Examples:
        >>> import torch
        >>> from offline_plugins.modules.causal_lm import CausalLMLogProbs
        >>> from offline_plugins.objectives.llm.online import _example_rollouts
        >>> _ = torch.manual_seed(0)
        >>> loss = GKDLoss(CausalLMLogProbs(torch.nn.Embedding(6, 6)), torch.nn.Embedding(6, 6), beta=0.5)
        >>> out = loss(_example_rollouts(torch.randint(0, 6, (4, 5)), [0.] * 4, [0, 1, 2, 3]))
        >>> bool(0 < out["loss_distill"] < out["kl_to_teacher"])  # JSD(0.5) is below both KLs
        True
    """

    def __init__(self, actor_network: torch.nn.Module, teacher: torch.nn.Module, *, beta: Optional[float] = 0.5) -> None:
        super().__init__(actor_network, teacher)
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= float(beta) <= 1:
            raise ValueError(f"GKDLoss: beta must be a number in [0, 1] (0: forward KL, 1: reverse KL, GKD's "
                             f"generalised JSD between), got {beta!r}")
        # a Python float, not a buffer: it picks the formula (beta = 0 or 1 are the KLs), with no host sync
        self.beta = float(beta)

    def token_divergence(self, student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor) -> torch.Tensor:
        """``JSD(beta)`` at each position."""
        return generalized_jsd(student_log_probs, teacher_log_probs, self.beta)
