"""Supervised fine-tuning and expert iteration on text as TorchRL loss modules: the token-mean NLL of
the completions given their prompts (SFT, the LLM's behaviour cloning, on offline rows), and of the
sampled responses whose reward passes a threshold (expert iteration / STaR, on rollouts)."""

from __future__ import annotations

from typing import Optional

import torch
from tensordict import TensorDict, TensorDictBase

from offline_plugins.objectives.llm.rollout import GroupAdvantageLoss, RolloutLoss

__all__ = ["ExpertIterationLoss", "TextSFTLoss"]


class ExpertIterationLoss(GroupAdvantageLoss):
    """Expert iteration (STaR / rejection-sampling fine-tuning): SFT on the sampled responses
    whose reward reaches ``threshold``.

    Zelikman et al. 2022, STaR, arXiv:2203.14465; Anthony et al. 2017, Thinking Fast and
    Slow, arXiv:1705.08439. Sample, keep the responses that pass, fine-tune on them by
    token-mean NLL, sample again from the improved policy: the seeds' "iterative DT" (a
    policy conditioned on success). The row's weight (1 kept, 0 dropped) is written as its
    advantage; the loss is ``-sum(w * logp) / sum(w * tokens)``, 0 when no row passed.

    A sibling of :class:`TextGRPOLoss` (no ratio, no KL term); the other constructor arguments
    of :class:`TextGRPOLoss` are accepted and unused, as before.

    Keyword Args:
        threshold (float): the reward a response must reach. Defaults to ``1.0``.
    """

    has_kl_term = False

    def __init__(self, actor_network, *, threshold: float = 1.0, clip_epsilon=None, beta: Optional[float] = None,
                 length_normalizer: Optional[int] = None) -> None:
        super().__init__()
        self.actor_network = actor_network
        self.threshold = float(threshold)

    optimised_terms = ("loss_nll",)

    @property
    def out_keys(self):
        return ["loss_nll", "kept_fraction"]

    def advantages(self, rewards, groups):
        keep = rewards >= self.threshold
        return keep.to(torch.float32), keep

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        tokens, attn, mask = self._text(tensordict)
        mask = mask.bool()
        weight = self._get(tensordict, "advantage", "the kept-row weights").reshape(mask.shape)
        lp = self.actor_network.log_probs(tokens, attn)
        w = weight * mask.to(lp.dtype)
        out = TensorDict({"loss_nll": self._weighted_nll(lp, w)}, [])
        with torch.no_grad():
            out.set("kept_fraction", (w.sum(-1) > 0).to(lp.dtype).mean())
        return out


class TextSFTLoss(RolloutLoss):
    """Supervised fine-tuning: token-mean NLL of the completions given their prompts.

    The LLM's behaviour cloning (Ouyang et al. 2022, arXiv:2203.02155, step 1): its result
    is the reference the preference and online algorithms start from. It reads the text keys
    of :class:`~offline_plugins.objectives.llm.rollout.RolloutLoss` from offline rows (no rollouts,
    so no ``process_rollouts``).

    Args:
        actor_network: as :class:`TextGRPOLoss`.

    Examples:
        >>> import torch
        >>> from offline_plugins.modules.causal_lm import CausalLMLogProbs
        >>> td = TensorDict({"tokens": {"full": torch.randint(0, 6, (2, 4))},
        ...                  "masks": {"all_attention_mask": torch.ones(2, 4, dtype=torch.bool),
        ...                            "all_assistant_mask": torch.tensor([[0, 0, 1, 1]] * 2).bool()}}, [2])
        >>> TextSFTLoss(CausalLMLogProbs(torch.nn.Embedding(6, 6)))(td)["loss_nll"].shape
        torch.Size([])
    """

    reads = ("tokens", "attention_mask", "response_mask")

    def __init__(self, actor_network: torch.nn.Module) -> None:
        super().__init__()
        self.actor_network = actor_network

    optimised_terms = ("loss_nll",)

    @property
    def out_keys(self):
        return ["loss_nll"]

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        tokens, attn, mask = self._text(tensordict)
        lp = self.actor_network.log_probs(tokens, attn)
        return TensorDict({"loss_nll": self._weighted_nll(lp, mask.to(torch.float32))}, [])
