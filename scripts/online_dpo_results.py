"""Online DPO against offline DPO on the same pair budget, and iterative DPO by round (built-in task).

    OFFLINE_PLUGINS_CACHE=~/.cache/offline-plugins python scripts/online_dpo_results.py run \\
        --root runs/results-online-dpo --seeds 0 1 2
    python scripts/online_dpo_results.py table --root runs/results-online-dpo

Every run starts from the cached SFT reference of docs/results-history.md ("Online RL on the built-in
task": ``--dataset arithmetic --model tiny``) and trains through the CLI, one run at a time
(``--threads 1``), into ``ROOT/SETTING/sSEED``; an existing ``summary.json`` is kept (rerun with
``--overwrite``).

* ``online-dpo`` at lr 1e-5 (its default: DPO's registered rate) and 1e-4: 600 steps = 300
  rounds of 16 prompts x G = 8 (38,400 sampled responses, the sampling budget of the GRPO runs).
* ``offline-dpo``: the ``dpo`` algorithm on the built-in preference pairs of the same task
  (``offline-plugins/arithmetic/preference-v0``: a right answer against the reference's most
  frequent wrong one), at the same rate, for as many pairs as the online run of the same seed
  and rate trained on: ``ceil(pairs / 16)`` steps of 16 pairs. Its policy is scored afterwards
  by the online runs' evaluation (``RolloutData.held_out_scores``: 200 held-out prompts, greedy,
  positions from each row's first token) into ``fixed_eval.json``, since the preference kind's
  own exact match batches prompts without that fix (docs/results-history.md).
* ``iterative-dpo``: 8 rounds of 128 prompts x G = 8, 4 epochs per round (256 steps), evaluated
  after every round; with the run's reference throughout and with ``update_reference=true``,
  at lr 1e-5 (DPO's registered rate) and 1e-4.

The pairs an online run trained on are ``rounds * prompts_per_round * (1 - groups_without_signal)``
(a prompt gives a pair unless its 8 rewards are all equal), from its ``summary.json``.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import fmt as _fmt, results_main, train_arithmetic  # noqa: E402

#: setting -> (algorithm, steps, eval_every, --set values)
SETTINGS = {
    "online-dpo": ("online-dpo", 600, 150, []),
    "online-dpo-lr1e-4": ("online-dpo", 600, 150, ["lr=1e-4"]),
    "offline-dpo": ("dpo", None, None, []),
    "offline-dpo-lr1e-4": ("dpo", None, None, ["lr=1e-4"]),
    "iterative-dpo": ("iterative-dpo", 256, 32, []),
    "iterative-dpo-update-ref": ("iterative-dpo", 256, 32, ["update_reference=true"]),
    "iterative-dpo-lr1e-4": ("iterative-dpo", 256, 32, ["lr=1e-4"]),
    "iterative-dpo-lr1e-4-update-ref": ("iterative-dpo", 256, 32, ["lr=1e-4", "update_reference=true"]),
}
#: offline setting -> the online setting whose pair budget it gets
BUDGET_OF = {"offline-dpo": "online-dpo", "offline-dpo-lr1e-4": "online-dpo-lr1e-4"}
PAIR_BATCH = 16


def pairs_trained(summary: dict) -> int:
    """Real pairs an online run trained on (tie slots excluded)."""
    prompts = summary["rounds"] * summary["config"]["prompts_per_round"]
    return round(prompts * (1 - summary["groups_without_signal"]))


def _train(algorithm: str, steps: int, eval_every: int, seed: int, out: Path, sets: list[str], timeout: int) -> None:
    train_arithmetic(algorithm, steps, eval_every, seed, out, sets, timeout,
                     shows=lambda line: "held-out" in line or "accuracy" in line)


def _fixed_eval(out: Path) -> dict:
    """The online runs' held-out evaluation of a run's exported policy, written to ``fixed_eval.json``."""
    path = out / "fixed_eval.json"
    if path.is_file():
        return json.loads(path.read_text())
    import torch

    from offline_plugins.modules.tiny_lm import load_causal_lm
    from offline_plugins.text.data.rollouts import load_rollout_data

    torch.set_num_threads(1)
    from offline_plugins.kinds.sft import supervised_finetune

    data = load_rollout_data("arithmetic", model="tiny", finetune=supervised_finetune)
    model, _ = load_causal_lm(out / "model")
    result = {"exact_match_before": data.held_out_scores(data.reference)["exact_match"],
              "exact_match_after": data.held_out_scores(model)["exact_match"],
              "heldout_prompts": len(data.source.held_out)}
    path.write_text(json.dumps(result, indent=1))
    return result


def run(args) -> None:
    root = Path(args.root)
    for seed in args.seeds:
        for setting in args.settings:
            algorithm, steps, every, sets = SETTINGS[setting]
            out = root / setting / f"s{seed}"
            done = (out / "summary.json").is_file() and not args.overwrite
            if setting in BUDGET_OF:
                online = json.loads((root / BUDGET_OF[setting] / f"s{seed}" / "summary.json").read_text())
                steps = math.ceil(pairs_trained(online) / PAIR_BATCH)
                every = steps
                sets = [*sets, f"batch_size={PAIR_BATCH}"]
            if done:
                print(f"{out}: done, kept", flush=True)
            else:
                _train(algorithm, steps, every, seed, out, sets, args.timeout)
            if setting in BUDGET_OF:
                print(f"{out}: fixed evaluation {_fixed_eval(out)}", flush=True)



def _rollout_rows(out: Path) -> dict[int, dict]:
    """``rollout/*`` per round (the step it was sampled at) from ``metrics.csv``."""
    rows: dict[int, dict] = {}
    with open(out / "metrics.csv") as fh:
        for r in csv.DictReader(fh):
            if r.get("rollout/reward_mean"):
                rows[int(r["step"])] = {k.split("/", 1)[1]: float(v) for k, v in r.items()
                                        if k.startswith("rollout/") and v}
    return rows


def table(args) -> None:
    root = Path(args.root)
    runs = {}
    for setting in SETTINGS:
        paths = sorted((root / setting).glob("s*/summary.json"))
        if paths:
            runs[setting] = [(p.parent, json.loads(p.read_text())) for p in paths]
    print("| setting | lr | held-out exact match | gain | per seed | pairs trained on | gradient steps "
          "| sampled reward, first -> last round | KL to reference | prompts without a pair | wall time per run |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    reference = None
    for setting, rs in runs.items():
        if setting in BUDGET_OF:
            fixed = [_fixed_eval(out) for out, _ in rs]
            after = [f["exact_match_after"] for f in fixed]
            before = fixed[0]["exact_match_before"]
            pairs = [s["steps"] * s["config"]["batch_size"] for _, s in rs]
            reward, kl, ties = "–", _fmt([s["kl_to_reference"] for _, s in rs], 1, 3), "–"
        else:
            after = [s["exact_match_after"] for _, s in rs]
            before = rs[0][1]["exact_match_before"]
            pairs = [pairs_trained(s) for _, s in rs]
            reward = (f"{_fmt([s['reward_mean_first_round'] for _, s in rs], 1, 2)} -> "
                      f"{_fmt([s['reward_mean'] for _, s in rs], 1, 2)}")
            kl = _fmt([s["kl_to_reference"] for _, s in rs], 1, 3)
            ties = f"{_fmt([s['groups_without_signal'] for _, s in rs])} %"
        reference = before
        lr = rs[0][1]["config"]["lr"]
        print(f"| {setting} | {lr:g} | {_fmt(after)} | {100 * (statistics.mean(after) - before):+.1f} "
              f"| {', '.join(f'{100 * a:.1f}' for a in after)} | {', '.join(str(p) for p in pairs)} "
              f"| {rs[0][1]['steps']} | {reward} | {kl} | {ties} | {statistics.mean(s['wall_s'] for _, s in rs):.0f} s |")
    print(f"\nreference (exact_match_before): {100 * reference:.1f} %" if reference is not None else "no runs")
    for setting in [s for s in runs if s.startswith("iterative")]:
        rs = runs[setting]
        every = SETTINGS[setting][2]
        print(f"\n{setting} by round (mean over {len(rs)} seeds; exact match after the round's training, "
              "sampled reward and prompts without a pair of the round's own rollouts):\n")
        print("| round | held-out exact match | per seed | sampled reward | prompts without a pair |")
        print("|---|---|---|---|---|")
        per_round = {}
        for out, s in rs:
            rollouts = _rollout_rows(out)
            for e in s["eval_history"]:
                k = e["step"] // every
                per_round.setdefault(k, {"em": [], "reward": [], "ties": []})["em"].append(e["exact_match"])
                r = rollouts.get((k - 1) * every)
                if r is not None:
                    per_round[k]["reward"].append(r["reward_mean"])
                    per_round[k]["ties"].append(r["groups_without_signal"])
        print(f"| 0 (reference) | {100 * rs[0][1]['exact_match_before']:.1f} | | | |")
        for k in sorted(per_round):
            v = per_round[k]
            print(f"| {k} | {_fmt(v['em'])} | {', '.join(f'{100 * a:.1f}' for a in v['em'])} "
                  f"| {_fmt(v['reward'], 1, 3) if v['reward'] else '–'} "
                  f"| {_fmt(v['ties']) + ' %' if v['ties'] else '–'} |")


def main() -> None:
    results_main(__doc__, "runs/results-online-dpo", run, table, pick=("--settings", SETTINGS), steps=False)


if __name__ == "__main__":
    main()
