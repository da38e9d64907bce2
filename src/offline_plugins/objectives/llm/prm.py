"""The process reward model (PRM): a causal LM scoring each step of a solution, as a TorchRL loss module.

Lightman et al. 2023, "Let's Verify Step by Step", arXiv:2305.20050: a PRM reads the
solution once and predicts, at the end of each step, whether the step is correct.
TorchRL has no PRM loss; this one follows its loss contract (``_AcceptedKeys``,
``set_keys``, keyword-only hyperparameters, ``loss_*`` terms and detached diagnostics).

Batch layout (:func:`offline_plugins.text.data.steps.tokenize_steps`): ``[B]`` rows with
``("tokens", "full")`` and ``("masks", "all_attention_mask")``, and for ``S`` step slots
``("steps", "position")`` (the token ending each step: its separator), ``("steps", "mask")``
(real steps) and ``("steps", "label")`` (1.0 correct, 0.0 incorrect).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase

from offline_plugins.modules.causal_lm import CausalLMReward
from offline_plugins.objectives.llm.common import PreferenceInputError, PreferenceLossBase, run_network

__all__ = ["CausalLMStepReward", "ProcessRewardLoss", "first_error"]


def first_error(wrong: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The index of the first real step flagged ``wrong`` in each row, ``S`` (the step slots) when none is.

    >>> first_error(torch.tensor([[False, True, True], [False, False, True]]),
    ...             torch.tensor([[True, True, True], [True, True, False]])).tolist()
    [1, 3]
    """
    flagged = wrong & mask
    slots = torch.arange(flagged.shape[-1], device=flagged.device).expand_as(flagged)
    return torch.where(flagged, slots, flagged.shape[-1]).amin(-1)


class CausalLMStepReward(CausalLMReward):
    """A score per step: a causal LM's last hidden state at each step's last token, then a linear head.

    The reward model's network (:class:`~offline_plugins.modules.causal_lm.CausalLMReward`,
    one head) read at every step's end instead of the sequence's: one forward scores all
    steps, each seeing only the prompt and the steps up to it (the LM is causal). The
    score is a logit: ``sigmoid(score)`` is the probability that the step is correct.

    Keyword Args:
        positions_key: the ``[..., S]`` token index ending each step. Defaults to ``("steps", "position")``.
        score_key: where the ``[..., S]`` step logits go. Defaults to ``("steps", "score")``.
        logits_key: where the same forward's ``[..., T, V]`` next-token logits go (for
            :class:`ProcessRewardLoss`'s language-modelling term), or None to drop them. Defaults to None.
        (others): as :class:`~offline_plugins.modules.causal_lm.CausalLMReward`.
    """

    def __init__(self, model: torch.nn.Module, *, positions_key: NestedKey = ("steps", "position"),
                 score_key: NestedKey = ("steps", "score"), logits_key: Optional[NestedKey] = None, **kwargs) -> None:
        super().__init__(model, reward_key=score_key, **kwargs)
        self.positions_key, self.logits_key = positions_key, logits_key
        self.in_keys = [self.tokens_key, self.attention_mask_key, positions_key]
        self.out_keys = [score_key] + ([logits_key] if logits_key is not None else [])

    def scores_and_logits(self, tokens: torch.Tensor, attention_mask: torch.Tensor,
                          positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, S]`` step logits and ``[B, T, V]`` next-token logits of ``[B, T]`` right-padded rows, one forward."""
        out = self.model(input_ids=tokens, attention_mask=attention_mask.long(), output_hidden_states=True)
        hidden = out.hidden_states[-1]
        at = positions.clamp(0, tokens.shape[-1] - 1)
        h = hidden.gather(1, at.unsqueeze(-1).expand(*at.shape, hidden.shape[-1]))
        return self.combine(self.head(h.float())), out.logits

    def step_scores(self, tokens: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` step logits of ``[B, T]`` right-padded rows."""
        return self.scores_and_logits(tokens, attention_mask, positions)[0]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        scores, logits = self.scores_and_logits(tensordict.get(self.tokens_key),
                                                tensordict.get(self.attention_mask_key),
                                                tensordict.get(self.positions_key))
        tensordict.set(self.reward_key, scores)
        if self.logits_key is not None:
            tensordict.set(self.logits_key, logits)
        return tensordict


class ProcessRewardLoss(PreferenceLossBase):
    """Binary cross-entropy of each step's score against its label: ``-[y log p + (1-y) log(1-p)]``, ``p = sigmoid(score)``.

    Lightman et al. 2023, arXiv:2305.20050 (the PRM's per-step classification); averaged over
    the real steps of the batch (``reduction="mean"``), summed, or ``[B, S]`` with padded slots 0
    (``"none"``).

    With ``lm_coef > 0`` a second term, ``loss_lm``, is ``lm_coef`` times the mean next-token
    cross-entropy of the backbone on the tokens of the steps labelled correct (the prompt and the
    wrong steps are not imitated): the verifier also learns to solve, as Cobbe et al. 2021
    (arXiv:2110.14168) train GSM8K verifiers with a language-modelling objective beside the
    verification one. The step network must then write its next-token logits at
    ``tensor_keys.lm_logits`` (:class:`CausalLMStepReward` with ``logits_key``).

    Args:
        step_network: writes ``[B, S]`` step logits at ``tensor_keys.score`` (e.g.
            :class:`CausalLMStepReward`). ``None`` reads logits already in the batch.

    Keyword Args:
        reduction (str): ``"mean"``, ``"sum"`` or ``"none"``. Defaults to ``"mean"``.
        lm_coef (float): weight of the language-modelling term (0: none). Defaults to 0.0.

    The output adds ``step_accuracy`` (a step is called correct when ``p > 0.5``) and
    ``first_error_accuracy`` (rows whose first step called wrong is the true first error,
    or none when both find none), detached.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> batch = TensorDict({("steps", "score"): torch.tensor([[2.0, -1.0]]),
        ...                     ("steps", "label"): torch.tensor([[1.0, 0.0]]),
        ...                     ("steps", "mask"): torch.tensor([[True, True]])}, [1])
        >>> out = ProcessRewardLoss()(batch)
        >>> round(out["loss_prm"].item(), 4), out["step_accuracy"].item(), out["first_error_accuracy"].item()
        (0.2201, 1.0, 1.0)
    """

    @dataclass
    class _AcceptedKeys:
        """Keys the loss reads; rename with ``set_keys``.

        Attributes:
            score: ``[B, S]`` step logits. Defaults to ``("steps", "score")``.
            label: ``[B, S]`` 1.0 for a correct step, 0.0 for a wrong one. Defaults to ``("steps", "label")``.
            mask: ``[B, S]`` True for real steps. Defaults to ``("steps", "mask")``.
            position: ``[B, S]`` the token ending each step (``lm_coef > 0``). Defaults to ``("steps", "position")``.
            tokens: ``[B, T]`` token ids (``lm_coef > 0``). Defaults to ``("tokens", "full")``.
            assistant_mask: ``[B, T]`` True for the steps' tokens, not the prompt's (``lm_coef > 0``).
                Defaults to ``("masks", "all_assistant_mask")``.
            lm_logits: ``[B, T, V]`` the backbone's next-token logits (``lm_coef > 0``). Defaults to
                ``("steps", "lm_logits")``.
        """

        score: NestedKey = ("steps", "score")
        label: NestedKey = ("steps", "label")
        mask: NestedKey = ("steps", "mask")
        position: NestedKey = ("steps", "position")
        tokens: NestedKey = ("tokens", "full")
        assistant_mask: NestedKey = ("masks", "all_assistant_mask")
        lm_logits: NestedKey = ("steps", "lm_logits")

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys

    _LM_KEYS = ("position", "tokens", "assistant_mask", "lm_logits")

    def __init__(self, step_network: Optional[torch.nn.Module] = None, *, reduction: str = "mean",
                 lm_coef: float = 0.0) -> None:
        super().__init__(None, reduction=reduction)
        if not lm_coef >= 0:
            raise PreferenceInputError(f"ProcessRewardLoss: lm_coef must be >= 0 (0: no language-modelling term), "
                                       f"got {lm_coef!r}")
        self.step_network, self.lm_coef = step_network, float(lm_coef)

    @property
    def in_keys(self):
        k = self.tensor_keys
        return [getattr(k, f) for f in k.__dataclass_fields__ if self.lm_coef or f not in self._LM_KEYS]

    def _scored(self, tensordict: TensorDictBase) -> tuple[TensorDictBase, torch.Tensor]:
        """The step network's output (the batch when there is none) and its ``[B, S]`` step logits."""
        if self.step_network is None:
            return tensordict, self._get(tensordict, "score", "[B, S] step logits (or pass a step_network)")
        out = run_network(self.step_network, tensordict, "ProcessRewardLoss: the step network",
                          "tokenise the rows with offline_plugins.text.data.steps.tokenize_steps")
        return out, self._get(out, "score", "the step network's output")

    def scores(self, tensordict: TensorDictBase) -> torch.Tensor:
        """``[B, S]`` step logits: from the step network when given, else from the batch."""
        return self._scored(tensordict)[1]

    def lm_loss(self, tensordict: TensorDictBase, logits: torch.Tensor, label: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over the tokens of the steps labelled correct: a token belongs to
        the first real step whose end (``position``) is at or after it; prompt tokens to none."""
        tokens = self._get(tensordict, "tokens", "[B, T] token ids")
        steps = self._get(tensordict, "assistant_mask", "[B, T] the steps' token mask (tokenize_steps writes it)")
        position = self._get(tensordict, "position", "[B, S] the token ending each step")
        t = torch.arange(tokens.shape[-1], device=tokens.device)
        step_of = ((position.unsqueeze(-2) < t.unsqueeze(-1)) & mask.unsqueeze(-2)).sum(-1)  # [B, T]
        real = step_of < mask.sum(-1, keepdim=True)
        good = steps & real & (label.gather(-1, step_of.clamp(max=label.shape[-1] - 1)) > 0.5)
        weight = good[..., 1:].to(logits.dtype)  # token t is predicted at t - 1
        ce = torch.nn.functional.cross_entropy(logits[..., :-1, :].transpose(-1, -2), tokens[..., 1:], reduction="none")
        return (ce * weight).sum() / weight.sum().clamp_min(1)

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        out_td, score = self._scored(tensordict)
        label = self._get(tensordict, "label", "[B, S] step labels (1.0 correct, 0.0 incorrect)").to(score.dtype)
        mask = self._get(tensordict, "mask", "[B, S] the real-step mask")
        for name, value in (("label", label), ("mask", mask)):
            if value.shape != score.shape:
                raise PreferenceInputError(
                    f"ProcessRewardLoss: {name} at key {getattr(self.tensor_keys, name)!r} has shape "
                    f"{tuple(value.shape)} but the step scores have {tuple(score.shape)}; both must be [B, S], one "
                    "entry per step slot (offline_plugins.text.data.steps.tokenize_steps writes them together)")
        per = torch.nn.functional.binary_cross_entropy_with_logits(score, label, reduction="none") * mask
        if self.reduction == "mean":
            loss = per.sum() / mask.sum().clamp_min(1)
        else:
            loss = per.sum() if self.reduction == "sum" else per
        out = TensorDict({"loss_prm": loss}, [])
        if self.lm_coef:
            logits = self._get(out_td, "lm_logits", "[B, T, V] next-token logits (CausalLMStepReward(logits_key=...))")
            out.set("loss_lm", self.lm_coef * self.lm_loss(tensordict, logits, label, mask))
        called_ok = score.detach() > 0
        out.set("step_accuracy", ((called_ok == (label > 0.5)) & mask).sum() / mask.sum().clamp_min(1))
        hit = first_error(~called_ok, mask) == first_error(label < 0.5, mask)
        out.set("first_error_accuracy", hit.float().mean())
        return out
