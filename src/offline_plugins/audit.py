"""Audit preference data before training on it: length, style and position bias, annotators, label flips.

:func:`audit_preference_data` (``offline-plugins data audit DATASET``) reads any preference
dataset the package reads (a built-in task, a JSONL file, ``hf:NAME``) and measures what
the seeds (5.6.9) name as the ceiling of preference optimisation: systematic biases of the
labels (length, markdown style, position), disagreement between annotators, annotators'
accuracy on gold rows, and broken rows. With a trained reward model or DPO-family policy
(``model=``, a run folder or checkpoint, or a Python scoring function) it adds the model's
accuracy per length-difference bucket, the correlation of its score with length and the
pairs it ranks most confidently against their labels (candidate label flips).
docs/audit.md explains each number.

The statistics are written here (no extra dependency), each with its formula:
:func:`cohen_kappa`, :func:`krippendorff_alpha` (nominal, missing labels allowed) and
:func:`wilson_interval`.

>>> report = audit_preference_data([
...     {"prompt": "1+1=", "chosen": "2, since one and one make two", "rejected": "3"},
...     {"prompt": "2+2=", "chosen": "4", "rejected": "5 or so", "shown_first": "chosen"},
... ])
>>> report["length"]["chosen_longer"], report["position"]["first_preferred"]
(0.5, 1.0)
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import matplotlib
import matplotlib.pyplot as plt
import torch
from tqdm.auto import tqdm

from offline_plugins.data.jsonl import jsonl_objects
from offline_plugins.errors import UserError
from offline_plugins.eval.judge import judge_from
from offline_plugins.kinds.preference import PreferenceText
from offline_plugins.kinds.sft import supervised_finetune
from offline_plugins.lightning.checkpoint_files import algorithm_of_checkpoint
from offline_plugins.lightning.checkpoints import load_checkpoint, load_trained_run
from offline_plugins.modules.causal_lm import sequence_log_probs
from offline_plugins.modules.tiny_lm import load_causal_lm
from offline_plugins.plugins import shared_registry
from offline_plugins.text.backends.generation import model_context
from offline_plugins.text.data.preference import (
    PAIR_FIELDS,
    TokenizeReport,
    encode_example,
    prompt_token_ids,
    reference_log_probs,
    tokenize_pairs,
    validate_rows,
)
from offline_plugins.text.data.preference_sources import (
    BUILTIN_PREFERENCE_DATASETS,
    OPTIONAL_PAIR_FIELDS,
    PAIR_LENGTH_CAP,
    _keep_optional,
    _rows_from,
    load_preference_source,
    resolve_preference_id,
    unknown_preference_dataset,
)

__all__ = [
    "AuditError",
    "audit_preference_data",
    "read_pairs",
    "cohen_kappa",
    "krippendorff_alpha",
    "wilson_interval",
    "plot_audit",
    "LENGTH_UNITS",
    "STYLE_FEATURES",
]

#: how response length is counted: characters, whitespace-separated words, or tokens of the tokenizer
LENGTH_UNITS = ("chars", "words", "tokens")
#: algorithms whose loss is -log sigmoid(beta * implicit reward margin): their label probability uses beta
_BETA_SIGMOID = ("dpo", "robust-dpo", "rpo")
_TEXT_LIMIT = 200
#: a fenced code block (``` or ~~~), up to its closing fence or the end of the text
_CODE_BLOCK = re.compile(r"^ {0,3}(`{3,}|~{3,}).*?(?:^ {0,3}\1|\Z)", re.M | re.S)
#: markdown style counted outside code blocks: ATX headings, list items, bold spans
_STYLE_FEATURES = {
    "headings": re.compile(r"^ {0,3}#{1,6}[ \t]+\S", re.M),
    "list_items": re.compile(r"^[ \t]*(?:[-*+]|\d{1,9}[.)])[ \t]+\S", re.M),
    "bold": re.compile(r"\*\*(?=\S)[^\n]*?\S\*\*|__(?=\S)[^\n]*?\S__"),
}
#: the style features the audit reports, in this order
STYLE_FEATURES = (*_STYLE_FEATURES, "code_blocks")


class AuditError(UserError, ValueError):
    """A dataset, model or option that ``data audit`` cannot use."""


# ---- statistics --------------------------------------------------------------------------


def cohen_kappa(a: Sequence[Any], b: Sequence[Any]) -> Optional[float]:
    """Cohen's kappa of two annotators' labels on the same units (Cohen 1960).

    ``kappa = (p_o - p_e) / (1 - p_e)``, where ``p_o`` is the share of units both label
    alike and ``p_e = sum_c p_a(c) p_b(c)`` the agreement expected from each annotator's
    own label frequencies. Units where either label is ``None`` are left out. ``None``
    when undefined: no unit labelled by both, or ``p_e = 1`` (both always give one label).

    Cohen, J. (1960). A coefficient of agreement for nominal scales. Educational and
    Psychological Measurement, 20(1), 37-46.

    >>> round(cohen_kappa(["y", "y", "n", "n"], ["y", "n", "n", "n"]), 6)  # p_o = .75, p_e = .5
    0.5
    >>> cohen_kappa(["y", None], ["y", "n"]) is None  # one shared unit, one label: p_e = 1
    True
    """
    if len(a) != len(b):
        raise ValueError(f"cohen_kappa needs one label per unit from each annotator, got {len(a)} and {len(b)}")
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    n = len(pairs)
    if n == 0:
        return None
    p_o = sum(x == y for x, y in pairs) / n
    ca, cb = Counter(x for x, _ in pairs), Counter(y for _, y in pairs)
    p_e = sum(ca[c] * cb[c] for c in ca) / (n * n)
    if p_e >= 1.0:
        return None
    return (p_o - p_e) / (1.0 - p_e)


def _alpha_of_units(units: Iterable[Sequence[Any]]) -> Optional[float]:
    """Nominal alpha from the values each unit received (one list per unit, missing ones left out)."""
    disagreeing = 0.0  # sum over c != k of the coincidences o_ck
    n_c: Counter = Counter()
    for values in units:
        m = len(values)
        if m < 2:
            continue  # a unit with one value pairs with nothing: not pairable
        counts = Counter(values)
        # ordered pairs of values c != k inside the unit, each unit weighted 1 / (m_u - 1)
        disagreeing += (m * m - sum(v * v for v in counts.values())) / (m - 1)
        n_c.update(counts)
    n = sum(n_c.values())
    expected = n * n - sum(v * v for v in n_c.values())  # sum over c != k of n_c n_k
    if n < 2 or expected == 0:
        return None
    return 1.0 - (n - 1) * disagreeing / expected


def krippendorff_alpha(data: Sequence[Sequence[Any]]) -> Optional[float]:
    """Krippendorff's alpha for nominal labels from any number of annotators, missing labels allowed.

    ``data`` is Krippendorff's reliability-data matrix: one sequence per annotator (coder),
    one entry per unit, ``None`` where that annotator gave no label. With ``m_u`` the
    labels unit ``u`` received (units with fewer than two are not pairable and left out),
    the coincidences are ``o_ck = sum_u #(ordered pairs of labels c, k in u) / (m_u - 1)``,
    ``n_c = sum_k o_ck`` and ``n = sum_c n_c``; then

    ``alpha = 1 - D_o / D_e = 1 - (n - 1) * sum_{c != k} o_ck / sum_{c != k} n_c n_k``.

    ``None`` when undefined (fewer than two pairable labels, or a single label value
    throughout, ``D_e = 0``). 1 is perfect agreement, 0 agreement at chance.

    Krippendorff, K. (2011). Computing Krippendorff's Alpha-Reliability. University of
    Pennsylvania, https://repository.upenn.edu/asc_papers/43 (its example C below, 4
    observers, 12 units, missing values: alpha_nominal = 0.743).

    >>> N = None
    >>> round(krippendorff_alpha([[1, 2, 3, 3, 2, 1, 4, 1, 2, N, N, N],
    ...                           [1, 2, 3, 3, 2, 2, 4, 1, 2, 5, N, 3],
    ...                           [N, 3, 3, 3, 2, 3, 4, 2, 2, 5, 1, N],
    ...                           [1, 2, 3, 3, 2, 4, 4, 1, 2, 5, 1, N]]), 3)
    0.743
    """
    if not data:
        return None
    widths = {len(row) for row in data}
    if len(widths) != 1:
        raise ValueError(f"krippendorff_alpha needs one entry per unit from every annotator (None where missing), "
                         f"got rows of lengths {sorted(widths)}")
    return _alpha_of_units([[v for v in unit if v is not None] for unit in zip(*data)])


def wilson_interval(k: int, n: int, *, z: float = 1.959964) -> tuple[float, float]:
    """Wilson's score interval for a proportion ``k / n`` (95% for the default ``z``).

    ``(p + z^2 / 2n -+ z sqrt(p (1 - p) / n + z^2 / 4n^2)) / (1 + z^2 / n)`` with
    ``p = k / n``; unlike ``p -+ z sqrt(p (1 - p) / n)`` it stays inside [0, 1] and keeps its
    coverage for small ``n`` (Wilson, E. B. (1927), Probable inference, the law of
    succession, and statistical inference, JASA 22(158), 209-212). ``(0, 1)`` when ``n = 0``.

    >>> [round(x, 3) for x in wilson_interval(8, 10)]
    [0.49, 0.943]
    """
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1.0 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def _ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties given their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for t in range(i, j + 1):
            ranks[order[t]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def _pearson(x: Sequence[float], y: Sequence[float]) -> Optional[float]:
    n = len(x)
    if n < 2:
        return None
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def _spearman(x: Sequence[float], y: Sequence[float]) -> Optional[float]:
    return _pearson(_ranks(x), _ranks(y))


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo))


def _one_feature_accuracy(diffs: Sequence[float], folds: int = 5) -> tuple[float, bool]:
    """Held-out accuracy of the best rule "the response with more (or less) of one feature is chosen".

    ``diffs`` is the feature of the chosen minus that of the rejected, per pair (length, markdown
    style). The direction is chosen on the other folds of a ``folds``-fold split (pair ``i`` in
    fold ``i % folds``), so a dataset without the bias scores about 0.5 rather than the
    optimistic ``max(p, 1 - p)``; a tie counts 1/2 (a coin flip). Returns the accuracy and
    whether the rule fitted on all pairs is "more is chosen".

    >>> _one_feature_accuracy([3, 1, 2, -1, 5])  # each fold's rule, from the other four: "more"
    (0.8, True)
    """
    n = len(diffs)
    folds = max(1, min(folds, n))
    sign = [(d > 0) - (d < 0) for d in diffs]
    per_fold = [0] * folds
    for i, s in enumerate(sign):
        per_fold[i % folds] += s
    total = sum(per_fold)
    right = 0.0
    for i, s in enumerate(sign):
        rest = total - per_fold[i % folds]
        rule = 1 if rest >= 0 else -1  # no evidence: prefer the one with more
        right += 0.5 if s == 0 else float(s == rule)
    return right / max(n, 1), total >= 0


def _chosen_more(diffs: Sequence[float]) -> dict:
    """How often the chosen has more of a feature than the rejected: shares of all pairs, and the
    share among the pairs that differ with its 95% Wilson interval."""
    n = len(diffs)
    more, less = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    untied = more + less
    return {"chosen_more": more / n, "rejected_more": less / n, "ties": (n - untied) / n, "pairs_differing": untied,
            "chosen_more_untied": more / untied if untied else None,
            "chosen_more_untied_ci95": list(wilson_interval(more, untied)) if untied else None}


# ---- rows --------------------------------------------------------------------------------


def _unknown_dataset(dataset: str) -> AuditError:
    return unknown_preference_dataset(dataset, "data audit", verb="reads", error=AuditError)


def _check_dataset_id(dataset: Any) -> None:
    if isinstance(dataset, (str, os.PathLike)):
        if resolve_preference_id(str(dataset)) is None:
            raise _unknown_dataset(str(dataset))


def _decode_pairs(td, tokenizer) -> list[dict]:
    """``(prompt, chosen, rejected)`` text rows back from tokenised ``[N, 2]`` pairs."""
    tokens = td.get(("tokens", "full"))
    attn = td.get(("masks", "all_attention_mask"))
    resp = td.get(("masks", "all_assistant_mask"))
    rows = []
    for i in range(tokens.shape[0]):
        prompt = tokens[i, 0][attn[i, 0] & ~resp[i, 0]]
        texts = [tokenizer.decode(tokens[i, k][resp[i, k]], skip_special_tokens=True) for k in (0, 1)]
        rows.append({"prompt": tokenizer.decode(prompt, skip_special_tokens=True), "chosen": texts[0],
                     "rejected": texts[1]})
    return rows


def _keep_gold(row: dict, value: Any, where: str) -> None:
    """Check a row's ``gold`` marker (true: its ``chosen`` is the known right answer) and set it on ``row``.

    >>> row = {}
    >>> _keep_gold(row, True, "rows: row 0"); row
    {'gold': True}
    >>> _keep_gold(row, "yes", "f.jsonl: row 3 (line 4)")
    Traceback (most recent call last):
    ...
    offline_plugins.audit.AuditError: f.jsonl: row 3 (line 4) field 'gold' is 'yes'; expected true (the row's chosen is the known right answer) or false; fix the row, or leave the field out
    """
    if value is None:
        return
    if not isinstance(value, bool):
        raise AuditError(f"{where} field 'gold' is {value!r}; expected true (the row's chosen is the known right "
                         "answer) or false; fix the row, or leave the field out")
    row["gold"] = value


def _keep_gold_jsonl(path: Path, rows: list[dict]) -> None:
    """Copy the checked ``gold`` markers of a JSONL file's rows onto ``rows`` (the loaders keep no ``gold``)."""
    if '"gold"' not in path.read_text(encoding="utf-8-sig"):
        return  # most files carry none: no second parse
    for i, (n, raw) in enumerate(jsonl_objects(path, error=AuditError)):
        if "gold" in raw:
            _keep_gold(rows[i], raw["gold"], f"{path}: row {i} (line {n})")


def _read_rows(dataset: Union[str, Sequence[Mapping]], *, base_model: str, progress: bool,
               loaded: Any = None) -> tuple[str, list[dict], dict]:
    """``(dataset id, rows, notes)``; ``loaded`` is a ``PreferenceData`` of the same built-in dataset to reuse."""
    notes: dict = {}
    if not isinstance(dataset, (str, os.PathLike)):
        raw = list(dataset)
        rows = validate_rows(raw, PAIR_FIELDS, source="rows")
        for i, (row, original) in enumerate(zip(rows, raw)):
            for f in OPTIONAL_PAIR_FIELDS:
                if f in original:
                    _keep_optional(row, f, original[f], f"rows: row {i}")
            if "gold" in original:
                _keep_gold(row, original["gold"], f"rows: row {i}")
        return "rows", rows, notes
    resolved = resolve_preference_id(str(dataset))
    if resolved is None:
        raise _unknown_dataset(str(dataset))
    if resolved in BUILTIN_PREFERENCE_DATASETS:
        data = loaded if loaded is not None else load_preference_source(
            resolved, kind="preference-pairs", algorithm="data audit", model=base_model, progress=progress,
            finetune=supervised_finetune)
        rows = _decode_pairs(data.train, data.tokenizer)
        if data.test_pairs is not None:
            rows += _decode_pairs(data.test_pairs, data.tokenizer)
        notes["rows"] = (f"decoded from the tokenised pairs, {data.train.batch_size[0]} training rows then "
                         f"{len(rows) - data.train.batch_size[0]} held-out rows")
        if data.report is not None and data.report.dropped:
            notes["loader_dropped"] = dict(data.report.dropped)
        return resolved, rows, notes
    rows, layout = _rows_from(resolved)
    if layout != "pairs":
        raise AuditError(
            f"data audit reads (prompt, chosen, rejected) pairs, but {resolved} holds unpaired (prompt, completion, "
            "label) rows; audit the paired data they came from, or pair the rows first"
        )
    if not resolved.startswith("hf:"):
        _keep_gold_jsonl(Path(resolved), rows)
    return resolved, rows, notes


def _length(text: str, unit: str, tokenizer: Any) -> int:
    if unit == "chars":
        return len(text.strip())
    if unit == "words":
        return len(text.split())
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _clip(text: str) -> str:
    return text if len(text) <= _TEXT_LIMIT else text[: _TEXT_LIMIT - 3] + "..."


def read_pairs(dataset: Union[str, os.PathLike, Sequence[Mapping]], *, base_model: str = "tiny",
               progress: bool = True) -> tuple[str, list[dict]]:
    """``(dataset id, rows)``: the ``(prompt, chosen, rejected)`` rows of any preference dataset the audit reads,
    with their checked optional fields (``shown_first``, ``annotations``, ``gold``)."""
    _check_dataset_id(dataset)
    dataset_id, rows, _ = _read_rows(dataset, base_model=base_model, progress=progress)
    return dataset_id, rows


# ---- the model -----------------------------------------------------------------------------


@dataclass
class _Scorer:
    """A rebuilt reward model or policy of a preference run, with what scoring needs."""

    policy: Any
    reference: Any
    tokenizer: Any
    context: int
    algorithm: str
    checkpoint: str
    dataset_id: str
    base_model: str
    data: Any
    scale: Optional[float]

    @property
    def is_reward(self) -> bool:
        return hasattr(self.policy, "rewards")

    def score(self, rows: Sequence[dict], *, batch_size: int, progress: bool):
        return _score_rows(self, rows, batch_size=batch_size, progress=progress)


@dataclass
class _FunctionScorer:
    """A Python function ``score(prompt, response) -> float`` (a reward) in place of a trained run."""

    function: Callable[[str, str], float]
    algorithm = "function"
    dataset_id = None
    is_reward = True
    scale = None  # its units are unknown: no P(label)

    @property
    def checkpoint(self) -> str:
        return getattr(self.function, "__qualname__", None) or repr(self.function)

    def score(self, rows: Sequence[dict], *, batch_size: int, progress: bool):
        kept = [i for i, r in enumerate(rows) if r["chosen"].strip() and r["rejected"].strip()
                and r["chosen"].strip() != r["rejected"].strip()]  # the loader's row rules that need no tokenizer
        scores = []
        for i in kept:
            pair = [self.function(rows[i]["prompt"], rows[i][k]) for k in ("chosen", "rejected")]
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in pair):
                raise AuditError(f"model function {self.checkpoint} scored row {i} as {pair!r}; expected two finite "
                                 "numbers (the reward of the chosen and of the rejected response)")
            scores.append([float(x) for x in pair])
        return kept, torch.tensor(scores, dtype=torch.float32).reshape(-1, 2)


def _checkpoint_of(model: Union[str, os.PathLike]) -> Path:
    path = Path(model)
    if path.is_file():
        return path
    if path.is_dir():
        for candidate in (path / "checkpoints" / "last.ckpt", path.parent / "checkpoints" / "last.ckpt"):
            # the run folder itself, or its OUT/model (the policy saved for transformers)
            if candidate.is_file() and (candidate.parents[1] == path or (path / "config.json").is_file()):
                return candidate
    raise AuditError(
        f"--model {str(model)!r} is not a preference run: expected a run folder OUT holding "
        "OUT/checkpoints/last.ckpt, or a .ckpt file, of a reward-model or dpo-family run; train one with "
        "'offline-plugins train reward-model --dataset DATASET --out OUT'"
    )


def _load_scorer(model: Union[str, os.PathLike], *, registry: Any, device: str, progress: bool) -> _Scorer:
    """Rebuild a run's reward model or policy from its checkpoint (``lightning.checkpoints.load_trained_run``)."""
    path = _checkpoint_of(model)
    info = load_checkpoint(path)["offline_plugins"]
    if registry is None:
        registry = shared_registry()
    spec = algorithm_of_checkpoint(info, registry, path)
    if not isinstance(registry.kind_of(spec), PreferenceText):
        raise AuditError(
            f"--model {str(model)!r} is a {spec.name} run, trained on {spec.data}; data audit scores pairs with a "
            "reward model or a preference-trained policy: give a run of reward-model, dpo, ipo, kto, orpo, simpo, "
            "rpo or robust-dpo"
        )
    base = str(info.get("run", {}).get("model", "tiny"))
    try:
        trained = load_trained_run(path, device=device, registry=registry, spec=spec, progress=progress)
    except UserError as exc:
        if "does not fit the networks" in str(exc):
            raise AuditError(f"--model {str(model)!r}: {exc}") from None
        raise AuditError(
            f"--model {str(model)!r}: rebuilding its {spec.name} run needs the data it trained on "
            f"({info['dataset']!r}) and its base model ({base!r}): {exc}"
        ) from None
    module, plan = trained.module, trained.plan
    module.eval()
    # with LoRA the run's reference is the policy with its adapters off (AlgorithmParts.reference)
    reference = (module.parts.reference if module.parts.reference is not None else plan.data.reference).to(device)
    config = info.get("config", {})
    scale = 1.0 if hasattr(module.policy, "rewards") else (
        float(config["beta"]) if spec.name in _BETA_SIGMOID and "beta" in config else None)
    context = model_context(reference, cap=PAIR_LENGTH_CAP)
    return _Scorer(module.policy, reference, plan.data.tokenizer, context, spec.name, str(path), plan.dataset_id, base,
                   plan.data, scale)


def _score_rows(scorer: _Scorer, rows: Sequence[dict], *, batch_size: int, progress: bool):
    """``(row indices, scores [K, 2])`` of the rows the loader would keep, in the scorer's units.

    A reward model's reward, or a policy's implicit reward ``log pi(y|x) - log pi_ref(y|x)``
    summed over the response (what ``eval.preference.pairwise_scores`` ranks by).
    """
    scratch = TokenizeReport()
    kept = []
    for i, row in enumerate(rows):
        # the loader's own criteria (tokenize_pairs), so the kept rows keep their indices
        if row["chosen"].strip() == row["rejected"].strip():
            continue
        c = encode_example(scorer.tokenizer, row["prompt"], row["chosen"], max_length=scorer.context, report=scratch)
        r = encode_example(scorer.tokenizer, row["prompt"], row["rejected"], max_length=scorer.context,
                           report=scratch) if c is not None else None
        if r is not None and c[0] != r[0]:
            kept.append(i)
    if not kept:
        return [], torch.zeros(0, 2)
    td, _ = tokenize_pairs([rows[i] for i in kept], scorer.tokenizer, max_length=scorer.context, source="audit")
    if td.batch_size[0] != len(kept):  # pragma: no cover - the filter above is tokenize_pairs' own
        raise RuntimeError(f"tokenize_pairs kept {td.batch_size[0]} of {len(kept)} pre-filtered rows")
    device = next(scorer.policy.parameters()).device
    ref = None if scorer.is_reward else reference_log_probs(scorer.reference, td, batch_size=batch_size)
    out = []
    starts = range(0, len(kept), batch_size)
    with torch.no_grad():
        for s in tqdm(starts, desc=f"scoring pairs with {scorer.algorithm}", unit="batch", disable=not progress,
                      leave=False):
            chunk = td[s : s + batch_size].to(device)
            tokens, attn = chunk.get(("tokens", "full")), chunk.get(("masks", "all_attention_mask"))
            if scorer.is_reward:
                out.append(scorer.policy.rewards(tokens, attn).float().cpu())
            else:
                total, _ = sequence_log_probs(scorer.policy.log_probs(tokens, attn),
                                              chunk.get(("masks", "all_assistant_mask")))
                out.append(total.float().cpu() - ref[s : s + batch_size])
    return kept, torch.cat(out)


# ---- the sections --------------------------------------------------------------------------


def _length_section(lc: Sequence[int], lr: Sequence[int], unit: str) -> dict:
    diffs = [float(c - r) for c, r in zip(lc, lr)]
    n = len(diffs)
    s = sorted(diffs)
    mean = sum(diffs) / n
    accuracy, more = _one_feature_accuracy(diffs)
    share = _chosen_more(diffs)
    bins = max(1, min(30, len(set(diffs))))
    lo, hi = s[0], s[-1]
    width = (hi - lo) / bins if hi > lo else 1.0
    edges = [lo + width * k for k in range(bins + 1)] if hi > lo else [lo - 0.5, lo + 0.5]
    counts = [0] * (len(edges) - 1)
    for d in diffs:
        counts[min(int((d - edges[0]) / (edges[1] - edges[0])), len(counts) - 1)] += 1
    return {
        "unit": unit,
        "pairs": n,
        "chosen_longer": share["chosen_more"],
        "rejected_longer": share["rejected_more"],
        "ties": share["ties"],
        "chosen_longer_untied": share["chosen_more_untied"],
        "chosen_longer_untied_ci95": share["chosen_more_untied_ci95"],
        "chosen_mean": sum(lc) / n,
        "rejected_mean": sum(lr) / n,
        "difference": {
            "mean": mean,
            "std": math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1)) if n > 1 else 0.0,
            "min": s[0], "p10": _quantile(s, 0.1), "p25": _quantile(s, 0.25), "median": _quantile(s, 0.5),
            "p75": _quantile(s, 0.75), "p90": _quantile(s, 0.9), "max": s[-1],
        },
        "length_only_accuracy": accuracy,
        "length_only_rule": "longer" if more else "shorter",
        "histogram": {"edges": edges, "counts": counts},
    }


def _position_section(rows: Sequence[dict]) -> Optional[dict]:
    shown = [r["shown_first"] for r in rows if "shown_first" in r]
    if not shown:
        return None
    first = sum(s == "chosen" for s in shown)
    return {"pairs": len(shown), "first_preferred": first / len(shown),
            "first_preferred_ci95": list(wilson_interval(first, len(shown)))}


def _style_counts(text: str) -> dict[str, int]:
    """Markdown headings, list items, bold spans and fenced code blocks in ``text``.

    >>> _style_counts("# Plan\\n\\n- **one**\\n- two\\n\\n```py\\nx = 1\\n```")
    {'headings': 1, 'list_items': 2, 'bold': 1, 'code_blocks': 1}
    """
    prose, blocks = _CODE_BLOCK.subn("", text)
    return {**{name: len(pattern.findall(prose)) for name, pattern in _STYLE_FEATURES.items()}, "code_blocks": blocks}


def _style_section(rows: Sequence[dict]) -> dict:
    counts = [(_style_counts(r["chosen"]), _style_counts(r["rejected"])) for r in rows]
    n = len(rows)
    features = {}
    for name in STYLE_FEATURES:
        features[name] = {"chosen_mean": sum(c[name] for c, _ in counts) / n,
                          "rejected_mean": sum(r[name] for _, r in counts) / n,
                          **_chosen_more([c[name] - r[name] for c, r in counts])}
    combined = [sum(c.values()) - sum(r.values()) for c, r in counts]
    accuracy, more = _one_feature_accuracy(combined)
    return {
        "pairs": n,
        "pairs_with_style": sum(bool(sum(c.values()) + sum(r.values())) for c, r in counts),
        "features": features,
        "combined": _chosen_more(combined),
        "style_only_accuracy": accuracy,
        "style_only_rule": "more" if more else "less",
    }


def _gold_section(rows: Sequence[dict]) -> Optional[dict]:
    """Each annotator's accuracy on the gold rows, whose ``chosen`` is the known right answer."""
    gold = [r for r in rows if r.get("gold")]
    if not gold:
        return None
    right: Counter = Counter()
    given: Counter = Counter()
    for r in gold:
        for a in r.get("annotations") or []:
            given[a["annotator"]] += 1
            right[a["annotator"]] += a["preferred"] == "chosen"
    per = [{"annotator": who, "gold_labels": given[who], "correct": right[who], "accuracy": right[who] / given[who],
            "accuracy_ci95": list(wilson_interval(right[who], given[who]))} for who in sorted(given)]
    return {"rows": len(gold), "annotated_rows": sum(bool(r.get("annotations")) for r in gold),
            "labels": sum(given.values()), "accuracy": sum(right.values()) / sum(given.values()) if given else None,
            "per_annotator": per}


def _pair_key(row: Mapping) -> tuple:
    return row["prompt"], frozenset((row["chosen"].strip(), row["rejected"].strip()))


def _units(rows: Sequence[dict]) -> dict:
    """Rows grouped by pair: the prompt and the two responses, in either order.

    Each annotator keeps one label per pair (the first), stored as the preferred response's
    text. ``order`` is the pair's label-free orientation that agreement is computed in: the
    order shown to the annotator when the first row has ``shown_first``, else the two
    responses sorted. (The chosen/rejected orientation would not do: ``chosen`` is usually
    the annotators' own majority, so in it every pair's "true" category is the same and
    chance-corrected agreement is about 0 however well they agree.)
    """
    units: dict = {}
    for i, row in enumerate(rows):
        c, r = row["chosen"].strip(), row["rejected"].strip()
        if c == r:
            continue
        key = _pair_key(row)
        if key not in units:
            shown = row.get("shown_first")
            order = (c, r) if shown == "chosen" else (r, c) if shown == "rejected" else tuple(sorted((c, r)))
            units[key] = {"rows": [], "first": i, "chosen": row["chosen"], "rejected": row["rejected"],
                          "order": order, "labels": {}, "row_label": {}, "votes": Counter()}
        unit = units[key]
        unit["rows"].append(i)
        annotations = row.get("annotations") or []
        for a in annotations:
            if a["annotator"] not in unit["labels"]:
                unit["labels"][a["annotator"]] = c if a["preferred"] == "chosen" else r
                unit["row_label"][a["annotator"]] = c
                unit["votes"][unit["labels"][a["annotator"]]] += 1
        if not annotations:
            unit["votes"][c] += 1  # the row's own label is one vote
    return units


def _agreement_section(units: dict) -> Optional[dict]:
    annotated = [u for u in units.values() if u["labels"]]
    if not annotated:
        return None
    annotators = sorted({a for u in annotated for a in u["labels"]})
    # each label as the position of the preferred response in the pair's label-free order
    coded = [{a: u["order"].index(text) for a, text in u["labels"].items()} for u in annotated]
    values = [list(c.values()) for c in coded]
    agree_pairs = sum(sum(k * (k - 1) for k in Counter(v).values()) for v in values)
    all_pairs = sum(len(v) * (len(v) - 1) for v in values)
    kappa = None
    if len(annotators) == 2:
        a, b = annotators
        kappa = cohen_kappa([c.get(a) for c in coded], [c.get(b) for c in coded])
    per = []
    for who in annotators:
        agree = total = given = with_row = 0
        for u, c in zip(annotated, coded):
            if who not in c:
                continue
            given += 1
            with_row += u["labels"][who] == u["row_label"][who]
            others = [v for a, v in c.items() if a != who]
            agree += sum(v == c[who] for v in others)
            total += len(others)
        per.append({"annotator": who, "labels": given, "agreement_with_others": agree / total if total else None,
                    "agrees_with_row_label": with_row / given})
    return {
        "pairs": len(annotated),
        "annotators": len(annotators),
        "labels": sum(len(v) for v in values),
        "pairs_with_two_or_more": sum(len(v) >= 2 for v in values),
        "observed_agreement": agree_pairs / all_pairs if all_pairs else None,
        "cohen_kappa": kappa,
        "krippendorff_alpha": _alpha_of_units(values),
        "per_annotator": per,
    }


def _judge_section(judge: Any, units: dict, rows: Sequence[dict]) -> Optional[dict]:
    """The judge on every pair (both display orders): position consistency, agreement and kappa with the labels.

    Labels are coded as in :func:`_agreement_section`, by position in the pair's label-free
    order; a tie (position-inconsistent, or within the judge's margin) is no label.
    """
    pairs = list(units.values())
    if not pairs:
        return None
    judged = judge.compare_many([(rows[u["first"]]["prompt"], *u["order"]) for u in pairs])
    codes = [None if j.verdict == "tie" else "ab".index(j.verdict) for j in judged]
    row_codes = [u["order"].index(u["chosen"].strip()) for u in pairs]
    decided = [i for i, c in enumerate(codes) if c is not None]
    consistent = sum(j.consistent for j in judged)
    per = []
    for who in sorted({a for u in pairs for a in u["labels"]}):
        theirs = [u["order"].index(u["labels"][who]) if who in u["labels"] else None for u in pairs]
        both = [i for i in decided if theirs[i] is not None]
        per.append({"annotator": who, "pairs": len(both),
                    "agreement": sum(codes[i] == theirs[i] for i in both) / len(both) if both else None,
                    "cohen_kappa": cohen_kappa(codes, theirs)})
    return {
        "judge": judge.name,
        "pairs": len(pairs),
        "position_consistency": consistent / len(pairs),
        "position_consistency_ci95": list(wilson_interval(consistent, len(pairs))),
        "ties": (len(pairs) - len(decided)) / len(pairs),
        "agrees_with_row_label": sum(codes[i] == row_codes[i] for i in decided) / len(decided) if decided else None,
        "cohen_kappa_with_row_label": cohen_kappa(codes, row_codes),
        "per_annotator": per,
    }


def _contradictions(units: dict, rows: Sequence[dict], top: int) -> dict:
    found = []
    for u in units.values():
        for_chosen, for_rejected = u["votes"][u["chosen"].strip()], u["votes"][u["rejected"].strip()]
        if for_chosen and for_rejected:
            found.append({"rows": u["rows"], "prompt": _clip(rows[u["first"]]["prompt"]), "chosen": _clip(u["chosen"]),
                          "rejected": _clip(u["rejected"]), "votes_chosen": for_chosen,
                          "votes_rejected": for_rejected})
    # the most evenly split first
    found.sort(key=lambda f: (-min(f["votes_chosen"], f["votes_rejected"]) / (f["votes_chosen"] + f["votes_rejected"]),
                              f["rows"][0]))
    return {"count": len(found), "pairs": found[:top]}


def _issues_section(rows: Sequence[dict], tokenizer: Any, context: int, top: int) -> dict:
    seen: set = set()
    duplicates, equal, empty, over = [], [], [], []
    prompt_len: dict = {}
    for i, r in enumerate(rows):
        key = (r["prompt"], r["chosen"], r["rejected"])
        if key in seen:
            duplicates.append(i)
        seen.add(key)
        if not r["chosen"].strip() or not r["rejected"].strip():
            empty.append(i)
        elif r["chosen"].strip() == r["rejected"].strip():
            equal.append(i)
        if r["prompt"] not in prompt_len:
            prompt_len[r["prompt"]] = len(prompt_token_ids(tokenizer, r["prompt"]))
        if prompt_len[r["prompt"]] >= context:  # the loader's test: no room left for a response
            over.append(i)
    return {
        "duplicate_rows": len(duplicates),
        "chosen_equals_rejected": len(equal),
        "empty_responses": len(empty),
        "prompts_over_context": len(over),
        "context_tokens": context,
        "examples": {"duplicate_rows": duplicates[:top], "chosen_equals_rejected": equal[:top],
                     "empty_responses": empty[:top], "prompts_over_context": over[:top]},
    }


def _length_buckets(diffs: Sequence[float], margins: Sequence[float]) -> dict:
    """Preference accuracy (``margin > 0``) per bucket of the length difference ``d`` = chosen - rejected.

    Five buckets around ``t``, the median ``|d|`` of the pairs of unequal length: ``d < -t``,
    ``-t <= d < 0``, ``d = 0``, ``0 < d <= t`` and ``d > t``. A model that learned length
    rather than content is right where the chosen is the longer and wrong where it is the shorter.
    """
    unequal = sorted(abs(d) for d in diffs if d)
    t = _quantile(unequal, 0.5) if unequal else 0.0
    inside = ((f"d < -{t:g}", lambda d: d < -t), (f"-{t:g} <= d < 0", lambda d: -t <= d < 0),
              ("d = 0", lambda d: d == 0), (f"0 < d <= {t:g}", lambda d: 0 < d <= t), (f"d > {t:g}", lambda d: d > t))
    buckets = []
    for name, test in inside:
        hits = [m > 0 for d, m in zip(diffs, margins) if test(d)]
        right = sum(hits)
        buckets.append({"bucket": name, "pairs": len(hits), "accuracy": right / len(hits) if hits else None,
                        "accuracy_ci95": list(wilson_interval(right, len(hits))) if hits else None})
    return {"threshold": t, "buckets": buckets}


def _model_section(scorer: Union[_Scorer, _FunctionScorer], rows: Sequence[dict], lengths: tuple, *, top: int,
                   batch_size: int, progress: bool) -> dict:
    kept, scores = scorer.score(rows, batch_size=batch_size, progress=progress)
    section: dict = {
        "path": scorer.checkpoint,
        "algorithm": scorer.algorithm,
        "trained_on": scorer.dataset_id,
        "score": "reward" if scorer.is_reward else "implicit reward log pi/pi_ref",
        "pairs_scored": len(kept),
        "pairs_skipped": len(rows) - len(kept),
    }
    if not kept:
        section["note"] = "no row is usable by this model (empty, equal or over its context)"
        return section
    margin = (scores[:, 0] - scores[:, 1]).tolist()
    lc, lr = lengths
    flat_scores = scores.reshape(-1).tolist()
    flat_lengths = [float(x) for i in kept for x in (lc[i], lr[i])]
    section.update({
        "accuracy": sum(m > 0 for m in margin) / len(margin),
        "score_length_pearson": _pearson(flat_lengths, flat_scores),
        "score_length_spearman": _spearman(flat_lengths, flat_scores),
        "margin_length_difference_spearman": _spearman([float(lc[i] - lr[i]) for i in kept], margin),
        "length_buckets": _length_buckets([float(lc[i] - lr[i]) for i in kept], margin),
    })
    order = sorted(range(len(kept)), key=lambda j: margin[j])
    flips = []
    for j in order[:top]:
        if margin[j] >= 0:
            break
        i = kept[j]
        p = None if scorer.scale is None else 1.0 / (1.0 + math.exp(-max(-50.0, min(50.0, scorer.scale * margin[j]))))
        flips.append({"row": i, "margin": margin[j], "p_label": p, "prompt": _clip(rows[i]["prompt"]),
                      "chosen": _clip(rows[i]["chosen"]), "rejected": _clip(rows[i]["rejected"])})
    section["candidate_flips"] = flips
    section["ranked_against_label"] = sum(m < 0 for m in margin)
    return section


# ---- the audit -----------------------------------------------------------------------------


def audit_preference_data(
    dataset: Union[str, os.PathLike, Sequence[Mapping[str, Any]]],
    *,
    model: Union[None, str, os.PathLike, Callable[[str, str], float]] = None,
    judge: Any = None,
    base_model: str = "tiny",
    length_unit: str = "chars",
    top: int = 10,
    device: str = "cpu",
    batch_size: int = 64,
    progress: bool = True,
    registry: Any = None,
) -> dict[str, Any]:
    """Audit a preference dataset: what ``offline-plugins data audit`` prints, as a JSON-ready dict.

    Args:
        dataset: a preference dataset id (a built-in task, a ``.jsonl`` file, ``hf:NAME[:SPLIT]``)
            or a list of ``{"prompt", "chosen", "rejected"}`` rows; rows may carry
            ``shown_first`` and ``annotations`` (see :mod:`offline_plugins.text.data.preference_sources`)
            and, in JSONL files and lists, ``gold`` (true: the row's ``chosen`` is the known answer).

    Keyword Args:
        model: a run folder (``OUT``) or checkpoint of a ``reward-model`` or DPO-family run, or
            a Python function ``score(prompt, response) -> float`` (a reward); adds the ``model``
            section (accuracy per length-difference bucket, its score's correlation with
            length, candidate label flips).
        judge: a judge of :mod:`offline_plugins.eval.judge` (a ``Judge``, a function
            ``f(prompt, first, second) -> P(first better)``, ``"MODULE:FUNCTION"`` or a model for
            a rubric judge); adds the ``judge`` section (position consistency, agreement and
            Cohen's kappa with the row labels and each annotator).
        base_model: without ``model``, the model whose tokenizer and context length count
            prompts over the context (and ``tokens`` lengths), and the base of a built-in
            task's SFT reference: the ``--model`` a training run would get. Defaults to ``"tiny"``.
        length_unit: ``"chars"``, ``"words"`` or ``"tokens"``.
        top: how many candidate flips, contradictory pairs and example rows to list.
        device: where the model scores pairs.
        batch_size: pairs per forward when scoring.
        progress: show progress bars (the built-in task's SFT, scoring).
        registry: the plugin registry (default: discover installed plugins).

    Returns:
        ``dataset``, ``rows``, ``notes``, ``length``, ``style``, ``position`` (None without
        ``shown_first``), ``agreement`` (None without ``annotations``), ``gold`` (None
        without gold rows),
        ``contradictory_pairs``, ``issues`` and ``model`` (None without ``model``);
        docs/audit.md describes every entry. Row numbers count from 0 in file order.
    """
    if length_unit not in LENGTH_UNITS:
        raise AuditError(f"length unit {length_unit!r} is not one of {', '.join(LENGTH_UNITS)}; pick one")
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise AuditError(f"top must be a whole number >= 0, got {top!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise AuditError(f"batch_size must be a whole number >= 1, got {batch_size!r}")
    _check_dataset_id(dataset)  # before any model is loaded
    scorer = None if model is None or callable(model) else _load_scorer(model, registry=registry, device=device,
                                                                         progress=progress)
    reuse = None
    if scorer is not None and isinstance(dataset, (str, os.PathLike)):
        if resolve_preference_id(str(dataset)) == scorer.dataset_id:
            reuse = scorer.data  # the run's own built-in data, already loaded
    dataset_id, rows, notes = _read_rows(dataset, base_model=scorer.base_model if scorer else base_model,
                                         progress=progress, loaded=reuse)
    if not rows:
        raise AuditError(f"{dataset_id}: no rows to audit; it needs (prompt, chosen, rejected) rows")
    if scorer is not None:
        tokenizer, context, counted_by = scorer.tokenizer, scorer.context, f"{scorer.algorithm} run {scorer.checkpoint}"
    else:
        lm, tokenizer = load_causal_lm(base_model, seed=0)
        context, counted_by = model_context(lm, cap=PAIR_LENGTH_CAP), str(base_model)
        del lm
    lengths = ([_length(r["chosen"], length_unit, tokenizer) for r in rows],
               [_length(r["rejected"], length_unit, tokenizer) for r in rows])
    length = _length_section(*lengths, length_unit)
    if judge is not None:
        judge = judge_from(judge, device=device)
    units = _units(rows)
    issues = _issues_section(rows, tokenizer, context, top)
    issues["tokenizer_of"] = counted_by
    if "loader_dropped" in notes:
        issues["loader_dropped"] = notes.pop("loader_dropped")
    report: dict[str, Any] = {
        "dataset": dataset_id,
        "rows": len(rows),
        "notes": notes,
        "length": length,
        "style": _style_section(rows),
        "position": _position_section(rows),
        "agreement": _agreement_section(units),
        "gold": _gold_section(rows),
        "judge": None if judge is None else _judge_section(judge, units, rows),
        "contradictory_pairs": _contradictions(units, rows, top),
        "issues": issues,
        "model": None,
    }
    if model is not None:
        report["model"] = _model_section(_FunctionScorer(model) if callable(model) else scorer, rows, lengths, top=top,
                                         batch_size=batch_size, progress=progress)
    return report


def plot_audit(report: dict, out_png) -> "Path":
    """The length-difference histogram and, when rows carry annotations, each annotator's agreement."""
    matplotlib.use("Agg")

    ag = report["agreement"]
    fig, axes = plt.subplots(1, 2 if ag else 1, figsize=(11 if ag else 6, 4), squeeze=False)
    ln = report["length"]
    ax = axes[0][0]
    edges, counts = ln["histogram"]["edges"], ln["histogram"]["counts"]
    ax.stairs(counts, edges, fill=True, alpha=0.7)
    ax.axvline(0, color="k", lw=1)
    ax.set_xlabel(f"length of chosen - rejected ({ln['unit']})")
    ax.set_ylabel("pairs")
    ax.set_title(f"chosen longer {ln['chosen_longer']:.2f}, length-only accuracy {ln['length_only_accuracy']:.2f}")
    if ag:
        ax = axes[0][1]
        per = ag["per_annotator"]
        ax.bar(range(len(per)), [a["agreement_with_others"] or 0.0 for a in per])
        ax.set_xticks(range(len(per)), [a["annotator"] for a in per], rotation=45 if len(per) > 6 else 0)
        ax.set_ylim(0, 1)
        ax.set_ylabel("agreement with the other annotators")
        alpha = ag["krippendorff_alpha"]
        ax.set_title(f"Krippendorff's alpha {'-' if alpha is None else f'{alpha:.2f}'}")
    fig.suptitle(report["dataset"], fontsize=9)
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
