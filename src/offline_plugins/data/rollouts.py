"""Rollouts for online RL on text: prompts, rewards, and a collector that fills a TorchRL buffer.

A :class:`PromptSource` says where prompts come from and how a response is scored: the
built-in arithmetic task (its verifier), a JSONL file of ``prompt``/``answer`` rows (exact
match), or prompt rows with a user's reward function ``module:function`` called as
TRL's reward functions are, ``fn(prompts, responses, **columns) -> list[float]``.
Held-out prompts are split off deterministically by a hash of their text
(:func:`~offline_plugins.data.preference_sources.held_out_prompts`, as the preference loader).

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

import hashlib
import importlib
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from tensordict import NonTensorStack, TensorDict

from offline_plugins.errors import UserError
from offline_plugins.modules.generation import generate_left_padded, model_context

__all__ = [
    "RolloutError",
    "PromptSource",
    "task_prompt_source",
    "jsonl_prompt_source",
    "load_reward_function",
    "score_responses",
    "RolloutCollector",
    "RolloutData",
    "CompletionData",
    "BUILTIN_ROLLOUT_TASKS",
    "resolve_rollout_id",
    "sft_reference",
    "load_rollout_data",
    "load_completion_data",
    "model_context",
    "rollout_seed",
    "generate_left_padded",
    "greedy_responses",
]


class RolloutError(UserError, ValueError):
    """A reward function, prompt file or rollout setting that cannot be used."""


def rollout_seed(*parts: int) -> int:
    """A 63-bit seed from integers (seed, rank, round, attempt): the same everywhere, every run.

    >>> rollout_seed(0, 0, 1) != rollout_seed(0, 1, 1)
    True
    """
    digest = hashlib.blake2b(",".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class PromptSource:
    """Training and held-out prompts, and how a response to one is scored.

    Attributes:
        name: what the source is, for messages (``"arithmetic-2d+"``, a file path).
        train: the training rows (dicts with at least ``"prompt"``), or None when ``sample``
            draws them (a task makes fresh problems).
        held_out: the held-out rows.
        reward_fn: ``fn(prompts, responses, **columns) -> list[float]``.
        reward_name: the function's name, for error messages.
        sample_fn: ``sample_fn(n, seed) -> rows`` (a task); default: draw from ``train``.
        max_prompt_chars: the longest prompt the source can give (tasks: their longest form).
    """

    name: str
    held_out: list[dict]
    reward_fn: Callable[..., Sequence[float]]
    reward_name: str
    train: Optional[list[dict]] = None
    sample_fn: Optional[Callable[[int, int], list[dict]]] = None
    longest_prompts: list[str] = field(default_factory=list)

    def sample(self, n: int, seed: int) -> list[dict]:
        """``n`` training rows drawn with ``seed`` (with replacement)."""
        if self.sample_fn is not None:
            return self.sample_fn(n, seed)
        rng = random.Random(seed)
        return [self.train[rng.randrange(len(self.train))] for _ in range(n)]

    @property
    def has_answers(self) -> bool:
        return bool(self.held_out) and all("answer" in r for r in self.held_out)


def task_prompt_source(task: Any, *, n_held_out: int = 200) -> PromptSource:
    """A built-in verifiable task: fresh train-split problems per round, test-split problems held out."""
    held = [{"prompt": p.prompt, "answer": p.answer} for p in task.problems(n_held_out, split="test", seed=1)]

    def sample(n: int, seed: int) -> list[dict]:
        return [{"prompt": p.prompt, "answer": p.answer} for p in task.problems(n, split="train", seed=seed)]

    def reward(prompts, responses, **_):
        return task.rewards(prompts, responses)

    digits = getattr(task, "digits", 2)
    longest = [f"{'9' * digits}{op}{'9' * digits}=" for op in getattr(task, "ops", "+")]
    return PromptSource(task.name, held, reward, f"{task.name} verifier", sample_fn=sample, longest_prompts=longest)


def _exact_match(prompts, responses, answer=None, **_):
    from offline_plugins.envs.tasks import exact_match

    return [exact_match(r, a) for r, a in zip(responses, answer)]


def load_reward_function(spec: str) -> Callable[..., Sequence[float]]:
    """The callable ``module:function`` names (``--reward``); a ``UserError`` naming what is wrong."""
    from offline_plugins.data.reward_source import is_reward_model_dir, reward_model_function

    if Path(str(spec)).is_dir():  # a reward-model run's OUT dir or its exported OUT/reward_model
        if not is_reward_model_dir(spec):
            from offline_plugins.data.reward_source import _folder

            _folder(spec)  # raises, naming what the folder lacks
        return reward_model_function(spec)
    module_name, sep, attr = str(spec).partition(":")
    if not sep or not module_name or not attr:
        raise RolloutError(f"--reward {spec!r} must be 'module:function' (e.g. mytask.rewards:score), a Python "
                           "callable (prompts, responses, **columns) -> list[float]")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's module
        raise RolloutError(f"--reward {spec!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); "
                           "put it on PYTHONPATH or install it") from None
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise RolloutError(f"--reward {spec!r}: module {module_name!r} has no attribute {attr!r}; name a "
                               "function defined in it")
    if not callable(fn):
        raise RolloutError(f"--reward {spec!r} is a {type(fn).__name__}, not a callable; name a function "
                           "(prompts, responses, **columns) -> list[float]")
    return fn


def score_responses(source: PromptSource, rows: Sequence[dict], responses: Sequence[str]) -> list[float]:
    """The source's rewards of ``responses`` to ``rows``, checked: one finite number per response."""
    prompts = [r["prompt"] for r in rows]
    columns = {k: [r.get(k) for r in rows] for k in rows[0] if k != "prompt"} if rows else {}
    name = source.reward_name
    try:
        values = source.reward_fn(prompts, list(responses), **columns)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's function failed: say which and how
        raise RolloutError(f"reward function {name} raised {type(exc).__name__}: {exc} (on prompt "
                           f"{prompts[0]!r:.60} and {len(prompts) - 1} more); fix the function, it is called as "
                           "fn(prompts, responses, **columns) -> list[float]") from None
    try:
        values = list(values)
    except TypeError:
        raise RolloutError(f"reward function {name} returned a {type(values).__name__}, expected a list of "
                           f"{len(prompts)} floats (one per response)") from None
    if len(values) != len(prompts):
        raise RolloutError(f"reward function {name} returned {len(values)} rewards for {len(prompts)} responses; "
                           "return one float per response, in order")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) and not (torch.is_tensor(v) and v.numel() == 1):
            raise RolloutError(f"reward function {name} returned {v!r} ({type(v).__name__}) for response {i} "
                               f"({responses[i]!r:.40} to {prompts[i]!r:.40}); return floats")
        v = float(v)
        if not math.isfinite(v):
            raise RolloutError(f"reward function {name} returned {v} for response {i} ({responses[i]!r:.40} to "
                               f"{prompts[i]!r:.40}); rewards must be finite numbers")
        out.append(v)
    return out


def jsonl_prompt_source(path: str, *, reward: Optional[str] = None, test_fraction: float = 0.1,
                        min_test_rows: int = 100) -> PromptSource:
    """Rows of a JSONL file: ``prompt`` and ``answer`` (exact-match reward), or ``prompt`` (and any
    other columns) with ``reward``, a ``module:function`` reward function."""
    from offline_plugins.data.preference_sources import held_out_prompts

    p = Path(path)
    if not p.is_file():
        raise RolloutError(f"prompt file {path!r} does not exist; give a .jsonl file of prompt/answer rows")
    rows = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RolloutError(f"{path}: line {n} is not JSON ({exc.msg}); each line must be an object "
                               '{"prompt": ..., "answer": ...}') from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise RolloutError(f"{path}: line {n} has no non-empty string 'prompt'; each line must be an object "
                               '{"prompt": ..., "answer": ...}')
        if reward is None and "answer" not in row:
            raise RolloutError(f"{path}: line {n} has no 'answer'; give prompt/answer rows for the exact-match "
                               "reward, or a reward function with --reward module:function")
        if "answer" in row:
            row["answer"] = str(row["answer"])
        rows.append(row)
    if not rows:
        raise RolloutError(f"{path} holds no rows; it needs prompt/answer rows")
    held = held_out_prompts([r["prompt"] for r in rows], fraction=test_fraction, min_rows=min_test_rows)
    train = [r for r in rows if r["prompt"] not in held]
    test = [r for r in rows if r["prompt"] in held]
    if not train:
        raise RolloutError(f"{path}: every row fell in the held-out split; give more rows")
    fn, name = (_exact_match, "exact match against 'answer'") if reward is None else (load_reward_function(reward),
                                                                                      reward)
    longest = sorted((r["prompt"] for r in rows), key=len)[-3:]
    return PromptSource(str(path), test, fn, name, train=train, longest_prompts=longest)


def _prompt_ids(tokenizer, prompt: str) -> list[int]:
    from offline_plugins.tokens import prompt_token_ids

    return prompt_token_ids(tokenizer, prompt)


def greedy_responses(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[str], *, max_new_tokens: int,
                     batch_size: int = 100) -> list[str]:
    """Greedy decoded responses, prompts left-padded in batches of ``batch_size``
    (:func:`offline_plugins.data.text_tasks.generate`): what one prompt at a time would give."""
    from offline_plugins.data.text_tasks import generate

    return [r[0] for r in generate(model, tokenizer, prompts, greedy=True, max_new_tokens=max_new_tokens,
                                   batch_size=batch_size)]


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


#: the built-in online task: id -> (summary, task settings)
BUILTIN_ROLLOUT_TASKS: dict[str, tuple[str, dict]] = {
    "offline-plugins/arithmetic/v0": ("2-digit addition, exact-match reward", {"digits": 2, "ops": "+"}),
}
_ALIASES = {"arithmetic": "offline-plugins/arithmetic/v0", "arithmetic/v0": "offline-plugins/arithmetic/v0"}


def resolve_rollout_id(dataset: str) -> Optional[str]:
    """The canonical id of a built-in task or a ``.jsonl`` prompt file; None otherwise.

    >>> resolve_rollout_id("arithmetic"), resolve_rollout_id("pendulum/medium-v0")
    ('offline-plugins/arithmetic/v0', None)
    """
    dataset = dataset.strip()
    if dataset in BUILTIN_ROLLOUT_TASKS:
        return dataset
    if dataset in _ALIASES:
        return _ALIASES[dataset]
    if dataset.endswith(".jsonl"):
        return dataset
    return None


def sft_reference(task: Any, *, model: Any = "tiny", seed: int = 0, steps: int = 2000, batch_size: int = 64,
                  lr: float = 3e-3, rows: int = 8000, max_length: int = 24, cache_dir: Optional[Path] = None,
                  progress: bool = False):
    """``(model, tokenizer)``: ``model`` after SFT on the task's exact answers, cached as
    :func:`~offline_plugins.data.text_tasks.task_preference_data` caches it (same folder name), so
    the online and the preference results start from one reference."""
    from offline_plugins.data.text_tasks import sft_rows, supervised_finetune
    from offline_plugins.modules.tiny_lm import load_causal_lm, model_cache_tag

    tag = f"sft-{task.name}-{model_cache_tag(model)}-s{seed}-n{steps}-b{batch_size}"
    ref_dir = Path(cache_dir) / tag if cache_dir is not None else None
    if ref_dir is not None and (ref_dir / "config.json").is_file():
        return load_causal_lm(ref_dir, seed=seed)
    reference, tokenizer = load_causal_lm(model, seed=seed)
    supervised_finetune(reference, tokenizer, sft_rows(task, rows, seed=seed), steps=steps, batch_size=batch_size,
                        lr=lr, max_length=max_length, seed=seed, progress=progress)
    if ref_dir is not None:
        reference.save_pretrained(ref_dir)
        tokenizer.save_pretrained(ref_dir)
    return reference, tokenizer


class RolloutData:
    """What an online algorithm's ``build(config, data)`` receives: prompts, reference, collector, buffer.

    Attributes:
        source: the :class:`PromptSource` (training and held-out prompts, the reward).
        reference: the frozen reference model; the policy starts as a copy of it. Setting it
            sets the collector's too (a LoRA build makes it the policy's base with adapters off,
            and the rollouts' reference log-probs must come from that).
        tokenizer: its tokenizer.
        collector: the :class:`RolloutCollector` (built by ``build``'s config: group size...).
        buffer: the TorchRL replay buffer the collector writes (made by :meth:`replay_buffer`).
        updates_per_round: gradient steps per batch of rollouts (``ppo_epochs`` passes).
        rows_per_round: training rows a round gives: the rollouts themselves
            (``prompts_per_round * group_size``), or what :meth:`train_on` declares.
        to_training_rows: None (train on the rollout rows), or the function :meth:`train_on`
            set that turns a round's rollouts into its training rows.
        from_scratch: the reference is the tiny model at its random initialisation.
    """

    action_space = "tokens"

    def __init__(self, source: PromptSource, reference, tokenizer, collector: RolloutCollector, *,
                 dataset_id: str, model: str, batch_size: int, ppo_epochs: int = 1,
                 from_scratch: bool = False) -> None:
        self.source = source
        self.collector = collector
        self.reference = reference
        self.tokenizer = tokenizer
        self.dataset_id = dataset_id
        self.model = model
        self.from_scratch = from_scratch
        self.batch_size = int(batch_size)
        n = collector.rows
        if ppo_epochs < 1:
            raise RolloutError(f"ppo_epochs must be at least 1, got {ppo_epochs}; fix it with --set ppo_epochs=1")
        if self.batch_size < 1 or n % self.batch_size:
            raise RolloutError(
                f"batch_size {self.batch_size} must divide the {n} rollouts of a round (prompts_per_round "
                f"{collector.prompts_per_round} x group_size {collector.group_size}); fix it with --set "
                f"batch_size={math.gcd(n, max(self.batch_size, 1))} or change prompts_per_round")
        self.ppo_epochs = int(ppo_epochs)
        self.rows_per_round = n
        self.to_training_rows: Optional[Callable[[TensorDict], TensorDict]] = None
        self.minibatches = n // self.batch_size
        self.updates_per_round = self.ppo_epochs * self.minibatches
        self.buffer = None

    @property
    def reference(self):
        return self._reference

    @reference.setter
    def reference(self, model) -> None:
        self._reference = model
        self.collector.reference = model

    def train_on(self, rows_per_round: int, to_training_rows: Callable[[TensorDict], TensorDict], *, epochs: int,
                 what: str, epochs_field: str = "ppo_epochs") -> None:
        """Train on rows made from each round's rollouts instead of the rollouts themselves.

        ``to_training_rows(rollouts)`` (run once per round, by the rollout callback) returns
        ``rows_per_round`` rows whatever the rollouts hold, e.g. one preference pair ``[P, 2]``
        per prompt, ties kept as weight-0 pairs so shapes are static. The round then serves
        ``epochs`` passes of minibatches of ``batch_size`` of those rows:
        ``updates_per_round = epochs * rows_per_round / batch_size``. ``what`` names the rows
        in the errors (``"preference pairs (one per prompt of prompts_per_round)"``).
        """
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise RolloutError(f"{epochs_field} must be a whole number >= 1, got {epochs!r}; fix it with "
                               f"--set {epochs_field}=1")
        n = int(rows_per_round)
        if n < 1 or n % self.batch_size:
            raise RolloutError(
                f"batch_size {self.batch_size} must divide the {n} {what} of a round; fix it with --set "
                f"batch_size={math.gcd(n, self.batch_size)} or change prompts_per_round")
        self.rows_per_round = n
        self.to_training_rows = to_training_rows
        self.ppo_epochs = int(epochs)
        self.minibatches = n // self.batch_size
        self.updates_per_round = self.ppo_epochs * self.minibatches

    def training_rows(self, rollouts: TensorDict) -> TensorDict:
        """The rows a round trains on: ``rollouts`` itself, or what :meth:`train_on` declared,
        without the ``"text"`` columns.

        The losses read tokens; the prompt and response strings stay in the round's rollouts
        (the callback's ``rollouts``, its checkpoint state, ``process_rollouts``). Kept in the
        buffer, a ``NonTensorStack`` per column made every write and minibatch read build one
        Python object per row: measured, the shell's GRPO ran 17-20 % more steps/s without them
        (docs/benchmarks.md, "Online RL").
        """
        rows = rollouts if self.to_training_rows is None else self.to_training_rows(rollouts)
        return rows.exclude("text")

    def replay_buffer(self, batch_size: int, *, sampler: str = "random", slice_len=None, seed: int = 0,
                      device=None):
        """The TorchRL buffer of one round's training rows: ``prompts_per_round * group_size``
        rollouts, or the ``rows_per_round`` rows :meth:`train_on` declared.

        It starts with a placeholder round (what the shell's stream first draws); the rollout
        callback (:class:`~offline_plugins.kinds.rollouts.RolloutRefill`) writes real rounds and
        hands out each step's minibatch."""
        from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

        n = self.rows_per_round
        self.buffer = TensorDictReplayBuffer(storage=LazyTensorStorage(n, device=device or "cpu"),
                                             batch_size=int(batch_size))
        self.buffer.extend(self.placeholder(device))
        return self.buffer

    def placeholder(self, device=None) -> TensorDict:
        """A round of training rows, all padding (never trained on): the rollout layout, passed
        through :meth:`training_rows` when :meth:`train_on` declared other rows."""
        return self.training_rows(self._rollout_placeholder(device))

    def _rollout_placeholder(self, device=None) -> TensorDict:
        n, t = self.collector.rows, self.collector.width
        zeros = lambda dtype: torch.zeros(n, t, dtype=dtype, device=device)  # noqa: E731
        done = torch.ones(n, 1, dtype=torch.bool, device=device)
        td = TensorDict({
            "tokens": {"full": zeros(torch.long)},
            "masks": {"all_attention_mask": zeros(torch.bool), "all_assistant_mask": zeros(torch.bool)},
            "log_probs": {"full": zeros(torch.float32)},
            "next": {"reward": torch.zeros(n, 1, device=device), "done": done, "terminated": done.clone(),
                     "ref_log_probs": {"full": zeros(torch.float32)}},
            "response_length": torch.zeros(n, device=device),
            "group": torch.zeros(n, dtype=torch.long, device=device),
            "advantage": torch.zeros(n, t, 1, device=device),
            "has_signal": torch.zeros(n, dtype=torch.bool, device=device),
        }, [n], device=device)
        td.set(("text", "prompt"), NonTensorStack(*([""] * n), batch_size=[n]))
        td.set(("text", "response"), NonTensorStack(*([""] * n), batch_size=[n]))
        return td

    @torch.no_grad()
    def held_out_scores(self, model, *, n: Optional[int] = None, batch_size: int = 100) -> dict[str, Optional[float]]:
        """Greedy responses to the held-out prompts: ``exact_match`` (None without answers) and ``reward``."""

        rows = self.source.held_out[: n or len(self.source.held_out)]
        if not rows:
            return {"exact_match": None, "heldout_reward": None}
        responses = greedy_responses(model, self.tokenizer, [r["prompt"] for r in rows],
                                     max_new_tokens=self.collector.max_new_tokens, batch_size=batch_size)
        rewards = score_responses(self.source, rows, responses)
        em = None
        if self.source.has_answers:
            from offline_plugins.envs.tasks import exact_match

            em = sum(exact_match(r, row["answer"]) for r, row in zip(responses, rows)) / len(rows)
        return {"exact_match": em, "heldout_reward": sum(rewards) / len(rewards)}


def load_rollout_data(dataset_id: str, *, model: str = "tiny", reward: Optional[str] = None, seed: int = 0,
                      group_size: int = 8, prompts_per_round: int = 16, max_new_tokens: int = 6,
                      temperature: float = 1.0, top_p: float = 1.0, batch_size: int = 32, ppo_epochs: int = 1,
                      reference_sft_steps: int = 2000, eval_prompts: int = 200, max_attempts: int = 4,
                      cache_dir: Optional[Path] = None, progress: bool = False,
                      min_group_size: int = 2) -> RolloutData:
    """Load a rollout task (:func:`resolve_rollout_id`) and its reference.

    The built-in task with ``model="tiny"`` starts from the cached SFT reference of the
    preference results (:func:`sft_reference`, ``reference_sft_steps`` steps); any other
    ``model`` (a ``save_pretrained`` folder such as an ``sft`` run's ``OUT/model``, or a hub
    id) is the reference itself. A JSONL file's reference is ``model`` as given.
    """
    from offline_plugins.data.preference_sources import cache_root
    from offline_plugins.modules.tiny_lm import load_causal_lm

    resolved = resolve_rollout_id(dataset_id)
    if resolved is None:
        raise RolloutError(f"{dataset_id!r} is not a rollout task; use {', '.join(BUILTIN_ROLLOUT_TASKS)} "
                           "(short: arithmetic) or a .jsonl file of prompt/answer rows")
    if resolved in BUILTIN_ROLLOUT_TASKS:
        from offline_plugins.envs.tasks import ArithmeticTask

        task = ArithmeticTask(**BUILTIN_ROLLOUT_TASKS[resolved][1])
        source = task_prompt_source(task, n_held_out=eval_prompts)
        if reward is not None:
            fn = load_reward_function(reward)
            source.reward_fn, source.reward_name = fn, reward
        if str(model) == "tiny":
            reference, tokenizer = sft_reference(task, model="tiny", seed=0, steps=reference_sft_steps,
                                                 cache_dir=Path(cache_dir) if cache_dir else cache_root() / "preference",
                                                 progress=progress)
        else:
            reference, tokenizer = load_causal_lm(model, seed=seed)
        from_scratch = False
    else:
        source = jsonl_prompt_source(resolved, reward=reward)
        source.held_out = source.held_out[:eval_prompts] if eval_prompts else source.held_out
        reference, tokenizer = load_causal_lm(model, seed=seed)
        from_scratch = str(model) == "tiny"
    if reward is not None and Path(str(reward)).is_dir():
        from offline_plugins.data.reward_source import check_reward_tokenizer

        check_reward_tokenizer(reward, tokenizer)
    reference.eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    collector = RolloutCollector(source, tokenizer, reference, group_size=group_size,
                                 prompts_per_round=prompts_per_round, max_new_tokens=max_new_tokens,
                                 temperature=temperature, top_p=top_p, seed=seed, max_attempts=max_attempts,
                                 min_group_size=min_group_size)
    return RolloutData(source, reference, tokenizer, collector, dataset_id=resolved, model=str(model),
                       batch_size=batch_size, ppo_epochs=ppo_epochs, from_scratch=from_scratch)


class CompletionData:
    """Prompt/completion rows for supervised fine-tuning, tokenised in the TED text layout.

    Attributes:
        train, test: ``[N]`` TensorDicts of ``("tokens", "full")`` and its two masks.
        held_out_rows: the held-out ``{"prompt", "completion"}`` rows, scored by greedy exact match.
        reference: the model SFT starts from (frozen; the policy is a trainable copy).
    """

    action_space = "tokens"

    def __init__(self, train: TensorDict, held_out_rows: list[dict], reference, tokenizer, *, dataset_id: str,
                 model: str, max_new_tokens: int, from_scratch: bool) -> None:
        self.train = train
        self.held_out_rows = held_out_rows
        self.reference = reference
        self.tokenizer = tokenizer
        self.dataset_id = dataset_id
        self.model = model
        self.max_new_tokens = int(max_new_tokens)
        self.from_scratch = from_scratch

    def replay_buffer(self, batch_size: int, *, sampler: str = "random", slice_len=None, seed: int = 0,
                      device=None):
        from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

        n = self.train.batch_size[0]
        buffer = TensorDictReplayBuffer(storage=LazyTensorStorage(n, device=device or "cpu"),
                                        batch_size=int(batch_size))
        buffer.extend(self.train)
        return buffer

    @torch.no_grad()
    def held_out_scores(self, model, *, batch_size: int = 100) -> dict[str, Optional[float]]:

        rows = self.held_out_rows
        if not rows:
            return {"exact_match": None}
        outs = greedy_responses(model, self.tokenizer, [r["prompt"] for r in rows],
                                max_new_tokens=self.max_new_tokens, batch_size=batch_size)
        from offline_plugins.envs.tasks import exact_match

        correct = sum(exact_match(o, r["completion"]) for o, r in zip(outs, rows))
        return {"exact_match": correct / len(rows)}


def load_completion_data(dataset_id: str, *, model: str = "tiny", seed: int = 0, eval_prompts: int = 200,
                         max_length: int = 32, train_rows: int = 8000) -> CompletionData:
    """Prompt/completion rows: the built-in task's exact answers (``train_rows`` of them, test-split
    problems held out), or a JSONL file of ``{"prompt", "completion"}`` rows (held out by prompt hash)."""
    from offline_plugins.data.preference import tokenize_completions
    from offline_plugins.data.preference_sources import held_out_prompts
    from offline_plugins.modules.tiny_lm import load_causal_lm

    resolved = resolve_rollout_id(dataset_id)
    if resolved is None:
        raise RolloutError(f"{dataset_id!r} is no supervised dataset; use arithmetic or a .jsonl file of "
                           "prompt/completion rows")
    if resolved in BUILTIN_ROLLOUT_TASKS:
        from offline_plugins.data.text_tasks import sft_rows
        from offline_plugins.envs.tasks import ArithmeticTask

        task = ArithmeticTask(**BUILTIN_ROLLOUT_TASKS[resolved][1])
        rows = sft_rows(task, train_rows, seed=seed)
        held = sft_rows(task, eval_prompts, split="test", seed=1)
    else:
        path = Path(resolved)
        if not path.is_file():
            raise RolloutError(f"file {resolved!r} does not exist; give a .jsonl file of prompt/completion rows")
        all_rows = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RolloutError(f"{resolved}: line {n} is not JSON ({exc.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not isinstance(
                    row.get("completion"), str):
                raise RolloutError(f"{resolved}: line {n} needs string fields 'prompt' and 'completion' (sft "
                                   "trains on prompt/completion rows)")
            all_rows.append({"prompt": row["prompt"], "completion": row["completion"]})
        if not all_rows:
            raise RolloutError(f"{resolved} holds no rows; it needs prompt/completion rows")
        out = held_out_prompts([r["prompt"] for r in all_rows])
        rows = [r for r in all_rows if r["prompt"] not in out]
        held = [r for r in all_rows if r["prompt"] in out][:eval_prompts]
        if not rows:
            raise RolloutError(f"{resolved}: every row fell in the held-out split; give more rows")
    reference, tokenizer = load_causal_lm(model, seed=seed)
    reference.eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    max_length = min(max_length, model_context(reference))
    train, _ = tokenize_completions(rows, tokenizer, max_length=max_length, source=resolved)
    longest = max(len(tokenizer(r["completion"], add_special_tokens=False)["input_ids"]) for r in rows + held)
    return CompletionData(train, held, reference, tokenizer, dataset_id=resolved, model=str(model),
                          max_new_tokens=longest + 1, from_scratch=str(model) == "tiny")
