"""AI feedback as the labeller: a judge that prefers one of two responses, asked in both display orders.

RLAIF (Lee et al. 2023, arXiv:2309.00267) and constitutional AI (Bai et al. 2022,
arXiv:2212.08073) let a model compare two responses against written principles instead
of a human annotator. Judges, like annotators, favour the response shown first (the
seeds, 5.6.9: position bias), and the seeds' mitigation is to show every pair both ways.
:meth:`Judge.compare` asks twice, once per order: when the two verdicts disagree the
judgement depends on the display order, not on the responses, and the pair is a tie.

A judge is a :class:`FunctionJudge` (any ``f(prompt, first, second) -> P(first is
better)``) or a :class:`RubricJudge` (a causal LM from a ``save_pretrained`` folder,
scoring the answers " A" and " B" to a rubric prompt). :func:`label_pairs` relabels
preference rows with a judge (``offline-plugins data label``); ``offline-plugins data audit
--judge`` reports its agreement with the file's labels and its position consistency.

>>> first_shown = FunctionJudge(lambda prompt, first, second: 1.0)  # always prefers the first shown
>>> j = first_shown.compare("2+2=", "4", "5")  # "4" wins shown first, "5" wins shown first
>>> j.verdict, j.consistent
('tie', False)
>>> FunctionJudge(lambda prompt, first, second: float(first == "4")).compare("2+2=", "5", "4").verdict
'b'
"""

from __future__ import annotations

import abc
import difflib
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from offline_plugins.errors import UserError
from offline_plugins.modules.causal_lm import CausalLMLogProbs, sequence_log_probs
from offline_plugins.modules.tiny_lm import load_causal_lm
from offline_plugins.plugins.manager import shared_registry
from offline_plugins.text.backends.generation import model_context
from offline_plugins.text.data.preference import tokenize_pairs
from offline_plugins.text.data.preference_sources import PAIR_LENGTH_CAP
from offline_plugins.text.sources.remote import RemoteClient, checked_scores

__all__ = ["JudgeError", "Judgement", "Judge", "FunctionJudge", "RubricJudge", "label_pairs", "judge_from", "TIES",
           "DEFAULT_PRINCIPLES", "RUBRIC_TEMPLATE"]

#: what :func:`label_pairs` does with a tie: leave it out, or write it both ways (its margin is pulled to 0)
TIES = ("drop", "both")
DEFAULT_PRINCIPLES = ("Prefer the response that answers the prompt correctly, helpfully and honestly, "
                      "without harmful content. Formatting and length earn nothing.")
#: the rubric prompt; the judge's answer (" A" or " B") follows it
RUBRIC_TEMPLATE = ("Principles: {principles}\n\nPrompt: {prompt}\n\nResponse A: {first}\n\nResponse B: {second}\n\n"
                   "Which response better follows the principles? Answer A or B.\nAnswer:")


class JudgeError(UserError, ValueError):
    """A judge, or a judge's answer, that cannot be used."""


@dataclass(frozen=True)
class Judgement:
    """One pair ``(a, b)`` judged twice: ``p_ab`` = P(a better) with ``a`` shown first, ``p_ba`` =
    P(a better) with ``b`` shown first. ``verdict`` is ``"a"``, ``"b"`` or ``"tie"``; ``consistent``
    says the two orders gave the same verdict."""

    p_ab: float
    p_ba: float
    verdict: str
    consistent: bool

    @property
    def p_a(self) -> float:
        """P(a better) averaged over the two orders (RLAIF's position-debiased preference)."""
        return (self.p_ab + self.p_ba) / 2


def _side(p: float, margin: float) -> str:
    return "a" if p > 0.5 + margin else "b" if p < 0.5 - margin else "tie"


class Judge(abc.ABC):
    """Prefers one of two responses to a prompt; subclasses say how likely the first shown is the better.

    Keyword Args:
        margin (float): a probability within ``margin`` of 1/2 is no preference. Defaults to ``0.0``.
        name (str): how reports name the judge.
    """

    def __init__(self, *, margin: float = 0.0, name: str = "judge") -> None:
        if not 0.0 <= margin < 0.5:
            raise JudgeError(f"judge margin must be in [0, 0.5), got {margin!r}: a probability within it of 1/2 is "
                             "a tie")
        self.margin, self.name = float(margin), name

    @abc.abstractmethod
    def prefer_first(self, asks: Sequence[tuple[str, str, str]]) -> list[float]:
        """P(the first shown is better) for each ``(prompt, first, second)``."""

    def compare_many(self, pairs: Sequence[tuple[str, str, str]]) -> list[Judgement]:
        """Judge each ``(prompt, a, b)`` in both orders; a verdict that flips with the order is a tie."""
        n = len(pairs)
        probs = self.prefer_first([(p, a, b) for p, a, b in pairs] + [(p, b, a) for p, a, b in pairs])
        if len(probs) != 2 * n:
            raise JudgeError(f"judge {self.name} answered {len(probs)} of {2 * n} comparisons; it must answer each")
        out = []
        for i in range(n):
            p_ab, p_ba = float(probs[i]), 1.0 - float(probs[n + i])
            first, second = _side(p_ab, self.margin), _side(p_ba, self.margin)
            out.append(Judgement(p_ab, p_ba, first if first == second else "tie", first == second))
        return out

    def compare(self, prompt: str, a: str, b: str) -> Judgement:
        return self.compare_many([(prompt, a, b)])[0]

    def rank(self, prompt: str, responses: Sequence[str]) -> list[tuple[int, float]]:
        """A group ranked by round robin: every pair judged both ways, a win 1, a tie 1/2.

        Returns ``(index, wins)`` best first (ties in wins keep the given order).
        """
        pairs = [(i, j) for i in range(len(responses)) for j in range(i + 1, len(responses))]
        wins = [0.0] * len(responses)
        for (i, j), jd in zip(pairs, self.compare_many([(prompt, responses[i], responses[j]) for i, j in pairs])):
            wins[i] += 1.0 if jd.verdict == "a" else 0.5 if jd.verdict == "tie" else 0.0
            wins[j] += 1.0 if jd.verdict == "b" else 0.5 if jd.verdict == "tie" else 0.0
        return sorted(enumerate(wins), key=lambda t: -t[1])


class FunctionJudge(Judge):
    """A Python function ``f(prompt, first, second)`` returning P(first is better) in [0, 1] (or a bool)."""

    def __init__(self, function: Callable[[str, str, str], Union[float, bool]], *, margin: float = 0.0,
                 name: Optional[str] = None) -> None:
        if not callable(function):
            raise JudgeError(f"a function judge needs a callable f(prompt, first, second), got {function!r}")
        super().__init__(margin=margin, name=name or getattr(function, "__qualname__", None) or repr(function))
        self.function = function

    def prefer_first(self, asks: Sequence[tuple[str, str, str]]) -> list[float]:
        out = []
        for prompt, first, second in asks:
            p = self.function(prompt, first, second)
            if isinstance(p, bool):
                p = float(p)
            if not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:  # NaN fails the range test too
                raise JudgeError(f"judge {self.name} answered {p!r} for prompt {prompt[:40]!r}; expected "
                                 "P(first shown is better), a number in [0, 1] (or True/False)")
            out.append(float(p))
        return out


class RubricJudge(Judge):
    """A causal LM asked which of two responses better follows written principles (constitutional AI).

    The prompt is :data:`RUBRIC_TEMPLATE` filled with the principles, the prompt and the two
    responses; P(first better) is ``sigmoid(log p(" A" | prompt) - log p(" B" | prompt))``,
    each answer's log-probability summed over its tokens, so any tokenizer works. Rubric
    prompts longer than the model's context lose their start (the principles first), and
    ``truncated_prompts`` counts them.

    Args:
        model: ``"tiny"`` (the built-in untrained model, for tests), a folder written by
            ``save_pretrained`` (model and tokenizer), or a hub id.

    Keyword Args:
        principles (str): the constitution. Defaults to :data:`DEFAULT_PRINCIPLES`.
        template (str): the rubric prompt, with ``{principles}``, ``{prompt}``, ``{first}``, ``{second}``.
        answers (tuple): the two answers scored. Defaults to ``(" A", " B")``.
        device (str): where the model runs. batch_size (int): comparisons per forward.
        margin, name: as :class:`Judge` (the name defaults to ``model``).
    """

    def __init__(self, model: Union[str, Any] = "tiny", *, principles: str = DEFAULT_PRINCIPLES,
                 template: str = RUBRIC_TEMPLATE, answers: tuple[str, str] = (" A", " B"), device: str = "cpu",
                 batch_size: int = 16, margin: float = 0.0, name: Optional[str] = None) -> None:
        super().__init__(margin=margin, name=name or str(model))
        try:
            template.format(principles="", prompt="", first="", second="")
        except (KeyError, IndexError, ValueError) as exc:
            raise JudgeError(f"rubric template {template[:60]!r} does not format ({type(exc).__name__}: {exc}); it "
                             "may use only {principles}, {prompt}, {first} and {second}") from None
        if len(answers) != 2 or answers[0].strip() == answers[1].strip():
            raise JudgeError(f"answers must be two different strings (the judge's 'first' and 'second'), got "
                             f"{answers!r}")
        lm, self.tokenizer = load_causal_lm(model, seed=0)
        self.lm = CausalLMLogProbs(lm.to(device).eval())
        self.context = model_context(lm, cap=PAIR_LENGTH_CAP)
        self.principles, self.template, self.answers, self.batch_size = principles, template, answers, batch_size
        self.truncated_prompts = 0

    def to(self, device) -> "RubricJudge":
        """Move the judge's model to ``device`` (once; a no-op where it already is)."""
        if next(self.lm.parameters()).device != torch.device(device):
            self.lm.to(device)
        return self

    def prefer_first(self, asks: Sequence[tuple[str, str, str]]) -> list[float]:
        rows = [{"prompt": self.template.format(principles=self.principles, prompt=p, first=f, second=s),
                 "chosen": self.answers[0], "rejected": self.answers[1]} for p, f, s in asks]
        if not rows:
            return []
        # room for the longer answer and its end token; the prompt keeps its end (the question and "Answer:")
        room = max(len(self.tokenizer(a, add_special_tokens=False)["input_ids"]) for a in self.answers) + 2
        td, report = tokenize_pairs(rows, self.tokenizer, max_length=self.context,
                                    max_prompt_length=self.context - room, source=f"judge {self.name}")
        if td.batch_size[0] != len(rows):  # pragma: no cover - only equal answers drop a row, refused above
            raise RuntimeError(f"tokenize_pairs kept {td.batch_size[0]} of {len(rows)} rubric prompts")
        self.truncated_prompts += report.truncated_prompts // 2  # each rubric prompt is encoded once per answer
        device = next(self.lm.parameters()).device
        out = []
        with torch.no_grad():
            for s in range(0, len(rows), self.batch_size):
                chunk = td[s : s + self.batch_size].to(device)
                total, _ = sequence_log_probs(
                    self.lm.log_probs(chunk.get(("tokens", "full")), chunk.get(("masks", "all_attention_mask"))),
                    chunk.get(("masks", "all_assistant_mask")))
                out.append(torch.sigmoid((total[:, 0] - total[:, 1]).float()))
        return torch.cat(out).tolist()


def _swap(row: Mapping[str, Any]) -> dict:
    """The row with chosen and rejected exchanged, its ``shown_first`` and annotations following them."""
    other = {"chosen": "rejected", "rejected": "chosen"}
    out = dict(row, chosen=row["rejected"], rejected=row["chosen"])
    if "shown_first" in row:
        out["shown_first"] = other[row["shown_first"]]
    if row.get("annotations"):
        out["annotations"] = [dict(a, preferred=other[a["preferred"]]) for a in row["annotations"]]
    return out


def label_pairs(judge: Judge, rows: Sequence[Mapping[str, Any]], *, ties: str = "drop") -> tuple[list[dict], dict]:
    """Relabel ``(prompt, chosen, rejected)`` rows with ``judge``: ``(labelled rows, summary)``.

    Each pair is judged in both orders. A decided pair is written with the judge's pick as
    ``chosen``; a tie (position-inconsistent, or within the judge's margin) is left out
    (``ties="drop"``) or written both ways (``ties="both"``: a Bradley-Terry or DPO loss then
    pulls its margin to 0, at twice a pair's weight). Every written row carries ``judge``:
    its name, ``verdict`` (``"chosen"`` or ``"tie"``), ``consistent``, ``p_chosen`` (P(chosen
    better) averaged over the orders) and ``agrees_with_input``; ``shown_first`` and
    ``annotations`` follow the responses when the judge swaps them.

    >>> rows = [{"prompt": "2+2=", "chosen": "5", "rejected": "4"}, {"prompt": "1+1=", "chosen": "2", "rejected": "3"}]
    >>> labelled, summary = label_pairs(FunctionJudge(lambda p, first, second: float(first in "24")), rows)
    >>> [(r["chosen"], r["judge"]["agrees_with_input"]) for r in labelled], summary["agrees_with_input"]
    ([('4', False), ('2', True)], 0.5)
    """
    if ties not in TIES:
        raise JudgeError(f"ties={ties!r} is not one of {', '.join(TIES)}: 'drop' leaves ties out, 'both' writes them "
                         "both ways")
    judged = judge.compare_many([(r["prompt"], r["chosen"], r["rejected"]) for r in rows])
    out, agree, decided = [], 0, 0
    for row, jd in zip(rows, judged):
        keep = dict(row, judge={"name": judge.name, "consistent": jd.consistent})
        if jd.verdict == "tie":
            if ties == "both":
                keep["judge"].update(verdict="tie", p_chosen=jd.p_a, agrees_with_input=None)
                swapped = _swap(keep)
                swapped["judge"] = dict(keep["judge"], p_chosen=1.0 - jd.p_a)
                out += [keep, swapped]
            continue
        decided += 1
        agree += jd.verdict == "a"
        keep["judge"].update(verdict="chosen", p_chosen=jd.p_a if jd.verdict == "a" else 1.0 - jd.p_a,
                             agrees_with_input=jd.verdict == "a")
        out.append(keep if jd.verdict == "a" else dict(_swap(keep), judge=keep["judge"]))
    n = len(rows)
    summary = {"judge": judge.name, "pairs": n, "decided": decided, "ties": n - decided,
               "position_consistency": sum(j.consistent for j in judged) / n if n else None,
               "agrees_with_input": agree / decided if decided else None, "rows_written": len(out), "ties_policy": ties}
    return out, summary


class RemoteJudge(Judge):
    """A judge answered by an ``offline-plugins serve judge`` server (``POST /v1/judge``), with the
    bearer token, retries and checks of :class:`~offline_plugins.text.sources.remote.RemoteClient`."""

    def __init__(self, url: str, *, margin: float = 0.0, **client: Any) -> None:
        self.client = RemoteClient(url, **client)
        super().__init__(margin=margin, name=self.client.url)

    def prefer_first(self, asks: Sequence[tuple[str, str, str]]) -> list[float]:
        answer = self.client.post("/v1/judge", {"prompts": [a[0] for a in asks], "firsts": [a[1] for a in asks],
                                                "seconds": [a[2] for a in asks]})
        return checked_scores(answer, "p_first", len(asks), self.client.url)


def judge_from(spec: Union[str, Judge, Callable], *, registry: Any = None, **kwargs: Any) -> Judge:
    """A :class:`Judge` from a judge, a function ``f(prompt, first, second)``, the name of a registered
    judge (``offline-plugins list``: ``rubric``, and the judges plugins add), ``"MODULE:FUNCTION"``
    naming a function, or a model (``"tiny"``, a ``save_pretrained`` folder, a hub id) for a :class:`RubricJudge`.

    ``kwargs`` go to :class:`RubricJudge` (``margin`` to either); ``registry`` defaults to the process's.

    >>> judge_from("rubric").name
    'rubric'
    """
    if isinstance(spec, Judge):
        return spec
    if callable(spec):
        return FunctionJudge(spec, margin=kwargs.get("margin", 0.0))
    text = str(spec)
    if text.startswith(("http://", "https://")):  # an offline-plugins serve judge server
        return RemoteJudge(text, margin=kwargs.get("margin", 0.0))
    if not any(c in text for c in ":/\\") and not Path(text).exists():
        judges = (registry if registry is not None else shared_registry()).judges
        if text.strip().lower() in judges:
            made = judges[text.strip().lower()].load()
            if isinstance(made, type) and issubclass(made, Judge):
                return made(name=text.strip().lower(), **kwargs)
            return FunctionJudge(made, margin=kwargs.get("margin", 0.0), name=text.strip().lower())
        close = difflib.get_close_matches(text.strip().lower(), list(judges), n=3, cutoff=0.6)
        if close and text not in ("tiny", "small", "small-pad-eos"):  # tiny_lm.BUILTIN_MODELS (no torch here)
            raise JudgeError(f"unknown judge {text!r}; did you mean {', '.join(map(repr, close))}? Give a registered "
                             f"judge ({', '.join(sorted(judges))}: 'offline-plugins list'), a model folder or "
                             "MODULE:FUNCTION")
    module, sep, attr = text.partition(":")
    if sep and module.replace(".", "").replace("_", "").isalnum() and not Path(spec).exists():
        try:
            function = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise JudgeError(f"judge {spec!r}: cannot import {attr!r} from {module!r} ({type(exc).__name__}: {exc}); "
                             "give MODULE:FUNCTION importable from here, or a model folder") from None
        return FunctionJudge(function, margin=kwargs.get("margin", 0.0), name=str(spec))
    return RubricJudge(spec, **kwargs)

