"""Where ``offline-plugins train dpo --dataset ID`` finds its preference data.

Three kinds of ``ID``:

* a built-in task, ``offline-plugins/arithmetic/preference-v0`` (short forms
  ``arithmetic/preference-v0`` and ``arithmetic``): 2-digit addition. The reference is
  ``--model`` after supervised fine-tuning on the task's exact answers; pairs are
  sampled from that reference (a correct against an incorrect answer), held-out pairs
  from test prompts, and exact-match accuracy is scored on held-out prompts;
  ``offline-plugins/arithmetic-length/preference-v0`` (short ``arithmetic-length``): the same
  prompts and reference, pairs of its samples ranked by a gold length reward
  (:class:`~offline_plugins.text.tasks.LengthTask`), for the RLHF over-optimisation study;
* a JSONL file (``*.jsonl``) of ``{"prompt", "chosen", "rejected"}`` pairs or
  ``{"prompt", "completion", "label"}`` unpaired rows;
* a Hugging Face dataset, ``hf:NAME`` or ``hf:NAME:SPLIT`` (needs ``datasets``, and a
  network unless it is cached).

Pairs may carry two optional fields, checked and kept on the rows (``offline-plugins
data audit`` reads them; training ignores them):

* ``shown_first``: ``"chosen"`` or ``"rejected"``, the response the annotator saw first;
* ``annotations``: a list of ``{"annotator": ID, "preferred": "chosen"|"rejected"}``, one
  per annotator who labelled the pair (IDs are compared as strings).

For files and Hugging Face datasets ``--model`` is the reference itself (no SFT step),
and at least 100 rows or a tenth of them, whichever is more (whole prompts, by a hash
of the prompt text), are held out.

The SFT reference and the reference log-probs are cached under
``$OFFLINE_PLUGINS_CACHE`` (default ``~/.cache/offline-plugins``), so the three seeds
of a study share one reference and training runs no reference forward.

>>> resolve_preference_id("arithmetic")
'offline-plugins/arithmetic/preference-v0'
>>> resolve_preference_id("arithmetic-length")
'offline-plugins/arithmetic-length/preference-v0'
>>> resolve_preference_id("pendulum/medium-v0") is None
True
"""

from __future__ import annotations

import difflib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from offline_plugins.config import cache_root as root
from offline_plugins.data.jsonl import jsonl_objects
from offline_plugins.errors import UserError
from offline_plugins.text.tasks import make_task
from offline_plugins.text.tasks.base import held_out_prompts

__all__ = [
    "BUILTIN_PREFERENCE_DATASETS",
    "OPTIONAL_PAIR_FIELDS",
    "PreferenceSourceError",
    "cache_root",
    "resolve_preference_id",
    "unknown_preference_dataset",
    "load_preference_source",
    "held_out_prompts",
]


class PreferenceSourceError(UserError, ValueError):
    """A preference dataset id that names nothing, or data that does not suit the algorithm."""


#: built-in preference datasets: id -> (summary, task settings (``task``: a name in
#: :data:`offline_plugins.text.tasks.TASKS`, default arithmetic), data settings of
#: :func:`offline_plugins.text.data.task_data.task_preference_data`)
BUILTIN_PREFERENCE_DATASETS: dict[str, tuple[str, dict, dict]] = {
    "offline-plugins/arithmetic/preference-v0": (
        "2-digit addition: correct vs incorrect answers sampled from the SFT reference",
        {"digits": 2, "ops": "+"},
        {"n_train": 4096, "n_test": 500},
    ),
    # the gold reward is a known function of the text (length against 6 characters); the
    # reference's samples cut to 1-5 tokens (under the target), ranked by it: "longer is better" on
    # every pair, so a reward model learns it, and a policy allowed past 6 characters over-optimises
    "offline-plugins/arithmetic-length/preference-v0": (
        "2-digit addition prompts: SFT-reference samples ranked by a gold length reward (target 6 characters)",
        {"task": "arithmetic-length", "target": 6, "digits": 2, "ops": "+"},
        {"n_train": 512, "n_test": 200, "pairs": "gold", "num_samples": 2, "temperature": 1.0,
         "max_new_tokens": 5, "vary_length": True},
    ),
    # the reference's own samples (4 a prompt, its whole worked solutions) labelled by the verifier: its
    # most frequent wrong solution against a right one (or the exact solution where it wrote none)
    "offline-plugins/word-problems/preference-v0": (
        "word problems (GSM8K's shape, three tiers): right vs wrong worked solutions sampled from the SFT reference",
        {"task": "word-problems"},
        {"n_train": 2048, "n_test": 500},
    ),
}

_ALIASES = {"arithmetic": "offline-plugins/arithmetic/preference-v0",
            "arithmetic-length": "offline-plugins/arithmetic-length/preference-v0",
            "word-problems": "offline-plugins/word-problems/preference-v0"}

#: optional fields of a pair row, kept by the loaders: what the annotator saw first, and each annotator's label
OPTIONAL_PAIR_FIELDS = ("shown_first", "annotations")
_SIDES = ("chosen", "rejected")


def cache_root() -> Path:
    """``$OFFLINE_PLUGINS_CACHE`` or ``~/.cache/offline-plugins`` (:func:`offline_plugins.config.cache_root`)."""

    return root()


def resolve_preference_id(dataset: str) -> Optional[str]:
    """The canonical id when ``dataset`` is a built-in preference dataset, a ``.jsonl`` path or ``hf:...``; else None."""
    dataset = dataset.strip()
    if dataset in BUILTIN_PREFERENCE_DATASETS:
        return dataset
    if f"offline-plugins/{dataset}" in BUILTIN_PREFERENCE_DATASETS:
        return f"offline-plugins/{dataset}"
    if dataset in _ALIASES:
        return _ALIASES[dataset]
    if dataset.startswith("hf:") or dataset.endswith(".jsonl"):
        return dataset
    return None


def unknown_preference_dataset(dataset: str, algorithm: str, *, verb: str = "trains on",
                               error: Optional[type] = None) -> PreferenceSourceError:
    """The error for an id that names no preference dataset, with close matches and what is accepted.

    ``algorithm`` and ``verb`` say who reads it (``"dpo trains on"``, ``"data audit reads"``);
    ``error`` is the class to raise (default :class:`PreferenceSourceError`).
    """
    known = list(BUILTIN_PREFERENCE_DATASETS)
    close = difflib.get_close_matches(dataset, known + list(_ALIASES), n=2, cutoff=0.5)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return (error or PreferenceSourceError)(
        f"{algorithm} {verb} preference data, but {dataset!r} is not one.{hint} Use a built-in preference "
        f"dataset ({', '.join(known)}), a .jsonl file of prompt/chosen/rejected rows, or hf:NAME[:SPLIT]"
    )


class NoHeldOutWarning(UserWarning):
    """A preference file too small or too uniform to hold rows out: its held-out figures are n/a."""


def _warn_no_held_out(source: str, rows: Sequence[dict]) -> None:
    """Say why a file gets no held-out split: too few rows, or every row on one prompt (a prompt's rows stay
    on one side of the split), and how many distinct rows there are."""

    prompts = len({r["prompt"] for r in rows})
    distinct = len({json.dumps(r, sort_keys=True, default=str) for r in rows})
    if len(rows) == 1:
        why = "it has a single row"
    elif prompts < 2:
        why = f"its {len(rows)} rows share one prompt, and a prompt's rows stay on one side of the split"
    else:
        why = f"it has only {len(rows)} rows"
    dups = f"; only {distinct} of them distinct (the rest are copies)" if distinct < len(rows) else ""
    warnings.warn(NoHeldOutWarning(
        f"{source}: no rows held out, so the held-out figures will read n/a: {why}{dups}; add rows with other "
        "prompts (10 % of the rows, at least 100 and at most half, are held out, whole prompts at a time)"), stacklevel=3)


#: the longest a preference row is padded to: every row is padded to one width, so a long-context
#: hub model's full context (32k) would make every pair that wide
PAIR_LENGTH_CAP = 1024


def _layout(columns) -> str:
    return "unpaired" if "completion" in columns and "chosen" not in columns else "pairs"


def _rows_from(source: str) -> tuple[list[dict], str]:
    """``(rows, "pairs"|"unpaired")`` of a JSONL file or ``hf:`` dataset, fields checked."""
    from offline_plugins.text.data.preference import PAIR_FIELDS, UNPAIRED_FIELDS, load_hf_dataset, load_jsonl

    if source.startswith("hf:"):
        try:
            import datasets
        except ImportError:
            raise PreferenceSourceError("reading Hugging Face datasets needs `pip install datasets`") from None
        name, _, split = source[3:].partition(":")
        try:
            ds = datasets.load_dataset(name, split=split or "train")
        except Exception as exc:  # noqa: BLE001 - any loading failure is the user's dataset name or network
            raise PreferenceSourceError(
                f"cannot load Hugging Face dataset {name!r} (split {split or 'train'!r}): {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}; check the name, or save it as JSONL"
            ) from None
        layout = _layout(ds.column_names)
        rows = load_hf_dataset(ds, fields=PAIR_FIELDS if layout == "pairs" else UNPAIRED_FIELDS)
        if layout == "pairs":
            for f in OPTIONAL_PAIR_FIELDS:
                if f in ds.column_names:
                    for i, (row, value) in enumerate(zip(rows, ds[f])):
                        _keep_optional(row, f, value, f"{source}: row {i}")
    else:
        path = Path(source)
        if not path.is_file():
            raise PreferenceSourceError(f"preference file {source!r} does not exist; give a path to a .jsonl file")

        try:
            head = next((row for _, row in jsonl_objects(path, error=PreferenceSourceError)), None)
        except PreferenceSourceError:
            head = {}  # load_jsonl names the bad line
        if head is None:
            raise PreferenceSourceError(
                f"{source} holds no rows; it needs prompt/chosen/rejected (or prompt/completion/label) rows")
        layout = _layout(head if isinstance(head, dict) else {})
        rows = load_jsonl(path, fields=PAIR_FIELDS if layout == "pairs" else UNPAIRED_FIELDS)
        if layout == "pairs":
            _keep_optional_jsonl(path, rows)
    return rows, layout


def _keep_optional_jsonl(path: Path, rows: list[dict]) -> None:
    """Copy the checked optional fields of a JSONL file's rows onto ``rows`` (``load_jsonl`` drops them)."""

    text = path.read_text(encoding="utf-8-sig")  # load_jsonl read it: it is UTF-8
    if not any(f'"{f}"' in text for f in OPTIONAL_PAIR_FIELDS):
        return  # most files carry neither: no second parse
    for i, (n, raw) in enumerate(jsonl_objects(path, error=PreferenceSourceError)):
        for f in OPTIONAL_PAIR_FIELDS:
            if f in raw:
                _keep_optional(rows[i], f, raw[f], f"{path}: row {i} (line {n})")


def _keep_optional(row: dict, field: str, value: Any, where: str) -> None:
    """Check one optional field of a pair row and set it on ``row``; ``None`` means absent.

    >>> row = {}
    >>> _keep_optional(row, "annotations", [{"annotator": 7, "preferred": "chosen"}], "row 0")
    >>> row
    {'annotations': [{'annotator': '7', 'preferred': 'chosen'}]}
    >>> _keep_optional(row, "shown_first", "left", "f.jsonl: row 3")
    Traceback (most recent call last):
    ...
    offline_plugins.text.data.preference_sources.PreferenceSourceError: f.jsonl: row 3 field 'shown_first' is 'left'; expected "chosen" or "rejected" (the response the annotator saw first); fix the row, or leave the field out where the order is unknown
    """
    if value is None:
        return
    if field == "shown_first":
        if value not in _SIDES:
            raise PreferenceSourceError(
                f"{where} field 'shown_first' is {value!r}; expected \"chosen\" or \"rejected\" (the response the "
                "annotator saw first); fix the row, or leave the field out where the order is unknown")
        row[field] = value
        return
    form = '{"annotator": ID, "preferred": "chosen"|"rejected"}'
    if not isinstance(value, (list, tuple)):
        raise PreferenceSourceError(
            f"{where} field 'annotations' is a {type(value).__name__} ({str(value)[:40]!r}); expected a list of "
            f"{form} objects, one per annotator; fix the row, or leave the field out")
    kept, seen = [], set()
    for j, item in enumerate(value):
        at = f"{where} field 'annotations[{j}]'"
        if not isinstance(item, dict) or "annotator" not in item or "preferred" not in item:
            has = f"has keys {sorted(item)}" if isinstance(item, dict) else f"is a {type(item).__name__}"
            raise PreferenceSourceError(f"{at} {has}; expected an object {form}; fix the row")
        who, preferred = item["annotator"], item["preferred"]
        if isinstance(who, bool) or not isinstance(who, (str, int)) or str(who) == "":
            raise PreferenceSourceError(
                f"{at} has annotator {who!r}; expected a non-empty string or integer ID; fix the row")
        if preferred not in _SIDES:
            raise PreferenceSourceError(
                f"{at} has preferred {preferred!r}; expected \"chosen\" or \"rejected\" (relative to this row's "
                "chosen and rejected responses); fix the row")
        if str(who) in seen:
            raise PreferenceSourceError(
                f"{at}: annotator {str(who)!r} labels this row twice; keep one label per annotator and row")
        seen.add(str(who))
        kept.append({"annotator": str(who), "preferred": preferred})
    row[field] = kept


def load_preference_source(
    dataset: str,
    *,
    kind: str,
    algorithm: str = "",
    model: Union[str, os.PathLike] = "tiny",
    seed: int = 0,
    cache_dir: Optional[Union[str, os.PathLike]] = None,
    test_fraction: float = 0.1,
    min_test_rows: int = 100,
    progress: bool = True,
    finetune: Optional[Any] = None,
    reference_sft_steps: Optional[int] = None,
):
    """Load a preference dataset id for an algorithm reading ``kind`` data.

    Args:
        dataset: an id accepted by :func:`resolve_preference_id`.

    Keyword Args:
        kind: ``"preference-pairs"`` or ``"unpaired-feedback"``; pairs serve both (KTO
            reads each pair as a desirable and an undesirable row).
        algorithm: the algorithm's name, for error messages.
        model: ``"tiny"``, a local directory written by ``save_pretrained``, or a hub id.
        seed: the data seed (SFT and sampling); training seeds do not change the data.
        cache_dir: where references and reference log-probs are cached (default
            :func:`cache_root` ``/preference``).
        test_fraction, min_test_rows: file / Hugging Face rows held out: at least
            ``max(min_test_rows, test_fraction * rows)`` (at most half), whole prompts
            chosen by a hash of their text (:func:`held_out_prompts`).
        progress: show a progress bar while the SFT reference trains.
        reference_sft_steps: the built-in datasets: SFT steps of their reference (None: the task's own).
        finetune: the built-in datasets: how their SFT reference is trained when it is not cached
            (:func:`offline_plugins.kinds.sft.supervised_finetune`, the ``sft`` algorithm).

    Returns:
        A :class:`~offline_plugins.text.data.preference.PreferenceData`.
    """
    from offline_plugins.text.data.preference import (
        PreferenceData,
        add_reference_log_probs,
        pairs_to_unpaired,
        tokenize_pairs,
        tokenize_unpaired,
    )

    resolved = resolve_preference_id(dataset)
    if resolved is None:
        raise unknown_preference_dataset(dataset, algorithm or "this algorithm")
    cache = Path(cache_dir) if cache_dir is not None else cache_root() / "preference"
    if resolved in BUILTIN_PREFERENCE_DATASETS:
        from offline_plugins.text.data.task_data import task_preference_data

        _, task_settings, data_settings = BUILTIN_PREFERENCE_DATASETS[resolved]
        task = make_task(**task_settings)
        data = task_preference_data(task, model=str(model), kind=kind, seed=seed, cache_dir=cache, progress=progress,
                                    finetune=finetune, **{"sft_steps": reference_sft_steps, **data_settings})
        data.dataset_id = resolved
        return data

    from offline_plugins.modules.tiny_lm import is_builtin_model, load_causal_lm
    from offline_plugins.text.backends.generation import model_context

    rows, layout = _rows_from(resolved)
    if layout == "unpaired" and kind == "preference-pairs":
        raise PreferenceSourceError(
            f"{algorithm or 'this algorithm'} trains on (prompt, chosen, rejected) pairs, but {resolved} holds "
            "unpaired (prompt, completion, label) rows; train kto on it, or give paired rows"
        )
    reference, tokenizer = load_causal_lm(model, seed=seed)
    reference.eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    max_length = model_context(reference, cap=PAIR_LENGTH_CAP)
    held = held_out_prompts([r["prompt"] for r in rows], fraction=test_fraction, min_rows=min_test_rows)
    train_rows = [r for r in rows if r["prompt"] not in held]
    test_rows = [r for r in rows if r["prompt"] in held]
    if not train_rows:
        raise PreferenceSourceError(f"{resolved}: every row fell in the held-out split; give more rows")
    if not test_rows:
        _warn_no_held_out(resolved, rows)
    tok = tokenize_pairs if layout == "pairs" and kind == "preference-pairs" else tokenize_unpaired
    to_rows = pairs_to_unpaired if layout == "pairs" and kind == "unpaired-feedback" else (lambda r: r)
    train, report = tok(to_rows(train_rows), tokenizer, max_length=max_length, source=resolved)
    test = test_pairs = train_pairs = None
    ref_cache = cache / "reference_log_probs"
    model_tag = Path(str(model)).name
    add_reference_log_probs(train, reference, cache_dir=ref_cache, dataset_id=f"{resolved}-{model_tag}")
    if layout == "pairs" and kind == "unpaired-feedback":
        # KTO trains on unpaired rows; its training accuracy is scored on the pairs they came from
        train_pairs = tokenize_pairs(train_rows, tokenizer, max_length=max_length, source=resolved)[0]
        add_reference_log_probs(train_pairs, reference, cache_dir=ref_cache, dataset_id=f"{resolved}-{model_tag}")
    if test_rows:
        test, _ = tok(to_rows(test_rows), tokenizer, max_length=max_length, source=f"{resolved} (held out)")
        add_reference_log_probs(test, reference, cache_dir=ref_cache, dataset_id=f"{resolved}-{model_tag}-test")
        if layout == "pairs":
            test_pairs = test if kind == "preference-pairs" else tokenize_pairs(
                test_rows, tokenizer, max_length=max_length, source=f"{resolved} (held out)")[0]
            if test_pairs is not test:
                add_reference_log_probs(test_pairs, reference, cache_dir=ref_cache,
                                        dataset_id=f"{resolved}-{model_tag}-test")
    return PreferenceData(kind, train, reference, tokenizer, test=test, report=report, dataset_id=resolved,
                          test_pairs=test_pairs, model=str(model), from_scratch=is_builtin_model(model),
                          train_pairs=train_pairs)
