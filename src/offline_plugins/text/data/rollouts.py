"""Rollout data for online RL on text: what an online algorithm's ``build`` and the
``text-rollouts`` kind read.

The prompts and the reward live in :mod:`offline_plugins.text.sources.prompts`, the sampling in
:mod:`offline_plugins.text.collectors.collector`; this module loads a task (:func:`load_rollout_data`:
prompts, reward, the frozen reference, the collector's settings) and prompt/completion rows for
SFT (:func:`load_completion_data`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from offline_plugins.config import ROLLOUT_DEFAULTS
from offline_plugins.modules.tiny_lm import is_builtin_model, load_causal_lm
from offline_plugins.text.backends.generation import generate_left_padded, greedy_responses, model_context
from offline_plugins.text.collectors.collector import RolloutCollector, SamplingSettings, rollout_width
from offline_plugins.text.collectors.multiturn import greedy_final_answers
from offline_plugins.text.data.preference import tokenize_completions
from offline_plugins.text.data.preference_sources import cache_root, held_out_prompts
from offline_plugins.text.data.task_data import check_task_fits, sft_reference, sft_rows
from offline_plugins.text.sources.prompts import (
    TASK_REWARD,
    PromptSource,
    RewardGuard,
    RolloutError,
    combined_reward,
    jsonl_prompt_source,
    load_reward_function,
    read_jsonl_rows,
    reward_specs,
    rollout_seed,
    score_responses,
    single_reward,
    task_prompt_source,
)
from offline_plugins.text.sources.reward_source import check_reward_tokenizer
from offline_plugins.text.tasks import exact_match
from offline_plugins.text.tasks.ids import resolve_rollout_id, text_task_names, text_tasks
from offline_plugins.tokens import prompt_token_ids

__all__ = [
    "RolloutError",
    "PromptSource",
    "task_prompt_source",
    "jsonl_prompt_source",
    "load_reward_function",
    "score_responses",
    "RolloutCollector",
    "TextTaskData",
    "RolloutData",
    "CompletionData",
    "resolve_rollout_id",
    "sft_reference",
    "load_rollout_data",
    "load_completion_data",
    "model_context",
    "rollout_seed",
    "generate_left_padded",
    "greedy_responses",
]


def _task_of(dataset_id: str, files: str) -> tuple[str, Any]:
    """``(canonical id, the registered task or None for a file)``; a :class:`RolloutError` naming what
    ids are accepted (the registered text tasks and ``files``) otherwise."""
    resolved = resolve_rollout_id(dataset_id)
    if resolved is None:
        raise RolloutError(f"{dataset_id!r} is not a text task; use {', '.join(text_tasks())} (short: "
                           f"{text_task_names()}) or {files}")
    tasks = text_tasks()
    if resolved not in tasks:
        return resolved, None
    return resolved, tasks[resolved].make()


def __getattr__(name: str):
    if name == "BUILTIN_ROLLOUT_TASKS":  # the table the registry replaced (TextTaskSpec records)

        warnings.warn("offline_plugins.text.data.rollouts.BUILTIN_ROLLOUT_TASKS is deprecated: the text tasks are "
                      "registered records, offline_plugins.text.tasks.ids.text_tasks()", DeprecationWarning,
                      stacklevel=2)
        return {k: (v.summary, dict(v.settings)) for k, v in text_tasks().items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _with_turn_settings(resolved: str, task: Any, **settings: Any) -> Any:
    """``task`` with the multi-turn settings that differ from their defaults; refused by name for a
    task without turns."""
    changed = {k: v for k, v in settings.items() if v != ROLLOUT_DEFAULTS[k]}
    if not changed:
        return task
    if getattr(task, "multiturn", None) is None:
        name = next(iter(changed))
        raise RolloutError(f"{name} applies to multi-turn tasks with tools (tool-arithmetic); {resolved} is answered "
                           f"in one turn: drop --set {name}")
    if "tools" in changed:
        changed["tools"] = tuple(t.strip() for t in str(changed["tools"]).split(",") if t.strip())
    return dataclasses.replace(task, **changed)


class TextTaskData:
    """What the text-rollouts and text-completions data share: the frozen reference the policy
    starts from, its tokenizer, where they came from, and greedy scoring of held-out rows."""

    action_space = "tokens"

    def __init__(self, reference, tokenizer, *, dataset_id: str, model: str, from_scratch: bool) -> None:
        self.reference = reference
        self.tokenizer = tokenizer
        self.dataset_id = dataset_id
        self.model = model
        self.from_scratch = from_scratch

    @staticmethod
    @torch.no_grad()
    def greedy_answers(model, tokenizer, rows: list[dict], answer: Optional[str], *, max_new_tokens: int,
                       batch_size: int = 100, multiturn: Any = None,
                       width: int = 0) -> tuple[list[str], Optional[float]]:
        """``model``'s greedy responses to the rows' prompts (with ``multiturn``: the final answers of
        greedy episodes within ``width`` tokens), and their exact match against the rows' ``answer``
        column (None when ``answer`` is None)."""
        prompts = [r["prompt"] for r in rows]
        if multiturn is not None:
            responses = greedy_final_answers(model, tokenizer, prompts, multiturn, width=width,
                                             max_new_tokens=max_new_tokens, batch_size=batch_size)
        else:
            responses = greedy_responses(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                         batch_size=batch_size)
        if answer is None:
            return responses, None

        return responses, sum(exact_match(o, r[answer]) for o, r in zip(responses, rows)) / len(rows)


class RolloutData(TextTaskData):
    """A loaded text task, what an online algorithm's ``build(config, data)`` receives: the
    prompts and their reward, the frozen reference, its tokenizer and the sampling settings.

    Nothing changes it after loading: an algorithm that samples from other prompts, scores
    against another reference or adds tokens says so in its
    :class:`~offline_plugins.algorithms.base.RolloutPlan`, and a run's one collector is made from
    both (:meth:`collector_for`).

    Attributes:
        source: the :class:`~offline_plugins.text.sources.prompts.PromptSource` (training and held-out
            prompts, the reward).
        reference: the frozen reference model; the policy starts as a copy of it.
        tokenizer: its tokenizer.
        settings: the :class:`~offline_plugins.text.collectors.collector.SamplingSettings` (``group_size``,
            ``prompts_per_round``, ``max_new_tokens``, ``temperature``, ``top_p``, ``max_attempts``, the
            reward's time limit, failure reward and workers), checked at load.
        max_prompt_tokens, width: the longest prompt, and a round's width (prompt and response, or a
            multi-turn episode's turns and observations), in tokens; checked against the model's context.
        reward_guard: how held-out scoring calls the reward (the run's collector has its own).
        from_scratch: the reference is the tiny model at its random initialisation.
        gold: a built-in task's own verifier, ``gold(prompts, responses) -> list[float]``, kept
            when ``--reward`` replaced it as the rollouts' reward (None otherwise): the gold
            score of the held-out responses, beside the proxy the policy is trained on.
        gold_key: the held-out score the reward-hacking monitor watches as the gold:
            ``"heldout_gold"`` (``gold`` set), ``"exact_match"`` (the reward is exact match
            against answers), else ``"heldout_reward"``.
    """

    def __init__(self, source: PromptSource, reference, tokenizer, settings: SamplingSettings, *,
                 dataset_id: str, model: str, from_scratch: bool = False, gold: Optional[Any] = None,
                 gold_key: Optional[str] = None) -> None:
        super().__init__(reference, tokenizer, dataset_id=dataset_id, model=model, from_scratch=from_scratch)
        self.source = source
        self.settings = settings
        self.max_prompt_tokens, self.width = rollout_width(source, tokenizer, model_context(reference),
                                                           settings.max_new_tokens)
        self.reward_guard = settings.reward_guard()
        self.gold = gold
        if gold_key is None:
            gold_key = ("heldout_gold" if gold is not None else
                        "exact_match" if source.has_answers else "heldout_reward")
        if gold_key == "heldout_gold" and gold is None:
            raise RolloutError("gold_key='heldout_gold' needs gold, the task's verifier; pass gold=task.rewards")
        self.gold_key = gold_key

    def collector_for(self, plan: Any = None, *, seed: int = 0) -> RolloutCollector:
        """The collector of one run (:meth:`RolloutCollector.for_data
        <offline_plugins.text.collectors.collector.RolloutCollector.for_data>`): these sampling settings, with
        the prompt source, reference and tokenizer ``plan`` names in place of the data's."""
        return RolloutCollector.for_data(self, plan, seed=seed)

    @torch.no_grad()
    def held_out_scores(self, model, *, plan: Any = None, n: Optional[int] = None, batch_size: int = 100,
                        guard: Any = None) -> dict[str, Optional[float]]:
        """Greedy responses to the held-out prompts (``plan``'s source and tokenizer where it names
        them): ``exact_match`` (None without answers), ``heldout_reward``, the reward called through
        ``guard`` (a run's :class:`~offline_plugins.text.sources.prompts.RewardGuard`; default: the data's),
        ``response_chars`` (their mean length in characters, stripped), ``heldout_n`` (how many
        prompts were scored) and, where ``--reward``
        replaced a built-in task's verifier, ``heldout_gold``: the task's verifier on the same
        responses (None when the plan samples from its own prompts, which the task did not make)."""
        source = getattr(plan, "source", None) or self.source
        tokenizer = getattr(plan, "tokenizer", None) or self.tokenizer
        rows = source.held_out[: n or len(source.held_out)]
        empty = {"exact_match": None, "heldout_reward": None, "response_chars": None}
        if self.gold is not None:
            empty["heldout_gold"] = None
        if not rows:
            return empty
        responses, em = self.greedy_answers(model, tokenizer, rows, "answer" if source.has_answers else None,
                                            max_new_tokens=self.settings.max_new_tokens, batch_size=batch_size,
                                            multiturn=source.multiturn, width=self.width)
        rewards = score_responses(source, rows, responses, guard=guard or self.reward_guard)
        out = {**empty, "exact_match": em, "heldout_reward": sum(rewards) / len(rewards),
               "response_chars": sum(len(r.strip()) for r in responses) / len(responses),
               "heldout_n": len(rows)}  # the monitor's noise interval reads the size
        if self.gold is not None and source is self.source:
            gold = [float(g) for g in self.gold([r["prompt"] for r in rows], responses)]
            out["heldout_gold"] = sum(gold) / len(gold)
        return out


def load_rollout_data(dataset_id: str, *, model: str = "tiny", reward: Optional[str] = None, seed: int = 0,
                      group_size: int = 8, prompts_per_round: int = 16, max_new_tokens: Optional[int] = None,
                      temperature: float = 1.0, top_p: float = 1.0, reference_sft_steps: Optional[int] = None,
                      eval_prompts: int = 200, max_attempts: int = 4, reward_timeout: Optional[float] = 60.0,
                      reward_on_failure: float = 0.0, reward_workers: str = "thread",
                      max_turns: Optional[int] = None, tools: Optional[str] = None,
                      tool_timeout: float = 5.0, tool_reward: float = 0.0,
                      tool_sandbox: Optional[str] = None, reward_weights: Any = None,
                      cache_dir: Optional[Path] = None, progress: bool = False,
                      finetune: Optional[Any] = None) -> RolloutData:
    """Load a rollout task (:func:`resolve_rollout_id`) and its reference.

    The built-in task with ``model="tiny"`` starts from the cached SFT reference of the
    preference results (:func:`~offline_plugins.text.data.task_data.sft_reference`,
    ``reference_sft_steps`` steps of the ``sft`` algorithm, ``finetune``, when it is not
    cached yet; None: the task's own ``reference_sft_steps``, its documented results' recipe); any other
    ``model`` (a ``save_pretrained`` folder such as an ``sft`` run's ``OUT/model``, or a hub
    id) is the reference itself. A JSONL file's reference is ``model`` as given. The reward is
    called under ``reward_timeout`` seconds a call, a failed call costing ``reward_on_failure``
    (:class:`~offline_plugins.text.sources.prompts.RewardGuard`). A multi-turn task's episodes take
    ``max_turns`` turns with ``tools`` (comma-separated names; None: the task's own), a Python call
    ``tool_timeout`` seconds in the sandbox ``tool_sandbox`` (None: ``bwrap``; a task whose tools cannot
    work here is refused before anything else is loaded), and a turn whose call answered the problem
    earns ``tool_reward``.

    ``reward`` may list several rewards, ``["NAME=SPEC", ...]`` (``--reward`` given twice or more; SPEC
    ``task`` is the task's own verifier): each response is scored by each, the rows carry them side by
    side at ``("next", "reward_components")`` (what ``gdpo`` reads) and their sum weighted by
    ``reward_weights`` (``"1,0.5"``; None: all 1) is the reward every other loss reads.
    """
    RewardGuard(workers=reward_workers)  # a bad reward_workers is refused before anything loads
    specs = reward_specs(reward)  # several rewards: [(name, spec)], checked before anything loads
    weights = _reward_weights(reward_weights, specs)
    reward = None if specs is not None else single_reward(reward)
    resolved, task = _task_of(dataset_id, "a .jsonl file of prompt/answer rows")
    task = _with_turn_settings(resolved, task, max_turns=max_turns, tools=tools, tool_timeout=tool_timeout,
                               tool_reward=tool_reward, tool_sandbox=tool_sandbox)
    if getattr(task, "multiturn", None) is not None:
        task.multiturn.tools.check()  # e.g. the python tool's sandbox: refused here, before the reference is made
    if max_new_tokens is None:  # the task's own budget (its documented results'), 6 for a prompt file
        max_new_tokens = int(getattr(task, "max_new_tokens", 6)) if task is not None else 6
    # the sampling settings, refused here if no round can use them: before the reference is made or loaded
    settings = SamplingSettings.checked(group_size=group_size, prompts_per_round=prompts_per_round,
                                        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                        max_attempts=max_attempts, reward_timeout=reward_timeout,
                                        reward_on_failure=reward_on_failure, reward_workers=reward_workers)
    gold, gold_key = None, None
    if task is not None:
        if not task.scores_exact_match:  # its held-out rows carry answers, but its verifier is not exact match
            gold_key = "heldout_reward"
        source = task_prompt_source(task, n_held_out=eval_prompts)
        if specs is not None:
            _set_components(source, specs, weights)
            if any(spec != TASK_REWARD for _, spec in specs):  # the verifier stays the held-out gold score
                gold, gold_key = task.rewards, "heldout_gold"
        elif reward is not None:  # the task's verifier stays the gold score of the held-out responses
            gold, gold_key = task.rewards, "heldout_gold"
            fn = load_reward_function(reward)
            source.reward_fn, source.reward_name = fn, reward
        if is_builtin_model(model):
            if reference_sft_steps is None:
                reference_sft_steps = getattr(getattr(task, "reference_task", task), "reference_sft_steps", 2000)
            reference, tokenizer = sft_reference(task, model=str(model), seed=0, steps=int(reference_sft_steps),
                                                 cache_dir=Path(cache_dir) if cache_dir else cache_root() / "preference",
                                                 progress=progress, finetune=finetune)
        else:
            reference, tokenizer = load_causal_lm(model, seed=seed)
        from_scratch = False
    else:
        own = specs is not None and any(spec == TASK_REWARD for _, spec in specs)  # its exact match is one of them
        source = jsonl_prompt_source(resolved, reward=reward if specs is None else (None if own else specs[0][1]))
        if specs is not None:
            _set_components(source, specs, weights)
        source.held_out = source.held_out[:eval_prompts] if eval_prompts else source.held_out
        reference, tokenizer = load_causal_lm(model, seed=seed)
        from_scratch = is_builtin_model(model)
    for spec in ([reward] if specs is None else [spec for _, spec in specs]):
        if spec is not None and Path(str(spec)).is_dir():
            check_reward_tokenizer(spec, tokenizer)
    reference.eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    return RolloutData(source, reference, tokenizer, settings, dataset_id=resolved, model=str(model),
                       from_scratch=from_scratch, gold=gold, gold_key=gold_key)


def _reward_weights(value: Any, specs: Optional[list]) -> list[float]:
    """``reward_weights`` (``"1,0.5"``, a list, or None: all 1) as one float per reward of ``specs``."""
    if value is None:
        return [1.0] * len(specs or [])
    if specs is None:
        raise RolloutError(f"reward_weights={value!r} weighs several rewards, and this run has one; give them as "
                           "--reward NAME=SPEC twice or more, or drop reward_weights")
    parts = [p.strip() for p in value.split(",")] if isinstance(value, str) else list(value)
    try:
        weights = [float(p) for p in parts]
    except (TypeError, ValueError):
        weights = []
    if len(weights) != len(specs) or not all(math.isfinite(w) for w in weights):
        names = [n for n, _ in specs]
        raise RolloutError(f"reward_weights={value!r} must be {len(specs)} finite numbers, one per reward "
                           f"({', '.join(names)}, in the order of the --reward flags), e.g. --set reward_weights="
                           f"{','.join(['1'] * len(specs))}")
    return weights


def _set_components(source: Any, specs: list, weights: list[float]) -> None:
    """Give ``source`` the rewards of ``specs`` (``task``: its own reward function) and their weighted sum."""
    own = source.reward_fn
    source.components = [(name, own if spec == TASK_REWARD else load_reward_function(spec)) for name, spec in specs]
    source.reward_weights = list(weights)
    source.reward_fn = combined_reward(source.components, weights)
    source.reward_name = source.reward_fn.__qualname__


class CompletionData(TextTaskData):
    """Prompt/completion rows for supervised fine-tuning, tokenised in the TED text layout.

    Attributes:
        train, test: ``[N]`` TensorDicts of ``("tokens", "full")`` and its two masks.
        held_out_rows: the held-out ``{"prompt", "completion"}`` rows, scored by greedy exact match.
        reference: the model SFT starts from (frozen; the policy is a trainable copy).
    """

    def __init__(self, train: TensorDict, held_out_rows: list[dict], reference, tokenizer, *, dataset_id: str,
                 model: str, max_new_tokens: int, from_scratch: bool,
                 verifier: Optional[Callable[[list, list], Sequence[float]]] = None) -> None:
        super().__init__(reference, tokenizer, dataset_id=dataset_id, model=model, from_scratch=from_scratch)
        self.train = train
        self.held_out_rows = held_out_rows
        self.max_new_tokens = int(max_new_tokens)
        #: a built-in task's verifier where it is not exact match of the whole completion (it reads the
        #: final answer of a worked solution): scored beside the exact match as ``heldout_reward``
        self.verifier = verifier

    def replay_buffer(self, batch_size: int, *, sampler: str = "random", slice_len=None, seed: int = 0,
                      device=None):
        n = self.train.batch_size[0]
        buffer = TensorDictReplayBuffer(storage=LazyTensorStorage(n, device=device or "cpu"),
                                        batch_size=int(batch_size))
        buffer.extend(self.train)
        return buffer

    @torch.no_grad()
    def held_out_scores(self, model, *, plan: Any = None, batch_size: int = 100,
                        guard: Any = None) -> dict[str, Optional[float]]:
        """Greedy responses to the held-out rows: ``exact_match`` against their completions (``plan``
        and ``guard``: ignored, SFT samples no rollouts and calls no reward)."""
        if not self.held_out_rows:
            return {"exact_match": None}
        responses, em = self.greedy_answers(model, self.tokenizer, self.held_out_rows, "completion",
                                            max_new_tokens=self.max_new_tokens, batch_size=batch_size)
        out: dict[str, Optional[float]] = {"exact_match": em, "heldout_n": len(self.held_out_rows)}
        if self.verifier is not None:
            scores = self.verifier([r["prompt"] for r in self.held_out_rows], responses)
            out["heldout_reward"] = sum(float(x) for x in scores) / len(scores)
        return out


def load_completion_data(dataset_id: str, *, model: str = "tiny", seed: int = 0, eval_prompts: int = 200,
                         max_length: int = 32, train_rows: int = 8000) -> CompletionData:
    """Prompt/completion rows: the built-in task's exact answers (``train_rows`` of them, test-split
    problems held out), or a JSONL file of ``{"prompt", "completion"}`` rows (held out by prompt hash)."""
    resolved, task = _task_of(dataset_id, "a .jsonl file of prompt/completion rows")
    if task is not None:
        rows = sft_rows(task, train_rows, seed=seed)
        held = sft_rows(task, eval_prompts, split="test", seed=1)
        max_length = max(max_length, getattr(task, "sft_max_length", 0))  # a worked solution is longer
    else:
        def check(row: dict) -> Optional[str]:
            if not isinstance(row.get("prompt"), str) or not isinstance(row.get("completion"), str):
                return "needs string fields 'prompt' and 'completion' (sft trains on prompt/completion rows)"
            return None

        all_rows = [{"prompt": r["prompt"], "completion": r["completion"]} for r in read_jsonl_rows(
            resolved, what="prompt/completion rows", shape='{"prompt": ..., "completion": ...}', check=check)]
        out = held_out_prompts([r["prompt"] for r in all_rows])
        rows = [r for r in all_rows if r["prompt"] not in out]
        held = [r for r in all_rows if r["prompt"] in out][:eval_prompts]
        if not rows:
            raise RolloutError(f"{resolved}: every row fell in the held-out split; give more rows")
    reference, tokenizer = load_causal_lm(model, seed=seed)
    if task is not None:
        check_task_fits(task, reference, tokenizer, model_name=model)
    reference.eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    context = model_context(reference)
    max_length = min(max_length, context)
    train, report = tokenize_completions(rows, tokenizer, max_length=max_length, source=resolved)
    if report.dropped or report.truncated_responses:  # as the preference loaders say it
        logging.getLogger(__name__).warning("%s: %s", resolved, report.summary())
    held, longest = _held_out_within(held, tokenizer, context, source=resolved)
    verifier = task.rewards if task is not None and not task.scores_exact_match else None
    return CompletionData(train, held, reference, tokenizer, dataset_id=resolved, model=str(model),
                          max_new_tokens=longest + 1, from_scratch=is_builtin_model(model), verifier=verifier)


def _held_out_within(held: list[dict], tokenizer: Any, context: int, *, source: str) -> tuple[list[dict], int]:
    """The held-out rows whose prompt, completion and eos fit the model's ``context`` (greedy
    decoding of a longer one would run past the position table), and their longest completion in
    tokens; the rows left out are counted in a warning, none left is an error."""
    kept, longest, over = [], 0, []
    for r in held:
        n_completion = len(tokenizer(r["completion"], add_special_tokens=False)["input_ids"])
        if len(prompt_token_ids(tokenizer, r["prompt"])) + n_completion + 1 > context:
            over.append(r)
            continue
        kept.append(r)
        longest = max(longest, n_completion)
    if over:
        logging.getLogger(__name__).warning(
            "%s: %d held-out row(s) are longer than the model's context of %d tokens (e.g. prompt %.40r); they are "
            "left out of the exact-match evaluation", source, len(over), context, over[0]["prompt"])
    if held and not kept:
        raise RolloutError(f"{source}: every held-out row's prompt and completion is longer than the model's "
                           f"context of {context} tokens; shorten the completions or use a model with a longer "
                           "context")
    return kept, longest
