"""AI feedback as the labeller of online DPO (issue 27): the task's reward against two judges (built-in task).

    python scripts/judge_results.py run --root runs/results-judge --seeds 0 1 2
    python scripts/judge_results.py table --root runs/results-judge

Every run is ``offline-plugins train online-dpo --dataset arithmetic --model tiny`` from the cached
SFT reference of docs/results-history.md, with two samples per prompt (``group_size=2``: the judge compares
two responses, as Guo et al. 2024's online AI feedback does) and lr 1e-4, trained through the CLI one
run at a time (``--threads 1``) into ``ROOT/SETTING/sSEED``; an existing ``summary.json`` is kept
(rerun with ``--overwrite``). The settings differ only in who picks each prompt's pair:

* ``reward``: the task's exact-match verifier (no judge);
* ``function-judge``: ``--judge judge_results:verifier_judge``, a function judge that prefers the right
  answer (the same preference as the reward, asked in both display orders);
* ``rubric-judge``: ``--judge rubric``, the built-in untrained tiny model asked the rubric question.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import fmt as _fmt, results_main  # noqa: E402
from online_dpo_results import _rollout_rows, _train  # noqa: E402

STEPS = 600
BASE = ["group_size=2", "lr=1e-4"]
#: setting -> the --set values of its run
SETTINGS = {
    "reward": BASE,
    "function-judge": [*BASE, "judge=judge_results:verifier_judge"],
    "rubric-judge": [*BASE, "judge=rubric"],
}


def verifier_judge(prompt: str, first: str, second: str) -> float:
    """P(first better): 1 when only the first is the right sum, 0 when only the second is, else 1/2 (a tie)."""
    from offline_plugins.text.tasks import ArithmeticTask

    right_first, right_second = ArithmeticTask().rewards([prompt, prompt], [first, second])
    return 0.5 if right_first == right_second else float(right_first > right_second)


def run(args) -> None:
    # the runs import the function judge from this folder
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    root = Path(args.root)
    for seed in args.seeds:
        for setting in args.settings:
            out = root / setting / f"s{seed}"
            if (out / "summary.json").is_file() and not args.overwrite:
                print(f"{out}: done, kept", flush=True)
                continue
            _train("online-dpo", STEPS, STEPS, seed, out, SETTINGS[setting], args.timeout)


def table(args) -> None:
    import json

    root = Path(args.root)
    print("| pairs picked by | held-out exact match | gain | per seed | pairs trained on | judge ties | judge agrees "
          "with the reward | wall time per run |")
    print("|---|---|---|---|---|---|---|---|")
    before = None
    for setting in SETTINGS:
        paths = sorted((root / setting).glob("s*/summary.json"))
        if not paths:
            continue
        s = [json.loads(p.read_text()) for p in paths]
        rounds = [list(_rollout_rows(p.parent).values()) for p in paths]
        after = [r["exact_match_after"] for r in s]
        before = s[0]["exact_match_before"]
        pairs = [round(r["rounds"] * r["config"]["prompts_per_round"] * (1 - r["groups_without_signal"])) for r in s]
        ties = [statistics.mean(x["judge_ties"] for x in run) for run in rounds if "judge_ties" in run[0]]
        agree = [statistics.mean(v for x in run if (v := x.get("judge_agreement")) == v) for run in rounds
                 if "judge_agreement" in run[0] and any(x.get("judge_agreement") == x.get("judge_agreement")
                                                        for x in run)]
        print(f"| {setting} | {_fmt(after)} | {100 * (statistics.mean(after) - before):+.1f} "
              f"| {', '.join(f'{100 * a:.1f}' for a in after)} | {', '.join(map(str, pairs))} "
              f"| {_fmt(ties) + ' %' if ties else '–'} | {_fmt(agree) + ' %' if agree else '–'} "
              f"| {statistics.mean(r['wall_s'] for r in s):.0f} s |")
    if before is not None:
        print(f"\nreference (exact_match_before): {100 * before:.1f} %, seeds: {len(s)}")


def main() -> None:
    results_main(__doc__, "runs/results-judge", run, table, pick=("--settings", SETTINGS), steps=False)


if __name__ == "__main__":
    main()
