"""The rollout collector: a round of sampled responses, scored, written as TED text rows.

A :class:`RolloutCollector` runs each round through the text environment
(:class:`RolloutEnv`, the :class:`~offline_plugins.envs.text.TextEnv` of a
:class:`~offline_plugins.data.prompts.PromptSource`; a TorchRL ``EnvBase``: prompt = state,
response = action, the reference = the behaviour policy the KL is measured against):
``reset(round=, rank=, attempt=)`` gives the round's prompts, drawn with
``rollout_seed(seed, rank, round, attempt)``; the policy samples ``G`` responses per prompt
in one batched ``generate`` (KV cache, temperature / top-p, ``max_new_tokens``, stopping at
eos) and hands their tokens over as the action; ``step`` places those exact tokens after
their prompts and scores them with the source's reward
(:func:`~offline_plugins.data.prompts.score_responses`). The collector adds the reference's
per-token log-probs and returns the rows in the TED text layout (DESIGN.md; see
:mod:`offline_plugins.objectives.llm.online`). A loss's ``process_rollouts`` then writes the
advantages, so the buffer can serve several epochs.

Why not TorchRL's ``LLMCollector`` (with ``ChatEnv`` / ``DatasetChatEnv`` and
``TransformersWrapper``): its environments draw prompts from a ``DataLoader`` iterator
(``DataLoadingPrimer``), so which prompts a round gets depends on how many came before, while
a resumed run must sample exactly the prompts and responses of an uninterrupted one, as a
function of ``(seed, rank, round, attempt)``; its loop yields a fixed number of dialog turns,
while dynamic sampling decides after the advantages whether to sample another attempt in the
same round; and its rollouts are the wrapper's, where ours are one ``generate`` per round with
``G`` samples per prompt under a forked, seeded RNG whose sampled tokens are kept as they are
(a decode / re-tokenise round trip need not give them back, and the PPO ratio needs them).
So we keep our loop and step our own env, behind the same layout. The sampling log-probs
are recorded inside ``generate`` from the model's raw logits (:mod:`offline_plugins.modules.generation`,
before the temperature / top-p warpers), the distribution ``CausalLMLogProbs`` scores for the
losses, so a round costs one ``generate`` and one reference forward, not a second policy
forward. TorchRL's ``TransformersWrapper`` still scores these rows (tests/test_online_losses.py).

With ``--generator vllm`` the samples come from the collector's :attr:`RolloutCollector.generator`,
an in-process vLLM engine with the same contract (the round's seed, the sampled tokens as they
are, the raw distribution's log-probs; :mod:`offline_plugins.modules.vllm_engine`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from tensordict import TensorDict

from offline_plugins.data.multiturn import multiturn_rows
from offline_plugins.data.prompts import (
    PromptSource,
    RewardGuard,
    RolloutError,
    _prompt_ids,
    rollout_seed,
    score_parts,
    score_responses,
)
from offline_plugins.envs.text import TextEnv
from offline_plugins.modules.causal_lm import CausalLMLogProbs
from offline_plugins.modules.generation import generate, model_context
from offline_plugins.tokens import pad_token_id

__all__ = ["RolloutCollector", "RolloutEnv"]

#: what a round writes: the TED text layout the losses read (the env's other keys stay behind)
_ROW_KEYS = (("tokens", "full"), ("masks", "all_attention_mask"), ("masks", "all_assistant_mask"),
             ("log_probs", "full"), ("next", "reward"), ("next", "done"), ("next", "terminated"),
             ("text", "prompt"), ("text", "response"), "response_length", "group")


class RolloutEnv(TextEnv):
    """The :class:`~offline_plugins.envs.text.TextEnv` of a :class:`PromptSource`, as the collector steps it.

    ``reset(round=r, rank=k, attempt=a)`` draws the source's rows with
    ``rollout_seed(seed, k, r, a)``; ``step`` scores the decoded responses with
    :func:`score_responses` (the source's reward function, its columns, its checks and its
    name in every error). ``source`` is a plain attribute.

    Args:
        tokenizer: the policy's tokenizer.
        source: the :class:`PromptSource`.

    Keyword Args:
        as :class:`~offline_plugins.envs.text.TextEnv`'s (``batch_size``, ``group_size``,
        ``max_length``, ``max_new_tokens``, ``max_attempts``, ``seed``, ``device``, ...).
    """

    def __init__(self, tokenizer: Any, source: PromptSource, **kwargs: Any) -> None:
        self.source = source
        super().__init__(tokenizer, **kwargs)

    @property
    def source_name(self) -> str:
        return self.source.name

    def episode_seed(self, rank: int, round: int, attempt: int) -> int:
        return rollout_seed(self.seed, rank, round, attempt)

    def sample_rows(self, n: int, seed: int) -> list[dict]:
        return self.source.sample(n, seed)

    #: how the reward function is called (the collector's: its time limit, failure reward, stop signal)
    guard: Optional[RewardGuard] = None

    def score(self, rows: list[dict], responses: list[str]) -> list[float]:
        return score_responses(self.source, rows, responses, guard=self.guard)

    def score_parts(self, rows: list[dict], responses: list[str]) -> tuple[list[float], Optional[list[list[float]]]]:
        return score_parts(self.source, rows, responses, guard=self.guard)


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
        reward_timeout (float), reward_on_failure (float): the reward function's time limit per call
            (0/None: none) and the reward of a response its call failed on (:class:`RewardGuard`,
            ``reward_guard``; the run sets its ``should_stop``).
        reward_workers (str): ``"thread"`` or ``"process"`` (a call past its limit is killed with its process).
    """

    def __init__(self, source: PromptSource, tokenizer: Any, reference: Optional[torch.nn.Module], *,
                 group_size: int = 8, prompts_per_round: int = 16, max_new_tokens: int = 6,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, max_attempts: int = 4,
                 context: Optional[int] = None, min_group_size: int = 2, reward_timeout: Optional[float] = 60.0,
                 reward_on_failure: float = 0.0, reward_workers: str = "thread") -> None:
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
        self.reward_guard = RewardGuard(time_limit=reward_timeout, on_failure=float(reward_on_failure),
                                        workers=reward_workers)
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
        multiturn = source.multiturn
        if multiturn is not None:  # turns and observations (offline_plugins.data.multiturn), within the context
            self.width = min(self.context, longest + multiturn.max_turns * (self.max_new_tokens
                                                                            + multiturn.max_observation_tokens))
        #: what samples the rounds: None, the policy's own ``generate`` (transformers); or an engine
        #: with the same ``generate`` contract, holding its own copy of the policy's weights
        #: (:class:`~offline_plugins.modules.vllm_engine.VLLMGenerator`, ``--generator vllm``; the
        #: run's data module starts it and loads the weights before each round)
        self.generator: Optional[Any] = None

    @property
    def rows(self) -> int:
        return self.prompts_per_round * self.group_size

    # -- one round: reset, act, step -----------------------------------------------
    def _env(self, device: torch.device) -> Any:
        """The :class:`RolloutEnv` the rounds step, on ``device``; its source is ours."""
        env = getattr(self, "_text_env", None)
        key = (device, self.tokenizer, self.rows, self.group_size, self.width, self.max_new_tokens, self.seed,
               self.max_attempts)
        if env is None or self._text_env_key != key:
            env = RolloutEnv(self.tokenizer, self.source, batch_size=self.rows, group_size=self.group_size,
                          max_length=self.width, max_new_tokens=self.max_new_tokens, max_attempts=self.max_attempts,
                          seed=self.seed, device=device)
            self._text_env, self._text_env_key = env, key
        env.source = self.source  # a plain attribute here: whoever set it last is read
        env.guard = self.reward_guard
        return env

    @torch.no_grad()
    def _act(self, model: torch.nn.Module, env: Any, td: TensorDict, seed: int) -> TensorDict:
        """The policy: ``G`` samples of each of the episode's prompts in one ``generate``, their tokens
        the action ``("tokens", "response")``, their sampling log-probs ``("log_probs", "response")``;
        sampled by :attr:`generator` where one is set (its weights, the same contract)."""
        kwargs = dict(pad_id=self.pad_id, eos_id=self.tokenizer.eos_token_id, max_new_tokens=self.max_new_tokens,
                      num_samples=self.group_size, temperature=self.temperature, top_p=self.top_p, seed=seed)
        if self.generator is not None:
            out = self.generator.generate(env.prompt_ids, device=next(model.parameters()).device, **kwargs)
        else:
            out = generate(model, env.prompt_ids, log_probs=True, **kwargs)
        td.set(("tokens", "response"), out.tokens)
        td.set(("log_probs", "response"), out.log_probs)
        return td

    @torch.no_grad()
    def _round(self, model: torch.nn.Module, *, round: int, rank: int, attempt: int) -> TensorDict:
        """One batch of episodes: the env's prompts for ``(seed, rank, round, attempt)``, sampled, stepped, and
        the reference's log-probs; the rows in the TED text layout."""
        device = next(model.parameters()).device
        env = self._env(device)
        td = env.reset(round=round, rank=rank, attempt=attempt)
        if self.source.multiturn is not None:  # episodes of turns with tools

            row = multiturn_rows(self, model, env, td, rollout_seed(self.seed, rank, round, attempt))
        else:
            td = env.step(self._act(model, env, td, rollout_seed(self.seed, rank, round, attempt)))
            row = td.select(*_ROW_KEYS, ("next", "reward_components"), strict=False)
        if self.reference is not None:
            # the frozen reference belongs to the data, not to the trained module, so the trainer does not
            # move it: it follows the policy's device here, once (a LoRA reference is the policy itself)
            ref_device = next(self.reference.parameters()).device
            if ref_device != device:
                self.reference.to(device)
            row.set(("next", "ref_log_probs", "full"),
                    CausalLMLogProbs(self.reference).log_probs(row.get(("tokens", "full")),
                                                               row.get(("masks", "all_attention_mask"))))
        return row

    def collect(self, model: torch.nn.Module, *, round: int, rank: int = 0,
                process: Optional[Callable[[TensorDict], TensorDict]] = None,
                dynamic_sampling: bool = False) -> tuple[TensorDict, dict[str, float]]:
        """One batch of rollouts from ``model``: ``prompts_per_round * group_size`` rows, and their stats.

        ``process`` (a loss's ``process_rollouts``) writes ``"advantage"`` and ``"has_signal"``; with
        ``dynamic_sampling`` groups without signal are replaced by groups of newly sampled prompts
        (up to ``max_attempts`` batches; what is still missing keeps groups without signal).
        Stats: ``reward_mean``, ``groups_without_signal`` (share of the first batch's groups whose
        rewards were all equal), ``response_length``, ``kl_to_reference`` (mean over responses of
        ``sum_t log pi_sample - log pi_ref``), ``sampled_prompts``, and the mean (NaN ignored) of each
        per-row column ``process`` writes under ``"stats"``.
        """
        p, g = self.prompts_per_round, self.group_size
        kept: list[TensorDict] = []
        spare: list[TensorDict] = []
        first_stats = None
        sampled = 0
        failures_before = self.reward_guard.counts()
        for attempt in range(self.max_attempts if dynamic_sampling else 1):
            # "group" (the env's): prompt ids unique within the run and rank: round, attempt, position
            td = self._round(model, round=round, rank=rank, attempt=attempt)
            sampled += p
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
        # responses whose reward call raised, exited or hung this round (they got reward_on_failure)
        stats.update({k: float(v - failures_before[k]) for k, v in self.reward_guard.counts().items()})
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
        # a loss's own per-row figures, written by its process_rollouts under "stats" (online DPO's judge): means
        extra = td.get("stats", None)
        names = list(extra.keys()) if extra is not None else []
        values += [extra.get(k).float().nanmean() for k in names]
        reward, length, no_signal, kl, *more = torch.stack([v.reshape(()).to(torch.float32).cpu()
                                                            for v in values]).tolist()
        return {"reward_mean": reward, "response_length": length, "groups_without_signal": no_signal,
                "kl_to_reference": kl, **dict(zip(names, more))}
