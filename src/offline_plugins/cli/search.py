"""The ``search`` sub-command: PRM-guided search at inference against greedy and the outcome verifier.

``offline-plugins search --policy DIR --prm OUT`` samples solutions of a step task's held-out
prompts from the policy and compares, by the task's outcome verifier, greedy decoding, best-of-N
ranked by the verifier and by the PRM, and step-level beam search guided by the PRM and by the
task's own step checker (:func:`offline_plugins.eval.search.search_sweep`); several ``--n`` or
``--beam-width`` values sweep the compute. Cheap to import (torch loads inside the command).
"""

from __future__ import annotations

import json
from pathlib import Path

from offline_plugins.cli.args import seed as _seed
from offline_plugins.errors import UserError
from offline_plugins.text.tasks.steps import StepChainTask

__all__ = ["add_parsers", "cmd_search", "policy_folder"]

_LABELS = {"greedy": "greedy", "best_of_n_orm": "best-of-N, outcome verifier (oracle)",
           "best_of_n_prm": "best-of-N, PRM", "beam_prm": "beam search, PRM",
           "beam_gold_steps": "beam search, step checker (a perfect PRM)"}


def policy_folder(path: str) -> Path:
    """The ``save_pretrained`` folder of ``--policy``: the folder itself, a train run's ``OUT`` (its
    ``OUT/model``) or one of its checkpoints (``OUT/checkpoints/*.ckpt``)."""
    p = Path(path)
    for folder in (p, p / "model", p.parent.parent / "model" if p.suffix == ".ckpt" else None):
        if folder is not None and (folder / "config.json").is_file():
            return folder
    what = "does not exist" if not p.exists() else "holds no model (config.json) and no OUT/model"
    raise UserError(f"--policy {path!r} {what}; give a save_pretrained folder of a causal LM, or a train run's OUT "
                    "folder or checkpoint (its OUT/model: sft, grpo, dpo ...)")


def _task(dataset: str):
    """The step task of ``--dataset``: a built-in step-labelled dataset or the steps-arithmetic rollout task."""
    from offline_plugins.text.data.rollouts import resolve_rollout_id
    from offline_plugins.text.data.steps import BUILTIN_STEP_DATASETS

    task = BUILTIN_STEP_DATASETS.get(dataset.strip())
    if task is None and resolve_rollout_id(dataset) == "offline-plugins/steps-arithmetic/v0":
        task = StepChainTask()  # the rollout task's (its default settings)
    if task is None:
        raise UserError(f"--dataset {dataset!r} is no step task search can check; use steps-arithmetic or one of "
                        f"{', '.join(sorted(BUILTIN_STEP_DATASETS))}")
    return task


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, label in _LABELS.items():
        points = sorted((r["tokens_per_prompt"], 100 * r["exact_match"]) for r in rows if r["method"] == method)
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("generated tokens per prompt")
    ax.set_ylabel("exact match (%)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_search(args) -> int:
    """``offline-plugins search``: exact match and generated tokens per prompt of each search method."""
    import torch

    from offline_plugins.eval.search import load_prm, search_sweep
    from offline_plugins.modules.tiny_lm import load_causal_lm
    from offline_plugins.text.sources.reward_source import is_reward_model_dir

    task = _task(args.dataset)
    policy_dir = policy_folder(args.policy)
    if not is_reward_model_dir(args.prm):
        raise UserError(f"--prm {args.prm!r} is no PRM folder; give a 'train prm' run's OUT folder or its "
                        "OUT/reward_model (offline-plugins train prm --dataset steps/arithmetic-v1 --out OUT)")
    if args.threads:
        torch.set_num_threads(args.threads)
    policy, tokenizer = load_causal_lm(policy_dir, seed=0)
    prm, prm_tokenizer = load_prm(args.prm)
    if prm_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise UserError(f"--prm {args.prm!r} reads another tokenizer than --policy {str(policy_dir)!r} "
                        f"({len(prm_tokenizer)} tokens against {len(tokenizer)}); train the PRM from the policy's "
                        "model family (train prm --model tiny or the policy's folder)")
    policy.to(args.device).eval()
    prm.to(args.device)
    rows = search_sweep(task, policy, tokenizer, prm, task.prompts(args.prompts, split="test", seed=args.seed),
                        ns=args.n, beam_widths=args.beam_width, max_steps=args.max_steps, aggregate=args.aggregate,
                        seed=args.seed)
    print(f"search on {args.dataset}, {args.prompts} held-out prompts, seed {args.seed}, PRM {args.aggregate} "
          "over steps:")
    width = max(len(v) for v in _LABELS.values())
    print(f"  {'method':<{width}}  {'n':>3}  {'beam':>4}  exact match  tokens/prompt")
    for r in rows:
        beam = "-" if r["beam_width"] is None else r["beam_width"]
        print(f"  {_LABELS[r['method']]:<{width}}  {r['n']:>3}  {beam:>4}  {100 * r['exact_match']:10.1f}%  "
              f"{r['tokens_per_prompt']:13.1f}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: getattr(args, k) for k in ("policy", "prm", "dataset", "n", "beam_width", "aggregate",
                                                   "prompts", "seed", "max_steps")}
        out.write_text(json.dumps({"settings": settings, "results": rows}, indent=1))
        written = [str(out)]
        if len(args.n) > 1 or len(args.beam_width) > 1:
            _plot(rows, out.with_suffix(".png"))
            written.append(str(out.with_suffix(".png")))
        print(f"wrote {', '.join(written)}")
    return 0


def add_parsers(subparsers) -> None:
    """Add ``search`` to the ``offline-plugins`` sub-command parsers."""
    p = subparsers.add_parser(
        "search", help="PRM-guided search at inference: greedy, best-of-N (verifier, PRM), step beam search",
        description="Sample solutions of a step task's held-out prompts from --policy and score, by the task's "
        "outcome verifier, greedy decoding, best-of-N ranked by the verifier (an oracle) and by the PRM, and "
        "step-level beam search guided by the PRM and by the task's step checker; prints exact match and "
        "generated tokens per prompt. Several --n or --beam-width values sweep the compute (docs/prm.md).")
    p.add_argument("--policy", required=True, metavar="DIR",
                   help="the solution writer: a save_pretrained folder, or a train run's OUT folder or checkpoint")
    p.add_argument("--prm", required=True, metavar="OUT", help="a 'train prm' run's OUT folder (or OUT/reward_model)")
    p.add_argument("--dataset", default="steps-arithmetic", metavar="ID",
                   help="the step task: steps-arithmetic (default) or a built-in step dataset (steps/arithmetic-v1)")
    p.add_argument("--n", type=int, nargs="+", default=[4], metavar="N",
                   help="samples of best-of-N and candidates per beam expansion; several values sweep (default 4)")
    p.add_argument("--beam-width", type=int, nargs="+", default=[2], metavar="W",
                   help="partial solutions the beam keeps; several values sweep (default 2)")
    p.add_argument("--aggregate", choices=("min", "prod"), default="min",
                   help="a solution's PRM score from its steps': their minimum or product (default min)")
    p.add_argument("--max-steps", type=int, default=4, metavar="S", help="the longest solution, in steps (default 4)")
    p.add_argument("--prompts", type=int, default=100, metavar="P", help="held-out prompts (default 100)")
    p.add_argument("--seed", type=_seed, default=0, help="the prompts' draw and the sampling seed (default 0)")
    p.add_argument("--device", default="cpu", help="device of the policy and the PRM (default cpu)")
    p.add_argument("--threads", type=int, default=None, metavar="T", help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default=None, metavar="FILE.json",
                   help="write the results as JSON, and a plot of exact match against tokens (FILE.png) when sweeping")
    p.set_defaults(func=cmd_search)
