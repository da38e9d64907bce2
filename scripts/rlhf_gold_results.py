"""PPO-RLHF against a learnt proxy with a known gold reward (issue 26 item 3): the seeds' shape.

    OFFLINE_PLUGINS_CACHE=~/.cache/offline-plugins python scripts/rlhf_gold_results.py run \\
        --root runs/results-rlhf-gold --seeds 0 1 2
    python scripts/rlhf_gold_results.py table --root runs/results-rlhf-gold

The task is ``offline-plugins/arithmetic-length/v0``: the built-in arithmetic prompts, gold reward
``max(0, 1 - |chars - 6| / 6)`` of the stripped response (``offline_plugins.text.tasks.LengthTask``);
the SFT reference (the cached arithmetic one) answers in 2-3 characters. Per seed, one run at a
time (``--threads 1``), into ``ROOT/SETTING/sSEED`` (an existing result is kept unless
``--overwrite``):

* ``reward-model``: ``train reward-model`` on ``offline-plugins/arithmetic-length/preference-v0``
  (the reference's samples cut to 1-5 characters, ranked by the gold, ties dropped); its held-out
  pairwise accuracy is the proxy's quality.
* ``ppo-rlhf``: from the SFT reference against that proxy with the KL penalty, response budget 12
  tokens (room to overshoot the target of 6); every evaluation records the held-out gold
  (``heldout_gold``), the proxy (``heldout_reward``, ``reward_mean``) and the KL; the run's
  reward-hacking monitor keeps the best-gold checkpoint, warns, and fits Gao et al.'s RL form.
* ``best-of-n``: the same proxy picks the best of ``n`` reference samples (budget 12) per held-out
  prompt, ``n = 1, 2, 4, ..., --bon-max``; gold of the pick against ``KL_bon = log n - (n-1)/n``,
  with Gao et al.'s best-of-n fit.
* ``grpo-gold``: ``grpo`` with the gold function itself as the reward (the task's verifier), the
  same budget: what optimising the gold directly reaches.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import run_logged  # noqa: E402

DATASET = "offline-plugins/arithmetic-length/v0"
PAIRS = "offline-plugins/arithmetic-length/preference-v0"
SETTINGS = ("reward-model", "ppo-rlhf", "best-of-n", "grpo-gold")


def _cli(cmd: list[str], out: Path, timeout: int) -> None:
    run_logged(cmd, timeout, shows=lambda line: " on " in line and " steps, seed " in line)


def best_of_n(rm_dir: Path, *, seed: int, n_max: int, max_new_tokens: int, prompts: int) -> dict:
    """Gold and proxy of the proxy's pick among ``n`` reference samples per held-out prompt."""
    import torch

    from offline_plugins.eval.overoptimization import fit_gao
    from offline_plugins.kinds.sft import supervised_finetune
    from offline_plugins.text.backends.generation import generate_texts as generate
    from offline_plugins.text.data.rollouts import load_reward_function, load_rollout_data
    from offline_plugins.text.tasks import LengthTask

    torch.set_num_threads(1)
    data = load_rollout_data(DATASET, max_new_tokens=max_new_tokens, group_size=1, eval_prompts=prompts,
                             finetune=supervised_finetune)
    task, proxy_fn = LengthTask(target=6), load_reward_function(str(rm_dir))
    rows = [r["prompt"] for r in data.source.held_out]
    samples = generate(data.reference, data.tokenizer, rows, num_samples=n_max, max_new_tokens=max_new_tokens,
                       seed=seed, batch_size=25)
    gold = [task.rewards([p] * n_max, s) for p, s in zip(rows, samples)]
    proxy = [proxy_fn([p] * n_max, s) for p, s in zip(rows, samples)]
    points, n = [], 1
    while n <= n_max:
        picks = [max(range(n), key=lambda j: pr[j]) for pr in proxy]
        points.append({"n": n, "kl": math.log(n) - (n - 1) / n,
                       "gold": statistics.mean(g[k] for g, k in zip(gold, picks)),
                       "proxy": statistics.mean(pr[k] for pr, k in zip(proxy, picks)),
                       "chars": statistics.mean(len(s[k].strip()) for s, k in zip(samples, picks))})
        n *= 2
    g0 = points[0]["gold"]
    fit = fit_gao([math.sqrt(p["kl"]) for p in points], [p["gold"] - g0 for p in points], form="bon")
    return {"points": points, "gao_fit_bon": fit, "prompts": len(rows), "n_max": n_max}


def run(args) -> None:
    root = Path(args.root)
    for seed in args.seeds:
        for setting in args.settings:
            out = root / setting / f"s{seed}"
            done = out / ("result.json" if setting == "best-of-n" else "summary.json")
            if done.is_file() and not args.overwrite:
                print(f"{out}: done, kept", flush=True)
                continue
            rm = root / "reward-model" / f"s{seed}"
            common = ["--model", "tiny", "--seed", str(seed), "--threads", "1", "--no-progress", "--out", str(out),
                      "--overwrite"]
            if setting == "reward-model":
                _cli(["offline-plugins", "train", "reward-model", "--dataset", PAIRS, "--steps", str(args.rm_steps),
                      "--eval-every", str(args.rm_steps // 2), *common], out, args.timeout)
            elif setting == "ppo-rlhf":
                _cli(["offline-plugins", "train", "ppo-rlhf", "--dataset", DATASET, "--reward", str(rm),
                      "--set", f"max_new_tokens={args.max_new_tokens}", "--steps", str(args.ppo_steps),
                      "--eval-every", str(args.eval_every), *common], out, args.timeout)
            elif setting == "grpo-gold":
                _cli(["offline-plugins", "train", "grpo", "--dataset", DATASET,
                      "--set", f"max_new_tokens={args.max_new_tokens}", "--steps", str(args.grpo_steps),
                      "--eval-every", str(args.grpo_eval_every), *common], out, args.timeout)
            else:
                result = best_of_n(rm, seed=seed, n_max=args.bon_max, max_new_tokens=args.max_new_tokens,
                                   prompts=args.bon_prompts)
                out.mkdir(parents=True, exist_ok=True)
                done.write_text(json.dumps(result, indent=2))
                print(f"best-of-n s{seed}: " + ", ".join(f"n={p['n']} gold {p['gold']:.3f}" for p in result["points"]),
                      flush=True)


def _load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def _fmt(values, digits=3) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def table(args) -> None:
    root = Path(args.root)
    seeds = sorted(int(p.name[1:]) for p in (root / "ppo-rlhf").glob("s*")) if (root / "ppo-rlhf").is_dir() else []
    rm = [_load(root / "reward-model" / f"s{s}" / "summary.json") for s in seeds]
    ppo = [_load(root / "ppo-rlhf" / f"s{s}" / "summary.json") for s in seeds]
    grpo = [_load(root / "grpo-gold" / f"s{s}" / "summary.json") for s in seeds]
    bon = [_load(root / "best-of-n" / f"s{s}" / "result.json") for s in seeds]
    rows = [("proxy: held-out pairwise accuracy", [r["preference_accuracy"] for r in rm if r])]
    hack = [(p.get("reward_hacking") or {}) for p in ppo if p]
    rows += [
        ("ppo-rlhf: held-out gold, reference", [p["heldout_gold_before"] for p in ppo if p]),
        ("ppo-rlhf: best held-out gold (monitor)", [h["best_gold"]["gold"] for h in hack if h.get("best_gold")]),
        ("ppo-rlhf: KL at the best gold", [h["best_gold"]["kl"] for h in hack if h.get("best_gold")]),
        ("ppo-rlhf: held-out gold, end", [p["heldout_gold_after"] for p in ppo if p]),
        ("ppo-rlhf: held-out proxy, reference", [p["heldout_reward_before"] for p in ppo if p]),
        ("ppo-rlhf: held-out proxy, end", [p["heldout_reward_after"] for p in ppo if p]),
        ("ppo-rlhf: KL to the reference, end", [p["kl_to_reference"] for p in ppo if p]),
        ("ppo-rlhf: held-out response characters, end", [p["response_chars_after"] for p in ppo if p]),
        ("ppo-rlhf: monitor warnings", [float(len(h.get("hacking_warnings") or [])) for h in hack]),
        ("ppo-rlhf: Gao RL fit, peak KL", [(h.get("gao_fit_rl") or {}).get("peak_kl") for h in hack]),
        ("ppo-rlhf: Gao RL fit, r2", [(h.get("gao_fit_rl") or {}).get("r2") for h in hack]),
        ("grpo-gold: held-out gold, end", [g["heldout_reward_after"] for g in grpo if g]),
    ]
    for b in (b for b in bon[:1] if b):
        for i, p in enumerate(b["points"]):
            rows.append((f"best-of-{p['n']} (KL {p['kl']:.2f}): gold", [x["points"][i]["gold"] for x in bon if x]))
        rows.append(("best-of-n: Gao fit, peak KL", [(x["gao_fit_bon"] or {}).get("peak_kl") for x in bon if x]))
    print(f"| figure | mean ± sd over seeds {seeds} | per seed |\n|---|---|---|")
    for name, values in rows:
        per = ", ".join("n/a" if v is None else f"{v:.3f}" for v in values)
        print(f"| {name} | {_fmt(values)} | {per} |")
    for s, p in zip(seeds, ppo):
        if p:
            print(f"\nppo-rlhf s{s} (step: gold / proxy / KL / chars): " + "; ".join(
                f"{r['step']}: {r.get('heldout_gold', float('nan')):.3f} / {r['heldout_reward']:.2f} / "
                f"{r['kl_to_reference']:.1f} / {r['response_chars']:.1f}" for r in p["eval_history"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--root", default="runs/results-rlhf-gold")
    r.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    r.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    r.add_argument("--rm-steps", type=int, default=256)
    r.add_argument("--ppo-steps", type=int, default=2400)
    r.add_argument("--eval-every", type=int, default=200)
    r.add_argument("--grpo-steps", type=int, default=600)
    r.add_argument("--grpo-eval-every", type=int, default=150)
    r.add_argument("--max-new-tokens", type=int, default=12)
    r.add_argument("--bon-max", type=int, default=64)
    r.add_argument("--bon-prompts", type=int, default=200)
    r.add_argument("--timeout", type=int, default=900)
    r.add_argument("--overwrite", action="store_true")
    t = sub.add_parser("table")
    t.add_argument("--root", default="runs/results-rlhf-gold")
    args = parser.parse_args()
    run(args) if args.cmd == "run" else table(args)


if __name__ == "__main__":
    main()
