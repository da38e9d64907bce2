"""Return-conditioned generation on text (the seeds' Decision Transformer on rollouts) as a TorchRL loss.

The Decision Transformer (Chen et al. 2021, arXiv:2106.01345) writes RL as conditional
sequence modelling: a trajectory is fed as ``(R_hat, s, a)`` with the return-to-go
``R_hat``, the model is trained by maximum likelihood on the actions, and at test time
it is conditioned on the return one wants. A text episode is one step (prompt = state,
response = action, the verifier's reward = the return), so ``R_hat`` is the response's
reward. As in Quark (Lu et al. 2022, arXiv:2205.13636) the return is a **reward token**
prepended to the prompt: rewards are quantised into the buckets of ``return_levels``
``l_0 < l_1 < ... < l_{K-1}`` and bucket ``k`` has its own token ``<|return=l_k|>``,

    ``bucket(r) = max{k : l_k <= r}``, and ``0`` when ``r < l_0``.

Training is the Online Decision Transformer's (Zheng et al. 2022, arXiv:2202.05607):
responses are sampled conditioned on the target (best) return, and each sampled row is
**relabelled in hindsight** with the token of the return it actually achieved, then
trained by token-mean NLL on its response tokens,

    ``L = - sum_{i,t} w_i m_{i,t} log pi(y_{i,t} | tok(bucket(r_i)), x_i, y_{i,<t}) / sum_{i,t} w_i m_{i,t}``,

``m`` the response mask, ``w_i = 1`` for a row relabelled at the target return and
``low_return_weight`` for any other. With ``low_return_weight = 1`` (the default) every row
is trained, as the Decision Transformer trains on every trajectory: a failure teaches what
the low-return token means. With ``0`` only the rows that reach the target are, which is
expert iteration (:class:`~offline_plugins.objectives.llm.online.ExpertIterationLoss`) with a
token in front; values between interpolate (what docs/results-history.md, "Return-conditioned generation (text-DT)" measures).

:meth:`TextDTLoss.process_rollouts` does the relabelling once per round of rollouts in the
TED text layout of :mod:`offline_plugins.objectives.llm.online`, keeping the buffer's shapes:
the return token is found among the row's tokens (exactly one per row) and replaced;
``("text", "prompt")`` is rewritten to match.

>>> import torch
>>> return_buckets(torch.tensor([-1.0, 0.0, 0.4, 0.5, 1.0, 2.0]), torch.tensor([0.0, 0.5, 1.0])).tolist()
[0, 0, 0, 1, 2, 2]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from tensordict import NestedKey, NonTensorStack, TensorDict, TensorDictBase

from offline_plugins.objectives.llm.estimators import group_advantages
from offline_plugins.objectives.llm.rollout import RolloutLoss

__all__ = ["return_buckets", "relabel_return_tokens", "TextDTLoss"]


def return_buckets(rewards: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """The bucket of each reward: the highest level it reaches, ``max{k : levels[k] <= r}`` (0 below ``levels[0]``).

    Args:
        rewards: ``[...]`` rewards (any shape).
        levels: ``[K]`` increasing return levels.

    Returns:
        ``[...]`` long bucket indices in ``[0, K)``.
    """
    reached = (rewards.to(levels.dtype).unsqueeze(-1) >= levels).sum(-1)
    return (reached - 1).clamp_min(0)


def relabel_return_tokens(tokens: torch.Tensor, return_token_ids: torch.Tensor,
                          buckets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens [B, T]`` with every return token of row ``i`` replaced by ``return_token_ids[buckets[i]]``.

    Returns ``(relabelled, count)``: ``count [B]`` is how many return tokens each row held
    (1 for a row the conditioned prompt source wrote).

    >>> ids = torch.tensor([[1, 11, 5, 6], [1, 11, 7, 0]])
    >>> out, n = relabel_return_tokens(ids, torch.tensor([10, 11]), torch.tensor([0, 1]))
    >>> out.tolist(), n.tolist()
    ([[1, 10, 5, 6], [1, 11, 7, 0]], [1, 1])
    """
    is_return = torch.isin(tokens, return_token_ids)
    new = return_token_ids[buckets].unsqueeze(-1).to(tokens.dtype)
    return torch.where(is_return, new, tokens), is_return.sum(-1)


class TextDTLoss(RolloutLoss):
    """Text Decision Transformer: NLL of responses conditioned on the reward token of the return they achieved.

    Chen et al. 2021, Decision Transformer, arXiv:2106.01345 (return-conditioned sequence
    modelling); Zheng et al. 2022, Online Decision Transformer, arXiv:2202.05607 (sample at a
    target return, relabel in hindsight); Lu et al. 2022, Quark, arXiv:2205.13636 (the return as
    a reward token prepended to the prompt). See the module docstring for the formulas.

    Args:
        actor_network: writes per-token log-probs (``log_probs(tokens, attention_mask)``, e.g.
            :class:`~offline_plugins.modules.causal_lm.CausalLMLogProbs`).

    Keyword Args:
        return_token_ids (sequence of int): the token of each return level, in level order.
        return_levels (sequence of float): the increasing return levels ``l_0 < ... < l_{K-1}``.
        target_return (float, optional): the level sampling and evaluation are conditioned on
            (one of ``return_levels``). Defaults to the highest level.
        return_token_texts (sequence of str, optional): the tokens' texts; when given,
            ``("text", "prompt")`` is rewritten with the relabelled token.
        low_return_weight (float): the NLL weight of a row relabelled below the target return.
            Defaults to ``1.0`` (the Decision Transformer: every row).

    Examples:
        >>> import torch
        >>> from offline_plugins.modules.causal_lm import CausalLMLogProbs
        >>> loss = TextDTLoss(CausalLMLogProbs(torch.nn.Embedding(12, 12)), return_token_ids=[10, 11],
        ...                   return_levels=[0.0, 1.0])
        >>> td = TensorDict({"tokens": {"full": torch.tensor([[1, 11, 5, 6], [1, 11, 7, 8]])},
        ...                  "masks": {"all_attention_mask": torch.ones(2, 4, dtype=torch.bool),
        ...                            "all_assistant_mask": torch.tensor([[0, 0, 1, 1]] * 2).bool()},
        ...                  "next": {"reward": torch.tensor([[0.0], [1.0]])}}, [2])
        >>> loss.process_rollouts(td)["tokens", "full"].tolist()
        [[1, 10, 5, 6], [1, 11, 7, 8]]
        >>> sorted(k for k in loss(td).keys() if k.startswith("loss_"))
        ['loss_nll']
    """

    @dataclass
    class _AcceptedKeys(RolloutLoss._AcceptedKeys):
        """The text keys of :class:`~offline_plugins.objectives.llm.rollout.RolloutLoss` (``advantage`` is
        written here: the row's NLL weight on its response tokens), plus ``prompt_text``:
        ``("text", "prompt")`` (rewritten when the token texts are known)."""

        prompt_text: NestedKey = ("text", "prompt")

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys
    reads = ("tokens", "attention_mask", "response_mask", "reward", "advantage")

    def __init__(
        self,
        actor_network: torch.nn.Module,
        *,
        return_token_ids: Sequence[int],
        return_levels: Sequence[float],
        target_return: Optional[float] = None,
        return_token_texts: Optional[Sequence[str]] = None,
        low_return_weight: float = 1.0,
    ) -> None:
        super().__init__()
        levels = [float(x) for x in return_levels]
        ids = [int(i) for i in return_token_ids]
        if not levels or len(ids) != len(levels):
            raise ValueError(f"TextDTLoss: give one return token per return level, got {len(ids)} tokens for "
                             f"levels {levels}")
        if any(b <= a for a, b in zip(levels, levels[1:])):
            raise ValueError(f"TextDTLoss: return_levels must increase strictly, got {levels}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"TextDTLoss: the return tokens must differ, got ids {ids}")
        target = levels[-1] if target_return is None else float(target_return)
        if target not in levels:
            raise ValueError(f"TextDTLoss: target_return {target_return!r} is none of the return levels {levels}")
        if return_token_texts is not None and len(return_token_texts) != len(ids):
            raise ValueError(f"TextDTLoss: {len(return_token_texts)} token texts for {len(ids)} return tokens")
        if not 0 <= float(low_return_weight) <= 1:
            raise ValueError(f"TextDTLoss: low_return_weight must be in [0, 1], got {low_return_weight!r}")
        self.actor_network = actor_network
        self.register_buffer("low_return_weight", torch.tensor(float(low_return_weight)))
        self.register_buffer("return_levels", torch.tensor(levels, dtype=torch.float32))
        self.register_buffer("return_token_ids", torch.tensor(ids, dtype=torch.long))
        self.target_index = levels.index(target)
        self.target_return = target
        self.return_token_texts = None if return_token_texts is None else [str(t) for t in return_token_texts]

    @property
    def out_keys(self):
        return ["loss_nll", "target_return_fraction"]

    @property
    def target_token_id(self) -> int:
        """The token sampling and evaluation are conditioned on."""
        return int(self.return_token_ids[self.target_index])

    # -- what runs once per round of rollouts ---------------------------------
    def process_rollouts(self, td: TensorDictBase) -> TensorDictBase:
        """Hindsight relabelling: each row's return token becomes the token of the reward it achieved.

        Writes ``("tokens", "full")`` (same shape), ``"return_bucket"`` ``[B]``, ``"advantage"``
        (``[B, T, 1]``: the row's weight ``w_i`` on its response tokens), ``"has_signal"`` (whether the
        row's group, ``"group"``, holds different rewards: a statistic only, every row is trained;
        all True without groups) and, with the token texts known, ``("text", "prompt")``.

        Raises:
            ValueError: a row holding no return token or more than one (its prompt did not come
                from the conditioned prompt source of :mod:`offline_plugins.algorithms.text_dt`).
        """
        k = self.tensor_keys
        tokens, attn, mask = self._text(td)
        attn, mask = attn.bool(), mask.bool()
        reward = self._get(td, "reward", "the rollouts' rewards").reshape(-1)
        buckets = return_buckets(reward, self.return_levels)
        # only prompt tokens carry the conditioning (a sampled response could emit a return token)
        prompt = attn & ~mask
        relabelled, count = relabel_return_tokens(torch.where(prompt, tokens, -1), self.return_token_ids, buckets)
        bad = count != 1
        if bool(bad.any()):  # once per round, not per step
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"TextDTLoss: rollout row {i} holds {int(count[i])} return tokens in its prompt, expected exactly 1 "
                f"(one of ids {self.return_token_ids.tolist()}); sample with the conditioned prompt source of "
                "offline_plugins.algorithms.text_dt (build_text_dt conditions the prompts)")
        td.set(k.tokens, torch.where(prompt, relabelled, tokens))
        td.set("return_bucket", buckets)
        at_target = buckets == self.target_index
        weight = torch.where(at_target, torch.ones_like(reward, dtype=torch.float32),
                             self.low_return_weight.expand_as(reward))
        td.set(k.advantage, self._on_response(weight, mask))
        groups = td.get(k.group, None)
        if groups is None:
            td.set("has_signal", torch.ones_like(buckets, dtype=torch.bool))
        else:  # as the other online losses: whether the group's rewards differ (the rollout statistics read it)
            td.set("has_signal", group_advantages(reward, groups)[1])
        texts = td.get(k.prompt_text, None) if self.return_token_texts is not None else None
        if texts is not None:
            td.set(k.prompt_text, NonTensorStack(*self._relabel_texts(texts, buckets), batch_size=[len(buckets)]))
        return td

    def _relabel_texts(self, texts, buckets: torch.Tensor) -> list[str]:
        names = self.return_token_texts
        out = []
        for text, b in zip(texts.tolist() if hasattr(texts, "tolist") else list(texts), buckets.tolist()):
            text = str(text)
            for name in names:
                if text.startswith(name):
                    text = text[len(name):]
                    break
            out.append(names[b] + text)
        return out

    # -- the objective --------------------------------------------------------
    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        tokens, attn, mask = self._text(tensordict)
        mask = mask.to(torch.float32)
        weight = self._get(tensordict, "advantage", "the row weights (written by loss.process_rollouts)")
        w = weight.reshape(mask.shape) * mask
        lp = self.actor_network.log_probs(tokens, attn)
        out = TensorDict({"loss_nll": self._weighted_nll(lp, w, floor=1e-6)}, [])
        with torch.no_grad():
            # the share of the batch's rows relabelled with the target return (the success rate)
            target = self.return_token_ids[self.target_index]
            at_target = ((tokens == target) & attn.bool() & ~mask.bool()).any(-1)
            out.set("target_return_fraction", at_target.to(torch.float32).mean())
        return out
