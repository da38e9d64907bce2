"""Responses/s of a round's sampling: transformers ``generate`` against the in-process vLLM engine.

Both sample what the rollout collector asks for: ``G`` responses to each of ``P`` prompts
(2-digit additions, the built-in task's), up to ``max_new_tokens`` tokens, temperature 1,
top-p 1, the per-token log-probs of the sampled tokens, one seeded call per round:

* ``hf``: :func:`offline_plugins.text.backends.generation.generate` (``log_probs=True``), the
  collector's default (``--generator hf``): one batched ``model.generate``, left-padded,
  KV cache, the log-prob recorder;
* ``vllm``: :meth:`offline_plugins.text.backends.vllm_engine.VLLMGenerator.generate`
  (``--generator vllm``) on an engine started from the same weights; ``sync`` is the
  weight load a round pays before sampling (``sync_every=1``), timed apart.

The model is a random-init GPT-2 built in code (``tiny``: the package's 2 x 128; ``small``:
6 x 512; ``medium``: 12 x 768, GPT-2 small's shape with the character vocabulary), so
responses run to ``max_new_tokens`` (a random model rarely samples eos): both engines
generate the same number of tokens. Median over ``--rounds`` interleaved rounds, after one
warm-up round each. Needs vLLM (``bash scripts/make_vllm_env.sh``; run in that venv):

    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 python bench/generation_bench.py [--threads 1] \
        [--sizes tiny small] [--max-new-tokens 6 64] [--prompts 16] [--group-size 8] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

SIZES = {"tiny": (128, 2, 4), "small": (512, 6, 8), "medium": (768, 12, 12)}


def _model(size: str, max_positions: int):
    from offline_plugins.modules.tiny_lm import char_tokenizer, tiny_causal_lm

    tok = char_tokenizer()
    hidden, layers, heads = SIZES[size]
    model = tiny_causal_lm(tok, hidden_size=hidden, num_layers=layers, num_heads=heads, intermediate_size=4 * hidden,
                           max_positions=max_positions, seed=0)
    return model.eval(), tok


def _prompts(tok, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [tok(f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=")["input_ids"] for _ in range(n)]


def bench(size: str, max_new_tokens: int, *, prompts: int, group_size: int, rounds: int) -> dict:
    from offline_plugins.text.backends.generation import generate
    from offline_plugins.text.backends.vllm_engine import VLLMGenerator

    model, tok = _model(size, max_positions=max(128, 16 + max_new_tokens))
    kwargs = dict(pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, max_new_tokens=max_new_tokens,
                  num_samples=group_size, temperature=1.0, top_p=1.0)
    engine = VLLMGenerator(sync_every=1)
    t0 = time.perf_counter()
    engine.before_round(model, 0)
    start_s = time.perf_counter() - t0
    times = {"hf": [], "vllm": [], "sync": []}
    tokens = {"hf": [], "vllm": []}
    try:
        for r in range(rounds + 1):  # round 0 warms both up
            batch = _prompts(tok, prompts, seed=r)
            t0 = time.perf_counter()
            out = generate(model, batch, seed=r, log_probs=True, **kwargs)
            hf_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            engine.before_round(model, r + 1)  # one optimiser step later: a weight load
            sync_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            vout = engine.generate(batch, seed=r, **kwargs)
            vllm_s = time.perf_counter() - t0
            if r:
                times["hf"].append(hf_s)
                times["vllm"].append(vllm_s)
                times["sync"].append(sync_s)
                tokens["hf"].append(int(out.lengths.sum()))
                tokens["vllm"].append(int(vout.lengths.sum()))
    finally:
        engine.close()
    n = prompts * group_size
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {"size": size, "parameters": sum(p.numel() for p in model.parameters()), "max_new_tokens": max_new_tokens,
           "responses_per_round": n, "engine_start_s": round(start_s, 2), "sync_s": round(med["sync"], 4)}
    for k in ("hf", "vllm"):
        row[f"{k}_responses_per_s"] = round(n / med[k], 1)
        row[f"{k}_tokens_per_s"] = round(statistics.median(tokens[k]) / med[k], 1)
    row["vllm_with_sync_responses_per_s"] = round(n / (med["vllm"] + med["sync"]), 1)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=sorted(SIZES))
    p.add_argument("--max-new-tokens", nargs="+", type=int, default=[6, 64])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rows = [bench(size, k, prompts=args.prompts, group_size=args.group_size, rounds=args.rounds)
            for size in args.sizes for k in args.max_new_tokens]
    import transformers
    import vllm

    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "vllm": vllm.__version__,
            "threads": args.threads, "torch_threads_after": torch.get_num_threads()}
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=2))
        return
    print(meta)
    print("| model | params | new tokens | responses/round | hf responses/s | vllm responses/s | vllm + sync "
          "responses/s | hf tokens/s | vllm tokens/s | engine start | sync |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['parameters'] / 1e6:.1f} M | {r['max_new_tokens']} | {r['responses_per_round']} | "
              f"{r['hf_responses_per_s']} | {r['vllm_responses_per_s']} | {r['vllm_with_sync_responses_per_s']} | "
              f"{r['hf_tokens_per_s']} | {r['vllm_tokens_per_s']} | {r['engine_start_s']} s | "
              f"{r['sync_s'] * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
