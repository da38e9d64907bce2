"""What the preference losses share: input checks, sequence log-probs, diagnostics.

Batch layout (DESIGN.md): paired losses read a ``[B, 2]`` TensorDict, index 0 along
the second dim the chosen response, index 1 the rejected one, both for the same
prompt; KTO reads ``[B]`` rows with a boolean ``label``. Sequence log-probs are
``(sum, count)`` over ``("masks", "all_assistant_mask")``; reference log-probs are
stored per sequence (summed, fp32) so training runs no reference forward.
"""

from __future__ import annotations

from typing import Optional

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase
from torchrl.objectives import LossModule
from torchrl.objectives.utils import _reduce

from offline_plugins.errors import UserError
from offline_plugins.modules.causal_lm import sequence_log_probs

__all__ = ["PreferenceInputError", "PreferenceLossBase", "run_network"]


class PreferenceInputError(UserError, ValueError):
    """A preference batch that lacks a key or has the wrong shape."""


def get_checked(td: TensorDictBase, key: NestedKey, *, what: str, loss: str, setter: str) -> torch.Tensor:
    """``td[key]``, or a :class:`PreferenceInputError` naming the key and the fix."""
    value = td.get(key, None)
    if value is None:
        raise PreferenceInputError(
            f"{loss} needs {what} at key {repr(key)}, which the batch lacks "
            f"(it has {sorted(map(str, td.keys(True, True)))[:12]}); "
            f"add it (see offline_plugins.text.data.preference), or point the loss elsewhere with "
            f"loss.set_keys({setter}=...)"
        )
    return value


def run_network(network, td: TensorDictBase, who: str, advice: str) -> TensorDictBase:
    """``network`` run on the entries of ``td`` it reads; a :class:`PreferenceInputError` naming
    ``who`` (``"Loss: the actor"``), the missing keys and ``advice`` when the batch lacks some."""
    missing = [k for k in network.in_keys if td.get(k, None) is None]
    if missing:
        raise PreferenceInputError(f"{who} reads {missing}, which the batch lacks; {advice}")
    return network(td.select(*network.in_keys))


class PreferenceLossBase(LossModule):
    """Base of the log-prob preference losses: runs the actor once over all rows and reduces.

    Subclasses declare ``_AcceptedKeys`` and implement ``forward``. The actor is any
    TensorDict module writing per-token log-probs at ``tensor_keys.log_probs``, such as
    :class:`~offline_plugins.modules.causal_lm.CausalLMLogProbs`.
    """

    def __init__(self, actor_network: Optional[torch.nn.Module], *, reduction: str = "mean") -> None:
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"{type(self).__name__}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.actor_network = actor_network
        self.reduction = reduction

    def _forward_value_estimator_keys(self, **kwargs) -> None:
        pass

    @property
    def in_keys(self):
        k = self.tensor_keys
        return [getattr(k, f) for f in k.__dataclass_fields__]

    def _get(self, td: TensorDictBase, name: str, what: str) -> torch.Tensor:
        return get_checked(td, getattr(self.tensor_keys, name), what=what, loss=type(self).__name__, setter=name)

    def _check_pairs(self, td: TensorDictBase) -> None:
        if td.batch_dims < 1 or td.batch_size[-1] != 2:
            raise PreferenceInputError(
                f"{type(self).__name__} expects a preference batch of shape [B, 2] (index 0 chosen, "
                f"1 rejected), got batch_size {tuple(td.batch_size)}; build it with "
                f"offline_plugins.text.data.preference.tokenize_pairs or stack chosen/rejected rows with torch.stack(..., 1)"
            )

    def _check_shape(self, value: torch.Tensor, name: str, shape: torch.Size) -> None:
        if value.shape != shape:
            raise PreferenceInputError(
                f"{type(self).__name__}: {name} at key {repr(getattr(self.tensor_keys, name))} has shape "
                f"{tuple(value.shape)}, expected {tuple(shape)} (one value per sequence of the batch); "
                f"recompute it for this batch (offline_plugins.text.data.preference.add_reference_log_probs)"
            )

    def sequence_log_probs(self, td: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum, count)`` of the policy's response log-probs, one per sequence.

        Runs the actor when one was given (one forward over every row); without one
        it reads per-token log-probs already in the batch.
        """
        keys = self.tensor_keys
        if self.actor_network is not None:
            out = run_network(
                self.actor_network, td, f"{type(self).__name__}: the actor",
                "tokenise the data with offline_plugins.text.data.preference (it writes ('tokens', 'full') and "
                "('masks', 'all_attention_mask')) or build the actor with matching keys",
            )
            log_probs = get_checked(
                out, keys.log_probs, what="the actor's per-token log-probs", loss=type(self).__name__, setter="log_probs"
            )
        else:
            log_probs = self._get(td, "log_probs", "per-token policy log-probs (or pass an actor_network)")
        response_mask = self._get(td, "response_mask", "the response-token mask")
        if response_mask.shape != log_probs.shape:
            raise PreferenceInputError(
                f"{type(self).__name__}: response mask {repr(keys.response_mask)} has shape "
                f"{tuple(response_mask.shape)} but the log-probs have {tuple(log_probs.shape)}; "
                f"both must be [..., T] over the same tokens"
            )
        return sequence_log_probs(log_probs, response_mask)

    def _reduce(self, value: torch.Tensor) -> torch.Tensor:
        return _reduce(value, self.reduction)

    @staticmethod
    def _pair_diagnostics(
        out: TensorDict,
        chosen_logps: torch.Tensor,
        rejected_logps: torch.Tensor,
        reward_chosen: torch.Tensor,
        reward_rejected: torch.Tensor,
        delta_chosen: Optional[torch.Tensor],
        delta_rejected: Optional[torch.Tensor],
    ) -> None:
        """The seeds' diagnostics (5.6.11), detached; names never contain ``loss``.

        ``likelihood_collapse`` is the fraction of pairs where both responses lost
        log-probability against the reference (example 5.6.1's failure mode); it
        needs reference log-probs.
        """
        margin = (reward_chosen - reward_rejected).detach()
        out.set("preference_accuracy", (margin > 0).float().mean())
        out.set("reward_margin", margin.mean())
        out.set("reward_chosen", reward_chosen.detach().mean())
        out.set("reward_rejected", reward_rejected.detach().mean())
        out.set("log_prob_chosen", chosen_logps.detach().mean())
        out.set("log_prob_rejected", rejected_logps.detach().mean())
        if delta_chosen is not None and delta_rejected is not None:
            both_fell = (delta_chosen.detach() < 0) & (delta_rejected.detach() < 0)
            out.set("likelihood_collapse", both_fell.float().mean())
