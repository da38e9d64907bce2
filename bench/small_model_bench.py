"""Tokens/s of the built-in models through the training shell: ``small`` (a 1.7 M Qwen2 with a BPE
tokenizer and a chat template) beside ``tiny`` (a 0.4 M GPT-2 with a character tokenizer), SFT, DPO and
GRPO on the same rows with the same settings, in the same process.

    python bench/small_model_bench.py [--threads 1] [--steps 40] [--json]

Each figure is the run's own ``tokens_per_s`` (every real token of the batches its steps read, prompts
included; ``summary.json``), median over ``--rounds``; GRPO's steps include sampling the rollouts. The
tokenizers differ, so the same text is a different number of tokens: small's BPE merges the tasks' words,
its chat template adds 8 tokens around each prompt; both are in the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch


def length_reward(prompts, responses, **row):
    return [1.0 / (1.0 + len(r)) for r in responses]


def _files(root: Path) -> dict:
    sums = [(a, b) for a in range(10, 60) for b in range(10, 30)]
    def write(name: str, rows: list) -> Path:
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return root / name

    return {
        "sft": write("sft.jsonl", [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in sums]),
        "dpo": write("pairs.jsonl", [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
                                     for a, b in sums]),
        "grpo": write("prompts.jsonl", [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in sums]),
    }


SETTINGS = {
    "sft": {"batch_size": 32},
    "dpo": {"batch_size": 16},
    "grpo": {"group_size": 8, "prompts_per_round": 8, "batch_size": 64, "max_new_tokens": 6, "eval_prompts": 4},
}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from offline_plugins.lightning.run import train_algorithm

    sys.path.insert(0, str(Path(__file__).parent))
    root = Path(tempfile.mkdtemp(prefix="small-bench-"))
    os.environ.setdefault("OFFLINE_PLUGINS_CACHE", str(root / "cache"))
    files = _files(root)
    results: dict = {"threads": args.threads, "steps": args.steps, "rounds": args.rounds, "device": args.device,
                     "torch": torch.__version__, "runs": {}}
    for algo in ("sft", "dpo", "grpo"):
        for model in ("tiny", "small"):
            rates = []
            for r in range(args.rounds):
                summary = train_algorithm(
                    algo, str(files[algo]), model=model, steps=args.steps, seed=r, progress=False,
                    threads=args.threads, eval_every=0, out_dir=root / f"{algo}-{model}-{r}",
                    accelerator="gpu" if args.device == "cuda" else "cpu",
                    reward="small_model_bench:length_reward" if algo == "grpo" else None,
                    overrides=SETTINGS[algo])
                rates.append(summary["tokens_per_s"])
            results["runs"][f"{algo}/{model}"] = {"tokens_per_s": statistics.median(rates), "all": rates}
        tiny, small = (results["runs"][f"{algo}/{m}"]["tokens_per_s"] for m in ("tiny", "small"))
        results["runs"][f"{algo}/ratio"] = small / tiny
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(f"{'':6} {'tiny tok/s':>11} {'small tok/s':>12} {'small/tiny':>11}")
        for algo in ("sft", "dpo", "grpo"):
            run = results["runs"]
            print(f"{algo:6} {run[algo + '/tiny']['tokens_per_s']:11.0f} {run[algo + '/small']['tokens_per_s']:12.0f} "
                  f"{run[algo + '/ratio']:10.2f}x")
    return results


if __name__ == "__main__":
    main()
