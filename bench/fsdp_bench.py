"""DDP against FSDP2 (``--strategy fsdp``) on two ranks: steps/s and peak memory of a DPO run.

Both runs are ``offline-plugins train dpo`` through the same CLI, on the same pairs and the
same GPT-2 built from a config (the package's character vocabulary, saved once with
``save_pretrained`` and given as ``--model``): DDP holds the whole model, its gradients and
Adam's two moments on every rank; FSDP2 holds a half of each per rank and gathers a layer's
parameters for its forward and backward. Reported per strategy: steps/s of the fit (the
summary's ``steps_per_s``), what rank 0 holds of the parameters and Adam's moments
(``held_state_mb``: the training state FSDP shards) and rank 0's peak memory
(``peak_memory_mb``: on CPU ranks the host's resident set, which also counts the Python
process, the data preparation (the reference's log-probs) and the export of the full model at
the end; CUDA's peak allocated on GPUs), and the FSDP / DDP ratios.

    OMP_NUM_THREADS=1 python bench/fsdp_bench.py [--size small|medium|500m] [--steps 6] \
        [--device cpu|cuda] [--json]

``--device cuda`` needs two GPUs (``--devices 2``); on CPU the two ranks are two processes
over gloo (one core each).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: hidden size, layers, heads of the GPT-2 built for the run
SIZES = {"small": (512, 6, 8), "medium": (768, 12, 12), "500m": (1280, 24, 20)}


def _model_folder(root: Path, size: str) -> tuple[Path, int]:
    from offline_plugins.modules.tiny_lm import char_tokenizer, tiny_causal_lm

    tok = char_tokenizer()
    hidden, layers, heads = SIZES[size]
    model = tiny_causal_lm(tok, hidden_size=hidden, num_layers=layers, num_heads=heads,
                           intermediate_size=4 * hidden, max_positions=128, seed=0)
    folder = root / f"gpt2-{size}"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, sum(p.numel() for p in model.parameters())


def _pairs(root: Path) -> Path:
    rows = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1 + (a % 3))}
            for a in range(20) for b in range(20)]
    path = root / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(strategy: str, model: Path, data: Path, out: Path, *, steps: int, device: str, batch: int) -> dict:
    cmd = [sys.executable, "-m", "offline_plugins.cli", "train", "dpo", "--dataset", str(data), "--model", str(model),
           "--steps", str(steps), "--devices", "2", "--accelerator", "gpu" if device == "cuda" else "cpu",
           "--strategy", strategy, "--set", f"batch_size={batch}", "--eval-every", str(steps), "--out", str(out),
           "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONWARNINGS": "ignore"}
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{strategy} run failed:\n{proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    memory = summary["peak_memory_mb"]
    return {"strategy": strategy, "steps_per_s": summary["steps_per_s"], "train_s": summary["train_s"],
            "wall_s": round(time.perf_counter() - started, 1),
            "peak_mb": memory.get("cuda_max_allocated", memory["host_max_rss"]),
            "memory_kind": "cuda_max_allocated" if "cuda_max_allocated" in memory else "host_max_rss",
            # rank 0's share of the parameters and of Adam's moments (the summary's held_state_mb)
            "held_mb": round(sum(summary["held_state_mb"].values()), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="fsdp-bench-") as tmp:
        root = Path(tmp)
        os.environ.setdefault("OFFLINE_PLUGINS_CACHE", str(root / "cache"))
        model, n_params = _model_folder(root, args.size)
        data = _pairs(root)
        rows = [_run(s, model, data, root / s, steps=args.steps, device=args.device, batch=args.batch_size)
                for s in ("ddp", "fsdp")]
    ddp, fsdp = rows
    result = {"size": args.size, "parameters": n_params, "device": args.device, "steps": args.steps,
              "batch_size": args.batch_size, "runs": rows,
              "fsdp_over_ddp": {"steps_per_s": round(fsdp["steps_per_s"] / ddp["steps_per_s"], 2),
                                "peak_memory": round(fsdp["peak_mb"] / ddp["peak_mb"], 2),
                                "held_state": round(fsdp["held_mb"] / ddp["held_mb"], 2)}}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"DPO, GPT-2 {args.size} ({n_params / 1e6:.1f} M parameters), 2 ranks on {args.device}, "
          f"{args.steps} steps of {args.batch_size} pairs")
    for r in rows:
        print(f"  {r['strategy']:5s} {r['steps_per_s']:7.2f} steps/s   parameters + Adam held by rank 0 "
              f"{r['held_mb']:8.1f} MB   peak {r['peak_mb']:8.1f} MB ({r['memory_kind']})")
    ratio = result["fsdp_over_ddp"]
    print(f"  fsdp / ddp: {ratio['steps_per_s']}x steps/s, {ratio['held_state']}x state held per rank, "
          f"{ratio['peak_memory']}x peak memory")


if __name__ == "__main__":
    main()
