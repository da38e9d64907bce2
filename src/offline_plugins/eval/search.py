"""PRM scoring and PRM-guided search at inference: best-of-N and step-level beam search.

A solution is a list of steps. A process reward model (PRM,
:class:`~offline_plugins.objectives.llm.prm.CausalLMStepReward`) gives each step the probability
that it is correct; a solution's score aggregates them by their minimum or their product
(Lightman et al. 2023, arXiv:2305.20050, rank best-of-N by the product; Wang et al. 2024,
arXiv:2312.08935, by the minimum). The search itself is written over two plain functions, so it
can be checked by hand on a tiny tree:

* ``expand(steps) -> [next step, ...]``: candidate next steps of a partial solution (a language
  model's samples: :class:`StepSampler`);
* ``score(steps) -> float``: the score of a partial solution (a PRM: :class:`PRMScorer`).

:func:`beam_search` keeps the ``beam_width`` best partial solutions, expands each, and keeps the
best ``beam_width`` of the children (the Trajectory Transformer's beam search over a learnt
model, here over reasoning steps); :func:`exhaustive_search` scores every leaf of the tree.

>>> tree = {(): ["a", "b"], ("a",): ["c", "d"], ("b",): ["e"]}
>>> value = {("a",): 0.9, ("b",): 0.8, ("a", "c"): 0.1, ("a", "d"): 0.2, ("b", "e"): 0.7}
>>> expand, score = (lambda s: tree.get(tuple(s), [])), (lambda s: value[tuple(s)])
>>> beam_search(expand, score, beam_width=1, max_steps=2), exhaustive_search(expand, score, max_steps=2)
((['a', 'd'], 0.2), (['b', 'e'], 0.7))
>>> beam_search(expand, score, beam_width=2, max_steps=2)
(['b', 'e'], 0.7)
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from offline_plugins.errors import UserError
from offline_plugins.objectives.llm.prm import CausalLMStepReward, ProcessRewardLoss
from offline_plugins.text.backends.generation import generate
from offline_plugins.text.data.steps import tokenize_steps
from offline_plugins.text.sources.reward_source import load_reward_model
from offline_plugins.text.tasks.steps import STEP_SEPARATOR
from offline_plugins.tokens import pad_token_id, prompt_token_ids

__all__ = ["AGGREGATES", "aggregate_steps", "evaluate_prm", "load_prm", "best_of_n", "beam_search", "exhaustive_search",
           "PRMScorer", "StepSampler", "sample_solution", "METHODS", "search_sweep", "compare_search"]

AGGREGATES = ("min", "prod")


def aggregate_steps(probs: torch.Tensor, mask: torch.Tensor, how: str = "min") -> torch.Tensor:
    """A solution's score from its ``[..., S]`` step probabilities over the real steps ``mask``: their
    minimum or their product.

    >>> p, m = torch.tensor([[0.9, 0.5, 0.1]]), torch.tensor([[True, True, False]])
    >>> aggregate_steps(p, m, "min").tolist(), [round(x, 4) for x in aggregate_steps(p, m, "prod").tolist()]
    ([0.5], [0.45])
    """
    if how == "min":
        return torch.where(mask, probs, torch.ones_like(probs)).amin(-1)
    if how == "prod":
        return torch.where(mask, probs, torch.ones_like(probs)).prod(-1)
    raise UserError(f"the PRM aggregate must be one of {', '.join(AGGREGATES)}, got {how!r}; fix it with "
                    "aggregate='min'")


@torch.no_grad()
def evaluate_prm(prm: Any, rows: Any, *, batch_size: int = 256) -> dict:
    """Held-out ``step_accuracy`` and ``first_error_accuracy`` of a PRM on tokenised step rows
    (:func:`~offline_plugins.text.data.steps.tokenize_steps`), in eval mode, and ``heldout_rows``."""
    n = int(rows.batch_size[0])
    if n == 0:
        return {"step_accuracy": None, "first_error_accuracy": None, "heldout_rows": 0}
    loss, was_training = ProcessRewardLoss(prm), prm.training
    device = next(prm.parameters()).device
    prm.eval()
    hits, steps, firsts = 0.0, 0.0, 0.0
    try:
        for start in range(0, n, batch_size):
            chunk = rows[start:start + batch_size].to(device)
            out = loss(chunk)
            real = chunk.get(("steps", "mask")).sum()
            hits, steps = hits + out["step_accuracy"] * real, steps + real
            firsts = firsts + out["first_error_accuracy"] * chunk.batch_size[0]
    finally:
        prm.train(was_training)
    return {"step_accuracy": float(hits / steps), "first_error_accuracy": float(firsts / n), "heldout_rows": n}


def load_prm(path: Any) -> tuple[Any, Any]:
    """``(CausalLMStepReward, tokenizer)`` from a ``prm`` run's ``OUT`` or ``OUT/reward_model`` folder
    (eval mode, frozen): the exported backbone and score head, read at each step's end."""
    reward, tokenizer = load_reward_model(path)
    prm = CausalLMStepReward(reward.model)
    prm.head = reward.head
    return prm.eval(), tokenizer


def best_of_n(solutions: Sequence[Sequence[str]], score: Callable[[Sequence[str]], float]) -> tuple[int, float]:
    """``(index, score)`` of the best-scored solution (the first on ties): best-of-N reranking by a
    PRM (:class:`PRMScorer`) or by an outcome verifier (``lambda s: task.reward(prompt, "\\n".join(s))``).

    >>> best_of_n([["1+1=3"], ["1+1=2"], ["1+1=2"]], lambda s: float(s[-1].endswith("=2")))
    (1, 1.0)
    """
    if not solutions:
        raise UserError("best_of_n needs at least one solution to rank; sample N >= 1 solutions")
    scores = [float(score(s)) for s in solutions]
    best = max(range(len(scores)), key=lambda i: (scores[i], -i))
    return best, scores[best]


def beam_search(expand: Callable[[list], Sequence[str]], score: Callable[[list], float], *, beam_width: int,
                max_steps: int) -> tuple[list, float]:
    """Step-level beam search: ``(steps, score)`` of the best solution found.

    Each round, every partial solution in the beam that ``expand`` still continues is replaced by
    its children (one per candidate step, each scored by ``score``); a partial solution with no
    candidates is finished and stays in the pool. The ``beam_width`` best of the pool are kept.
    After ``max_steps`` rounds (or when nothing expands) the best of the beam is returned.
    """
    if beam_width < 1 or max_steps < 1:
        raise UserError(f"beam_search needs beam_width >= 1 and max_steps >= 1, got {beam_width} and {max_steps}")
    beam: list[tuple[list, Optional[float]]] = [([], None)]
    for _ in range(max_steps):
        pool, grew = [], False
        for steps, value in beam:
            children = list(expand(steps))
            grew |= bool(children)
            pool += [(steps + [c], float(score(steps + [c]))) for c in children] if children else [(steps, value)]
        if not grew:
            break
        beam = sorted(pool, key=lambda sv: -float("inf") if sv[1] is None else sv[1], reverse=True)[:beam_width]
    return max(beam, key=lambda sv: -float("inf") if sv[1] is None else sv[1])


def exhaustive_search(expand: Callable[[list], Sequence[str]], score: Callable[[list], float], *,
                      max_steps: int) -> tuple[list, float]:
    """``(steps, score)`` of the best-scored leaf of the whole tree (no candidates or ``max_steps`` deep):
    the answer beam search approximates, and equals when its beam holds every node of each level."""
    best: tuple[list, float] = ([], -float("inf"))
    frontier = [[c] for c in expand([])]
    while frontier:
        steps = frontier.pop()
        children = list(expand(steps)) if len(steps) < max_steps else []
        if children:
            frontier += [steps + [c] for c in children]
        elif score(steps) > best[1]:
            best = (steps, float(score(steps)))
    return best


class PRMScorer:
    """Scores partial solutions of one prompt with a trained PRM: ``scorer(steps) -> float``.

    Args:
        prm: a :class:`~offline_plugins.objectives.llm.prm.CausalLMStepReward` (e.g. from
            :func:`~offline_plugins.text.sources.reward_source.load_reward_model`'s folder, rebuilt around it).
        tokenizer: the PRM's tokenizer.
        prompt: the problem the steps solve.

    Keyword Args:
        aggregate: ``"min"`` or ``"prod"`` over the steps' probabilities. Defaults to ``"min"``.
        max_length: token budget of prompt and steps. Defaults to 128.
    """

    def __init__(self, prm: Any, tokenizer: Any, prompt: str, *, aggregate: str = "min", max_length: int = 128) -> None:
        aggregate_steps(torch.ones(1), torch.ones(1, dtype=torch.bool), aggregate)  # refuse a bad name now
        self.prm, self.tokenizer, self.prompt = prm, tokenizer, prompt
        self.aggregate, self.max_length = aggregate, int(max_length)

    @torch.no_grad()
    def step_probs(self, solutions: Sequence[Sequence[str]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``([N, S] step probabilities, [N, S] real-step mask)`` of ``solutions``, in one forward."""
        rows = [{"prompt": self.prompt, "steps": list(s), "labels": [1] * len(s)} for s in solutions]
        td, report = tokenize_steps(rows, self.tokenizer, max_length=self.max_length)
        if report.kept != len(rows):
            raise UserError(f"PRMScorer: the prompt {self.prompt[:40]!r} leaves no room for a step in max_length="
                            f"{self.max_length} tokens; raise max_length")
        td = td.to(next(self.prm.parameters()).device)
        was_training = self.prm.training
        self.prm.eval()
        try:
            logits = self.prm.step_scores(td.get(("tokens", "full")), td.get(("masks", "all_attention_mask")),
                                          td.get(("steps", "position")))
        finally:
            self.prm.train(was_training)
        return torch.sigmoid(logits), td.get(("steps", "mask"))

    def scores(self, solutions: Sequence[Sequence[str]]) -> list[float]:
        probs, mask = self.step_probs(solutions)
        return aggregate_steps(probs, mask, self.aggregate).tolist()

    def __call__(self, steps: Sequence[str]) -> float:
        return self.scores([steps])[0]


class StepSampler:
    """Samples candidate next steps of a partial solution from a causal LM: ``sampler(steps) -> [step, ...]``.

    A step ends at the step separator's token (``"\\n"``) or at eos (the solution's last step); the
    sampler counts the tokens it generates up to there in ``generated_tokens`` (the compute a
    search spends). A partial solution of ``max_steps`` steps, or whose last step ended without a
    separator (eos or the token budget), gets no candidates: it is finished.

    Args:
        model, tokenizer: the causal LM that writes solutions and its tokenizer.
        prompt: the problem.

    Keyword Args:
        num_samples: candidates per expansion. Defaults to 4.
        max_steps: the longest solution. Defaults to 4.
        max_step_tokens: the token budget of one step. Defaults to 16.
        temperature: sampling temperature. Defaults to 1.0.
        greedy: argmax decoding (one candidate: set ``num_samples=1``). Defaults to False.
        seed: the sampling seed (each expansion adds its count). Defaults to 0.
    """

    def __init__(self, model: Any, tokenizer: Any, prompt: str, *, num_samples: int = 4, max_steps: int = 4,
                 max_step_tokens: int = 16, temperature: float = 1.0, greedy: bool = False, seed: int = 0) -> None:
        sep = list(tokenizer(STEP_SEPARATOR, add_special_tokens=False)["input_ids"])
        if len(sep) != 1:
            raise UserError(f"StepSampler: the tokenizer writes the step separator {STEP_SEPARATOR!r} as {len(sep)} "
                            "tokens; steps can be cut only at a single-token separator: use a tokenizer that has one")
        self.model, self.tokenizer, self.prompt, self.sep_id = model, tokenizer, prompt, sep[0]
        self.num_samples, self.max_steps, self.max_step_tokens = int(num_samples), int(max_steps), int(max_step_tokens)
        self.temperature, self.greedy, self.seed = float(temperature), bool(greedy), int(seed)
        self.generated_tokens, self._calls, self._open = 0, 0, {(): True}

    def _ids(self, steps: Sequence[str]) -> list[int]:
        ids = prompt_token_ids(self.tokenizer, self.prompt)
        for step in steps:
            ids += list(self.tokenizer(step + STEP_SEPARATOR, add_special_tokens=False)["input_ids"])
        return ids

    def sample(self, steps: Sequence[str], n: int) -> list[tuple[str, bool]]:
        """``n`` sampled next steps with whether each ended at the separator."""
        out = generate(self.model, [self._ids(steps)], pad_id=pad_token_id(self.tokenizer), eos_id=self.sep_id,
                       max_new_tokens=self.max_step_tokens, num_samples=n, temperature=self.temperature,
                       greedy=self.greedy, seed=self.seed + self._calls)
        self._calls += 1
        # a step runs to the separator; the solution's last step ends at eos, which ``generate`` (one stop
        # token) runs past: the step is cut there, and only the tokens up to the cut are counted
        stop = ((out.tokens == self.sep_id) | (out.tokens == self.tokenizer.eos_token_id)) & out.response_mask
        length = torch.where(stop.any(-1), stop.int().argmax(-1) + 1, out.response_mask.sum(-1))
        self.generated_tokens += int(length.sum())
        rows = out.tokens.tolist()
        return [(self.tokenizer.decode(rows[i][: length[i]], skip_special_tokens=True),
                 bool(stop[i].any()) and rows[i][length[i] - 1] == self.sep_id) for i in range(len(rows))]

    def __call__(self, steps: Sequence[str]) -> list[str]:
        if len(steps) >= self.max_steps or not self._open.get(tuple(steps), True):
            return []
        candidates = []
        for text, ended in self.sample(steps, self.num_samples):
            if text.strip() and text not in candidates:
                self._open[tuple(steps) + (text,)] = ended
                candidates.append(text)
        return candidates


def sample_solution(sampler: StepSampler) -> list[str]:
    """One whole solution, a step at a time, each the first candidate the sampler gives."""
    steps: list[str] = []
    while candidates := sampler(steps):
        steps.append(candidates[0])
    return steps


#: the methods :func:`search_sweep` compares
METHODS = ("greedy", "best_of_n_orm", "best_of_n_prm", "beam_prm", "beam_gold_steps")


def search_sweep(task: Any, policy: Any, tokenizer: Any, prm: Any, prompts: Sequence[str], *,
                 ns: Sequence[int] = (4,), beam_widths: Sequence[int] = (2,), max_steps: int = 4,
                 aggregate: str = "min", seed: int = 0) -> list[dict]:
    """Exact match (by the task's outcome verifier) and generated tokens per prompt of each method at each
    compute setting, one row ``{"method", "n", "beam_width", "exact_match", "tokens_per_prompt"}`` each:

    * ``greedy`` (``n`` 1), once;
    * ``best_of_n_orm`` (the outcome verifier ranks the samples: an oracle, since it knows the answer) and
      ``best_of_n_prm``, for each ``n`` in ``ns``: the first ``n`` of ``max(ns)`` samples at temperature 1,
      each ranked by its judge, the tokens of those ``n`` counted;
    * ``beam_prm`` and ``beam_gold_steps`` (the same beam, steps scored by the task's own step checker: what
      a perfect PRM would give), for each ``n`` (candidates per expansion) and each width in ``beam_widths``.
    """
    bad = [f"{name}={v}" for name, vs in (("n", ns), ("beam_width", beam_widths)) for v in vs if int(v) < 1]
    if bad or not ns or not beam_widths or not prompts:
        raise UserError(f"search needs at least one prompt and n, beam widths >= 1, got {len(prompts)} prompts, "
                        f"n {list(ns)}, beam widths {list(beam_widths)}; fix {', '.join(bad) or 'the empty list'}")
    aggregate_steps(torch.ones(1), torch.ones(1, dtype=torch.bool), aggregate)  # refuse a bad name now

    def sampler(prompt, k, **kw):
        return StepSampler(policy, tokenizer, prompt, num_samples=k, max_steps=max_steps, seed=seed, **kw)

    totals: dict = {}

    def add(key, steps, tokens, prompt):
        hits, spent = totals.get(key, (0.0, 0))
        totals[key] = (hits + (task.reward(prompt, STEP_SEPARATOR.join(steps)) if steps else 0.0), spent + tokens)

    for prompt in prompts:
        s = sampler(prompt, 1, greedy=True)
        add(("greedy", 1, None), sample_solution(s), s.generated_tokens, prompt)
        s, samples, spent = sampler(prompt, 1), [], []
        for _ in range(max(ns)):
            samples.append(sample_solution(s))
            spent.append(s.generated_tokens)
        prm_scorer = PRMScorer(prm, tokenizer, prompt, aggregate=aggregate)
        whole = [i for i, steps in enumerate(samples) if steps]  # an empty sample scores lowest
        by_prm = dict(zip(whole, prm_scorer.scores([samples[i] for i in whole]) if whole else []))
        judges = {"orm": [task.reward(prompt, STEP_SEPARATOR.join(st)) for st in samples],
                  "prm": [by_prm.get(i, -1.0) for i in range(len(samples))]}
        for k in ns:
            for name, scores in judges.items():
                best = best_of_n(range(k), lambda i: scores[i])[0]
                add((f"best_of_n_{name}", k, None), samples[best], spent[k - 1], prompt)
            for w in beam_widths:
                for name, score in (("prm", prm_scorer), ("gold_steps",
                                                          lambda st: float(min(task.step_labels(prompt, st)) > 0))):
                    s = sampler(prompt, k)
                    add((f"beam_{name}", k, w), beam_search(s, score, beam_width=w, max_steps=max_steps)[0],
                        s.generated_tokens, prompt)
    return [{"method": m, "n": k, "beam_width": w, "exact_match": hits / len(prompts),
             "tokens_per_prompt": tokens / len(prompts)}
            for (m, k, w), (hits, tokens) in sorted(totals.items(),
                                                    key=lambda kv: (METHODS.index(kv[0][0]), kv[0][1:]))]


def compare_search(task: Any, policy: Any, tokenizer: Any, prm: Any, prompts: Sequence[str], *, n: int = 4,
                   beam_width: int = 2, max_steps: int = 4, aggregate: str = "min", seed: int = 0) -> dict:
    """``{method: {"exact_match", "tokens_per_prompt"}}`` of :func:`search_sweep` at one ``n`` and one beam width."""
    rows = search_sweep(task, policy, tokenizer, prm, prompts, ns=(n,), beam_widths=(beam_width,),
                        max_steps=max_steps, aggregate=aggregate, seed=seed)
    return {r["method"]: {"exact_match": r["exact_match"], "tokens_per_prompt": r["tokens_per_prompt"]} for r in rows}
