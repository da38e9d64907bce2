"""Peak memory of per-token log-probs on large vocabularies: one forward to ``[N, T, V]`` logits
against :class:`~offline_plugins.modules.causal_lm.CausalLMLogProbs`'s ``chunk_size`` path.

    python bench/logprob_memory_bench.py [--vocab 32000 150000] [--rows 8] [--length 256] [--chunk 32]

Each case runs in its own process (a fresh ``ru_maxrss``): a 2-layer, 64-wide GPT-2 built from
a config with the given vocabulary, ``rows x length`` random tokens, the log-probs' sum
backpropagated once (a training step's pattern). Reported: the peak resident memory the step
added over the process after building the model and the batch, and the step's time.
``--device cuda`` measures ``torch.cuda.max_memory_allocated`` instead.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def one_case(vocab: int, rows: int, length: int, chunk: int, device: str) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from offline_plugins.modules.causal_lm import CausalLMLogProbs

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=2, n_positions=length, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).to(device)
    ids = torch.randint(0, vocab, (rows, length), device=device)
    mask = torch.ones(rows, length, dtype=torch.bool, device=device)
    actor = CausalLMLogProbs(model, chunk_size=chunk or None)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    actor.log_probs(ids, mask).sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"vocab": vocab, "chunk": chunk, "added_mb": round((peak - before) / 2**20, 1),
            "seconds": round(time.perf_counter() - t0, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 150000])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--case", nargs=2, type=int, help=argparse.SUPPRESS)  # (vocab, chunk): run one, print JSON
    args = parser.parse_args()
    if args.case:
        print(json.dumps(one_case(args.case[0], args.rows, args.length, args.case[1], args.device)))
        return
    results = []
    for vocab in args.vocab:
        for chunk in (0, args.chunk):
            out = subprocess.run([sys.executable, __file__, "--case", str(vocab), str(chunk), "--rows", str(args.rows),
                                  "--length", str(args.length), "--device", args.device],
                                 capture_output=True, text=True, check=True)
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{args.rows} rows x {args.length} tokens, 2-layer 64-wide GPT-2, forward + backward of the log-probs")
    print("| vocabulary | path | memory added (MB) | time (s) |")
    print("|---|---|---|---|")
    for r in results:
        path = "one forward, [N, T, V] logits" if not r["chunk"] else f"chunk_size={r['chunk']}"
        print(f"| {r['vocab']:,} | {path} | {r['added_mb']} | {r['seconds']} |")


if __name__ == "__main__":
    main()
