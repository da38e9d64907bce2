"""PPO-RLHF with the outcome verifier (``ppo-rlhf``) against ``ppo-prm`` (a trained PRM's step rewards) on ``steps-arithmetic``.

    python scripts/prm_ppo_results.py run --root runs/results-prm-ppo --steps 40 --seeds 0 1 2
    python scripts/prm_ppo_results.py table --root runs/results-prm-ppo

``run`` uses the PRM of ``--prm`` (a ``train prm`` OUT folder), or trains one into ``ROOT/prm`` by the
``train prm`` recipe (``--prm-steps`` on ``steps/arithmetic-v0``), then each arm through the CLI (one
thread, one run at a time) from the SFT reference of ``--reference-steps`` steps, into ``ROOT/ARM/sSEED``:
``ppo-rlhf`` (the verifier's reward on the last token), ``ppo-prm`` (the PRM's step rewards beside it) and
``ppo-prm-only`` (``ppo-prm`` with ``outcome_reward=false``). ``table`` prints the rows of docs/results-history.md
(the helpers and columns of scripts/prm_results.py).
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import run_table_args  # noqa: E402
from prm_results import _ms, _train, _train_seeds  # noqa: E402

#: arm -> (algorithm, its extra settings, the table's label)
ARMS = {"ppo-rlhf": ("ppo-rlhf", [], "ORM (ppo-rlhf)"),
        "ppo-prm": ("ppo-prm", [], "PRM steps + ORM (ppo-prm)"),
        "ppo-prm-only": ("ppo-prm", ["outcome_reward=false"], "PRM steps alone (ppo-prm, outcome_reward=false)")}


def run(root: Path, steps: int, seeds: list[int], reference_steps: int, prm_steps: int, prm: Path | None,
        arms: list[str]) -> None:
    if prm is None:
        prm = root / "prm"
        _train(["prm", "--dataset", "steps/arithmetic-v0", "--steps", str(prm_steps), "--seed", "0"], prm)
    for arm in arms:
        algo, extra, _ = ARMS[arm]
        extra = extra + [f"prm={prm}"] if algo == "ppo-prm" else extra
        _train_seeds(algo, extra, root / arm, steps, seeds, reference_steps)


def table(root: Path) -> None:
    print("| rewards | seeds | held-out verifier reward (greedy), before -> after | rollout reward, first -> last "
          "round | response tokens, first -> last round | KL to reference | monitor warnings | train s |")
    print("|---|---|---|---|---|---|---|---|")
    for arm, (_, _, label) in ARMS.items():
        runs = sorted((root / arm).glob("s*/summary.json"))
        if not runs:
            continue
        s = [json.loads(p.read_text()) for p in runs]
        length = [[float(r["rollout/response_length"]) for r in csv.DictReader(open(p.parent / "metrics.csv"))
                   if r.get("rollout/response_length")] for p in runs]
        warnings = sum(len(x["reward_hacking"].get("hacking_warnings") or []) for x in s)
        after = ", ".join(f"{x['heldout_reward_after']:.3f}" for x in s)
        print(f"| {label} | {len(s)} | {_ms([x['heldout_reward_before'] for x in s])} -> "
              f"{_ms([x['heldout_reward_after'] for x in s])} ({after}) | "
              f"{_ms([x['reward_mean_first_round'] for x in s])} -> {_ms([x['reward_mean'] for x in s])} | "
              f"{_ms([x[0] for x in length])} -> {_ms([x[-1] for x in length])} | "
              f"{_ms([x['kl_to_reference'] for x in s])} | {warnings} | "
              f"{statistics.mean(x['train_s'] for x in s):.0f} |")


def _run_options(r) -> None:
    r.add_argument("--steps", type=int, default=40)
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--reference-steps", type=int, default=800)
    r.add_argument("--prm-steps", type=int, default=300)
    r.add_argument("--prm", type=Path, default=None, help="a trained PRM's OUT folder (default: train one)")
    r.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))


def main(argv=None) -> int:
    a = run_table_args(__doc__, "runs/results-prm-ppo", _run_options, argv)
    if a.cmd == "run":
        run(a.root, a.steps, a.seeds, a.reference_steps, a.prm_steps, a.prm, a.arms)
    else:
        table(a.root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
