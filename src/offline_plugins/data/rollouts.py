"""Rollout data for online RL on text: what an online algorithm's ``build`` and the
``text-rollouts`` kind read.

The prompts and the reward live in :mod:`offline_plugins.data.prompts`, the sampling in
:mod:`offline_plugins.data.collector`; this module loads a task (:func:`load_rollout_data`:
prompts, reward, the frozen reference, the collector's settings) and prompt/completion rows for
SFT (:func:`load_completion_data`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from tensordict import NonTensorStack, TensorDict

from offline_plugins.data.collector import RolloutCollector
from offline_plugins.data.prompts import (
    PromptSource,
    RolloutError,
    greedy_responses,
    jsonl_prompt_source,
    load_reward_function,
    rollout_seed,
    score_responses,
    task_prompt_source,
)
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
