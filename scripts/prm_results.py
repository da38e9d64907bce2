"""GRPO with the outcome verifier (ORM) against ``grpo-prm`` (a trained PRM's step rewards) on ``steps-arithmetic``.

    python scripts/prm_results.py run --root runs/results-prm --steps 60 --seeds 0 1 2 [--prm PRM_OUT]
    python scripts/prm_results.py table --root runs/results-prm

``run`` trains the PRM once (``train prm``'s recipe of docs/prm.md, :data:`PRM_RECIPE`: ``steps/arithmetic-v1``
from the SFT reference, with the language-modelling term, ``--prm-steps``) into ``ROOT/prm`` unless ``--prm``
names a trained one, then
each arm through the CLI (one thread, one run at a time) from the SFT reference of ``--reference-steps``
steps, into ``ROOT/ALGO/sSEED``; ``table`` prints the rows of docs/results-history.md: the held-out verifier
reward (greedy; the gold the reward-hacking monitor watches) before and after, the rollout reward of
the first and last rounds, and the monitor's warnings.
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import run_table_args, run_unless_done  # noqa: E402

ALGOS = ("grpo", "grpo-prm")
SETTINGS = ["max_new_tokens=32", "eval_prompts=200"]
#: the PRM that checks arithmetic (docs/prm.md): v1's rows and the policy's own labelled solutions, from the
#: policy's SFT reference, with the LM term
PRM_RECIPE = ["--dataset", "steps/arithmetic-v1", "--set", "lm_coef=1", "--set", "lr=1e-3", "--set", "batch_size=32",
              "--set", "reference_sft_steps=800", "--set", "policy_rows=20000"]


def _train(cmd: list[str], out: Path) -> None:
    run_unless_done(["offline-plugins", "train", *cmd, "--out", str(out), "--threads", "1", "--no-progress"], out)


def _train_seeds(algo: str, extra: list[str], out: Path, steps: int, seeds: list[int], reference_steps: int) -> None:
    """``algo`` on ``steps-arithmetic`` from the SFT reference of ``reference_steps`` steps with :data:`SETTINGS`
    and ``extra``, a run a seed into ``out/sSEED``."""
    sets = [a for s in SETTINGS + [f"reference_sft_steps={reference_steps}", *extra] for a in ("--set", s)]
    for seed in seeds:
        _train([algo, "--dataset", "steps-arithmetic", "--steps", str(steps), "--seed", str(seed), *sets],
               out / f"s{seed}")


def run(root: Path, steps: int, seeds: list[int], reference_steps: int, prm_steps: int, prm: Path = None) -> None:
    if prm is None:
        prm = root / "prm"
        _train(["prm", *PRM_RECIPE, "--steps", str(prm_steps), "--seed", "0"], prm)
    for algo in ALGOS:
        extra = [f"prm={prm}"] if algo == "grpo-prm" else []
        _train_seeds(algo, extra, root / algo, steps, seeds, reference_steps)


def _ms(values) -> str:
    """Mean ± standard deviation (0 for one value), three decimals: the tables' cells."""
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.3f}"


def table(root: Path) -> None:
    print("| rewards | seeds | held-out verifier reward (greedy), before -> after | rollout reward, first -> last "
          "round | KL to reference | monitor warnings | train s |")
    print("|---|---|---|---|---|---|---|")
    for algo in ALGOS:
        runs = sorted((root / algo).glob("s*/summary.json"))
        if not runs:
            continue
        s = [json.loads(p.read_text()) for p in runs]
        warnings = sum(len(x["reward_hacking"].get("hacking_warnings") or []) for x in s)
        print(f"| {'ORM (grpo)' if algo == 'grpo' else 'PRM (grpo-prm)'} | {len(s)} | "
              f"{_ms([x['heldout_reward_before'] for x in s])} -> {_ms([x['heldout_reward_after'] for x in s])} | "
              f"{_ms([x['reward_mean_first_round'] for x in s])} -> {_ms([x['reward_mean'] for x in s])} | "
              f"{_ms([x['kl_to_reference'] for x in s])} | {warnings} | "
              f"{statistics.mean(x['train_s'] for x in s):.0f} |")


def _run_options(r) -> None:
    r.add_argument("--steps", type=int, default=60)
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--reference-steps", type=int, default=800)
    r.add_argument("--prm-steps", type=int, default=6000)
    r.add_argument("--prm", type=Path, default=None, help="a trained PRM (train prm's OUT) instead of training one")


def main(argv=None) -> int:
    a = run_table_args(__doc__, "runs/results-prm", _run_options, argv)
    if a.cmd == "run":
        run(a.root, a.steps, a.seeds, a.reference_steps, a.prm_steps, a.prm)
    else:
        table(a.root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
