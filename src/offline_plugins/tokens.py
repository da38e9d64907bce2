"""Tokenising prompt/response text for a causal LM: shared by the data layer and the text environment.

:mod:`offline_plugins.text.data.preference` tokenises datasets of pairs with these helpers and
:mod:`offline_plugins.text.envs.text` tokenises the prompts it serves; both import them from
here, so neither imports the other. The layout is bos, prompt (or the chat template's
user turn), response, eos, right-padded.

>>> from offline_plugins.modules.tiny_lm import char_tokenizer
>>> tok = char_tokenizer()
>>> ids, n_prompt = encode_example(tok, "1+1=", "2", max_length=16)
>>> n_prompt, len(ids), ids[0] == tok.bos_token_id, ids[-1] == tok.eos_token_id
(5, 7, True, True)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

from offline_plugins.modules.tiny_lm import ensure_pad_token

__all__ = [
    "TokenizeReport",
    "prompt_token_ids",
    "response_token_ids",
    "encode_example",
    "encode_segments",
    "pad_rows",
    "pad_token_id",
]


@dataclass
class TokenizeReport:
    """What tokenisation kept, truncated and dropped (and why)."""

    total: int = 0
    kept: int = 0
    truncated_prompts: int = 0
    truncated_responses: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def summary(self) -> str:
        parts = [f"kept {self.kept} of {self.total} rows"]
        if self.dropped:
            parts.append("dropped " + ", ".join(f"{n} ({r.replace('_', ' ')})" for r, n in sorted(self.dropped.items())))
        if self.truncated_prompts or self.truncated_responses:
            parts.append(
                f"truncated {self.truncated_prompts} prompts (kept their end) and "
                f"{self.truncated_responses} responses (kept their start)"
            )
        return "; ".join(parts + self.notes)


def prompt_token_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt's ids: through the chat template when the tokenizer has one, else with bos first."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=True, add_generation_prompt=True
        )
        if isinstance(ids, Mapping) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    bos = tokenizer.bos_token_id
    if bos is not None and (not ids or ids[0] != bos):
        ids = [bos] + ids
    return ids


def response_token_ids(tokenizer: Any, response: str) -> list[int]:
    ids = list(tokenizer(response, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return ids


def encode_example(
    tokenizer: Any,
    prompt: str,
    response: str,
    *,
    max_length: int,
    max_prompt_length: Optional[int] = None,
    report: Optional[TokenizeReport] = None,
) -> Optional[tuple[list[int], int]]:
    """``(ids, n_prompt)`` of prompt + response (+eos), or ``None`` when the row must be dropped."""
    report = report if report is not None else TokenizeReport()
    if not response.strip():
        report.drop("empty_response")
        return None
    p = prompt_token_ids(tokenizer, prompt)
    if max_prompt_length is not None and len(p) > max_prompt_length:
        p = p[-max_prompt_length:]
        report.truncated_prompts += 1
    if len(p) >= max_length:
        report.drop("prompt_over_context")
        return None
    r = response_token_ids(tokenizer, response)
    room = max_length - len(p)
    if len(r) > room:
        r = r[:room]
        report.truncated_responses += 1
    return p + r, len(p)


def encode_segments(
    tokenizer: Any,
    prompt: str,
    segments: Sequence[tuple[str, bool]],
    *,
    max_length: int,
    report: Optional[TokenizeReport] = None,
) -> Optional[tuple[list[int], int, list[bool]]]:
    """``(ids, n_prompt, trained)`` of a prompt and a response made of ``(text, trained)`` segments (+eos).

    Each segment is tokenised on its own, as a multi-turn episode's rows are made (the policy's turn,
    then the tool's observation, then the next turn), and only the trained segments and the eos are
    response tokens: SFT on a tool episode then learns the calls and the answer, not the tool's output.
    Cut at ``max_length`` like :func:`encode_example`; ``None`` when the row must be dropped.

    >>> from offline_plugins.modules.tiny_lm import char_tokenizer
    >>> tok = char_tokenizer()
    >>> ids, n, trained = encode_segments(tok, "Q", [("a", True), ("<r>", False), ("b", True)], max_length=16)
    >>> tok.decode([i for i, t in zip(ids, trained) if t], skip_special_tokens=False)
    'ab<eos>'
    """
    report = report if report is not None else TokenizeReport()
    if not "".join(text for text, _ in segments).strip():
        report.drop("empty_response")
        return None
    p = prompt_token_ids(tokenizer, prompt)
    if len(p) >= max_length:
        report.drop("prompt_over_context")
        return None
    ids, trained = list(p), [False] * len(p)
    for text, train in segments:
        part = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids += part
        trained += [bool(train)] * len(part)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
        trained.append(True)
    if len(ids) > max_length:
        ids, trained = ids[:max_length], trained[:max_length]
        report.truncated_responses += 1
    return ids, len(p), trained


def pad_rows(encoded: Sequence[tuple], pad_id: int, length: int) -> dict[str, torch.Tensor]:
    """Right-pad ``(ids, n_prompt)`` rows to ``length``: tokens, attention mask, response mask.

    A row ``(ids, n_prompt, trained)`` (:func:`encode_segments`) marks its response tokens itself."""
    n = len(encoded)
    tokens = torch.full((n, length), pad_id, dtype=torch.long)
    attn = torch.zeros(n, length, dtype=torch.bool)
    resp = torch.zeros(n, length, dtype=torch.bool)
    for i, row in enumerate(encoded):
        ids, n_prompt = row[0], row[1]
        tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attn[i, : len(ids)] = True
        if len(row) > 2:
            resp[i, : len(ids)] = torch.tensor(row[2], dtype=torch.bool)
        else:
            resp[i, n_prompt : len(ids)] = True
    return {"tokens": tokens, "attn": attn, "resp": resp}


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, giving it one first when it has none (see ``ensure_pad_token``)."""
    if tokenizer.pad_token_id is None:
        ensure_pad_token(tokenizer)
    return int(tokenizer.pad_token_id)
