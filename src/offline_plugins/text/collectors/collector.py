"""The rollout collector: a round of sampled responses, scored, written as TED text rows.

A :class:`RolloutCollector` runs each round through the text environment
(:class:`RolloutEnv`, the :class:`~offline_plugins.text.envs.text.TextEnv` of a
:class:`~offline_plugins.text.sources.prompts.PromptSource`; a TorchRL ``EnvBase``: prompt = state,
response = action, the reference = the behaviour policy the KL is measured against):
``reset(round=, rank=, attempt=)`` gives the round's prompts, drawn with
``rollout_seed(seed, rank, round, attempt)``; the policy samples ``G`` responses per prompt
in one batched ``generate`` (KV cache, temperature / top-p, ``max_new_tokens``, stopping at
eos) and hands their tokens over as the action; ``step`` places those exact tokens after
their prompts and scores them with the source's reward
(:func:`~offline_plugins.text.sources.prompts.score_responses`). The collector adds the reference's
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
are recorded inside ``generate`` from the model's raw logits (:mod:`offline_plugins.text.backends.generation`,
before the temperature / top-p warpers), the distribution ``CausalLMLogProbs`` scores for the
losses, so a round costs one ``generate`` and one reference forward, not a second policy
forward. TorchRL's ``TransformersWrapper`` still scores these rows (tests/test_online_losses.py).

With ``--generator vllm`` the samples come from the collector's :attr:`RolloutCollector.generator`,
an in-process vLLM engine with the same contract (the round's seed, the sampled tokens as they
are, the raw distribution's log-probs; :mod:`offline_plugins.text.backends.vllm_engine`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from tensordict import TensorDict

from offline_plugins.modules.causal_lm import CausalLMLogProbs
from offline_plugins.text.backends.generation import generate, model_context
from offline_plugins.text.envs.text import TextEnv
from offline_plugins.text.envs.turns import TurnBatch
from offline_plugins.text.sources.prompts import (
    PromptSource,
    RewardGuard,
    RolloutError,
    _prompt_ids,
    rollout_seed,
    score_parts,
    score_responses,
)
from offline_plugins.tokens import pad_token_id

__all__ = ["RolloutCollector", "RolloutEnv", "SamplingSettings", "rollout_width", "sample_turn"]

#: what a round writes: the TED text layout the losses read (the env's other keys stay behind)
_ROW_KEYS = (("tokens", "full"), ("masks", "all_attention_mask"), ("masks", "all_assistant_mask"),
             ("log_probs", "full"), ("next", "reward"), ("next", "done"), ("next", "terminated"),
             ("text", "prompt"), ("text", "response"), "response_length", "group",
             # several rewards side by side (gdpo); a multi-turn episode's turn rewards and counts
             ("next", "reward_components"), ("next", "turn_reward"), "stats")


@torch.no_grad()
def sample_turn(model: torch.nn.Module, batches: list[TurnBatch], *, rows: int, pad_id: int, eos_id: Optional[int],
                seed: Optional[int], temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False,
                generator: Any = None) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The policy's step: each of ``batches`` (the env's :meth:`~offline_plugins.text.envs.text.TextEnv.turn_batches`)
    sampled in one ``generate`` (by ``generator``, an engine with its contract, where given), seeded with
    ``rollout_seed(seed, *batch.seed_parts)`` (``seed`` itself for a batch with no parts; None: unseeded).

    Returns ``(tokens, lengths, log_probs)`` for the env's ``rows`` rows: ``[rows, K]`` right-padded with
    ``pad_id``, ``[rows]`` (None for one batch of every row: each response runs to its first eos, the
    env's single-turn action) and the sampling log-probs (None when greedy).
    """
    device = next(model.parameters()).device
    outs = []
    for b in batches:
        kwargs = dict(pad_id=pad_id, eos_id=eos_id, max_new_tokens=b.max_new_tokens, num_samples=b.num_samples,
                      temperature=temperature, top_p=top_p,
                      seed=None if seed is None else rollout_seed(seed, *b.seed_parts) if b.seed_parts else seed)
        outs.append(generator.generate(b.prompt_ids, device=device, **kwargs) if generator is not None
                    else generate(model, b.prompt_ids, greedy=greedy, log_probs=not greedy, **kwargs))
    if len(batches) == 1 and batches[0].rows is None:  # every row, in order
        return outs[0].tokens, None, outs[0].log_probs
    width = max((o.tokens.shape[1] for o in outs), default=0)
    tokens = torch.full((rows, width), pad_id, dtype=torch.long, device=device)
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    log_probs = None if greedy else torch.zeros(rows, width, dtype=torch.float32, device=device)
    for b, out in zip(batches, outs):
        index = torch.tensor(b.rows, device=device)
        tokens[index, :out.tokens.shape[1]] = out.tokens.to(device)
        lengths[index] = out.lengths.to(device)
        if log_probs is not None and out.log_probs is not None:
            log_probs[index, :out.tokens.shape[1]] = out.log_probs.to(device, torch.float32)
    return tokens, lengths, log_probs


class RolloutEnv(TextEnv):
    """The :class:`~offline_plugins.text.envs.text.TextEnv` of a :class:`PromptSource`, as the collector steps it.

    ``reset(round=r, rank=k, attempt=a)`` draws the source's rows with
    ``rollout_seed(seed, k, r, a)``; ``step`` scores the decoded responses with
    :func:`score_responses` (the source's reward function, its columns, its checks and its
    name in every error). ``source`` is a plain attribute.

    Args:
        tokenizer: the policy's tokenizer.
        source: the :class:`PromptSource`.

    Keyword Args:
        as :class:`~offline_plugins.text.envs.text.TextEnv`'s (``batch_size``, ``group_size``,
        ``max_length``, ``max_new_tokens``, ``max_attempts``, ``seed``, ``device``, ...).
    """

    def __init__(self, tokenizer: Any, source: PromptSource, **kwargs: Any) -> None:
        self.source = source
        super().__init__(tokenizer, **kwargs)

    @property
    def source_name(self) -> str:
        return self.source.name

    @property
    def multiturn(self) -> Any:
        return self.source.multiturn

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


@dataclass(frozen=True)
class SamplingSettings:
    """How a run samples its rounds (each a ``--set`` name): ``group_size`` responses to each of
    ``prompts_per_round`` prompts of at most ``max_new_tokens`` tokens, at ``temperature`` / ``top_p``; up
    to ``max_attempts`` batches a round under dynamic sampling; the reward called under ``reward_timeout``
    seconds, ``reward_on_failure`` the reward of a failed call, in ``reward_workers`` (:class:`RewardGuard`).
    Made by :meth:`checked`.
    """

    group_size: int = 8
    prompts_per_round: int = 16
    max_new_tokens: int = 6
    temperature: float = 1.0
    top_p: float = 1.0
    max_attempts: int = 4
    reward_timeout: Optional[float] = 60.0
    reward_on_failure: float = 0.0
    reward_workers: str = "thread"

    @classmethod
    def checked(cls, min_group_size: int = 1, **settings: Any) -> "SamplingSettings":
        """The settings, after refusing any no round can be sampled with (one line naming it and the fix);
        ``min_group_size``: the algorithm's (a group method compares ``G >= 2`` responses to one prompt,
        PPO-RLHF's value baseline needs no group)."""
        g, need = settings.get("group_size", cls.group_size), int(min_group_size)
        if isinstance(g, bool) or not isinstance(g, int) or g < need:
            why = "a group compares G responses to one prompt" if need > 1 else "responses sampled per prompt"
            raise RolloutError(f"group_size must be a whole number >= {need} ({why}), got {g!r}; fix it with "
                               f"--set group_size={max(8, need)}")
        s = cls(**settings)
        if s.prompts_per_round < 1:
            raise RolloutError(f"prompts_per_round must be at least 1, got {s.prompts_per_round}; fix it with "
                               "--set prompts_per_round=16")
        if s.max_new_tokens < 1:
            raise RolloutError(f"max_new_tokens must be at least 1, got {s.max_new_tokens}")
        if not s.temperature > 0 or not 0 < s.top_p <= 1:
            raise RolloutError(f"temperature must be > 0 and top_p in (0, 1], got {s.temperature}, {s.top_p}; "
                               "fix them with --set temperature=1.0 top_p=1.0")
        s.reward_guard()  # a bad reward_workers
        return cls(int(s.group_size), int(s.prompts_per_round), int(s.max_new_tokens), float(s.temperature),
                   float(s.top_p), int(s.max_attempts), s.reward_timeout, float(s.reward_on_failure), s.reward_workers)

    @property
    def rows(self) -> int:
        """Rows a round holds: ``prompts_per_round * group_size``."""
        return self.prompts_per_round * self.group_size

    def reward_guard(self) -> RewardGuard:
        """A :class:`RewardGuard` of these settings (each holds its own failure counts)."""
        return RewardGuard(time_limit=self.reward_timeout, on_failure=float(self.reward_on_failure),
                           workers=self.reward_workers)


def rollout_width(source: PromptSource, tokenizer: Any, context: int, max_new_tokens: int) -> tuple[int, int]:
    """``(longest prompt, width)`` in tokens of ``source``'s rounds: the width holds the longest prompt and
    a response (a multi-turn episode: its turns and observations, within ``context``); a prompt and
    response past the model's ``context`` are refused, naming the prompt."""
    longest = max((len(_prompt_ids(tokenizer, p)) for p in source.longest_prompts), default=1)
    if longest + max_new_tokens > context:
        worst = max(source.longest_prompts, key=lambda p: len(_prompt_ids(tokenizer, p)))
        raise RolloutError(
            f"{source.name}: prompt {worst!r:.80} is {longest} tokens; with max_new_tokens={max_new_tokens} "
            f"it exceeds the model's context of {context} tokens; shorten the prompt or lower "
            f"max_new_tokens (--set max_new_tokens=...)")
    multiturn = source.multiturn
    if multiturn is None:
        return longest, longest + max_new_tokens
    return longest, min(context, longest + multiturn.max_turns * (max_new_tokens + multiturn.max_observation_tokens))


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
        self.settings = SamplingSettings.checked(
            min_group_size, group_size=group_size, prompts_per_round=prompts_per_round, max_new_tokens=max_new_tokens,
            temperature=temperature, top_p=top_p, max_attempts=max_attempts, reward_timeout=reward_timeout,
            reward_on_failure=reward_on_failure, reward_workers=reward_workers)
        self.source = source
        self.tokenizer = tokenizer
        self.pad_id = pad_token_id(tokenizer)
        self.reference = reference
        self.group_size = self.settings.group_size
        self.prompts_per_round = self.settings.prompts_per_round
        self.max_new_tokens = self.settings.max_new_tokens
        self.temperature = self.settings.temperature
        self.top_p = self.settings.top_p
        self.seed = int(seed)
        self.max_attempts = self.settings.max_attempts
        self.reward_guard = self.settings.reward_guard()
        self.context = context if context is not None else model_context(reference)
        self.max_prompt_tokens, self.width = rollout_width(source, tokenizer, self.context, self.max_new_tokens)
        #: what samples the rounds: None, the policy's own ``generate`` (transformers); or an engine
        #: with the same ``generate`` contract, holding its own copy of the policy's weights
        #: (:class:`~offline_plugins.text.backends.vllm_engine.VLLMGenerator`, ``--generator vllm``; the
        #: run's data module starts it and loads the weights before each round)
        self.generator: Optional[Any] = None

    @property
    def rows(self) -> int:
        return self.settings.rows

    @classmethod
    def for_data(cls, data: Any, plan: Any = None, *, seed: int = 0) -> "RolloutCollector":
        """The collector of one run over loaded rollout data (a
        :class:`~offline_plugins.text.data.rollouts.RolloutData`): its sampling settings, with the prompt
        source, reference and tokenizer ``plan`` (a :class:`~offline_plugins.algorithms.base.RolloutPlan`)
        names in place of the data's, checked against the plan's ``min_group_size`` and the model's context."""
        def pick(name: str) -> Any:
            theirs = getattr(plan, name, None)
            return getattr(data, name) if theirs is None else theirs

        return cls(pick("source"), pick("tokenizer"), pick("reference"), seed=seed,
                   min_group_size=int(getattr(plan, "min_group_size", 1)), **dataclasses.asdict(data.settings))

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
        """The policy's step (:func:`sample_turn` of the env's :meth:`turn_batches`): single-turn, ``G``
        samples of each prompt in one ``generate``; multi-turn, the turn of every unfinished episode. The
        tokens are the action ``("tokens", "response")`` (with ``"turn_length"`` on a turn), their sampling
        log-probs ``("log_probs", "response")``; sampled by :attr:`generator` where one is set (its
        weights, the same contract)."""
        tokens, lengths, log_probs = sample_turn(
            model, env.turn_batches(), rows=len(env.rows), pad_id=self.pad_id, eos_id=self.tokenizer.eos_token_id,
            seed=seed, temperature=self.temperature, top_p=self.top_p, generator=self.generator)
        td.set(("tokens", "response"), tokens)
        td.set(("log_probs", "response"), log_probs)
        if lengths is not None:
            td.set("turn_length", lengths)
        return td

    @torch.no_grad()
    def _round(self, model: torch.nn.Module, *, round: int, rank: int, attempt: int) -> TensorDict:
        """One batch of episodes: the env's prompts for ``(seed, rank, round, attempt)``, sampled, stepped, and
        the reference's log-probs; the rows in the TED text layout."""
        device = next(model.parameters()).device
        env = self._env(device)
        td = env.reset(round=round, rank=rank, attempt=attempt)
        seed = rollout_seed(self.seed, rank, round, attempt)
        while True:  # one step a turn: a single-turn episode ends after the first
            td = env.step(self._act(model, env, td, seed))
            if env.episode_done:
                break
        row = td.select(*_ROW_KEYS, strict=False)
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
