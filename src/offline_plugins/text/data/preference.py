"""Preference data: rows from JSONL files or Hugging Face ``datasets`` into TensorDicts.

Paired rows ``{"prompt", "chosen", "rejected"}`` become a ``[N, 2]`` TensorDict
(index 0 chosen, 1 rejected); unpaired rows ``{"prompt", "completion", "label"}``
become ``[N]`` with a boolean ``label`` and, under ``"kl"``, each prompt with another
row's completion (KTO's mismatched pairs). Keys follow TorchRL's LLM stack:
``("tokens", "full")`` prompt + response, right-padded; ``("masks",
"all_attention_mask")`` real tokens; ``("masks", "all_assistant_mask")`` response
tokens. The tokenizer's chat template wraps the prompt when it has one.

Truncation keeps the end of the prompt (left-truncated to ``max_prompt_length``) and
the start of the response (cut to fit ``max_length``). Rows with an empty response,
chosen equal to rejected, or a prompt that leaves no room for a response are
dropped; :class:`TokenizeReport` counts each.

Reference log-probs are computed once in fp32 (:func:`add_reference_log_probs`) and
cached on disk under the dataset and model fingerprints, so training runs no
reference forward.

>>> from offline_plugins.modules.tiny_lm import char_tokenizer
>>> rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"},
...         {"prompt": "2+2=", "chosen": "4", "rejected": "4"}]
>>> td, report = tokenize_pairs(rows, char_tokenizer(), max_length=16)
>>> td.batch_size, report.kept, report.dropped
(torch.Size([1, 2]), 1, {'chosen_equals_rejected': 1})
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch
from tensordict import TensorDict
from torchrl.data import RandomSampler, TensorDictReplayBuffer, TensorStorage
from torchrl.data.replay_buffers.writers import ImmutableDatasetWriter

from offline_plugins.data.jsonl import jsonl_objects
from offline_plugins.errors import UserError
from offline_plugins.modules.causal_lm import CausalLMLogProbs, sequence_log_probs
from offline_plugins.modules.tiny_lm import model_fingerprint
from offline_plugins.tokens import (  # noqa: F401  (re-exported: the tokenisation helpers moved there)
    TokenizeReport,
    encode_example,
    encode_segments,
    pad_rows,
    pad_token_id,
    prompt_token_ids,
)

__all__ = [
    "PreferenceDataError",
    "ReferenceMismatchError",
    "TokenizeReport",
    "PAIR_FIELDS",
    "UNPAIRED_FIELDS",
    "validate_rows",
    "pairs_to_unpaired",
    "load_jsonl",
    "load_hf_dataset",
    "encode_example",
    "prompt_token_ids",
    "pad_rows",
    "pad_token_id",
    "tokenize_pairs",
    "tokenize_unpaired",
    "tokenize_completions",
    "dataset_fingerprint",
    "reference_log_probs",
    "add_reference_log_probs",
    "check_policy_matches_reference",
    "PreferenceData",
    "check_preference_data",
]

log = logging.getLogger(__name__)

PAIR_FIELDS = ("prompt", "chosen", "rejected")
UNPAIRED_FIELDS = ("prompt", "completion", "label")


class PreferenceDataError(UserError, ValueError):
    """A preference dataset row or file that cannot be used."""


class ReferenceMismatchError(UserError, ValueError):
    """A policy or dataset that does not match the cached reference log-probs."""


# ---- rows --------------------------------------------------------------------------------


def validate_rows(rows: Iterable[Mapping[str, Any]], fields: Sequence[str], *, source: str = "dataset") -> list[dict]:
    """Check every row has ``fields`` of the right type; raise naming the first bad row.

    Text fields must be strings; ``label`` must be a bool (or 0/1).
    """
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise PreferenceDataError(f"{source}: row {i} is a {type(row).__name__}, expected an object with {list(fields)}")
        missing = [f for f in fields if f not in row]
        if missing:
            raise PreferenceDataError(
                f"{source}: row {i} lacks field(s) {missing} (it has {sorted(row)}); every row needs "
                f"{list(fields)}; fix the row or rename its columns"
            )
        clean = {}
        for f in fields:
            v = row[f]
            if f == "label":
                if isinstance(v, bool) or v in (0, 1):
                    clean[f] = bool(v)
                    continue
                raise PreferenceDataError(
                    f"{source}: row {i} field 'label' is {v!r}; expected true/false (desirable or not)"
                )
            if not isinstance(v, str):
                raise PreferenceDataError(
                    f"{source}: row {i} field {f!r} is a {type(v).__name__} ({str(v)[:40]!r}); expected a string. "
                    f"Chat-format rows (lists of messages) must be flattened to text first"
                )
            clean[f] = v
        out.append(clean)
    return out


def pairs_to_unpaired(rows: Iterable[Mapping[str, Any]]) -> list[dict]:
    """Each ``(prompt, chosen, rejected)`` row as a desirable and an undesirable ``(prompt, completion, label)`` row.

    >>> pairs_to_unpaired([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}])
    [{'prompt': '1+1=', 'completion': '2', 'label': True}, {'prompt': '1+1=', 'completion': '3', 'label': False}]
    """
    return [{"prompt": r["prompt"], "completion": r[k], "label": k == "chosen"} for r in rows for k in ("chosen", "rejected")]


def load_jsonl(path: Union[str, Path], *, fields: Sequence[str] = PAIR_FIELDS) -> list[dict]:
    """Rows of a JSONL file (one JSON object a line), validated against ``fields``."""
    p = Path(path)
    if not p.is_file():
        raise PreferenceDataError(f"preference file {str(p)!r} does not exist")

    rows = [row for _, row in jsonl_objects(p, error=PreferenceDataError, shape="one JSON object per line")]
    return validate_rows(rows, fields, source=str(p))


def load_hf_dataset(
    name_or_dataset: Any, *, split: str = "train", fields: Sequence[str] = PAIR_FIELDS, **kwargs: Any
) -> list[dict]:
    """Rows of a Hugging Face dataset (a ``datasets.Dataset`` or a name for ``load_dataset``)."""
    try:
        import datasets
    except ImportError:
        raise PreferenceDataError("reading Hugging Face datasets needs `pip install datasets`") from None
    ds = name_or_dataset
    if isinstance(ds, str):
        ds = datasets.load_dataset(ds, split=split, **kwargs)
    elif isinstance(ds, datasets.DatasetDict):
        ds = ds[split]
    return validate_rows(iter(ds), fields, source=f"dataset {getattr(ds, 'info', None) and ds.info.dataset_name or ''}".strip())


# ---- tokenisation ------------------------------------------------------------------------


def _as_td(parts: dict[str, torch.Tensor], batch: Sequence[int]) -> TensorDict:
    return TensorDict(
        {
            "tokens": {"full": parts["tokens"]},
            "masks": {"all_attention_mask": parts["attn"], "all_assistant_mask": parts["resp"]},
        },
        batch_size=list(batch),
    )


def _pad_and_note(tokenizer: Any, report: TokenizeReport) -> int:
    had_pad = tokenizer.pad_token_id is not None
    pad = pad_token_id(tokenizer)
    if not had_pad:
        report.notes.append(f"tokenizer had no pad token; set it to {tokenizer.pad_token!r}")
    return pad


def tokenize_pairs(
    rows: Iterable[Mapping[str, Any]],
    tokenizer: Any,
    *,
    max_length: int = 64,
    max_prompt_length: Optional[int] = None,
    source: str = "dataset",
) -> tuple[TensorDict, TokenizeReport]:
    """``(td [N, 2], report)`` from ``(prompt, chosen, rejected)`` rows; see the module docstring."""
    rows = validate_rows(rows, PAIR_FIELDS, source=source)
    report = TokenizeReport(total=len(rows))
    pad = _pad_and_note(tokenizer, report)
    encoded = []
    for row in rows:
        if row["chosen"].strip() == row["rejected"].strip():
            report.drop("chosen_equals_rejected")
            continue
        c = encode_example(tokenizer, row["prompt"], row["chosen"], max_length=max_length,
                           max_prompt_length=max_prompt_length, report=report)
        if c is None:
            continue
        r = encode_example(tokenizer, row["prompt"], row["rejected"], max_length=max_length,
                           max_prompt_length=max_prompt_length, report=report)
        if r is None:
            continue
        if c[0] == r[0]:  # equal after truncation: no preference signal left
            report.drop("chosen_equals_rejected")
            continue
        encoded.append((c, r))
    report.kept = len(encoded)
    if not encoded:
        raise PreferenceDataError(f"{source}: no usable preference pairs ({report.summary()})")
    length = max(len(e[0]) for pair in encoded for e in pair)
    flat = [e for pair in encoded for e in pair]
    td = _as_td(pad_rows(flat, pad, length), [len(flat)]).reshape(len(encoded), 2)
    _log_report(source, report)
    return td, report


def tokenize_unpaired(
    rows: Iterable[Mapping[str, Any]],
    tokenizer: Any,
    *,
    max_length: int = 64,
    max_prompt_length: Optional[int] = None,
    source: str = "dataset",
) -> tuple[TensorDict, TokenizeReport]:
    """``(td [N], report)`` from ``(prompt, completion, label)`` rows, with KTO's mismatched rows under ``"kl"``.

    Row ``i``'s mismatched partner is its prompt with the completion of the next row
    (cyclically) whose prompt differs, as in KTO's reference implementation.
    """
    rows = validate_rows(rows, UNPAIRED_FIELDS, source=source)
    report = TokenizeReport(total=len(rows))
    pad = _pad_and_note(tokenizer, report)
    kept = []
    for row in rows:
        e = encode_example(tokenizer, row["prompt"], row["completion"], max_length=max_length,
                           max_prompt_length=max_prompt_length, report=report)
        if e is not None:
            kept.append((row, e))
    report.kept = len(kept)
    if len(kept) < 2:
        raise PreferenceDataError(f"{source}: KTO needs at least 2 usable rows ({report.summary()})")
    scratch = TokenizeReport()
    mismatched = []
    n = len(kept)
    for i, (row, _) in enumerate(kept):
        # the next row with another prompt: a (x, y) pair from unrelated rows, not a second
        # answer to the same prompt (paired data split into halves sits in consecutive rows)
        j = next(((i + k) % n for k in range(1, n) if kept[(i + k) % n][0]["prompt"] != row["prompt"]), (i + 1) % n)
        other = kept[j][0]
        m = encode_example(tokenizer, row["prompt"], other["completion"], max_length=max_length,
                           max_prompt_length=max_prompt_length, report=scratch)
        mismatched.append(m if m is not None else kept[i][1])
    length = max(len(e[0]) for e in [k[1] for k in kept] + mismatched)
    td = _as_td(pad_rows([k[1] for k in kept], pad, length), [len(kept)])
    td.set("label", torch.tensor([k[0]["label"] for k in kept], dtype=torch.bool))
    td.set("kl", _as_td(pad_rows(mismatched, pad, length), [len(kept)]))
    _log_report(source, report)
    return td, report


def tokenize_completions(
    rows: Iterable[Mapping[str, Any]], tokenizer: Any, *, max_length: int = 64, source: str = "dataset"
) -> tuple[TensorDict, TokenizeReport]:
    """``(td [N], report)`` from ``(prompt, completion)`` rows: SFT data in the same layout.

    A row with ``segments`` (a list of ``(text, trained)``, whose texts make up the completion: a tool
    episode's turns and observations) trains on its trained segments only (:func:`encode_segments`)."""
    rows = list(rows)
    segments = [r.get("segments") if isinstance(r, Mapping) else None for r in rows]
    rows = [dict(r, segments=s) for r, s in zip(validate_rows(rows, ("prompt", "completion"), source=source), segments)]
    report = TokenizeReport(total=len(rows))
    pad = _pad_and_note(tokenizer, report)

    def encode(r):
        if r.get("segments"):
            return encode_segments(tokenizer, r["prompt"], r["segments"], max_length=max_length, report=report)
        return encode_example(tokenizer, r["prompt"], r["completion"], max_length=max_length, report=report)

    enc = [e for r in rows if (e := encode(r))]
    report.kept = len(enc)
    if not enc:
        raise PreferenceDataError(f"{source}: no usable rows ({report.summary()})")
    return _as_td(pad_rows(enc, pad, max(len(e[0]) for e in enc)), [len(enc)]), report


def _log_report(source: str, report: TokenizeReport) -> None:
    if report.dropped or report.notes:
        log.warning("%s: %s", source, report.summary())


# ---- reference log-probs -----------------------------------------------------------------


def dataset_fingerprint(td: TensorDict) -> str:
    """A short hash of a tokenised dataset's tokens and masks."""
    h = hashlib.sha256()
    for key in (("tokens", "full"), ("masks", "all_attention_mask"), ("masks", "all_assistant_mask"),
                ("kl", "tokens", "full"), ("kl", "masks", "all_assistant_mask")):
        v = td.get(key, None)
        if v is not None:
            h.update(repr(key).encode())
            h.update(str(tuple(v.shape)).encode())
            h.update(v.to("cpu").contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@torch.no_grad()
def reference_log_probs(model: torch.nn.Module, td: TensorDict, *, batch_size: int = 64) -> torch.Tensor:
    """Summed response log-probs of the reference model, one per sequence, in fp32."""
    _check_vocab(model, td)
    actor = CausalLMLogProbs(model)
    tokens = td.get(("tokens", "full"))
    attn = td.get(("masks", "all_attention_mask"))
    resp = td.get(("masks", "all_assistant_mask"))
    lead = tokens.shape[:-1]
    tokens, attn, resp = (x.reshape(-1, x.shape[-1]) for x in (tokens, attn, resp))
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = []
    try:
        with torch.autocast(device.type, enabled=False):
            for i in range(0, tokens.shape[0], batch_size):
                sl = slice(i, i + batch_size)
                lp = actor.log_probs(tokens[sl].to(device), attn[sl].to(device))
                out.append(sequence_log_probs(lp, resp[sl].to(device))[0].float().cpu())
    finally:
        model.train(was_training)
    return torch.cat(out).reshape(lead)


def _vocab_size(model: torch.nn.Module) -> Optional[int]:
    config = getattr(model, "config", None)
    return getattr(config, "vocab_size", None)


def _check_vocab(model: torch.nn.Module, td: TensorDict) -> None:
    vocab = _vocab_size(model)
    tokens = td.get(("tokens", "full"))
    if vocab is not None and tokens.numel() and int(tokens.max()) >= vocab:
        raise ReferenceMismatchError(
            f"the data holds token id {int(tokens.max())} but the model's vocabulary has {vocab} tokens; "
            f"tokenise the data with this model's tokenizer"
        )


def add_reference_log_probs(
    td: TensorDict,
    reference: torch.nn.Module,
    *,
    cache_dir: Optional[Union[str, Path]] = None,
    dataset_id: str = "",
    model_id: Optional[str] = None,
    batch_size: int = 64,
) -> TensorDict:
    """Write ``("ref_log_probs", "response")`` (and under ``"kl"``) into ``td``, computed once.

    With ``cache_dir`` the values are stored in ``<cache_dir>/<dataset>-<model>.pt``,
    keyed by the dataset fingerprint (tokens and masks) and the reference model's
    weight fingerprint; a second call with the same data and model reads the file and
    runs no forward. The file also records the reference's vocabulary size, checked by
    :func:`check_policy_matches_reference`.
    """
    path = None
    if cache_dir is not None:
        model_id = model_id or model_fingerprint(reference)
        name = f"{_safe(dataset_id)}{'-' if dataset_id else ''}{dataset_fingerprint(td)}-{model_id}.pt"
        path = Path(cache_dir) / name
        if path.is_file():
            try:
                cached = torch.load(path, map_location="cpu", weights_only=True)
                _set_cached(td, cached)
                return td
            except Exception as exc:  # garbage, crafted (pickled code is refused by weights_only) or of other rows
                warnings.warn(f"the reference log-prob cache {path} is unreadable or does not fit this data "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else 'no message'}); "
                              "it is discarded and rebuilt", stacklevel=2)
                path.unlink(missing_ok=True)
    values = {"response": reference_log_probs(reference, td, batch_size=batch_size)}
    if "kl" in td.keys():
        values["kl_response"] = reference_log_probs(reference, td.get("kl"), batch_size=batch_size)
    values["vocab_size"] = torch.tensor(_vocab_size(reference) or -1)
    _set_cached(td, values)
    if path is not None:
        tmp = path.with_suffix(".tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(values, tmp)
            tmp.replace(path)
        except (OSError, RuntimeError) as exc:  # a full disk or a read-only cache: the values in hand are used
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            warnings.warn(f"the reference log-prob cache {path} could not be written ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:160] if str(exc) else 'no message'}); this run uses the values "
                          "it computed, and the next run computes them again", stacklevel=2)
    return td


def _set_cached(td: TensorDict, values: Mapping[str, torch.Tensor]) -> None:
    lead = tuple(td.get(("tokens", "full")).shape[:-1])
    if not isinstance(values, Mapping) or not isinstance(values.get("response"), torch.Tensor) \
            or tuple(values["response"].shape) != lead or not isinstance(values.get("vocab_size"), torch.Tensor):
        raise ValueError(f"expected {{'response': a {list(lead)} tensor, 'vocab_size': a tensor}}")
    td.set(("ref_log_probs", "response"), values["response"].to(torch.float32))
    if "kl_response" in values and "kl" in td.keys():
        td.set(("kl", "ref_log_probs", "response"), values["kl_response"].to(torch.float32))
    # per row, so the check travels with every sampled batch
    td.set(("ref_log_probs", "vocab_size"), values["vocab_size"].to(torch.long).expand(td.batch_size).clone())


def check_policy_matches_reference(policy: torch.nn.Module, td: TensorDict) -> None:
    """Raise if the policy's vocabulary differs from the one the cached reference log-probs used."""
    ref_vocab = td.get(("ref_log_probs", "vocab_size"), None)
    ref_vocab = None if ref_vocab is None or not ref_vocab.numel() else int(ref_vocab.reshape(-1)[0])
    vocab = _vocab_size(policy)
    if ref_vocab not in (None, -1) and vocab is not None and ref_vocab != int(vocab):
        raise ReferenceMismatchError(
            f"the policy has a vocabulary of {vocab} tokens but the cached reference log-probs were computed "
            f"with one of {ref_vocab}; train the policy that the reference was made from (same tokenizer), "
            f"or recompute the reference log-probs for this model"
        )
    _check_vocab(policy, td)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:60]



# ---- what an algorithm's build receives ----------------------------------------------------


@dataclass
class PreferenceData:
    """Tokenised preference data with its reference model: what a preference ``build`` takes.

    Attributes:
        kind: ``"preference-pairs"`` (``train`` is ``[N, 2]``) or ``"unpaired-feedback"`` (``[N]``).
        train: the training rows, with ``("ref_log_probs", "response")`` from
            :func:`add_reference_log_probs`.
        reference: the frozen reference (SFT) model; the policy starts as its copy.
        tokenizer: the tokenizer the rows were made with.
        test: held-out rows in the same layout, or None.
        report: what tokenisation kept and dropped.
        dataset_id: a name for logs and the reference cache.
        test_pairs: held-out ``[N, 2]`` pairs with reference log-probs, whatever
            ``kind`` is (KTO's unpaired runs are scored on pairs too); defaults to
            ``test`` for paired data.
        task: the verifiable task the rows came from (scores exact match), or None.
        model: the model name or path the reference was made from (``"tiny"``...).
        train_pairs: training ``[N, 2]`` pairs with reference log-probs, scored beside the
            held-out ones so memorisation shows; defaults to ``train`` for paired data.
        from_scratch: the reference is a randomly initialised model (a built-in ``--model``, tiny or small, on a
            file, no SFT step), which wants a from-scratch learning rate rather than a
            fine-tuning one (:func:`offline_plugins.algorithms.preference.resolve_lr`).
    """

    kind: str
    train: TensorDict
    reference: torch.nn.Module
    tokenizer: Any
    test: Optional[TensorDict] = None
    report: Optional[TokenizeReport] = None
    dataset_id: str = ""
    test_pairs: Optional[TensorDict] = None
    task: Optional[Any] = None
    model: str = ""
    from_scratch: bool = False
    train_pairs: Optional[TensorDict] = None

    def __post_init__(self) -> None:
        if self.kind == "preference-pairs":
            if self.test_pairs is None:
                self.test_pairs = self.test
            if self.train_pairs is None:
                self.train_pairs = self.train

    #: what ``offline-plugins train`` checks an algorithm against
    action_space = "tokens"

    @property
    def device(self) -> torch.device:
        return self.train.device if self.train.device is not None else torch.device("cpu")

    def replay_buffer(self, batch_size: int, *, sampler: str = "random", slice_len: Optional[int] = None,
                      seed: Optional[int] = None, device=None, **_: Any):
        """A read-only TorchRL ``TensorDictReplayBuffer`` over the training rows.

        The same buffer type the offline RL data gives (``RandomSampler`` over a
        ``TensorStorage`` wrapping ``train``, no copy on its own device): a preference
        batch is ``[batch_size, 2]`` pairs (``[batch_size]`` unpaired rows).
        """
        if sampler != "random":
            raise PreferenceDataError(f"preference rows are sampled at random, not with sampler={sampler!r}")
        if self.train.batch_size[0] == 0:
            raise PreferenceDataError(f"dataset {self.dataset_id!r} has no training rows left after tokenisation")
        td = self.train if device is None else self.train.to(device)
        buffer = TensorDictReplayBuffer(storage=TensorStorage(td), sampler=RandomSampler(),
                                        writer=ImmutableDatasetWriter(), batch_size=int(batch_size))
        if seed is not None:
            gen = torch.Generator(device=td.device if td.device is not None else "cpu")
            gen.manual_seed(int(seed))
            buffer.set_rng(gen)
        return buffer

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "model": self.model, "dataset_id": self.dataset_id}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Nothing to restore (the rows and reference are rebuilt from their cache)."""


def check_preference_data(data: Any, algorithm: str, kind: str, *, needs_reference: bool) -> None:
    """Raise a :class:`PreferenceDataError` unless ``data`` suits ``algorithm``."""
    if not all(hasattr(data, a) for a in ("kind", "train", "reference", "tokenizer")):
        raise PreferenceDataError(
            f"{algorithm}: build(config, data) expects an offline_plugins.text.data.preference.PreferenceData, "
            f"got {type(data).__name__}"
        )
    if data.kind != kind:
        fix = (
            "give (prompt, completion, label) rows (tokenize_unpaired)"
            if kind == "unpaired-feedback"
            else "give (prompt, chosen, rejected) rows (tokenize_pairs)"
        )
        raise PreferenceDataError(f"{algorithm} trains on {kind} data but the dataset holds {data.kind}; {fix}")
    want_dims = 2 if kind == "preference-pairs" else 1
    if data.train.batch_dims != want_dims or (want_dims == 2 and data.train.batch_size[-1] != 2):
        raise PreferenceDataError(
            f"{algorithm}: {kind} rows must have batch shape {'[N, 2]' if want_dims == 2 else '[N]'}, "
            f"got {tuple(data.train.batch_size)}"
        )
    if needs_reference and data.train.get(("ref_log_probs", "response"), None) is None:
        raise PreferenceDataError(
            f"{algorithm}: the training rows have no reference log-probs; compute them once with "
            f"add_reference_log_probs(data.train, data.reference, cache_dir=...)"
        )
    check_policy_matches_reference(data.reference, data.train)
