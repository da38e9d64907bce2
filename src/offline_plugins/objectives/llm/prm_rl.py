"""GRPO and PPO-RLHF with a process reward model: a dense reward at each step's end (issue 27).

Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, section 4.1.3 ("process supervision"):
the frozen PRM scores every step of every response; the step rewards are normalised over the
group (the mean and std of all step rewards of the prompt's responses), and a token's advantage
is the sum of the normalised rewards of the steps ending at or after it. The outcome verifier's
reward stays the rollout's logged reward, so the held-out gold the reward-hacking monitor
watches is the verifier, not the learnt judge.

:class:`PRMRewardPPOLoss` puts the same step scores (:class:`PRMStepScorer`, shared with GRPO's loss)
into PPO-RLHF's per-token reward, each on its step's end token, beside the verifier's reward on the
last token (Wang et al. 2024, Math-Shepherd, arXiv:2312.08935, step-by-step PPO).

>>> import torch
>>> rewards = torch.tensor([[1., 0.], [0., 0.]]); step_mask = torch.tensor([[True, True], [True, False]])
>>> ends = torch.tensor([[1, 3], [2, 0]]); response = torch.ones(2, 4, dtype=torch.bool)
>>> step_token_advantages(rewards, step_mask, ends, torch.tensor([0, 0]), response).mul(2 ** 0.5).round().tolist()
[[1.0, 1.0, -1.0, -1.0], [-1.0, -1.0, -1.0, 0.0]]
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from tensordict import TensorDictBase

from offline_plugins.errors import UserError
from offline_plugins.objectives.llm.online import TextGRPOLoss
from offline_plugins.objectives.llm.ppo_rlhf import PPORLHFLoss, on_last_token

__all__ = ["PRM_AGGREGATES", "step_token_advantages", "step_end_rewards", "split_steps", "PRMStepScorer",
           "PRMRewardGRPOLoss", "PRMRewardPPOLoss"]

#: how a token's advantage gathers the normalised rewards of the steps ending at or after it
PRM_AGGREGATES = ("sum", "min")


def step_token_advantages(step_rewards: torch.Tensor, step_mask: torch.Tensor, step_ends: torch.Tensor,
                          groups: torch.Tensor, response_mask: torch.Tensor, *, aggregate: str = "sum",
                          eps: float = 1e-6) -> torch.Tensor:
    """``[B, T]`` advantages from ``[B, S]`` step rewards ending at token ``step_ends`` (real where ``step_mask``).

    The rewards are standardised over each group's steps (population std); ``"sum"``: a token gets the
    sum of the standardised rewards of the steps ending at or after it (DeepSeekMath); ``"min"``: their
    minimum (PURE's min-form credit, Cheng et al. 2025, arXiv:2504.15275). Tokens after the last step
    and outside ``response_mask`` get 0.
    """
    if aggregate not in PRM_AGGREGATES:
        raise UserError(f"prm_aggregate must be one of {', '.join(PRM_AGGREGATES)}, got {aggregate!r}")
    r, m = step_rewards.float(), step_mask.to(torch.float32)
    _, inv = torch.unique(groups, return_inverse=True)
    per_group = lambda x: torch.zeros(r.shape[0], device=r.device).index_add(0, inv, x)  # noqa: E731
    count = per_group(m.sum(-1)).clamp_min(1)
    mean = (per_group((r * m).sum(-1)) / count)[inv].unsqueeze(-1)
    std = (per_group(((r - mean) ** 2 * m).sum(-1)) / count)[inv].sqrt().unsqueeze(-1)
    norm = (r - mean) / std.clamp_min(eps) * m
    B, T = response_mask.shape
    ends = step_ends.clamp(0, T - 1)
    if aggregate == "sum":
        at_end = torch.zeros(B, T, device=r.device).scatter_add(1, ends, norm)
        per_token = at_end.flip(-1).cumsum(-1).flip(-1)
    else:
        at_end = torch.full((B, T), float("inf"), device=r.device)
        at_end = at_end.scatter_reduce(1, ends, norm.masked_fill(~step_mask, float("inf")), "amin")
        per_token = at_end.flip(-1).cummin(-1).values.flip(-1)
        per_token = per_token.masked_fill(per_token.isinf(), 0.0)
    return per_token * response_mask.to(per_token.dtype)


def step_end_rewards(step_rewards: torch.Tensor, step_mask: torch.Tensor, step_ends: torch.Tensor,
                     response_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` dense rewards: each real step's reward (``[B, S]``, real where ``step_mask``) on its end token
    ``step_ends``, 0 on the other tokens and off ``response_mask``.

    >>> step_end_rewards(torch.tensor([[.5, .25]]), torch.tensor([[True, True]]), torch.tensor([[1, 3]]),
    ...                  torch.ones(1, 4, dtype=torch.bool)).tolist()
    [[0.0, 0.5, 0.0, 0.25]]
    """
    B, T = response_mask.shape
    r = torch.where(step_mask, step_rewards.float(), torch.zeros((), device=step_rewards.device))
    dense = torch.zeros(B, T, device=r.device).scatter_add(1, step_ends.clamp(0, T - 1), r)
    return dense * response_mask.to(dense.dtype)


def split_steps(ids: Sequence[int], positions: Sequence[int], separator_id: int, decode: Any
                ) -> tuple[list[str], list[int]]:
    """A response's steps: ``(texts, end positions)`` from its token ``ids`` at ``positions`` in the row.

    A step ends at its separator token; the last step ends at the response's last token (an EOS or a
    trailing separator belongs to it). Blank steps are dropped (their tokens fall to the next step).

    >>> split_steps([5, 9, 7, 9, 8], [3, 4, 5, 6, 7], 9, lambda ids: "".join(map(str, ids)))
    (['5', '7', '8'], [4, 6, 7])
    """
    texts, ends, start = [], [], 0
    for j, tok in enumerate(list(ids) + [separator_id]):
        if tok == separator_id:
            text = decode(list(ids[start:j]))
            if text.strip():
                texts.append(text)
                ends.append(positions[min(j, len(ids) - 1)])
            start = j + 1
    if ends:
        ends[-1] = positions[-1]
    return texts, ends


class PRMStepScorer:
    """The frozen PRM of a loss rewarding steps: a mixin before a rollout loss (it reads ``self._text``).

    :meth:`step_rewards` splits each response at the one-token step separator (:func:`split_steps`),
    and the PRM scores every step at its end (the probability it is right, no grad, on the policy's device).
    """

    def _set_prm(self, prm: torch.nn.Module, prm_tokenizer: Any, tokenizer: Any, tokenize_steps: Any,
                 separator: str, max_length: int) -> None:
        sep = list(tokenizer(separator, add_special_tokens=False)["input_ids"])
        if len(sep) != 1:
            raise UserError(f"{type(self).__name__}: the policy's tokenizer writes the step separator {separator!r} "
                            f"as {len(sep)} tokens; steps are split at a one-token separator")
        self.prm = prm.eval().requires_grad_(False)
        self.prm_tokenizer, self.tokenizer, self.separator = prm_tokenizer, tokenizer, separator
        self.tokenize_steps = tokenize_steps
        self.separator_id, self.max_length = sep[0], int(max_length)

    def train(self, mode: bool = True):
        super().train(mode)
        self.prm.eval()  # the judge stays frozen
        return self

    @torch.no_grad()
    def step_rewards(self, td: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``([B, S] PRM step probabilities, [B, S] step mask, [B, S] step-end token indices)`` of a round;
        each response's mean step probability goes into ``td["stats", "prm_step_reward"]`` (logged as
        ``rollout/prm_step_reward``: the learnt judge's score beside the verifier's reward)."""
        tokens, _, mask = self._text(td)
        device = tokens.device
        prompts = td.get(("text", "prompt"))
        prompts = prompts.tolist() if hasattr(prompts, "tolist") else list(prompts)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        rows, ends = [], []
        for prompt, ids, m in zip(prompts, tokens.tolist(), mask.bool().tolist()):  # the PRM reads text
            positions = [t for t, on in enumerate(m) if on]
            texts, row_ends = split_steps([ids[t] for t in positions], positions, self.separator_id, decode)
            rows.append({"prompt": prompt, "steps": texts, "labels": [1] * len(texts)})
            ends.append(row_ends)
        slots = max(1, max(len(e) for e in ends))
        step_ends = torch.tensor([e + [0] * (slots - len(e)) for e in ends], dtype=torch.long, device=device)
        probs = torch.zeros(len(rows), slots, device=device)
        step_mask = torch.zeros(len(rows), slots, dtype=torch.bool, device=device)
        scored = [i for i, r in enumerate(rows) if r["steps"]]
        if scored:
            batch, _ = self.tokenize_steps([rows[i] for i in scored], self.prm_tokenizer, max_length=self.max_length,
                                      separator=self.separator)
            if batch.batch_size[0] != len(scored):
                raise UserError(f"{type(self).__name__}: a prompt leaves no room for a step in the PRM's max_length="
                                f"{self.max_length} tokens; raise max_length")
            self.prm.to(device)
            batch = batch.to(device)
            logits = self.prm.step_scores(batch.get(("tokens", "full")), batch.get(("masks", "all_attention_mask")),
                                          batch.get(("steps", "position")))
            index, width = torch.tensor(scored, dtype=torch.long, device=device), min(logits.shape[-1], slots)
            probs[index, :width] = torch.sigmoid(logits[:, :width].float())
            step_mask[index, :width] = batch.get(("steps", "mask"))[:, :width]
        td.set(("stats", "prm_step_reward"), (probs * step_mask).sum(-1) / step_mask.sum(-1).clamp_min(1))
        return probs, step_mask, step_ends


class PRMRewardGRPOLoss(PRMStepScorer, TextGRPOLoss):
    """GRPO whose advantages come from a frozen PRM's step rewards (see the module's docstring).

    Args:
        actor_network: as :class:`~offline_plugins.objectives.llm.online.TextGRPOLoss`.

    Keyword Args:
        prm: a :class:`~offline_plugins.objectives.llm.prm.CausalLMStepReward` (e.g. from
            :func:`~offline_plugins.eval.search.load_prm`), frozen; it follows the policy's device.
        prm_tokenizer: the PRM's tokenizer; tokenizer: the policy's (decodes the responses).
        tokenize_steps: ``(rows, prm_tokenizer, max_length=, separator=) -> (TensorDict, report)``, the PRM's
            own tokenisation of ``{"prompt", "steps", "labels"}`` rows
            (:func:`offline_plugins.text.data.steps.tokenize_steps`).
        separator: the text between two steps. Defaults to ``"\\n"``.
        prm_aggregate: ``"sum"`` (DeepSeekMath) or ``"min"``. Defaults to ``"sum"``.
        max_length: the PRM's token budget (steps past it are not scored). Defaults to 128.
        (others): as :class:`~offline_plugins.objectives.llm.online.TextGRPOLoss`.
    """

    def __init__(self, actor_network: Optional[torch.nn.Module], *, prm: torch.nn.Module, prm_tokenizer: Any,
                 tokenizer: Any, tokenize_steps: Any, separator: str = "\n", prm_aggregate: str = "sum", max_length: int = 128,
                 **kwargs) -> None:
        super().__init__(actor_network, **kwargs)
        if prm_aggregate not in PRM_AGGREGATES:
            raise UserError(f"prm_aggregate must be one of {', '.join(PRM_AGGREGATES)}, got {prm_aggregate!r}")
        self._set_prm(prm, prm_tokenizer, tokenizer, tokenize_steps, separator, max_length)
        self.prm_aggregate = prm_aggregate

    def process_rollouts(self, td: TensorDictBase) -> TensorDictBase:
        td = super().process_rollouts(td)  # has_signal (the verifier's) and the row advantages, replaced here
        mask = self._get(td, "response_mask", "the response-token mask").bool()
        probs, step_mask, ends = self.step_rewards(td)
        adv = step_token_advantages(probs, step_mask, ends, self._get(td, "group", "the prompt ids"), mask,
                                    aggregate=self.prm_aggregate)
        td.set(self.tensor_keys.advantage, adv.unsqueeze(-1))
        return td


class PRMRewardPPOLoss(PRMStepScorer, PPORLHFLoss):
    """PPO-RLHF whose per-token reward carries a frozen PRM's step scores, each on its step's end token.

    Math-Shepherd's step-by-step PPO (Wang et al. 2024, arXiv:2312.08935) rewards each step at its end
    with the PRM's score: here ``r_t = prm_coef * p_i`` on the token ending step ``i`` (its
    separator; the response's last token for the last step), plus the outcome reward ``R`` on the last
    token when ``outcome_reward``, minus ``kl_coef * kl_t`` on every response token as in
    :class:`~offline_plugins.objectives.llm.ppo_rlhf.PPORLHFLoss`, whose GAE reads it. The rollouts'
    logged reward stays the outcome verifier's.

    Args:
        actor_network, value_network: as :class:`~offline_plugins.objectives.llm.ppo_rlhf.PPORLHFLoss`.

    Keyword Args:
        prm, prm_tokenizer, tokenizer, tokenize_steps, separator, max_length: as :class:`PRMRewardGRPOLoss`.
        prm_coef (float): the step rewards' weight. Defaults to ``1.0``.
        outcome_reward (bool): keep the outcome reward on the last token beside the step rewards (False:
            the step rewards alone). Defaults to ``True``.
        (others): as :class:`~offline_plugins.objectives.llm.ppo_rlhf.PPORLHFLoss`.
    """

    def __init__(self, actor_network: torch.nn.Module, value_network: Any, *, prm: torch.nn.Module,
                 prm_tokenizer: Any, tokenizer: Any, tokenize_steps: Any, separator: str = "\n",
                 max_length: int = 128, prm_coef: float = 1.0, outcome_reward: bool = True, **kwargs) -> None:
        super().__init__(actor_network, value_network, **kwargs)
        self._set_prm(prm, prm_tokenizer, tokenizer, tokenize_steps, separator, max_length)
        self.prm_coef, self.outcome_reward = float(prm_coef), bool(outcome_reward)

    def score_rewards(self, td: TensorDictBase, mask: torch.Tensor) -> torch.Tensor:
        probs, step_mask, ends = self.step_rewards(td)
        dense = step_end_rewards(self.prm_coef * probs, step_mask, ends, mask)
        if self.outcome_reward:
            dense = dense + on_last_token(self.rollout_rewards(td), mask)
        return dense
