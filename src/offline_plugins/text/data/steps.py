"""Step-labelled reasoning: rows of a prompt, its solution's steps and a label per step, into TensorDicts.

A row is ``{"prompt": str, "steps": [str, ...], "labels": [int, ...]}``, one JSON object a line.
The labels are PRM800K's per-step ratings (Lightman et al. 2023, arXiv:2305.20050): ``1``
good, ``0`` neutral, ``-1`` bad. This is the flattened form of PRM800K's rows (its
``label.steps[i].completions[chosen].rating`` per step, the prompt being
``question.problem``); a PRM800K phase-2 row stops at its first ``-1``. The PRM's target
is binary: a step is correct unless rated ``-1`` (neutral is not an error).

Tokens (:func:`tokenize_steps`): the prompt's ids (bos first, as
:func:`~offline_plugins.tokens.prompt_token_ids`), then each step followed by the separator
(``"\\n"``); the PRM reads each step at its separator's last token, so it sees the prompt and
the steps up to that one. Steps that do not fit ``max_length`` are cut from the end with their
labels; a row with no step that fits is dropped (:class:`~offline_plugins.tokens.TokenizeReport`).

>>> from offline_plugins.modules.tiny_lm import char_tokenizer
>>> td, report = tokenize_steps([{"prompt": "1+2*3=", "steps": ["1+2=3", "3*3=8"], "labels": [1, -1]}],
...                             char_tokenizer(), max_length=32)
>>> td["steps", "position"].tolist(), td["steps", "label"].tolist(), report.kept
([[12, 18]], [[1.0, 0.0]], 1)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
from tensordict import TensorDict

from offline_plugins.data.jsonl import jsonl_objects
from offline_plugins.errors import UserError
from offline_plugins.modules.tiny_lm import is_builtin_model, load_causal_lm
from offline_plugins.text.backends.generation import generate
from offline_plugins.text.data.preference import PreferenceData
from offline_plugins.text.data.preference_sources import cache_root, held_out_prompts
from offline_plugins.text.data.task_data import sft_reference
from offline_plugins.text.tasks.steps import STEP_SEPARATOR, StepChainTask
from offline_plugins.tokens import TokenizeReport, pad_token_id, prompt_token_ids

__all__ = ["StepDataError", "STEP_FIELDS", "RATINGS", "BUILTIN_STEP_DATASETS", "BUILTIN_STEP_ROWS",
           "validate_step_rows",
           "load_step_jsonl", "tokenize_steps", "StepData", "resolve_step_id", "load_step_source",
           "sampled_rows"]

STEP_FIELDS = ("prompt", "steps", "labels")
#: PRM800K's per-step ratings
RATINGS = (-1, 0, 1)
#: built-in step-labelled datasets: id -> the task that generates them
BUILTIN_STEP_DATASETS = {"steps/arithmetic-v0": StepChainTask(), "steps/arithmetic-v1": StepChainTask()}
#: their training rows: v1 is v0's task with 20 times the rows (v0 stays as it was, so earlier numbers reproduce)
BUILTIN_STEP_ROWS = {"steps/arithmetic-v0": 2000, "steps/arithmetic-v1": 40_000}
#: the prefix of a JSONL file of step-labelled rows (a bare .jsonl is read as preference data)
FILE_PREFIX = "steps:"
_SHAPE = '{"prompt": "...", "steps": ["...", ...], "labels": [1, -1, ...]}'


class StepDataError(UserError, ValueError):
    """A step-labelled row or file that cannot be used."""


def _row_problem(row: Any) -> Optional[str]:
    """What is wrong with one row, or None."""
    if not isinstance(row, Mapping):
        return f"is a {type(row).__name__}, expected an object"
    missing = [f for f in STEP_FIELDS if f not in row]
    if missing:
        return f"lacks field(s) {missing} (it has {sorted(row)})"
    if not isinstance(row["prompt"], str) or not row["prompt"].strip():
        return "has no non-empty string 'prompt'"
    steps, labels = row["steps"], row["labels"]
    if not isinstance(steps, list) or not steps:
        return "has no steps ('steps' must be a non-empty list of strings)"
    bad = next((i for i, s in enumerate(steps) if not isinstance(s, str) or not s.strip()), None)
    if bad is not None:
        return f"step {bad} is {steps[bad]!r}, expected non-empty text"
    if not isinstance(labels, list) or len(labels) != len(steps):
        n = len(labels) if isinstance(labels, list) else type(labels).__name__
        return f"has {len(steps)} steps but labels {n} (one label per step)"
    bad = next((i for i, v in enumerate(labels) if isinstance(v, bool) or v not in RATINGS), None)
    if bad is not None:
        return f"label {bad} is {labels[bad]!r}, expected a PRM800K rating -1 (bad), 0 (neutral) or 1 (good)"
    return None


def validate_step_rows(rows: Iterable[Any], *, source: str = "dataset") -> list[dict]:
    """The rows, each checked; a :class:`StepDataError` naming the first bad row, what is wrong and the shape."""
    out = []
    for i, row in enumerate(rows):
        problem = _row_problem(row)
        if problem:
            raise StepDataError(f"{source}: row {i} {problem}; each row must be {_SHAPE}")
        out.append({f: row[f] for f in STEP_FIELDS})
    if not out:
        raise StepDataError(f"{source} holds no rows; it needs step-labelled rows {_SHAPE}")
    return out


def load_step_jsonl(path: Any) -> list[dict]:
    """The validated rows of a JSONL file; errors name the line."""
    p = Path(path)
    if not p.is_file():
        raise StepDataError(f"step-labelled file {str(p)!r} does not exist; give a .jsonl file of rows {_SHAPE}")
    rows = []
    for n, row in jsonl_objects(p, error=StepDataError, shape=f"each line must be an object {_SHAPE}"):
        problem = _row_problem(row)
        if problem:
            raise StepDataError(f"{p}: line {n} {problem}; each line must be an object {_SHAPE}")
        rows.append(row)
    return validate_step_rows(rows, source=str(p))


def tokenize_steps(rows: Sequence[Mapping[str, Any]], tokenizer: Any, *, max_length: int,
                   separator: str = STEP_SEPARATOR) -> tuple[TensorDict, TokenizeReport]:
    """``[N]`` rows: ``("tokens", "full")``, ``("masks", "all_attention_mask")``, ``("masks", "all_assistant_mask")``
    (the steps' tokens, not the prompt's), and per step slot
    ``("steps", "position"|"mask"|"label")``; and what was kept, cut and dropped."""
    report = TokenizeReport()
    encoded = []
    for row in rows:
        ids = prompt_token_ids(tokenizer, row["prompt"])
        start, positions = len(ids), []
        for step in row["steps"]:
            step_ids = list(tokenizer(step + separator, add_special_tokens=False)["input_ids"])
            if len(ids) + len(step_ids) > max_length:
                break
            ids += step_ids
            positions.append(len(ids) - 1)
        if not positions:
            report.drop("prompt_over_context")
            continue
        report.truncated_responses += len(positions) < len(row["steps"])
        encoded.append((ids, positions, [float(v >= 0) for v in row["labels"][: len(positions)]], start))
    report.kept = len(encoded)
    n, length = len(encoded), max((len(e[0]) for e in encoded), default=1)
    slots = max((len(e[1]) for e in encoded), default=1)
    tokens = torch.full((n, length), pad_token_id(tokenizer), dtype=torch.long)
    attn = torch.zeros(n, length, dtype=torch.bool)
    steps = torch.zeros(n, length, dtype=torch.bool)
    position = torch.zeros(n, slots, dtype=torch.long)
    label = torch.zeros(n, slots)
    for i, (ids, pos, lab, start) in enumerate(encoded):
        tokens[i, : len(ids)] = torch.tensor(ids)
        attn[i, : len(ids)] = True
        steps[i, start: len(ids)] = True
        position[i, : len(pos)] = torch.tensor(pos)
        label[i, : len(lab)] = torch.tensor(lab)
    mask = torch.arange(slots) < torch.tensor([len(e[1]) for e in encoded], dtype=torch.long).reshape(n, 1)
    td = TensorDict({("tokens", "full"): tokens, ("masks", "all_attention_mask"): attn,
                     ("masks", "all_assistant_mask"): steps,
                     ("steps", "position"): position, ("steps", "mask"): mask, ("steps", "label"): label}, [n])
    return td, report


def sampled_rows(task: Any, model: Any, tokenizer: Any, prompts: Sequence[str], *, num_samples: int = 4,
                 max_new_tokens: int = 40, seed: int = 0, batch_prompts: int = 64) -> list[dict]:
    """Step-labelled rows of ``model``'s own solutions to ``prompts`` (``num_samples`` each, temperature 1), each
    step labelled by ``task.step_labels``: the generator's errors, as PRM800K labels the generator's samples
    (Lightman et al. 2023) and Math-Shepherd labels them automatically (Wang et al. 2024), here exactly. A
    solution is cut into steps at the separator's token; one with no step is left out."""
    sep = list(tokenizer(STEP_SEPARATOR, add_special_tokens=False)["input_ids"])
    if len(sep) != 1:
        raise StepDataError(f"the tokenizer writes the step separator {STEP_SEPARATOR!r} as {len(sep)} tokens; "
                            "sampled solutions can be cut into steps only at a single-token separator")
    rows = []
    for start in range(0, len(prompts), batch_prompts):
        chunk = prompts[start:start + batch_prompts]
        out = generate(model, [prompt_token_ids(tokenizer, p) for p in chunk], pad_id=pad_token_id(tokenizer),
                       eos_id=tokenizer.eos_token_id, max_new_tokens=max_new_tokens, num_samples=num_samples,
                       seed=seed + start)
        for i, (ids, n) in enumerate(zip(out.tokens.tolist(), out.lengths.tolist())):
            pieces, current = [], []
            for t in ids[:n] + sep:
                if t == sep[0]:
                    pieces.append(current)
                    current = []
                else:
                    current.append(t)
            steps = [text for piece in pieces if (text := tokenizer.decode(piece, skip_special_tokens=True).strip())]
            if steps:
                prompt = chunk[i // num_samples]
                rows.append({"prompt": prompt, "steps": steps, "labels": task.step_labels(prompt, steps)})
    return rows


@dataclass
class StepData(PreferenceData):
    """Tokenised step-labelled rows with the language model the PRM starts from: what ``train prm`` builds on.

    ``kind`` is ``"step-labels"``; ``train`` and ``test`` are ``[N]`` rows of
    :func:`tokenize_steps`; ``reference`` is the causal LM whose copy becomes the PRM's backbone;
    ``task`` is the :class:`~offline_plugins.text.tasks.steps.StepChainTask` of a built-in dataset.
    The replay buffer is the preference data's (random rows over the training TensorDict).
    """


def resolve_step_id(dataset: str) -> Optional[str]:
    """The canonical id of a built-in step dataset or a ``steps:FILE.jsonl``; else None."""
    dataset = dataset.strip()
    if dataset in BUILTIN_STEP_DATASETS or (dataset.startswith(FILE_PREFIX) and dataset.endswith(".jsonl")):
        return dataset
    return None


def load_step_source(dataset_id: str, *, model: Any = "tiny", n_train: Optional[int] = None, n_test: int = 200,
                     max_length: int = 96, seed: int = 0, reference_sft_steps: int = 0, progress: bool = False,
                     finetune: Optional[Any] = None, policy_rows: int = 0) -> StepData:
    """The :class:`StepData` of a built-in id (``n_train`` rows generated by its task, by default its
    :data:`BUILTIN_STEP_ROWS`: half of them with a planted error) or of ``steps:FILE.jsonl`` (the held-out
    prompts chosen by a hash, as preference files).

    A built-in id with ``model="tiny"`` and ``reference_sft_steps > 0`` starts from the task's SFT
    reference (:func:`~offline_plugins.text.data.task_data.sft_reference`, ``finetune``, cached as the
    ``steps-arithmetic`` rollout task's: the model that writes the solutions); else from ``model``. With
    ``policy_rows > 0`` a built-in id's training rows also hold that many of the starting model's own
    solutions to other training prompts, labelled by the task (:func:`sampled_rows`)."""
    task = BUILTIN_STEP_DATASETS.get(dataset_id)
    if task is not None:
        train_rows = task.rows(n_train or BUILTIN_STEP_ROWS[dataset_id], split="train", seed=seed)
        test_rows = task.rows(n_test, split="test", seed=seed)
    elif resolve_step_id(dataset_id) is not None:
        rows = load_step_jsonl(dataset_id[len(FILE_PREFIX):])
        held = held_out_prompts([r["prompt"] for r in rows], min_rows=min(100, len(rows) // 5))
        train_rows = [r for r in rows if r["prompt"] not in held]
        test_rows = [r for r in rows if r["prompt"] in held]
    else:
        raise StepDataError(f"{dataset_id!r} is no step-labelled dataset; use one of {sorted(BUILTIN_STEP_DATASETS)} "
                            f"or {FILE_PREFIX}FILE.jsonl with rows {_SHAPE}")
    sft = task is not None and is_builtin_model(model) and reference_sft_steps > 0
    if sft:
        reference, tokenizer = sft_reference(task, model=str(model), steps=int(reference_sft_steps), progress=progress,
                                             cache_dir=cache_root() / "preference", finetune=finetune)
    else:
        reference, tokenizer = load_causal_lm(model, seed=0)
    reference.eval()
    if task is not None and policy_rows > 0:
        prompts = task.prompts(-(-int(policy_rows) // 4), split="train", seed=seed + 1)
        train_rows = train_rows + sampled_rows(task, reference, tokenizer, prompts, seed=seed)[: int(policy_rows)]
    limit = min(int(max_length), int(getattr(reference.config, "n_positions", max_length) or max_length))
    train, report = tokenize_steps(train_rows, tokenizer, max_length=limit)
    test, _ = tokenize_steps(test_rows, tokenizer, max_length=limit)
    return StepData("step-labels", train, reference, tokenizer, test=test, report=report, dataset_id=dataset_id,
                    task=task, model=str(model), from_scratch=is_builtin_model(model) and not sft)
