"""The base of the losses that train on text rollouts: the text keys once, the once-per-round hook.

GRPO and its variants, RLOO, expert iteration, PPO-RLHF, online DPO and text-DT read rows
in the TED text layout a rollout collector (:mod:`offline_plugins.text.data.rollouts`) writes
(the table in :mod:`offline_plugins.objectives.llm.online`); SFT reads the same token and
mask keys from offline text. :class:`RolloutLoss` declares those keys and what the collector
reads of a loss (``dynamic_sampling``, ``min_group_size``). The hook the collector calls once
per round is ``process_rollouts``: :class:`GroupAdvantageLoss` writes it from
``rollout_rewards`` and an abstract ``advantages`` (GRPO and its variants, expert iteration:
a variant overrides one of the two); PPO-RLHF, online DPO and text-DT write their own; SFT,
trained on offline text, has none.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
from tensordict import NestedKey, TensorDictBase
from torchrl.objectives import LossModule

from offline_plugins.objectives.llm.common import get_checked

__all__ = ["RolloutLoss", "GroupAdvantageLoss"]


class RolloutLoss(LossModule):
    """Base of the text losses: the text keys, their helpers, the collector's flags.

    Subclasses register their networks (``self.actor_network``, as TorchRL's losses do in their
    own ``__init__``), set ``reads`` (the key names their ``in_keys`` list) and implement
    ``forward``; one trained on rollouts also implements ``process_rollouts(td)`` (or
    subclasses :class:`GroupAdvantageLoss`). A subclass that reads more keys extends
    ``_AcceptedKeys`` (``class _AcceptedKeys(RolloutLoss._AcceptedKeys): ...``).
    """

    @dataclass
    class _AcceptedKeys:
        """Keys the loss reads; rename them with ``set_keys(...)``.

        Attributes:
            tokens: ``("tokens", "full")``. attention_mask: ``("masks", "all_attention_mask")``.
            response_mask: ``("masks", "all_assistant_mask")``.
            sample_log_probs: ``("log_probs", "full")`` (the sampling policy's).
            ref_log_probs: ``("next", "ref_log_probs", "full")``. reward: ``("next", "reward")``.
            token_reward: ``("next", "turn_reward")``, optional: ``[B, T]`` rewards on the tokens where
            they were earned (a multi-turn episode's turns; they sum to ``reward``). group: ``"group"`` (prompt id). advantage: ``"advantage"`` (``[B, T, 1]``, as TorchRL's
            GRPOLoss; written by :meth:`process_rollouts`).
        """

        tokens: NestedKey = ("tokens", "full")
        attention_mask: NestedKey = ("masks", "all_attention_mask")
        response_mask: NestedKey = ("masks", "all_assistant_mask")
        sample_log_probs: NestedKey = ("log_probs", "full")
        ref_log_probs: NestedKey = ("next", "ref_log_probs", "full")
        reward: NestedKey = ("next", "reward")
        token_reward: NestedKey = ("next", "turn_reward")
        group: NestedKey = "group"
        advantage: NestedKey = "advantage"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys
    #: the key names ``in_keys`` lists, in order
    reads: tuple[str, ...] = ("tokens", "attention_mask", "response_mask", "sample_log_probs", "ref_log_probs",
                              "reward", "group", "advantage")
    #: drop groups without signal and sample again (DAPO's dynamic sampling); read by the collector
    dynamic_sampling: bool = False
    #: the fewest responses per prompt the advantages need (a value baseline needs no group)
    min_group_size: int = 2

    @property
    def optimised_terms(self) -> tuple[str, ...]:
        """The ``loss_*`` terms an optimiser minimises (the policy's group): the objective, and the KL term
        where the loss has one (``has_kl_term``); a loss with other terms overrides it."""
        return ("loss_objective", "loss_kl") if getattr(self, "has_kl_term", False) else ("loss_objective",)

    def _forward_value_estimator_keys(self, **kwargs) -> None:
        pass

    @property
    def in_keys(self):
        return [getattr(self.tensor_keys, name) for name in self.reads]

    def _get(self, td: TensorDictBase, name: str, what: str) -> torch.Tensor:
        return get_checked(td, getattr(self.tensor_keys, name), what=what, loss=type(self).__name__, setter=name)

    def _text(self, td: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tokens, attention_mask, response_mask)`` of the batch, as stored."""
        return (self._get(td, "tokens", "the rollouts' tokens"), self._get(td, "attention_mask", "the attention mask"),
                self._get(td, "response_mask", "the response-token mask"))

    @staticmethod
    def _on_response(per_row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """A per-row value ``[B]`` on the row's response tokens, 0 elsewhere: ``[B, T, 1]``."""
        return (per_row.unsqueeze(-1) * mask.to(per_row.dtype)).unsqueeze(-1)

    def rollout_rewards(self, td: TensorDictBase) -> torch.Tensor:
        """The reward of each rollout, ``[B]`` (default: the task's ``("next", "reward")``)."""
        return self._get(td, "reward", "the rollouts' rewards").reshape(-1).to(torch.float32)

    @staticmethod
    def _weighted_nll(log_probs: torch.Tensor, weight: torch.Tensor, *, floor: float = 1) -> torch.Tensor:
        """``-sum(w * logp) / max(floor, sum(w))``: token-mean NLL over the weighted tokens."""
        return -(log_probs * weight).sum() / weight.sum().clamp_min(floor)


class GroupAdvantageLoss(RolloutLoss):
    """A rollout loss whose round hook is a per-response advantage from the rewards and the
    prompt groups, written on the response tokens (GRPO and its variants, expert iteration).
    Subclasses implement :meth:`advantages`; one that scores rollouts otherwise overrides
    ``rollout_rewards``."""

    @abc.abstractmethod
    def advantages(self, rewards: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(advantage [B], has_signal [B])`` from the rewards and the prompt ids."""

    def process_rollouts(self, td: TensorDictBase) -> TensorDictBase:
        """Write ``"advantage"`` (``[B, T, 1]``, on response tokens) and ``"has_signal"`` into ``td``."""
        mask = self._get(td, "response_mask", "the response-token mask")
        adv, signal = self.advantages(self.rollout_rewards(td), self._get(td, "group", "the prompt ids"))
        td.set(self.tensor_keys.advantage, self._on_response(adv, mask))
        td.set("has_signal", signal)
        return td
