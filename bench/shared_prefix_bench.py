"""Shared prefixes: a GRPO-shaped batch's forward and backward with each prompt computed once.

``P`` prompts of ``--prompt-len`` tokens, ``G`` responses of ``--response-len`` tokens each
(right-padded rows, the package's layout), through a GPT-2 built from a config. Two ways of
computing the rows' token log-probs and their gradient (``sum(log-probs).backward()``):

* ``plain``: :meth:`~offline_plugins.modules.causal_lm.CausalLMLogProbs.log_probs`, one
  forward over the ``P * G`` rows, every prompt computed ``G`` times;
* ``shared``: the same with ``shared_prefix=True``
  (:func:`~offline_plugins.modules.causal_lm.shared_prefix_log_probs`): the ``P`` prompts
  once, their key/value cache copied to the rows, the responses on it.

Each mode runs in its own process (so the peak memory is its own): real tokens per second of
forward + backward (median of ``--rounds`` after one warm-up) and the peak memory the step
adds over the model alone (CUDA's peak allocated, or on CPU the growth of the resident set).

    OMP_NUM_THREADS=1 python bench/shared_prefix_bench.py [--size small] [--prompts 4] [--group-size 8] \
        [--prompt-len 192] [--response-len 32] [--device cpu|cuda] [--json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

SIZES = {"tiny": (128, 2, 4), "small": (512, 6, 8), "medium": (768, 12, 12)}


def _measure(args) -> dict:
    from offline_plugins.modules.causal_lm import CausalLMLogProbs
    from offline_plugins.modules.tiny_lm import char_tokenizer, tiny_causal_lm

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    tok = char_tokenizer()
    hidden, layers, heads = SIZES[args.size]
    width = args.prompt_len + args.response_len
    model = tiny_causal_lm(tok, hidden_size=hidden, num_layers=layers, num_heads=heads, intermediate_size=4 * hidden,
                           max_positions=width, seed=0).to(device)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = torch.randint(4, vocab, (args.prompts, args.prompt_len), generator=g)
    responses = torch.randint(4, vocab, (args.prompts * args.group_size, args.response_len), generator=g)
    tokens = torch.cat([prompts.repeat_interleave(args.group_size, 0), responses], 1).to(device)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    response = torch.zeros_like(mask)
    response[:, args.prompt_len:] = True
    actor = CausalLMLogProbs(model, shared_prefix=args.mode == "shared")

    def step() -> None:
        model.zero_grad(set_to_none=True)
        actor.log_probs(tokens, mask, response).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step()  # warm-up (and the peak)
    if device.type == "cuda":
        extra = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) / 1024
    times = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    return {"mode": args.mode, "tokens_per_s": round(tokens.numel() / seconds, 1), "step_s": round(seconds, 4),
            "peak_extra_mb": round(extra, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=192)
    p.add_argument("--response-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--mode", choices=("plain", "shared"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.mode is not None:  # one measurement, in this process
        print(json.dumps(_measure(args)))
        return
    rows = []
    for mode in ("plain", "shared"):
        cmd = [sys.executable, __file__, "--mode", mode] + [a for a in sys.argv[1:] if a != "--json"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        rows.append(json.loads(out))
    plain, shared = rows
    result = {"size": args.size, "device": args.device, "prompts": args.prompts, "group_size": args.group_size,
              "prompt_len": args.prompt_len, "response_len": args.response_len, "runs": rows,
              "shared_over_plain": {"tokens_per_s": round(shared["tokens_per_s"] / plain["tokens_per_s"], 2),
                                    "peak_extra_memory": round(shared["peak_extra_mb"] / max(plain["peak_extra_mb"],
                                                                                            1e-9), 2)}}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"GPT-2 {args.size}, {args.prompts} prompts x {args.group_size} responses, {args.prompt_len} + "
          f"{args.response_len} tokens, forward + backward on {args.device}")
    for r in rows:
        print(f"  {r['mode']:6s} {r['tokens_per_s']:10.1f} tokens/s   step {r['step_s']:.3f} s   "
              f"peak +{r['peak_extra_mb']:.1f} MB")
    ratio = result["shared_over_plain"]
    print(f"  shared / plain: {ratio['tokens_per_s']}x tokens/s, {ratio['peak_extra_memory']}x peak memory")


if __name__ == "__main__":
    main()
