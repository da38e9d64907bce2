"""The tables of docs/results.md, each made from the current code by one command.

    python scripts/tables.py list
    python scripts/tables.py run TABLE [--seeds 0 1 2] [--root runs/tables]   # trains what the table needs
    python scripts/tables.py write TABLE [--root runs/tables] [--doc docs/results.md]
    python scripts/tables.py run TABLE --smoke --root DIR && python scripts/tables.py write TABLE --smoke ...
    python scripts/tables.py same-results TABLE A [B]   # the smoke at commits A and B (HEAD) alike?
    python scripts/tables.py status TABLE [--root runs/tables]   # what is done, being made, left

A table is a list of runs (``offline-plugins train`` command lines) and a function that turns
what they left into markdown. ``run`` trains them one at a time (``--threads 1``) into
``ROOT/TABLE/<run>/s<seed>`` and keeps a finished run (its ``summary.json``) unless
``--overwrite``; then it scores every trained policy (``OUT/model``), and the reference they
started from, on the same held-out prompts with the task's verifier, one score a prompt
(``OUT/heldout_scores.json``), so every row is measured by the same code on the same prompts and
two rows can be compared prompt by prompt. It records in ``ROOT/TABLE/provenance.json`` the
commit (and whether the tree had uncommitted changes), the machine, the command and the budget. ``write`` replaces the
table's block in ``--doc`` (between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``) with
the table under a line saying all of that; it refuses runs made at another commit than the
current one unless that commit's package code and pins are the current ones (``git diff`` of
``src/``, ``pyproject.toml`` and ``constraints.txt`` empty: the stamp says so) or ``--stale`` is
given (say why in the doc), or a recorded ``same-results`` check found that commit's results equal to
those of a commit with the current code (below). ``--smoke`` runs every run at a tiny
budget in this process and writes the table to ``ROOT`` only: it checks that the table's
pipeline runs, not its figures (``tests/test_tables.py`` runs it).

A finished run's record (its ``summary.json``, ``heldout_scores.json``, ``made_at.json`` and
``metrics.csv``), the references' scores and the table's ``provenance.json`` are also copied into
``--records`` (``results/tables/`` in the repository, committed): a table's runs take hours of CPU,
so what is finished survives a new machine. ``run`` and ``write`` first restore into ``ROOT`` every
record ``ROOT`` lacks, so a recorded run is kept, not trained again, and ``write`` renders from the
records alone on a fresh clone. The SFT references the runs start from are kept there too
(``references/``, a few MB each) and restored into the cache, so every run of a table starts from
the reference its first row scores on whatever machine it is made (made again on another CPU, a
reference's weights differ by rounding). The policies and checkpoints stay in ``ROOT`` only.

A change that moves no figure (a refactor, a faster tokenisation) need not make a table again:
``same-results TABLE A B`` runs this script's smoke of the table in a checkout of each commit (its own
package code and cache; the same venv, so the pins must agree) and compares every file the runs made that
holds a result (weights byte for byte; summaries, metrics and held-out scores without timings, rates and
memory). When all agree it records the pair in ``--records``/``same-results.json``, and ``write`` then
takes runs made at A as the current code's, saying by which check. It is evidence, not proof: the smoke
budget is 2 steps and 16-token responses, so a change that acts only later in a run (a schedule, a
long-sequence path) passes it; run the table again after such a change.

Several ``run`` processes of the same table (and of tables sharing a base) may run side by side, one
a core: each run is made under a lock (``ROOT/TABLE/<run>/s<seed>.lock``), and a process finding a
run locked goes on to the next.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Run:
    """One row's training: ``argv(seed, budget, root)`` after ``offline-plugins train``; ``seeded``:
    False for a run made once (a reward model the others read)."""

    name: str
    argv: Callable[[int, dict, Path], list[str]]
    seeded: bool = True
    #: the task its policy is scored on (None: it trains no policy, as a reward model)
    dataset: Optional[str] = "word-problems"
    #: what the row is, when not the algorithm's name alone
    label: Optional[str] = None


@dataclasses.dataclass
class Table:
    name: str
    title: str
    runs: list[Run]
    budget: dict
    smoke: dict
    render: Callable[["Table", Path, list[int], dict], str]
    #: the table whose reference scores and same-named runs this one reads (trained there when missing)
    base: Optional[str] = None
    #: ``prepare(budget)``: made before the runs (e.g. the datasets, at the budget's size)
    prepare: Optional[Callable[[dict], None]] = None
    #: ``keep(run, budget)``: whether the budget trains this run (a smoke budget trains a few)
    keep: Optional[Callable[[Run, dict], bool]] = None
    #: ``figures(root, seeds, budget)``: PNG files the table draws, copied beside the doc's ``img/`` by ``write``
    figures: Optional[Callable[[Path, list, dict], list]] = None

    def folder(self, root: Path, name: str) -> Path:
        """Where run (or reference folder) ``name`` lives, ``root`` being this table's folder: under the
        base table's folder when the base has it."""
        if self.base and (name.startswith("reference") or name in {r.name for r in TABLES[self.base].runs}):
            return root.parent / self.base / name
        return root / name


# -- statistics -------------------------------------------------------------------------------------
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000}


def t975(df: float) -> float:
    """Student's t 97.5 % quantile at ``df`` degrees of freedom, read at the largest tabled ``df`` not
    above it (a wider interval where ``df`` falls between two), 1.96 past the table."""
    if df > max(_T975):
        return 1.96
    return _T975[max(k for k in _T975 if k <= max(df, 1))]


def mean_ci(values: list[float]) -> tuple[float, Optional[float]]:
    """The mean and the half-width of its 95 % interval over seeds (Student's t; None for one value)."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, None
    return m, t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def welch_ci(a: list[float], b: list[float]) -> tuple[float, Optional[float]]:
    """``mean(a) - mean(b)`` and the half-width of its 95 % interval by Welch's t (two independent
    sets of seeds, each with its own spread); None with fewer than two values on a side.

    >>> d, w = welch_ci([0.52, 0.54, 0.53], [0.50, 0.51, 0.49])
    >>> round(d, 3), round(w, 3)
    (0.03, 0.023)
    """
    d = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return d, None
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return d, 0.0
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return d, t975(df) * math.sqrt(va + vb)


def run_wall(summary: Optional[dict]) -> float:
    """A run's wall time in seconds: its summary's ``wall_s``, or, for a run stopped and resumed (whose
    summary times only the last stretch), that stretch's pace over all the run's steps.

    >>> run_wall({"wall_s": 400.0, "steps": 200, "steps_per_s": 0.25, "resumed_from": "ckpt"})
    800.0
    >>> run_wall({"wall_s": 700.0, "steps": 200, "steps_per_s": 0.29})
    700.0
    """
    summary = summary or {}
    if summary.get("resumed_from") and summary.get("steps_per_s") and summary.get("steps"):
        return float(summary["steps"]) / float(summary["steps_per_s"])
    return float(summary.get("wall_s") or 0.0)


def binomial_half_width(p: float, n: int) -> float:
    """The 95 % half-width of a share ``p`` measured on ``n`` prompts (normal approximation)."""
    return 1.96 * math.sqrt(max(p * (1 - p), 0.0) / n) if n else float("nan")


# -- scoring: every policy on the same held-out prompts --------------------------------------------------
def heldout_scores(dataset: str, model: str, n: int, max_new_tokens: Optional[int] = None) -> list[float]:
    """The task's verifier on ``model``'s greedy answers (episodes, for a multi-turn task) to the first
    ``n`` test-split prompts, one score a prompt; ``max_new_tokens``: the task's own unless given."""
    from offline_plugins.text.data.rollouts import _task_of, load_rollout_data
    from offline_plugins.tokens import prompt_token_ids

    data = load_rollout_data(dataset, model=model, eval_prompts=n)
    rows = data.source.held_out[:n]
    # answered in batches of prompts of like length: less padding and, as a long story has a long solution,
    # batches whose answers end together (a third less time on the word problems' reference); a prompt's
    # greedy answer does not depend on its batch (the scores of both references and a trained policy on
    # 2,000 prompts were the same in the prompts' own order)
    order = sorted(range(len(rows)), key=lambda i: len(prompt_token_ids(data.tokenizer, rows[i]["prompt"])))
    answered, _ = data.greedy_answers(data.reference, data.tokenizer, [rows[i] for i in order], None,
                                      max_new_tokens=max_new_tokens or data.settings.max_new_tokens, batch_size=100,
                                      multiturn=data.source.multiturn, width=data.width)
    responses = [""] * len(rows)
    for i, response in zip(order, answered):
        responses[i] = response
    task = _task_of(dataset, "")[1]
    return [float(x) for x in task.rewards([r["prompt"] for r in rows], responses)]


def reference_folder(dataset: str, budget: dict) -> Path:
    """The cached SFT reference the task's runs on ``small`` start from (made if missing)."""
    from offline_plugins.config import cache_root
    from offline_plugins.kinds.sft import supervised_finetune
    from offline_plugins.text.data.rollouts import _task_of
    from offline_plugins.text.data.task_data import reference_dir, sft_reference

    task = _task_of(dataset, "")[1]
    settings = dict(model="small", seed=0, steps=int(budget["reference_sft_steps"]), cache_dir=cache_root() / "preference")
    sft_reference(task, finetune=supervised_finetune, **settings)
    return reference_dir(task, **settings)


def _scored(path: Path, dataset: str, model: str, n: int, max_new_tokens: Optional[int] = None) -> list[float]:
    if path.is_file():
        found = json.loads(path.read_text())
        if found.get("n") == n and found.get("model") == model:
            return found["scores"]
    scores = heldout_scores(dataset, model, n, max_new_tokens)
    path.write_text(json.dumps({"dataset": dataset, "model": model, "n": n, "scores": scores}) + "\n")
    return scores


def paired_difference(a: list[float], b: list[float]) -> tuple[float, float]:
    """The mean of ``a - b`` over the same prompts and the half-width of its 95 % interval."""
    d = [x - y for x, y in zip(a, b)]
    return statistics.fmean(d), 1.96 * statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")


# -- the word-problem comparison (issue 40) ------------------------------------------------------------
def _online(algo: str, dataset: str = "word-problems", *, name: Optional[str] = None, extra: tuple = (),
            label: Optional[str] = None) -> Run:
    def argv(seed: int, b: dict, root: Path) -> list[str]:
        return [algo, "--dataset", dataset, "--model", "small", "--steps", str(b["online_steps"]),
                "--eval-every", str(max(b["online_steps"] // 4, 1)), "--seed", str(seed),
                "--set", f"eval_prompts={b['run_eval_prompts']}",
                "--set", f"reference_sft_steps={b['reference_sft_steps']}", *extra, *b.get("online_set", [])]
    default = algo if dataset == "word-problems" else f"{algo}-{dataset.split('-')[-1]}"
    return Run(name or default, argv, dataset=dataset, label=label)


def _offline(algo: str) -> Run:
    def argv(seed: int, b: dict, root: Path) -> list[str]:
        return [algo, "--dataset", "offline-plugins/word-problems/preference-v0", "--model", "small",
                "--steps", str(b["offline_steps"]), "--eval-every", str(b["offline_steps"]), "--seed", str(seed),
                "--set", f"reference_sft_steps={b['reference_sft_steps']}", "--set", f"eval_prompts={b['run_eval_prompts']}"]
    return Run(algo, argv)


def _reward_model(seed: int, b: dict, root: Path) -> list[str]:
    return ["reward-model", "--dataset", "offline-plugins/word-problems/preference-v0", "--model", "small",
            "--steps", str(b["offline_steps"]), "--eval-every", str(b["offline_steps"]), "--seed", "0",
            "--set", f"reference_sft_steps={b['reference_sft_steps']}"]


def _ppo_rlhf(seed: int, b: dict, root: Path) -> list[str]:
    return ["ppo-rlhf", "--dataset", "word-problems", "--model", "small", "--reward",
            str(root / "reward-model" / "s0"), "--steps", str(b["online_steps"]), "--eval-every",
            str(max(b["online_steps"] // 4, 1)), "--seed", str(seed), "--set", f"eval_prompts={b['run_eval_prompts']}",
            "--set", f"reference_sft_steps={b['reference_sft_steps']}", *b.get("online_set", [])]


#: ``--smoke``: every run at a tiny budget, responses of 16 tokens (an untrained policy writes to the limit)
_SMOKE = {"online_steps": 2, "offline_steps": 2, "eval_prompts": 4, "run_eval_prompts": 4, "reference_sft_steps": 2,
          "max_new_tokens": 16, "online_set": ["--set", "group_size=2", "--set", "prompts_per_round=4", "--set",
                                                "batch_size=4", "--set", "max_new_tokens=16"]}

ONLINE = ("grpo", "dapo", "dr-grpo", "rloo", "gspo", "reinforce-pp", "expert-iteration", "online-dpo")


def _render_word_problems(table: Table, root: Path, seeds: list[int], budget: dict) -> str:
    n = budget["eval_prompts"]
    ref_path = table.folder(root, "reference") / "heldout_scores.json"
    reference = json.loads(ref_path.read_text())["scores"] if ref_path.is_file() else None
    head = [f"| method | held-out accuracy ({n} prompts), mean ± 95 % interval over seeds | gain over the "
            "reference, mean ± 95 % interval over seeds (the pooled seeds' prompt-by-prompt interval) | per seed | "
            "wall time per run |",
            "|---|---|---|---|---|"]
    if reference is not None:
        r = statistics.fmean(reference)
        head.append(f"| SFT reference | {100 * r:.1f} (± {100 * binomial_half_width(r, n):.1f} from {n} prompts) "
                    "| | | |")
    rows, calc_ref, scored_by_run = [], None, {}
    for run in table.runs:
        if run.dataset is None:
            continue
        scored = [(seed, json.loads(p.read_text())["scores"], _summary(table.folder(root, run.name), seed))
                  for seed in (seeds if run.seeded else [0])
                  for p in [table.folder(root, run.name) / f"s{seed}" / "heldout_scores.json"] if p.is_file()]
        if not scored:
            rows.append(f"| {run.name} | not run | | | |")
            continue
        means = [statistics.fmean(sc) for _, sc, _ in scored]
        m, ci = mean_ci(means)
        label = run.label or run.name + (" (calculator)" if run.dataset != "word-problems" else "")
        if run.dataset == "word-problems":
            scored_by_run[run.name] = (label, {seed: sc for seed, sc, _ in scored})
        base = reference if run.dataset == "word-problems" else None
        if run.dataset != "word-problems":
            calc_path = table.folder(root, f"reference-{run.dataset}") / "heldout_scores.json"
            base = json.loads(calc_path.read_text())["scores"] if calc_path.is_file() else None
            calc_ref = base
        gain = ""
        if base is not None:
            g, g_ci = mean_ci([x - statistics.fmean(base) for x in means])
            _, w = paired_difference([x for _, sc, _ in scored for x in sc], base * len(scored))
            gain = (f"{100 * g:+.1f}" + (f" ± {100 * g_ci:.1f}" if g_ci is not None else "")
                    + f" (prompts ± {100 * w:.1f}){' *' if g_ci is not None and abs(g) > g_ci else ''}")
        wall = statistics.fmean(run_wall(s) for _, _, s in scored)
        rows.append(f"| {label} | {100 * m:.1f}"
                    + (f" ± {100 * ci:.1f}" if ci is not None else "") + f" | {gain} | "
                    + ", ".join(f"{100 * x:.1f}" for x in means) + f" | {wall:.0f} s |")
    notes = ["Every row is its policy's greedy answers to the same held-out prompts scored by the task's verifier "
             "(`heldout_scores` in scripts/tables.py). * marks a gain whose 95 % interval over seeds excludes 0 "
             "(Student's t on the per-seed gains; none is marked with one seed): the prompt-by-prompt interval "
             "in brackets counts only the held-out set's noise, not the seed-to-seed spread of training. Wall "
             "time is a run's training and evaluation on one core beside another run (a run stopped and resumed: "
             "its last stretch's pace over all its steps)."]
    if calc_ref is not None:
        notes.append(f"The calculator row's gain is over its own SFT reference ({100 * statistics.fmean(calc_ref):.1f} %).")
    rm = _summary(table.folder(root, "reward-model"), 0) if any(r.name == "reward-model" for r in table.runs) else None
    if rm and rm.get("preference_accuracy") is not None:
        notes.append(f"PPO-RLHF's reward model: held-out preference accuracy {100 * rm['preference_accuracy']:.1f} %.")
    return "\n".join(head + rows) + "\n\n" + " ".join(notes) + _against_baseline(scored_by_run, "grpo")


def _against_baseline(scored_by_run: dict, baseline: str) -> str:
    """The table's second block: each method's held-out accuracy minus ``baseline``'s, with Welch's
    interval over the two methods' seeds and the prompt-by-prompt interval of the same seeds' scores
    pooled (the held-out set's noise alone); * where the interval over seeds excludes 0."""
    if baseline not in scored_by_run:
        return ""
    base_label, base = scored_by_run[baseline]
    rows = [f"| method | minus {base_label}: mean ± 95 % interval over seeds (Welch) | the same seeds' prompts, "
            f"paired | seeds (method, {base_label}) |", "|---|---|---|---|"]
    tested = False
    for name, (label, seeds) in scored_by_run.items():
        if name == baseline:
            continue
        d, w = welch_ci([statistics.fmean(sc) for sc in seeds.values()], [statistics.fmean(sc) for sc in base.values()])
        shared = sorted(set(seeds) & set(base))
        paired = (paired_difference([x for s in shared for x in seeds[s]], [x for s in shared for x in base[s]])
                  if shared else None)
        tested = tested or w is not None
        rows.append(f"| {label} | {100 * d:+.1f}" + (f" ± {100 * w:.1f}" if w is not None else "")
                    + (" *" if w is not None and abs(d) > w else "") + " | "
                    + (f"{100 * paired[0]:+.1f} ± {100 * paired[1]:.1f}" if paired else "") + f" | {len(seeds)}, "
                    f"{len(base)} |")
    significant = [r.split(" | ")[0][2:] for r in rows[2:] if " *" in r]
    verdict = ("Significant at 95 % over seeds: " + ", ".join(significant) + "." if significant else
               f"No method differs from {base_label} past the 95 % interval over seeds." if tested else
               "Nothing is tested yet: the interval over seeds needs two seeds of each method.")
    return (f"\n\nEach method against {base_label} on the same held-out prompts. The interval over seeds "
            "(Welch's t on the per-seed accuracies) is the test: it holds both the training's seed-to-seed "
            "spread and the held-out set's noise; the paired prompt-by-prompt interval holds only the latter. "
            + verdict + "\n\n" + "\n".join(rows))


# -- OGBench's single-task manipulation (issue 41) -----------------------------------------------------
OGBENCH_ENVS = ("cube-single", "puzzle-3x3")
OGBENCH_METHODS = ("bc", "iql", "rebrac", "fql")
#: the published single-task success rates (%, the mean over an environment's 5 tasks) at 1M steps, 8 seeds:
#: flow Q-learning's paper (Park, Li & Levine 2025, arXiv:2502.02538), its OGBench table; "-": not reported
OGBENCH_PUBLISHED = {"cube-single": {"bc": "5", "iql": "83", "rebrac": "91", "fql": "96"},
                     "scene": {"bc": "5", "iql": "28", "rebrac": "41", "fql": "56"},
                     "puzzle-3x3": {"bc": "-", "iql": "9", "rebrac": "21", "fql": "30"}}


def _ogbench_preset(env: str, method: str) -> tuple[str, bool]:
    """The preset a method trains with on ``env``: the environment's own, or cube-single's where the
    environment's has no entry for it (IQL's and ReBRAC's puzzle-3x3 weights; said under the table)."""
    from offline_plugins.errors import UserError
    from offline_plugins.presets import preset

    try:
        preset(f"ogbench-{env}", method)
        return f"ogbench-{env}", True
    except UserError:
        return "ogbench-cube-single", False


def _ogbench(env: str, method: str, task: int) -> Run:
    def argv(seed: int, b: dict, root: Path) -> list[str]:
        return [method, "--dataset", f"ogbench/{env}-play-singletask-task{task}-v0", "--steps", str(b["offline_steps"]),
                "--eval-every", str(b["eval_every"]), "--eval-episodes", str(b["eval_episodes"]), "--seed", str(seed),
                "--set", f"preset={_ogbench_preset(env, method)[0]}", *b.get("offline_set", [])]
    return Run(f"{env}-{method}-task{task}", argv, dataset=None, label=f"{method} {env} task {task}")


def _ogbench_prepare(budget: dict) -> None:
    """The environments' play datasets (their recipe's 1,000 episodes, or ``dataset_episodes``) and the
    single-task views the runs read, in the local Minari store."""
    from offline_plugins.data.store import make_dataset

    for env in budget.get("envs", OGBENCH_ENVS):
        make_dataset(f"ogbench/{env}-play-v0", episodes=budget.get("dataset_episodes"), progress=False, exist_ok=True)
        for task in budget.get("tasks", range(1, 6)):
            make_dataset(f"ogbench/{env}-play-singletask-task{task}-v0", progress=False, exist_ok=True)


def _ogbench_keep(run_: Run, budget: dict) -> bool:
    env, _, task = run_.name.rpartition("-task")
    return int(task) in budget.get("tasks", range(1, 6)) and any(env.startswith(e + "-")
                                                                  for e in budget.get("envs", OGBENCH_ENVS))


def _ogbench_results(root: Path, seeds: list[int], env: str, method: str) -> dict[int, list[dict]]:
    """``{task: [summary of each seed that finished]}``."""
    return {task: [s for seed in seeds for s in [_summary(root / f"{env}-{method}-task{task}", seed)] if s]
            for task in range(1, 6)}


def _render_ogbench(table: Table, root: Path, seeds: list[int], budget: dict) -> str:
    head = ["| method | environment | success %, mean over the tasks run (± 95 % interval over seeds) | task 1 | "
            "task 2 | task 3 | task 4 | task 5 | published, 1M steps (FQL's paper) | wall time per run |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    rows, borrowed = [], []
    envs = budget.get("envs", OGBENCH_ENVS)
    for env in envs:
        for method in OGBENCH_METHODS:
            found = _ogbench_results(root, seeds, env, method)
            cells, per_seed = [], {}
            for task in range(1, 6):
                rates = [100 * s["success_rate"] for s in found[task]]
                for seed, s in zip(seeds, found[task]):
                    per_seed.setdefault(seed, []).append(100 * s["success_rate"])
                cells.append(f"{statistics.fmean(rates):.0f}" if rates else "-")
            means = [statistics.fmean(v) for v in per_seed.values() if v]
            if means:
                m, ci = mean_ci(means)
                overall = f"{m:.1f}" + (f" ± {ci:.1f}" if ci is not None else "")
            else:
                overall = "not run"
            walls = [run_wall(s) for task in found.values() for s in task if s.get("wall_s")]
            wall = f"{statistics.fmean(walls):.0f} s" if walls else ""
            if not _ogbench_preset(env, method)[1]:
                borrowed.append(f"{method} on {env}")
            rows.append(f"| {method} | {env} | {overall} | " + " | ".join(cells)
                        + f" | {OGBENCH_PUBLISHED[env][method]} | {wall} |")
    notes = ["Each cell is the share of evaluation episodes whose last step OGBench's single-task environment "
             "reports solved (`success_rate` in the run's summary.json), mean over seeds; the overall figure "
             "averages each seed's tasks, then the seeds. The published column is the paper's, at 1M steps, "
             "8 seeds and its own networks: a reader compares the budgets, not only the figures."]
    if borrowed:
        notes.append(f"{', '.join(borrowed)} train with the cube-single preset's behaviour weights: the "
                     "environment's own are in the paper's appendix table, which was not readable here "
                     "(src/offline_plugins/presets/).")
    notes.append("Learning curves (success against step, mean over tasks and seeds): "
                 + ", ".join(f"![{env}](img/ogbench-{env}.png)" for env in envs) + ".")
    return "\n".join(head + rows) + "\n\n" + " ".join(notes)


def _ogbench_figures(root: Path, seeds: list[int], budget: dict) -> list:
    """Success against step of each method (mean over the tasks and seeds run), one PNG an environment."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    for env in budget.get("envs", OGBENCH_ENVS):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for method in OGBENCH_METHODS:
            points: dict[int, list[float]] = {}
            for task in range(1, 6):
                for seed in seeds:
                    path = root / f"{env}-{method}-task{task}" / f"s{seed}" / "metrics.csv"
                    if not path.is_file():
                        continue
                    for r in csv.DictReader(path.open()):
                        if r.get("eval/success_rate"):
                            points.setdefault(int(r["step"]), []).append(100 * float(r["eval/success_rate"]))
            if points:
                steps = sorted(points)
                ax.plot(steps, [statistics.fmean(points[k]) for k in steps], marker="o", label=method)
        ax.set_xlabel("gradient step")
        ax.set_ylabel("success %")
        ax.set_title(f"OGBench {env}, single-task (mean over tasks and seeds)")
        if ax.lines:
            ax.legend()
        fig.tight_layout()
        path = root / f"ogbench-{env}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        out.append(path)
    return out


def finished(out: Path) -> bool:
    """Whether the run in ``out`` ran its steps to the end: a ``summary.json`` that is not an interrupted
    run's (a stopped run writes one too, with ``"interrupted": true``, and is resumed, not kept)."""
    path = out / "summary.json"
    if not path.is_file():
        return False
    summary = json.loads(path.read_text())
    return not summary.get("interrupted") and summary.get("steps", 0) >= (summary.get("steps_requested") or 0)


def _summary(folder: Path, seed: int) -> Optional[dict]:
    path = folder / f"s{seed}" / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


TABLES: dict[str, Table] = {
    "word-problems": Table(
        name="word-problems",
        title="Word problems (GSM8K's shape) with small: every method from one SFT reference",
        runs=[*(_online(a) for a in ONLINE), _offline("dpo"), _offline("kto"),
              Run("reward-model", _reward_model, seeded=False, dataset=None), Run("ppo-rlhf", _ppo_rlhf),
              _online("grpo", "word-problems-calculator")],
        budget={"online_steps": 200, "offline_steps": 400, "eval_prompts": 2000, "run_eval_prompts": 100,
                "reference_sft_steps": 900},
        smoke=_SMOKE,
        render=_render_word_problems,
    ),
    "variants-2026": Table(
        name="variants-2026",
        title="The 2026 variants beside GRPO and DAPO on the word problems with small",
        runs=[_online("grpo"), _online("dapo"),
              _online("gdpo", name="gdpo", label="gdpo (answer + 0.5 x step accuracy)",
                      extra=("--reward", "correct=task", "--reward",
                             "steps=offline_plugins.text.tasks.word_problems:step_accuracy", "--set", "reward_weights=1,0.5")),
              _online("maxrl"), _online("luspo"), _online("vespo"),
              _online("grpo", name="grpo-otb", label="grpo, optimal token baseline",
                      extra=("--set", "token_baseline=optimal")),
              _online("grpo", name="grpo-v32", label="grpo, unbiased KL + off-policy mask 0.5",
                      extra=("--set", "unbiased_kl=true", "--set", "off_policy_mask=0.5"))],
        budget={"online_steps": 200, "eval_prompts": 2000, "run_eval_prompts": 100, "reference_sft_steps": 900},
        smoke=_SMOKE,
        render=_render_word_problems,
        base="word-problems",
    ),
    "ogbench": Table(
        name="ogbench",
        title="OGBench single-task manipulation: BC, IQL, ReBRAC and flow Q-learning beside the published table",
        runs=[_ogbench(env, method, task) for env in OGBENCH_ENVS for method in OGBENCH_METHODS for task in range(1, 6)],
        # what one core affords: 60k steps of 2 x 256 networks (fql: 35 steps/s alone on a core, about 30 minutes
        # a run), against the paper's 1M of 4 x 512. fql's success on cube-single's task 2 was 0, 40, 80, 90 and
        # 70 % after 20k, 40k, 60k, 80k and 100k steps (10 episodes each, docs/algorithms/fql.md): 20k (the budget
        # first set) stops before it solves an episode. 50 evaluation episodes, as the paper. cube-single's 5 tasks
        # only: puzzle-3x3 (the paper's fql: 30 % at 1M steps) costs as much again; add it to "envs" to make it too
        budget={"offline_steps": 60000, "eval_every": 20000, "eval_episodes": 50, "envs": ["cube-single"],
                "offline_set": ["--set", "hidden=[256,256]"]},
        smoke={"offline_steps": 2, "eval_every": 2, "eval_episodes": 1, "dataset_episodes": 2, "envs": ["cube-single"],
               "tasks": [1], "offline_set": ["--set", "hidden=[16,16]", "--set", "batch_size=8"]},
        render=_render_ogbench,
        prepare=_ogbench_prepare,
        keep=_ogbench_keep,
        figures=_ogbench_figures,
    ),
}


# -- run / write -------------------------------------------------------------------------------------
def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _head() -> str:
    return _git("rev-parse", "--short", "HEAD") or "unknown (not a git checkout)"


def _dirty() -> bool:
    return bool(_git("status", "--porcelain", "--", "src", "scripts"))


#: what a run's result depends on in the repository: the package and its pins (not the tests, docs or scripts)
CODE_PATHS = ("src", "pyproject.toml", "constraints.txt")


def same_code(a: str, b: str) -> bool:
    """Whether commits ``a`` and ``b`` hold the same package code and pins (:data:`CODE_PATHS`)."""
    try:
        return subprocess.run(["git", "diff", "--quiet", a, b, "--", *CODE_PATHS], cwd=REPO,
                              capture_output=True).returncode == 0
    except OSError:
        return False


# -- results equal across commits: a change that moves no figure keeps the table --------------------------
#: where ``same-results`` records the commit pairs it found equal (under ``--records``)
SAME_RESULTS = "same-results.json"
#: the files of a smoke root two commits must share: every run's and reference's weights, summary, metrics
#: and held-out scores
COMPARED = ("*.safetensors", "summary.json", "heldout_scores.json", "metrics.csv")
#: summary keys and metric columns that measure the machine, not the result (seconds, rates, memory)
_MACHINE = re.compile(r"(_s|per_s|_mb|_all_ranks)$")


def _drop_machine(value):
    if isinstance(value, dict):
        return {k: _drop_machine(v) for k, v in value.items() if not _MACHINE.search(str(k))}
    if isinstance(value, list):
        return [_drop_machine(v) for v in value]
    return value


def comparable(path: Path, *places: Path):
    """What two commits' smoke runs must share of ``path``: its bytes' hash, or, for JSON and CSV, its
    values without timings, rates and memory, with ``places`` (the root and checkout) written as names."""
    if path.suffix == ".json":
        text = path.read_text()
        for i, place in enumerate(places):
            text = text.replace(str(place), f"<place {i}>")
        return _drop_machine(json.loads(text))
    if path.suffix == ".csv":
        rows = list(csv.reader(path.read_text().splitlines()))
        keep = [i for i, name in enumerate(rows[0]) if not _MACHINE.search(name)] if rows else []
        return [[row[i] for i in keep if i < len(row)] for row in rows]
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compare_roots(a: tuple[Path, ...], b: tuple[Path, ...]) -> tuple[int, list[str]]:
    """``(files compared, differences)`` of two smoke roots, each given as ``(root, checkout)``: the same
    files (:data:`COMPARED`) under each, each :func:`comparable` alike."""
    def files(root: Path) -> set[str]:
        return {str(p.relative_to(root)) for pattern in COMPARED for p in root.rglob(pattern) if p.is_file()}

    found_a, found_b = files(a[0]), files(b[0])
    diffs = [f"{name}: only under {a[0] if name in found_a else b[0]}" for name in sorted(found_a ^ found_b)]
    for name in sorted(found_a & found_b):
        if comparable(a[0] / name, *a) != comparable(b[0] / name, *b):
            diffs.append(f"{name}: differs")
    return len(found_a & found_b), diffs


def _full(commit: str) -> str:
    return _git("rev-parse", "--verify", "-q", f"{commit}^{{commit}}")


def same_results(args) -> None:
    """Run ``args.table``'s smoke at commits ``a`` and ``b``, each in a checkout of its own with its own
    package code and cache, and compare what they made (:func:`compare_roots`); when every file agrees,
    record the pair in ``--records``/:data:`SAME_RESULTS`, which ``write`` reads. Both run this script's
    smoke (what a run's figures depend on is the package code and pins, :data:`CODE_PATHS`, not how the
    smoke is sized)."""
    a, b = _full(args.a), _full(args.b)
    for name, full in ((args.a, a), (args.b, b)):
        if not full:
            sys.exit(f"{name} is not a commit of {REPO}; give two commits, e.g. same-results {args.table} 4fdbfc9 HEAD")
    if _git("diff", "--stat", a, b, "--", "pyproject.toml", "constraints.txt"):
        sys.exit(f"{args.a} and {args.b} pin other packages (pyproject.toml, constraints.txt): their results are "
                 "compared under one venv only when the pins agree; run the table again instead")
    work = Path(args.work or tempfile.mkdtemp(prefix="same-results-"))
    places = {}
    for commit in dict.fromkeys((a, b)):
        checkout, root = work / f"checkout-{commit[:10]}", work / f"runs-{commit[:10]}"
        if not checkout.is_dir():
            subprocess.run(["git", "worktree", "add", "-q", "--detach", str(checkout), commit], cwd=REPO, check=True)
        env = {**os.environ, "PYTHONPATH": str(checkout / "src"), "OFFLINE_PLUGINS_CACHE": str(root / "cache"),
               "MINARI_DATASETS_PATH": str(root / "minari"), "OMP_NUM_THREADS": "1"}
        print(f"{args.table} --smoke at {commit[:10]} into {root}", flush=True)
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "run", args.table, "--smoke",
                               "--root", str(root), "--seeds", "0"], cwd=checkout, env=env, timeout=args.timeout)
        if done.returncode:
            sys.exit(f"the smoke run of {args.table} at {commit[:10]} failed (exit {done.returncode}); see above")
        places[commit] = (root, checkout)
    count, diffs = compare_roots(places[a], places[b])
    if diffs or not count:
        sys.exit(f"{args.table} at {args.a} and {args.b}: {len(diffs)} of {count + len(diffs)} files differ"
                 + "".join(f"\n  {d}" for d in diffs[:20]) + ("\n  (no file compared)" if not count else "")
                 + f"\nthe runs under {work} show where; the table's runs must be made again at {args.b}")
    records = _records(args) or REPO / "results" / "tables"
    pairs = _pairs(records)
    pairs.append({"table": args.table, "a": a, "b": b, "files": count, "date": time.strftime("%Y-%m-%d"),
                  "machine": _cpu_name(), "command": f"python scripts/tables.py same-results {args.table} {a[:7]} {b[:7]}"})
    records.mkdir(parents=True, exist_ok=True)
    (records / SAME_RESULTS).write_text(json.dumps(pairs, indent=1) + "\n")
    print(f"{args.table}: {count} files alike at {a[:10]} and {b[:10]} (weights, summaries, metrics, held-out scores "
          f"of every smoke run); recorded in {records / SAME_RESULTS}")
    if not args.work:  # kept when asked for, or when they differ (to see where)
        for _, checkout in places.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(checkout)], cwd=REPO, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def _pairs(records: Optional[Path]) -> list[dict]:
    path = None if records is None else records / SAME_RESULTS
    return json.loads(path.read_text()) if path is not None and path.is_file() else []


def standing_for(head: str, table: str, records: Optional[Path]) -> dict[str, str]:
    """``{commit: how}`` of the commits whose runs of ``table`` stand for ``head``'s code: ``head``
    itself, and through each pair ``same-results`` recorded for the table (either way round), the commits
    whose results were found equal to one that stands; a run's commit stands when its package code and
    pins are those of one of them (:func:`same_code`)."""
    standing = {head: "the current commit"}
    pairs = [p for p in _pairs(records) if p.get("table") == table]
    grew = True
    while grew:
        grew = False
        for pair in pairs:
            for x, y in ((pair["a"], pair["b"]), (pair["b"], pair["a"])):
                if x not in standing and any(same_code(y, s) for s in standing):
                    standing[x] = f"`{pair['command']}` ({pair['date']})"
                    grew = True
    return standing


def run_commits(table: "Table", root: Path, seeds: list[int], fallback: str) -> dict[str, int]:
    """``{commit: runs}`` of the table's finished runs: each run's ``made_at.json``, or ``fallback`` (the
    table's provenance) for a run made before runs recorded their own."""
    counts: dict[str, int] = {}
    for run_ in table.runs:
        for seed in (seeds if run_.seeded else [0]):
            out = table.folder(root, run_.name) / f"s{seed}"
            if finished(out):
                made = out / "made_at.json"
                commit = json.loads(made.read_text())["commit"] if made.is_file() else fallback
                counts[commit] = counts.get(commit, 0) + 1
    return counts


def _cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's processor elsewhere): the weights a run
    ends with are bitwise the same on CPUs whose torch kernels agree, and differ by rounding elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            found = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        found = ""
    return found or platform.processor() or platform.platform()


def provenance(command: list[str], budget: dict, seeds: list[int]) -> dict:
    import torch

    return {"commit": _head(), "dirty": _dirty(),
            "machine": f"{_cpu_name()} ({platform.machine()}, torch kernels {torch.backends.cpu.get_cpu_capability()}), "
                       f"{os.cpu_count()} cores, torch {torch.__version__}",
            "command": " ".join(["python", "scripts/tables.py", *command]), "budget": budget, "seeds": seeds,
            "date": time.strftime("%Y-%m-%d")}


#: ``--smoke``: the demonstrations an SFT reference is made from (its 2 steps of 64 read 128; the recipe's 8,000
#: took most of a smoke's time to write and tokenise)
SMOKE_REFERENCE_ROWS = 256


@contextlib.contextmanager
def _smoke_sized():
    """``--smoke`` only: the SFT references are made from :data:`SMOKE_REFERENCE_ROWS` demonstrations,
    and the built-in preference sets sample a few prompts' pairs, not thousands, two samples a prompt
    within the smoke's response length (an untrained reference writes to the limit; the pipeline is what
    a smoke run checks). The reference's row count is in its recipe, so a smoke reference is cached
    under a name of its own."""
    from offline_plugins.text.data import task_data
    from offline_plugins.text.data.preference_sources import BUILTIN_PREFERENCE_DATASETS
    from offline_plugins.text.tasks import make_task

    # (function, its keyword that counts the reference's demonstrations): every way a run reaches the reference
    counts = [(task_data.sft_reference, "rows"), (task_data.reference_recipe, "rows"),
              (task_data.task_preference_data, "sft_rows_count")]
    rows = {(f, k): f.__kwdefaults__[k] for f, k in counts}
    for f, k in rows:
        f.__kwdefaults__[k] = SMOKE_REFERENCE_ROWS

    saved = {k: dict(v[2]) for k, v in BUILTIN_PREFERENCE_DATASETS.items()}
    classes = {type(make_task(**v[1])) for v in BUILTIN_PREFERENCE_DATASETS.values()}
    lengths = {cls: cls.__dict__.get("max_new_tokens") for cls in classes}
    for _, _, data in BUILTIN_PREFERENCE_DATASETS.values():
        data.update(n_train=16, n_test=4, num_samples=2)
    for cls in classes:
        cls.max_new_tokens = min(cls.max_new_tokens, _SMOKE["max_new_tokens"])
    try:
        yield
    finally:
        for (f, k), n in rows.items():
            f.__kwdefaults__[k] = n
        for k, v in saved.items():
            BUILTIN_PREFERENCE_DATASETS[k][2].clear()
            BUILTIN_PREFERENCE_DATASETS[k][2].update(v)
        for cls, length in lengths.items():
            if length is None:
                del cls.max_new_tokens
            else:
                cls.max_new_tokens = length


def _train(args, run_: Run, seed: int, budget: dict, folder: Path) -> None:
    """Train one run into ``FOLDER/s<seed>`` (``ROOT/TABLE/<run>``, or the base table's): kept when finished,
    continued from its last checkpoint when a run before this one was stopped (exact resume), else made
    from scratch."""
    root = folder.parent
    out = folder / f"s{seed}"
    if finished(out) and not args.overwrite:
        print(f"{out}: done, kept", flush=True)
        return
    if (out / "checkpoints" / "last.ckpt").is_file() and not args.overwrite and not args.smoke:
        argv = ["train", *run_.argv(seed, budget, root), "--resume", "--out", str(out), "--threads", "1",
                "--no-progress"]
    else:
        argv = ["train", *run_.argv(seed, budget, root), "--threads", "1", "--no-progress", "--out", str(out),
                "--overwrite"]
    print("offline-plugins " + " ".join(argv), flush=True)
    if args.smoke:  # in this process (inside run's _smoke_sized): the pipeline is what is checked
        from offline_plugins.cli import main as cli

        code = cli(argv)
    else:
        try:
            code = subprocess.call([sys.executable, "-m", "offline_plugins.cli", *argv], timeout=args.timeout)
        except subprocess.TimeoutExpired:
            sys.exit(f"{out}: stopped after --timeout {args.timeout} s (it resumes from its last checkpoint)")
    if code:
        sys.exit(f"{out}: exit {code}")
    # the commit this run was made at (a table may hold runs of several commits: `write` says which)
    (out / "made_at.json").write_text(json.dumps({"commit": _head(), "dirty": _dirty(), "date": time.strftime("%Y-%m-%d"),
                                                  "cpu": _cpu_name()}) + "\n")


def _keep_run_commits(table: Table, root: Path, prov: dict) -> None:
    """Before a run at another commit replaces ``provenance.json``: the finished runs that do not record
    their commit (made before runs did) get the one the old provenance names, so ``write`` still tells them
    apart from the runs made now."""
    path = root / "provenance.json"
    old = json.loads(path.read_text()) if path.is_file() else None
    if not old or old["commit"] == prov["commit"]:
        return
    for run_ in table.runs:
        folder = table.folder(root, run_.name)
        for out in (folder.glob("s*") if folder.is_dir() else []):
            if finished(out) and not (out / "made_at.json").is_file():
                (out / "made_at.json").write_text(json.dumps({"commit": old["commit"], "dirty": old["dirty"],
                                                              "date": old["date"]}) + "\n")


#: what a finished run's record holds (small files; the model and checkpoints stay in ROOT)
RECORD_FILES = ("summary.json", "heldout_scores.json", "made_at.json", "metrics.csv", "provenance.json")


def _records(args) -> Optional[Path]:
    """Where the records live, or None (``--smoke`` keeps nothing, ``--records ''`` turns them off)."""
    records = getattr(args, "records", None)
    return None if getattr(args, "smoke", False) or not records else Path(records)


def restore_records(records: Optional[Path], root: Path) -> int:
    """Copy into ``root`` (``--root``: every table's folder under it) each recorded file it lacks;
    the number copied."""
    copied = 0
    for src in (sorted(records.rglob("*")) if records is not None and records.is_dir() else []):
        dst = root / src.relative_to(records)
        if src.is_file() and src.name in RECORD_FILES and not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
            copied += 1
    return copied


def save_record(records: Optional[Path], root: Path, folder: Path) -> None:
    """Copy ``folder``'s record files (a run's ``s<seed>``, a reference's or a table's folder, under
    ``root``) into ``records``, at the same place."""
    if records is None:
        return
    for name in RECORD_FILES:
        src = folder / name
        if src.is_file():
            dst = records / folder.relative_to(root) / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())


@contextlib.contextmanager
def _run_lock(folder: Path, seed: int):
    """Hold ``folder/s<seed>.lock`` (yields True), or yield False at once when another process holds it;
    the kernel drops it when the holder dies, so a killed run never blocks the next ``run``."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / f"s{seed}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _references_in(records: Optional[Path]) -> Optional[Path]:
    return None if records is None else records / "references"


def restore_references(records: Optional[Path]) -> list[str]:
    """Copy each recorded SFT reference the cache lacks into it (``cache_root()/preference``), so every
    run of a table starts from the one reference its reference row scores, on any machine (made again
    elsewhere it would differ by rounding: the weights depend on the CPU's kernels); the names copied."""
    from offline_plugins.config import cache_root

    found = _references_in(records)
    copied = []
    for folder in (sorted(p for p in found.iterdir() if p.is_dir()) if found is not None and found.is_dir() else []):
        target = cache_root() / "preference" / folder.name
        if (target / "config.json").is_file():
            continue
        partial = target.with_name(target.name + ".restoring")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(folder, partial)
        partial.rename(target)  # whole or not at all: the cache takes a folder with config.json
        copied.append(folder.name)
    return copied


def save_reference(records: Optional[Path], ref_dir: Path) -> None:
    """Keep the SFT reference folder ``ref_dir`` (weights, tokenizer, ``reference.json``) with the records."""
    found = _references_in(records)
    if found is None or (found / ref_dir.name / "config.json").is_file():
        return
    found.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ref_dir, found / ref_dir.name, dirs_exist_ok=True)


def run(args) -> None:
    """Score the references, then train and score each run, seed by seed (every method's first seed
    before any method's second), so a table stopped part-way has rows for every method."""
    with _smoke_sized() if args.smoke else contextlib.nullcontext():
        _run(args)


def _run(args) -> None:
    table = TABLES[args.table]
    root = Path(args.root) / table.name
    budget = {**table.budget, **(table.smoke if args.smoke else {})}
    root.mkdir(parents=True, exist_ok=True)
    records = _records(args)
    restored = restore_records(records, root.parent)
    if restored:
        print(f"restored {restored} recorded files from {records} into {root.parent}", flush=True)
    for name in restore_references(records):
        print(f"restored the SFT reference {name} from {records}", flush=True)
    prov = provenance(sys.argv[1:], budget, args.seeds)
    _keep_run_commits(table, root, prov)
    (root / "provenance.json").write_text(json.dumps(prov, indent=1) + "\n")
    save_record(records, root.parent, root)
    if table.prepare is not None:
        table.prepare(budget)
    n = int(budget.get("eval_prompts", 0))
    for dataset in sorted({r.dataset for r in table.runs if r.dataset}):  # the references the runs start from
        folder = table.folder(root, "reference" if dataset == "word-problems" else f"reference-{dataset}")
        folder.mkdir(parents=True, exist_ok=True)
        ref_dir = reference_folder(dataset, budget)
        save_reference(records, ref_dir)
        _scored(folder / "heldout_scores.json", dataset, str(ref_dir), n, budget.get("max_new_tokens"))
        save_record(records, root.parent, folder)
    failed: list[str] = []
    for seed in args.seeds:
        for run_ in table.runs:
            if (not run_.seeded and seed != args.seeds[0]) or (table.keep and not table.keep(run_, budget)):
                continue
            seed_, folder = (seed if run_.seeded else 0), table.folder(root, run_.name)
            out = folder / f"s{seed_}"
            with _run_lock(folder, seed_) as held:
                if not held:
                    print(f"{out}: being made by another process, skipped", flush=True)
                    continue
                try:
                    _train(args, run_, seed_, budget, folder)
                except SystemExit as stop:  # one run failing does not stop hours of others; named at the end
                    if args.smoke:
                        raise
                    print(f"{stop}; going on with the next run", flush=True)
                    failed.append(str(out))
                    continue
                if run_.dataset and (out / "model").is_dir():
                    print(f"scoring {out}/model on {n} held-out prompts", flush=True)
                    _scored(out / "heldout_scores.json", run_.dataset, str(out / "model"), n,
                            budget.get("max_new_tokens"))
                if finished(out):
                    save_record(records, root.parent, out)
    if failed:
        sys.exit(f"{len(failed)} of the table's runs failed (each said why above): {', '.join(failed)}; "
                 f"`python scripts/tables.py run {table.name}` again makes them and keeps the rest")


def write(args) -> None:
    table = TABLES[args.table]
    root = Path(args.root) / table.name
    restore_records(_records(args), root.parent)
    prov_path = root / "provenance.json"
    if not prov_path.is_file():
        sys.exit(f"{root} holds no runs of {table.name}: run `python scripts/tables.py run {table.name}` first")
    prov = json.loads(prov_path.read_text())
    head = _head()
    commits = run_commits(table, root, prov["seeds"], prov["commit"]) or {prov["commit"]: 0}
    # a run made at a commit whose package code and pins are the current ones stands for the current code,
    # and so does one whose results a recorded `same-results` check found equal to such a commit's
    standing = standing_for(head, table.name, _records(args))
    why = {c: next((how for s, how in standing.items() if same_code(c, s)), None) for c in commits if c != head}
    same = sorted(c for c, how in why.items() if how is not None)
    others = sorted(c for c, how in why.items() if how is None)
    if others and not args.stale and not args.smoke:
        made = ", ".join(c + (f" ({commits[c]} runs)" if commits[c] else "") for c in others)
        sys.exit(f"runs under {root} were made at {made}, the code is at {head}: run them again "
                 "(run --overwrite), or pass --stale and say in the doc why they still hold")
    at = (f"commit {next(iter(commits))}" if len(commits) == 1 else
          "commits " + ", ".join(f"{c} ({n} runs)" for c, n in sorted(commits.items(), key=lambda kv: -kv[1])))
    by_code = [c for c in same if why[c] == "the current commit"]
    if by_code:
        at += (f" ({', '.join(by_code)}: the package's code and pins of {head}, "
               f"`git diff {by_code[0]} {head} -- {' '.join(CODE_PATHS)}` empty)")
    for c in (c for c in same if c not in by_code):
        at += (f" ({c}: its results equal {head}'s at the smoke budget, every smoke run's weights, metrics and "
               f"held-out scores, by {why[c]})")
    body = table.render(table, root, prov["seeds"], prov["budget"])
    stamp = (f"Made by `{prov['command']}` at {at}{' (with uncommitted changes)' if prov['dirty'] else ''}"
             f" on {prov['machine']}, {prov['date']}; seeds {', '.join(map(str, prov['seeds']))}; budget "
             + ", ".join(f"{k} {v}" for k, v in prov["budget"].items() if k not in ("online_set", "offline_set"))
             + "".join(f", {' '.join(v[1::2])}" for k, v in prov["budget"].items() if k == "offline_set")
             + f". Written by `python scripts/tables.py write {table.name}`; do not edit by hand.")
    block = f"<!-- table:{table.name} -->\n### {table.title}\n\n{stamp}\n\n{body}\n<!-- /table:{table.name} -->"
    doc = Path(args.doc) if not args.smoke else root / "results.md"
    for figure in (table.figures(root, prov["seeds"], prov["budget"]) if table.figures else []):
        (doc.parent / "img").mkdir(exist_ok=True)
        (doc.parent / "img" / Path(figure).name).write_bytes(Path(figure).read_bytes())
    text = doc.read_text() if doc.is_file() else ""
    start, end = f"<!-- table:{table.name} -->", f"<!-- /table:{table.name} -->"
    if start in text and end in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    doc.write_text(text)
    print(f"wrote {table.name} into {doc}")


def _held_by_another(folder: Path, seed: int) -> bool:
    """Whether a process holds run ``folder/s<seed>``'s lock now (it is being made)."""
    if not (folder / f"s{seed}.lock").is_file():
        return False
    with _run_lock(folder, seed) as mine:
        return not mine


def _last_step(out: Path) -> Optional[int]:
    """The last step ``out/metrics.csv`` logged, or None."""
    path = out / "metrics.csv"
    if not path.is_file():
        return None
    steps = [row.get("step") for row in csv.DictReader(path.read_text().splitlines())]
    return max((int(float(x)) for x in steps if x), default=None)


def status(args) -> None:
    """Each run of the table, seed by seed: done (its wall time and held-out score), being made (by which
    step), stopped (resumes from its checkpoint) or to do; and the core-hours left at the finished runs'
    pace."""
    table = TABLES[args.table]
    root = Path(args.root) / table.name
    restore_records(_records(args), root.parent)
    budget = table.budget
    steps = budget.get("online_steps", budget.get("offline_steps"))
    walls: dict[str, list[float]] = {}
    left: list[str] = []
    lines = []
    for run_ in table.runs:
        if table.keep and not table.keep(run_, budget):
            continue
        folder, cells = table.folder(root, run_.name), []
        for seed in (args.seeds if run_.seeded else [0]):
            out = folder / f"s{seed}"
            if finished(out):
                wall = run_wall(json.loads((out / "summary.json").read_text()))
                walls.setdefault(run_.name, []).append(wall)
                scores = out / "heldout_scores.json"
                if scores.is_file():
                    found = json.loads(scores.read_text())["scores"]
                    cells.append(f"s{seed} {100 * statistics.fmean(found):.1f} % in {wall:.0f} s")
                else:
                    cells.append(f"s{seed} trained in {wall:.0f} s" + (", not scored" if run_.dataset else ""))
                continue
            step = _last_step(out)
            at = f"step {step} of {steps}" if step is not None else "starting"
            if _held_by_another(folder, seed):
                cells.append(f"s{seed} being made ({at})")
            elif (out / "checkpoints" / "last.ckpt").is_file():
                cells.append(f"s{seed} stopped ({at}; resumes)")
            else:
                cells.append(f"s{seed} to do")
            left.append(run_.name)
        lines.append(f"{run_.name:20} " + " | ".join(cells))
    print(f"{table.name} under {root} (seeds {' '.join(map(str, args.seeds))}):")
    print("\n".join(lines))
    every = [w for ws in walls.values() for w in ws]
    if left and every:
        hours = sum(statistics.fmean(walls.get(name) or every) for name in left) / 3600
        print(f"{len(left)} runs left, about {hours:.1f} core-hours at the pace of the finished runs of each method "
              "(all finished runs for a method with none; a run resumed after a stop at its last stretch's pace)")
    elif not left:
        print(f"every run is done: python scripts/tables.py write {table.name} --root {args.root}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list")
    for name in ("run", "write", "same-results", "status"):
        p = sub.add_parser(name)
        p.add_argument("table", choices=sorted(TABLES))
        if name != "same-results":
            p.add_argument("--root", default="runs/tables")
            p.add_argument("--smoke", action="store_true", help="a tiny budget: the pipeline runs (tests/test_tables.py)")
        p.add_argument("--records", default=str(REPO / "results" / "tables"),
                       help="the committed records of finished runs ('' for none; --smoke keeps none)")
        if name == "same-results":
            p.add_argument("a", help="the commit the runs were made at")
            p.add_argument("b", nargs="?", default="HEAD", help="the commit they should stand for (default HEAD)")
            p.add_argument("--work", default="", help="where the two checkouts and smoke runs go (default: a new temporary folder)")
            p.add_argument("--timeout", type=int, default=3600)
        elif name == "status":
            p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
        elif name == "run":
            p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
            p.add_argument("--overwrite", action="store_true")
            p.add_argument("--timeout", type=int, default=4 * 3600)
        else:
            p.add_argument("--doc", default=str(REPO / "docs" / "results.md"))
            p.add_argument("--stale", action="store_true")
    args = parser.parse_args()
    if args.cmd == "list":
        for table in TABLES.values():
            print(f"{table.name:16} {table.title} ({len(table.runs)} runs a seed)")
        return
    {"run": run, "write": write, "same-results": same_results, "status": status}[args.cmd](args)


if __name__ == "__main__":
    main()
