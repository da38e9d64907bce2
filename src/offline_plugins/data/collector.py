"""The rollout collector: a round of sampled responses, scored, written as TED text rows.

A :class:`RolloutCollector` samples ``G`` responses per prompt from the current policy
(one batched ``generate`` with the KV cache, temperature / top-p, ``max_new_tokens``,
stopping at eos), scores them, computes the sampling policy's and the reference's
per-token log-probs and writes the rows into a TorchRL ``TensorDictReplayBuffer`` in the
TED text layout (DESIGN.md; see :mod:`offline_plugins.objectives.llm.online`). A loss's
``process_rollouts`` then writes the advantages, so the buffer can serve several epochs.

Why not TorchRL's ``LLMCollector`` + ``TransformersWrapper``: ``LLMCollector`` steps an
environment with a policy, one response per environment row; ours are one-step episodes
whose prompts must be a function of ``(seed, rank, round)`` so that a resumed run samples
exactly the prompts and responses of an uninterrupted one, and ``TextEnv`` keeps its
position as a counter of resets and re-tokenises decoded text (a BPE round trip need not
give back the generated tokens, which the PPO ratio needs). The sampling log-probs are
recorded inside ``generate`` from the model's raw logits (:mod:`offline_plugins.modules.generation`, before the
temperature / top-p warpers), the distribution ``CausalLMLogProbs`` scores for the losses,
so a round costs one ``generate`` and one reference forward, not a second policy forward.
TorchRL's ``TransformersWrapper`` still scores these rows (tests/test_online_losses.py).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from tensordict import NonTensorStack, TensorDict

from offline_plugins.data.prompts import PromptSource, RolloutError, _prompt_ids, rollout_seed, score_responses
from offline_plugins.modules.generation import model_context

__all__ = ["RolloutCollector"]


class RolloutCollector:
    """Samples ``group_size`` responses per prompt from a policy and writes TED text rows to a buffer.

    Args:
        source: the :class:`PromptSource`.
        tokenizer: the policy's tokenizer.
        reference: the frozen reference model (its log-probs go into every row), or None.

    Keyword Args:
        group_size (int): responses per prompt, ``G >= 2``.
        prompts_per_round (int): prompts per batch of rollouts; the buffer holds
            ``prompts_per_round * group_size`` rows.
        max_new_tokens (int), temperature (float), top_p (float): sampling.
        seed (int): the run's seed; round ``r`` of rank ``k`` samples with ``rollout_seed(seed, k, r, ...)``.
        max_attempts (int): dynamic sampling (``process`` asks for it): sample up to this many
            batches of prompts to find groups whose rewards differ.
    """

    def __init__(self, source: PromptSource, tokenizer: Any, reference: Optional[torch.nn.Module], *,
                 group_size: int = 8, prompts_per_round: int = 16, max_new_tokens: int = 6,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, max_attempts: int = 4,
                 context: Optional[int] = None, min_group_size: int = 2) -> None:
        # the algorithm declares its minimum: GRPO-style losses compare G >= 2 responses to one prompt,
        # PPO-RLHF (a value baseline) needs no group (min_group_size=1)
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < int(min_group_size):
            why = ("a group compares G responses to one prompt" if int(min_group_size) > 1
                   else "responses sampled per prompt")
            raise RolloutError(f"group_size must be a whole number >= {int(min_group_size)} ({why}), got "
                               f"{group_size!r}; fix it with --set group_size={max(8, int(min_group_size))}")
        if prompts_per_round < 1:
            raise RolloutError(f"prompts_per_round must be at least 1, got {prompts_per_round}; fix it with "
                               "--set prompts_per_round=16")
        if max_new_tokens < 1:
            raise RolloutError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if not temperature > 0 or not 0 < top_p <= 1:
            raise RolloutError(f"temperature must be > 0 and top_p in (0, 1], got {temperature}, {top_p}; "
                               "fix them with --set temperature=1.0 top_p=1.0")
        from offline_plugins.tokens import pad_token_id

        self.source = source
        self.tokenizer = tokenizer
        self.pad_id = pad_token_id(tokenizer)
        self.reference = reference
        self.group_size = int(group_size)
        self.prompts_per_round = int(prompts_per_round)
        self.max_new_tokens = int(max_new_tokens)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.seed = int(seed)
        self.max_attempts = int(max_attempts)
        self.context = context if context is not None else model_context(reference)
        longest = max((len(_prompt_ids(tokenizer, p)) for p in source.longest_prompts), default=1)
        self.max_prompt_tokens = longest
        if longest + self.max_new_tokens > self.context:
            worst = max(source.longest_prompts, key=lambda p: len(_prompt_ids(tokenizer, p)))
            raise RolloutError(
                f"{source.name}: prompt {worst!r:.80} is {longest} tokens; with max_new_tokens={self.max_new_tokens} "
                f"it exceeds the model's context of {self.context} tokens; shorten the prompt or lower "
                f"max_new_tokens (--set max_new_tokens=...)")
        self.width = longest + self.max_new_tokens

    @property
    def rows(self) -> int:
        return self.prompts_per_round * self.group_size

    # -- sampling ------------------------------------------------------------------
    def _check_prompt(self, ids: list[int], prompt: str) -> None:
        if len(ids) + self.max_new_tokens > self.width:
            raise RolloutError(
                f"{self.source.name}: prompt {prompt!r:.80} is {len(ids)} tokens; the rollout budget is "
                f"{self.width - self.max_new_tokens} prompt tokens + max_new_tokens={self.max_new_tokens} "
                f"(model context {self.context}); shorten the prompt")

    @torch.no_grad()
    def _sample(self, model: torch.nn.Module, rows: list[dict], seed: int) -> TensorDict:
        from offline_plugins.modules.causal_lm import CausalLMLogProbs
        from offline_plugins.modules.generation import generate

        g = self.group_size
        prompt_ids = [_prompt_ids(self.tokenizer, r["prompt"]) for r in rows]
        for ids, r in zip(prompt_ids, rows):
            self._check_prompt(ids, r["prompt"])
        out = generate(model, prompt_ids, pad_id=self.pad_id, eos_id=self.tokenizer.eos_token_id,
                       max_new_tokens=self.max_new_tokens, num_samples=g, temperature=self.temperature,
                       top_p=self.top_p, seed=seed, log_probs=True)
        gen, gen_lp, resp_len = out.tokens, out.log_probs, out.lengths
        device, n = gen.device, gen.shape[0]
        full = torch.full((n, self.width), self.pad_id, dtype=torch.long, device=device)
        resp_mask = torch.zeros(n, self.width, dtype=torch.bool, device=device)
        lengths_p = torch.tensor([len(prompt_ids[i // g]) for i in range(n)], device=device)
        pos = torch.arange(self.width, device=device)
        for i, ids in enumerate(prompt_ids):  # prompts are short lists: one copy per group
            full[i * g:(i + 1) * g, : len(ids)] = torch.tensor(ids, device=device)
        # place the responses right after their prompts (vectorised scatter)
        valid = out.response_mask
        target = lengths_p.unsqueeze(1) + torch.arange(gen.shape[1], device=device).unsqueeze(0)
        rows_idx = torch.arange(n, device=device).unsqueeze(1).expand_as(target)
        full[rows_idx[valid], target[valid]] = gen[valid]
        resp_mask[rows_idx[valid], target[valid]] = True
        lp_policy = torch.zeros(n, self.width, dtype=torch.float32, device=device)
        lp_policy[rows_idx[valid], target[valid]] = gen_lp[valid]
        attn = pos.unsqueeze(0) < (lengths_p + resp_len).unsqueeze(1)
        texts = out.texts(self.tokenizer, self.pad_id)
        expanded = [rows[i // g] for i in range(n)]
        rewards = score_responses(self.source, expanded, texts)
        lp_ref = CausalLMLogProbs(self.reference).log_probs(full, attn) if self.reference is not None else None
        done = torch.ones(n, 1, dtype=torch.bool, device=device)
        td = TensorDict(
            {
                "tokens": {"full": full},
                "masks": {"all_attention_mask": attn, "all_assistant_mask": resp_mask},
                "log_probs": {"full": lp_policy},
                "next": {"reward": torch.tensor(rewards, dtype=torch.float32, device=device).reshape(n, 1),
                         "done": done, "terminated": done.clone()},
                "response_length": resp_len.to(torch.float32),
            },
            [n],
            device=device,
        )
        if lp_ref is not None:
            td.set(("next", "ref_log_probs", "full"), lp_ref)
        # from_list: NonTensorStack(*items) on a device TensorDict moves every item (a tenth of a round)
        td.set(("text", "prompt"), NonTensorStack.from_list([r["prompt"] for r in expanded]))
        td.set(("text", "response"), NonTensorStack.from_list(texts))
        return td

    def collect(self, model: torch.nn.Module, *, round: int, rank: int = 0,
                process: Optional[Callable[[TensorDict], TensorDict]] = None,
                dynamic_sampling: bool = False) -> tuple[TensorDict, dict[str, float]]:
        """One batch of rollouts from ``model``: ``prompts_per_round * group_size`` rows, and their stats.

        ``process`` (a loss's ``process_rollouts``) writes ``"advantage"`` and ``"has_signal"``; with
        ``dynamic_sampling`` groups without signal are replaced by groups of newly sampled prompts
        (up to ``max_attempts`` batches; what is still missing keeps groups without signal).
        Stats: ``reward_mean``, ``groups_without_signal`` (share of the first batch's groups whose
        rewards were all equal), ``response_length``, ``kl_to_reference`` (mean over responses of
        ``sum_t log pi_sample - log pi_ref``), ``sampled_prompts``.
        """
        p, g = self.prompts_per_round, self.group_size
        kept: list[TensorDict] = []
        spare: list[TensorDict] = []
        first_stats = None
        sampled = 0
        for attempt in range(self.max_attempts if dynamic_sampling else 1):
            seed = rollout_seed(self.seed, rank, round, attempt)
            rows = self.source.sample(p, seed)
            td = self._sample(model, rows, seed)
            sampled += p
            # prompt ids unique within the run and rank: round, attempt, position
            td.set("group", (torch.arange(p, device=td.device).repeat_interleave(g)
                             + (round * self.max_attempts + attempt) * p))
            if process is not None:
                td = process(td)
            signal = td.get("has_signal", None)
            if first_stats is None:
                first_stats = self._stats(td)
            if not dynamic_sampling or signal is None:
                kept = [td]
                break
            by_group = signal.reshape(p, g)[:, 0]
            groups = td.reshape(p, g)
            kept.extend(groups[i] for i in torch.nonzero(by_group).flatten().tolist())
            spare.extend(groups[i] for i in torch.nonzero(~by_group).flatten().tolist())
            if len(kept) >= p:
                break
        if dynamic_sampling and kept and kept[0].batch_dims == 1 and kept[0].batch_size[0] == g:
            chosen = (kept + spare)[:p]
            td = torch.stack(chosen, 0).reshape(p * g)
        elif dynamic_sampling and not kept:
            td = torch.stack(spare[:p], 0).reshape(p * g)
        else:
            td = kept[0]
        stats = dict(first_stats or {})
        stats["sampled_prompts"] = float(sampled)
        if dynamic_sampling:
            signal = td.get("has_signal")
            stats["kept_groups_without_signal"] = float(1 - signal.float().mean())
        return td, stats

    def _stats(self, td: TensorDict) -> dict[str, float]:
        mask = td.get(("masks", "all_assistant_mask")).float()
        values = [td.get(("next", "reward")).float().mean(), td.get("response_length").float().mean()]
        signal = td.get("has_signal", None)
        values.append(1 - signal.float().mean() if signal is not None else torch.zeros(()))
        ref = td.get(("next", "ref_log_probs", "full"), None)
        kl = ((td.get(("log_probs", "full")) - ref) * mask).sum(-1).mean() if ref is not None else torch.zeros(())
        values.append(kl)
        reward, length, no_signal, kl = torch.stack([v.reshape(()).to(torch.float32).cpu() for v in values]).tolist()
        return {"reward_mean": reward, "response_length": length, "groups_without_signal": no_signal,
                "kl_to_reference": kl}
