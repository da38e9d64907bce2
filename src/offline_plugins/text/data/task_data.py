"""Data from a verifiable text task: SFT rows, model samples, preference pairs, accuracy.

The offline preference pipeline on a built-in task, with no network:

1. :func:`sft_rows` gives (prompt, completion) rows with the exact answers;
   the ``sft`` algorithm trains a model on them
   (:func:`offline_plugins.kinds.sft.supervised_finetune`, passed in as ``finetune``): that
   model is the reference.
2. :func:`sample_responses` samples answers from a model; :func:`preference_rows`
   pairs a correct answer (chosen) with an incorrect one (rejected) per prompt, and
   :func:`unpaired_rows` labels each sample by exact match (KTO's data).
3. :func:`exact_match_accuracy` scores greedy answers on held-out prompts.

A task whose verifier is a graded gold reward (:class:`~offline_plugins.text.tasks.LengthTask`)
gets its pairs from :func:`gold_preference_rows` instead: two samples of the reference per
prompt, the one with the higher gold reward chosen, ties dropped.

>>> from offline_plugins.text.tasks import ArithmeticTask
>>> sft_rows(ArithmeticTask(), 2, seed=0)
[{'prompt': '73+46=', 'completion': '119'}, {'prompt': '37+94=', 'completion': '131'}]
"""

from __future__ import annotations

import hashlib
import inspect
import json
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import lightning
import torch
import transformers
from transformers.utils import logging as hf_logging

import offline_plugins
from offline_plugins.data.files import atomic_folder
from offline_plugins.errors import UserError
from offline_plugins.modules.tiny_lm import from_scratch_lr, load_causal_lm, model_cache_tag
from offline_plugins.text.backends.generation import (
    generate_left_padded,
    generate_texts,
    generation_kwargs,
    left_pad,
    model_context,
)
from offline_plugins.text.data.preference import (
    PreferenceData,
    add_reference_log_probs,
    pairs_to_unpaired,
    tokenize_pairs,
    tokenize_unpaired,
)
from offline_plugins.text.tasks import exact_match
from offline_plugins.tokens import pad_token_id, prompt_token_ids

__all__ = [
    "sft_rows",
    "sample_responses",
    "preference_rows",
    "gold_preference_rows",
    "unpaired_rows",
    "exact_match_accuracy",
    "task_preference_data",
    "sft_reference",
]


def sft_rows(task: Any, n: int, *, split: str = "train", seed: int = 0) -> list[dict]:
    """``n`` rows ``{"prompt", "completion"}`` with the task's exact answers (a multi-turn task's
    ``demonstration``: the episode that calls the tool, as one completion)."""
    show = getattr(task, "demonstration", lambda p: p.answer)
    segments = getattr(task, "demonstration_segments", None)  # a tool episode: the observations are not trained
    return [{"prompt": p.prompt, "completion": show(p), **({"segments": segments(p)} if segments else {})}
            for p in task.problems(n, split=split, seed=seed)]


def sample_responses(model, tokenizer, prompts, *, num_samples=4, max_new_tokens=8, temperature=1.0, seed=0):
    """Sampled responses per prompt (temperature sampling); see :func:`generate`."""
    return generate_texts(model, tokenizer, prompts, num_samples=num_samples, max_new_tokens=max_new_tokens,
                          temperature=temperature, seed=seed)


def preference_rows(
    task: Any,
    model: torch.nn.Module,
    tokenizer: Any,
    n_prompts: int,
    *,
    split: str = "train",
    num_samples: int = 4,
    temperature: float = 1.0,
    seed: int = 0,
    batch_size: int = 64,
    max_new_tokens: int = 8,
) -> list[dict]:
    """``(prompt, chosen, rejected)`` rows: a correct answer against an incorrect one.

    Both come from the model's samples when it produced both (the rejected is its most
    frequent wrong answer); otherwise the chosen is the exact answer and the rejected a
    corrupted answer (so every prompt yields a pair).
    """
    rng = random.Random(seed)
    problems = task.problems(n_prompts, split=split, seed=seed)
    rows = []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        samples = sample_responses(model, tokenizer, [p.prompt for p in chunk], num_samples=num_samples,
                                   temperature=temperature, seed=seed + start, max_new_tokens=max_new_tokens)
        for p, outs in zip(chunk, samples):
            right = [o.strip() for o in outs if task.reward(p.prompt, o) == 1.0]
            wrong = [o.strip() for o in outs if task.reward(p.prompt, o) == 0.0 and o.strip()]
            chosen = right[0] if right else p.answer
            # the model's most frequent mistake: its likeliest wrong answer, the one worth pushing down
            rejected = Counter(wrong).most_common(1)[0][0] if wrong else task.corrupt(p.answer, rng)
            rows.append({"prompt": p.prompt, "chosen": chosen, "rejected": rejected})
    return rows


def gold_preference_rows(
    task: Any,
    model: torch.nn.Module,
    tokenizer: Any,
    n_prompts: int,
    *,
    split: str = "train",
    num_samples: int = 2,
    temperature: float = 1.0,
    max_new_tokens: int = 8,
    vary_length: bool = False,
    seed: int = 0,
    batch_size: int = 64,
) -> list[dict]:
    """``(prompt, chosen, rejected)`` rows labelled by the task's gold reward (``task.rewards``).

    ``num_samples`` responses are sampled per prompt at ``temperature`` within ``max_new_tokens``;
    the first two (stripped of surrounding spaces) with different gold rewards make the pair, the
    higher chosen; a prompt whose samples all tie yields no pair. Every row's label is what the
    gold reward says.

    ``vary_length``: the model's end-of-text is suppressed for ``max_new_tokens`` tokens and each
    sample is cut to a length drawn uniformly in ``1..max_new_tokens`` tokens (a prefix of a
    sample is a sample of the model with its end-of-text suppressed that long). Why: the
    arithmetic SFT reference answers in 2-3 characters at any temperature (at temperature 2, 4
    samples of 512 prompts differed in length for 74 of them, 60 of those 3 against 2), so its
    plain samples teach a reward model one length contrast; the cut samples span the budget.
    With :class:`~offline_plugins.text.tasks.LengthTask` and a budget under its target,
    "longer is better" holds on every pair.
    """
    problems = task.problems(n_prompts, split=split, seed=seed)
    rng = random.Random(f"gold-pairs-{split}-{seed}")
    pad, eos = pad_token_id(tokenizer), tokenizer.eos_token_id
    rows = []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        if not vary_length:
            samples = generate_texts(model, tokenizer, [p.prompt for p in chunk], num_samples=num_samples,
                                     max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + start)
        else:
            device = next(model.parameters()).device
            ids, attn = left_pad([prompt_token_ids(tokenizer, p.prompt) for p in chunk], pad, repeat=num_samples)
            kwargs = generation_kwargs(max_new_tokens=max_new_tokens, pad_id=pad, eos_id=eos,
                                       temperature=temperature)
            kwargs["generation_config"].min_new_tokens = max_new_tokens
            was_training = model.training
            model.eval()
            try:
                with torch.no_grad(), torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda"
                                                            else []):
                    torch.manual_seed(seed + start)
                    out = generate_left_padded(model, ids.to(device), attn.to(device), **kwargs)
            finally:
                model.train(was_training)
            gen = out[:, ids.shape[1]:].tolist()
            cut = [rng.randint(1, max_new_tokens) for _ in gen]
            texts = tokenizer.batch_decode([g[:k] for g, k in zip(gen, cut)], skip_special_tokens=True)
            samples = [texts[i * num_samples:(i + 1) * num_samples] for i in range(len(chunk))]
        for p, outs in zip(chunk, samples):
            outs = [o.strip() for o in outs]
            gold = task.rewards([p.prompt] * len(outs), outs)
            pair = next(((i, j) for i in range(len(outs)) for j in range(i + 1, len(outs)) if gold[i] != gold[j]),
                        None)
            if pair is None:
                continue
            hi, lo = pair if gold[pair[0]] > gold[pair[1]] else pair[::-1]
            rows.append({"prompt": p.prompt, "chosen": outs[hi], "rejected": outs[lo]})
    return rows


def unpaired_rows(
    task: Any, model: torch.nn.Module, tokenizer: Any, n_prompts: int, *, split: str = "train",
    num_samples: int = 2, seed: int = 0,
) -> list[dict]:
    """``(prompt, completion, label)`` rows: each pair of :func:`preference_rows` split in two."""
    return pairs_to_unpaired(
        preference_rows(task, model, tokenizer, n_prompts, split=split, num_samples=num_samples, seed=seed)
    )


def exact_match_accuracy(
    task: Any, model: torch.nn.Module, tokenizer: Any, *, n: int = 200, split: str = "test", seed: int = 1,
    batch_size: int = 100, max_new_tokens: int = 8,
) -> float:
    """Share of ``n`` held-out prompts whose greedy answer is exactly right: exact match of the
    answer, or, for a task whose problems' answers are worked solutions (``worked_solutions``: the
    word problems), its verifier's reward on the final answer, within the task's own response budget."""
    problems = task.problems(n, split=split, seed=seed)
    worked = bool(getattr(task, "worked_solutions", False))
    if worked:
        max_new_tokens = max(int(max_new_tokens), int(task.max_new_tokens))
    outs = generate_texts(model, tokenizer, [p.prompt for p in problems], greedy=True,
                          max_new_tokens=max_new_tokens, batch_size=batch_size)
    if worked:
        return sum(task.reward(p.prompt, o[0]) for p, o in zip(problems, outs)) / max(n, 1)
    return sum(exact_match(o[0], p.answer) for p, o in zip(problems, outs)) / max(n, 1)


def require_finetune(finetune: Any, what: str) -> None:
    """Refuse a missing ``finetune`` (the SFT step the data layer cannot import), naming the fix."""
    if finetune is None:
        raise UserError(f"{what} is not cached and no finetune was given to train it; pass "
                        "finetune=offline_plugins.kinds.sft.supervised_finetune (the sft algorithm), as the "
                        "data kinds do")


def check_task_fits(task: Any, model: Any, tokenizer: Any, *, model_name: Any = None, **_: Any) -> None:
    """Refuse, in one line, a task whose demonstrations run past ``model``'s context in ``tokenizer``'s
    tokens (checked on 256 of them, before any training): SFT would drop most rows and a rollout
    would run past the position table."""
    context = model_context(model)
    rows = sft_rows(task, 256, seed=0)
    longest = max(len(tokenizer(r["prompt"] + r["completion"], add_special_tokens=False)["input_ids"]) + 2
                  for r in rows)
    if longest > context:
        name = model_name or getattr(getattr(model, "config", None), "_name_or_path", "") or "the model"
        raise UserError(f"{task.name}: its demonstrations run to {longest} tokens in {name}'s tokenizer, past the "
                        f"model's context of {context}; use a model with a longer context (--model small reads "
                        "512 positions)")


#: the source files a reference goes through (the SFT step, its loss, the tokenisation of the rows,
#: the tasks): their bytes are part of the cache key, so a change to any of them makes a new reference
_REFERENCE_CODE = ("kinds/sft.py", "objectives/llm/sft.py", "objectives/llm/rollout.py", "text/data/preference.py",
                   "text/data/task_data.py")
#: a reference is made on the CPU with one thread whatever the machine has: the same pins then give
#: the same weights on any machine (two threads split the sums differently: 77.5 % against 74.5 %
#: held-out exact match on arithmetic after 2,000 steps of tiny)
REFERENCE_THREADS = 1


def reference_recipe(task: Any, *, model: Any = "tiny", seed: int = 0, steps: int = 2000, batch_size: int = 64,
                     lr: float = 3e-3, rows: int = 8000, max_length: int = 24) -> dict:
    """Everything the weights of ``task``'s SFT reference depend on: the settings, the versions of
    torch, transformers and Lightning, the thread count and a hash of the code the reference goes
    through (its task's module included). Its hash names the cached folder.

    >>> from offline_plugins.text.tasks import ArithmeticTask
    >>> r = reference_recipe(ArithmeticTask(), steps=10)
    >>> r["steps"], r["threads"], sorted(r["versions"])
    (10, 1, ['lightning', 'offline_plugins', 'torch', 'transformers'])
    >>> reference_recipe(ArithmeticTask(), steps=10, lr=1e-3)["code"] == r["code"]
    True
    """
    task = getattr(task, "reference_task", task)
    code = hashlib.sha256()
    root = Path(offline_plugins.__file__).parent
    for path in [*(root / f for f in _REFERENCE_CODE), Path(inspect.getfile(type(task)))]:
        code.update(path.read_bytes() if path.is_file() else b"")
    return {"task": task.name, "model": model_cache_tag(model), "seed": int(seed), "steps": int(steps),
            "batch_size": int(batch_size), "lr": float(lr), "rows": int(rows),
            "max_length": max(int(max_length), int(getattr(task, "sft_max_length", 0))),
            "threads": REFERENCE_THREADS, "device": "cpu",
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "lightning": lightning.__version__, "offline_plugins": offline_plugins.__version__},
            "code": code.hexdigest()[:16]}


def reference_dir(task: Any, *, cache_dir: Any, **settings: Any):
    """Where :func:`sft_reference` caches the reference of ``task`` (a task over another's problems:
    that task's) made with ``settings`` (:func:`reference_recipe`'s): the task, the model, the seed,
    the steps, the batch size and a hash of the whole recipe, so a reference made by other code,
    other versions or other settings is never taken for this one."""
    task = getattr(task, "reference_task", task)
    recipe = reference_recipe(task, **settings)
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:10]
    tag = f"sft-{task.name}-{recipe['model']}-s{recipe['seed']}-n{recipe['steps']}-b{recipe['batch_size']}-r{digest}"
    return Path(cache_dir) / tag


def _provenance_line(ref_dir: Any) -> str:
    """What ``ref_dir/reference.json`` says of how the reference was made, in one line."""
    path = Path(ref_dir) / "reference.json"
    if not path.is_file():
        return f"{ref_dir} (no reference.json: made before references recorded how)"
    made = json.loads(path.read_text())
    r, v = made["recipe"], made["recipe"]["versions"]
    return (f"{ref_dir}, made {made['date']} at {made['commit']} in {made['wall_s']:.0f} s: {r['steps']} steps, "
            f"batch {r['batch_size']}, lr {r['lr']:g}, {r['threads']} thread on the cpu, torch {v['torch']}, "
            f"transformers {v['transformers']}; last loss {made['last_loss']:.4f}")


def _commit() -> str:
    """The checkout's commit when the package runs from one (an editable install), else its version."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(offline_plugins.__file__).parent,
                             capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "-s", "--", "."], cwd=Path(offline_plugins.__file__).parent,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"version {offline_plugins.__version__}"
    if out.returncode:
        return f"version {offline_plugins.__version__}"
    return out.stdout.strip()[:7] + (" (with uncommitted changes)" if dirty else "")


def sft_reference(task: Any, *, model: Any = "tiny", seed: int = 0, steps: int = 2000, batch_size: int = 64,
                  lr: float = 3e-3, rows: int = 8000, max_length: int = 24, cache_dir: Optional[Any] = None,
                  progress: bool = False, finetune: Optional[Any] = None):
    """``(model, tokenizer)``: ``model`` after ``steps`` steps of SFT on ``rows`` of the task's exact
    answers (``finetune``: :func:`offline_plugins.kinds.sft.supervised_finetune`), saved under
    ``cache_dir`` (``save_pretrained``) and loaded from there next time: the one reference the
    online and the preference results start from.

    It is made on the CPU with :data:`REFERENCE_THREADS` thread, whatever the caller set, so the same
    versions give the same weights on any machine; the folder's ``reference.json`` records the recipe
    (:func:`reference_recipe`), the commit, the date and the time it took, and a run that reuses the
    folder says so in one line."""
    # a task over another task's problems (LengthTask) shares that task's reference
    task = getattr(task, "reference_task", task)
    settings = dict(model=model, seed=seed, steps=steps, batch_size=batch_size, lr=lr, rows=rows, max_length=max_length)
    max_length = max(max_length, getattr(task, "sft_max_length", 0))  # a multi-turn demonstration is longer
    ref_dir = reference_dir(task, cache_dir=cache_dir, **settings) if cache_dir is not None else None
    if ref_dir is not None and (ref_dir / "config.json").is_file():
        print(f"offline-plugins: the SFT reference of {task.name}: {_provenance_line(ref_dir)}", file=sys.stderr,
              flush=True)
        return load_causal_lm(ref_dir, seed=seed)
    reference, tokenizer = load_causal_lm(model, seed=seed)
    check_task_fits(task, reference, tokenizer, model_name=model)
    require_finetune(finetune, f"the SFT reference of {task.name}")

    where = f"; cached in {ref_dir} for later runs" if ref_dir is not None else ""
    print(f"offline-plugins: making the SFT reference of {task.name} from {model_cache_tag(model)}: {steps} steps of sft "
          f"on {rows} demonstrations with {REFERENCE_THREADS} thread, the model this task's runs start from "
          f"(--set reference_sft_steps=N to change){where}", file=sys.stderr, flush=True)

    threads, started = torch.get_num_threads(), time.monotonic()
    torch.set_num_threads(REFERENCE_THREADS)
    try:
        curve = finetune(reference, tokenizer, sft_rows(task, rows, seed=seed), steps=steps, batch_size=batch_size,
                         lr=from_scratch_lr(lr, model),  # lr is tiny's; small takes a third of it
                         max_length=max_length, seed=seed, progress=progress, title="reference sft")
    finally:
        torch.set_num_threads(threads)
    if ref_dir is not None:
        made = {"recipe": reference_recipe(task, **settings), "commit": _commit(), "date": time.strftime("%Y-%m-%d"),
                "wall_s": time.monotonic() - started, "last_loss": float(curve[-1]) if curve else float("nan")}
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a bar for one shard of a few MB
        try:
            with atomic_folder(ref_dir) as folder:  # a run stopped while writing leaves no half-written reference
                reference.save_pretrained(folder)
                tokenizer.save_pretrained(folder)
                (folder / "reference.json").write_text(json.dumps(made, indent=1) + "\n")
        finally:
            if bars:
                hf_logging.enable_progress_bar()
    return reference, tokenizer


def task_preference_data(
    task: Any,
    *,
    model: Any = "tiny",
    kind: str = "preference-pairs",
    sft_rows_count: int = 8000,
    sft_steps: Optional[int] = None,
    sft_batch_size: int = 64,
    sft_lr: float = 3e-3,
    n_train: int = 1024,
    n_test: int = 200,
    num_samples: int = 4,
    max_length: int = 24,
    seed: int = 0,
    cache_dir: Optional[Any] = None,
    progress: bool = False,
    finetune: Optional[Any] = None,
    pairs: str = "exact-match",
    temperature: float = 1.0,
    max_new_tokens: int = 8,
    vary_length: bool = False,
):
    """The whole offline preference set-up on a verifiable task, network-free.

    ``pairs="exact-match"``: a correct against an incorrect answer (:func:`preference_rows`);
    ``pairs="gold"``: two samples ranked by the task's gold reward, ties dropped
    (:func:`gold_preference_rows`, ``temperature``, ``max_new_tokens`` and ``vary_length`` its sampling).

    SFT on the task's exact answers makes the reference (``model="tiny"`` starts from
    the built-in tiny LM; a path or hub id starts from that model) with ``finetune`` (the
    ``sft`` algorithm in the training shell,
    :func:`offline_plugins.kinds.sft.supervised_finetune`; the data layer does not import
    the shell, so its caller passes it); preference pairs
    (or, with ``kind="unpaired-feedback"``, their halves labelled by exact match) are
    sampled from the reference on train prompts, and held-out pairs on test prompts;
    reference log-probs are computed once. With ``cache_dir`` the SFT reference is
    saved there (``save_pretrained``) and reused, and the reference log-probs are cached.

    Returns a :class:`~offline_plugins.text.data.preference.PreferenceData`.
    """
    if kind not in ("preference-pairs", "unpaired-feedback"):
        raise ValueError(f"kind must be 'preference-pairs' or 'unpaired-feedback', got {kind!r}")
    if pairs not in ("exact-match", "gold"):
        raise UserError(f"pairs must be 'exact-match' (correct vs incorrect answers) or 'gold' (samples ranked by "
                        f"the task's gold reward), got {pairs!r}")
    if sft_steps is None:  # the task's own recipe: the reference its online runs start from too
        sft_steps = int(getattr(getattr(task, "reference_task", task), "reference_sft_steps", 2000))
    max_length = max(max_length, getattr(task, "sft_max_length", 0))  # a worked solution is longer
    reference, tokenizer = sft_reference(task, model=model, seed=seed, steps=sft_steps, batch_size=sft_batch_size,
                                         lr=sft_lr, rows=sft_rows_count, max_length=max_length, cache_dir=cache_dir,
                                         progress=progress, finetune=finetune)
    reference.eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    if pairs == "gold":
        make = lambda n, split, s: gold_preference_rows(  # noqa: E731
            task, reference, tokenizer, n, split=split, num_samples=num_samples, temperature=temperature,
            max_new_tokens=max_new_tokens, vary_length=vary_length, seed=s)
    else:
        make = lambda n, split, s: preference_rows(  # noqa: E731
            task, reference, tokenizer, n, split=split, num_samples=num_samples, seed=s,
            max_new_tokens=max(8, int(getattr(task, "max_new_tokens", 8))))
    train_rows = make(n_train, "train", seed)
    test_rows = make(n_test, "test", seed + 1)
    if not train_rows or not test_rows:
        raise UserError(f"{task.name}: the reference's samples made {len(train_rows)} training and {len(test_rows)} "
                        "held-out pairs (every sample of a prompt tied); raise temperature or num_samples")
    test_pairs, _ = tokenize_pairs(test_rows, tokenizer, max_length=max_length, source=f"{task.name}/test")
    if kind == "preference-pairs":
        train, report = tokenize_pairs(train_rows, tokenizer, max_length=max_length, source=task.name)
        test = test_pairs
    else:
        train, report = tokenize_unpaired(pairs_to_unpaired(train_rows), tokenizer, max_length=max_length,
                                          source=task.name)
        test, _ = tokenize_unpaired(pairs_to_unpaired(test_rows), tokenizer, max_length=max_length, source=f"{task.name}/test")
    ref_cache = Path(cache_dir) / "reference_log_probs" if cache_dir is not None else None
    add_reference_log_probs(train, reference, cache_dir=ref_cache, dataset_id=task.name)
    add_reference_log_probs(test, reference, cache_dir=ref_cache, dataset_id=f"{task.name}-test")
    if test_pairs is not test:
        add_reference_log_probs(test_pairs, reference, cache_dir=ref_cache, dataset_id=f"{task.name}-test")
    return PreferenceData(kind, train, reference, tokenizer, test=test, report=report, dataset_id=task.name,
                          test_pairs=test_pairs, task=task, model=str(model))
