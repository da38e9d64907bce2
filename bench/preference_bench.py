"""Throughput of our DPO step against a bare forward+backward and TRL's ``DPOTrainer``.

Same tiny model (``load_causal_lm("tiny")``), same data (16 pairs of 64 tokens:
32 prompt + 32 response), CPU, in one run, interleaved rounds, median pairs/s:

* ``bare``: the policy's forward + backward on the same ``16*2`` rows (HF causal-LM
  cross-entropy), no optimiser step: the floor any trainer pays;
* ``ours``: ``DPOLoss(CausalLMLogProbs(policy))`` with cached fp32 reference
  log-probs, backward and an Adam step (what the Lightning shell runs);
* ``hand``: the seeds' hand-written DPO step (5.6.11: full log-softmax, a no-grad
  reference forward every step), backward and an Adam step;
* ``trl``: TRL's ``DPOTrainer`` on the same pairs with its defaults (a reference forward
  every step; skipped when ``trl`` is not installed), timed from its second to its last
  step by a callback, so set-up and tokenisation are excluded.

Targets: ours >= 1.5x TRL and >= 0.7x bare.

On a GPU (``--device cuda``), ``--model-size 100m`` builds a 12-layer, 768-wide GPT-2
(about 86 M parameters with the character vocabulary) from a config, and ``--precision
bf16`` runs every contender under bf16 autocast (TRL with ``bf16=True``); peak memory per
contender is reported.

    python bench/preference_bench.py [--threads 2] [--steps 20] [--rounds 3] [--skip-trl] [--json]
        [--device cuda] [--model-size tiny|100m|500m] [--precision fp32|bf16]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import time

import torch

#: set by main: the autocast context every contender's forward runs under
AUTOCAST = contextlib.nullcontext


def make_batch(tok, pairs: int = 16, prompt_len: int = 32, response_len: int = 32, seed: int = 0):
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    low = len(tok) - 95  # printable characters, no special tokens
    tokens = torch.randint(low, len(tok), (pairs, 2, prompt_len + response_len), generator=g)
    tokens[:, 1, :prompt_len] = tokens[:, 0, :prompt_len]  # same prompt for chosen and rejected
    length = prompt_len + response_len
    attn = torch.ones(pairs, 2, length, dtype=torch.bool)
    resp = torch.zeros(pairs, 2, length, dtype=torch.bool)
    resp[..., prompt_len:] = True
    return TensorDict(
        {"tokens": {"full": tokens}, "masks": {"all_attention_mask": attn, "all_assistant_mask": resp}}, [pairs, 2]
    )


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rate(step, batch_pairs: int, steps: int) -> float:
    step()  # warm-up
    _sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync()
    return batch_pairs * steps / (time.perf_counter() - t0)


def model_100m(tok, seed: int = 0):
    """A 12-layer, 768-wide GPT-2 from a config (no download), on the character vocabulary."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tok), n_positions=256, n_embd=768, n_layer=12, n_head=12,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                        activation_function="gelu")
    return GPT2LMHeadModel(config)


def model_500m(tok, seed: int = 0):
    """Qwen2.5-0.5B's shape from a config (no download): 24 layers, 896 wide, 14 query and 2 key/value
    heads, a 4864-wide SwiGLU, RMSNorm, rotary positions, a tied embedding of 151,936 rows (~494 M
    parameters; the ``small`` tokenizer's 462 ids are the first rows, the rest stand for a hub
    vocabulary's logits and memory). Random weights: for throughput and memory only."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    return Qwen2ForCausalLM(config)


def base_model(model_size: str):
    """``(model, tokenizer)`` of ``--model-size``: the tiny GPT-2, a 100 M GPT-2 on tiny's characters, or the
    0.5 B Qwen2 shape on the ``small`` BPE tokenizer and its chat template."""
    from offline_plugins.modules.tiny_lm import load_causal_lm

    model, tok = load_causal_lm("small" if model_size == "500m" else "tiny", seed=0)
    if model_size == "100m":
        model = model_100m(tok)
    elif model_size == "500m":
        model = model_500m(tok)
    return model, tok


def bench_bare(model, batch):
    ids = batch["tokens", "full"].reshape(-1, batch["tokens", "full"].shape[-1])
    mask = batch["masks", "all_attention_mask"].reshape(ids.shape).long()

    def step():
        model.zero_grad(set_to_none=True)
        with AUTOCAST():
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()

    return step


def bench_ours(model, batch):
    from offline_plugins.modules.causal_lm import CausalLMLogProbs
    from offline_plugins.objectives.llm import DPOLoss

    loss = DPOLoss(CausalLMLogProbs(model), beta=0.1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=True)

    def step():
        with AUTOCAST():
            out = loss(batch)
        opt.zero_grad(set_to_none=True)
        out["loss_dpo"].backward()
        opt.step()

    return step


def bench_hand(model, reference, batch):
    """The seeds' minimal DPO (5.6.11), with a reference forward every step."""
    import torch.nn.functional as F

    ids = batch["tokens", "full"].reshape(-1, batch["tokens", "full"].shape[-1])
    attn = batch["masks", "all_attention_mask"].reshape(ids.shape).long()
    resp = batch["masks", "all_assistant_mask"].reshape(ids.shape)[:, 1:].float()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=True)

    def seq_logp(m):
        logits = m(input_ids=ids, attention_mask=attn).logits[:, :-1]
        logp = F.log_softmax(logits, -1).gather(2, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        return (logp * resp).sum(1).view(-1, 2)

    def step():
        with AUTOCAST():
            with torch.no_grad():
                ref = seq_logp(reference)
            pol = seq_logp(model)
        z = 0.1 * ((pol[:, 0] - ref[:, 0]) - (pol[:, 1] - ref[:, 1])).float()
        loss = -F.logsigmoid(z).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def bench_trl(model, tok, batch, steps: int):
    """TRL's DPOTrainer on the same pairs; pairs/s over the timed steps (setup excluded)."""
    try:
        import trl
        from datasets import Dataset
        from transformers import TrainerCallback
    except ImportError:
        return None
    full = batch["tokens", "full"]
    resp = batch["masks", "all_assistant_mask"]
    rows = []
    for i in range(full.shape[0]):
        prompt = tok.decode(full[i, 0][~resp[i, 0]])
        rows.append({"prompt": prompt, "chosen": tok.decode(full[i, 0][resp[i, 0]]),
                     "rejected": tok.decode(full[i, 1][resp[i, 1]])})
    pairs = full.shape[0]
    data = Dataset.from_list(rows * (steps + 2))

    class Clock(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, args, state, control, **kw):
            self.times.append(time.perf_counter())

    clock = Clock()
    args = trl.DPOConfig(
        output_dir="/tmp/preference_bench_trl", per_device_train_batch_size=pairs, max_steps=steps + 1,
        beta=0.1, learning_rate=1e-4, max_length=full.shape[-1] + 2, report_to=[], logging_steps=10_000,
        save_strategy="no", use_cpu=not torch.cuda.is_available() or next(model.parameters()).device.type == "cpu",
        dataloader_num_workers=0, disable_tqdm=True, bf16=AUTOCAST is not contextlib.nullcontext,
    )
    trainer = trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=data,
                             processing_class=tok, callbacks=[clock])
    trainer.train()
    t = clock.times
    return pairs * (len(t) - 2) / (t[-1] - t[1]) if len(t) > 2 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-trl", action="store_true", help="do not time TRL's DPOTrainer")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--model-size", choices=("tiny", "100m", "500m"), default="tiny",
                        help="100m: a 12-layer GPT-2; 500m: the Qwen2.5-0.5B shape in bf16 (both for a GPU)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global AUTOCAST
    device = torch.device(args.device)
    if args.precision == "bf16":
        AUTOCAST = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731

    base, tok = base_model(args.model_size)
    base = base.to(device)
    batch = make_batch(tok).to(device)
    from offline_plugins.text.data.preference import add_reference_log_probs

    add_reference_log_probs(batch, base)  # once, in fp32, outside the timed loop, as training does
    pairs = batch.batch_size[0]
    results: dict[str, list[float]] = {"bare": [], "ours": [], "hand": []}
    peak: dict[str, float] = {}

    def measured(name, make):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        results[name].append(rate(make(), pairs, args.steps))
        if device.type == "cuda":
            peak[name] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)

    for _ in range(args.rounds):
        measured("bare", lambda: bench_bare(copy.deepcopy(base).train(), batch))
        measured("ours", lambda: bench_ours(copy.deepcopy(base).train(), batch))
        measured("hand", lambda: bench_hand(copy.deepcopy(base).train(), copy.deepcopy(base).eval(), batch))
    med = {k: statistics.median(v) for k, v in results.items()}
    trl_rate = None if args.skip_trl else bench_trl(copy.deepcopy(base), tok, batch, args.steps)
    if trl_rate is not None:
        med["trl"] = trl_rate
    summary = {
        "pairs_per_s": {k: round(v, 1) for k, v in med.items()},
        "ours_over_bare": round(med["ours"] / med["bare"], 2),
        "ours_over_hand": round(med["ours"] / med["hand"], 2),
        "ours_over_trl": round(med["ours"] / med["trl"], 2) if "trl" in med else None,
        "threads": args.threads,
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "precision": args.precision,
        "peak_memory_mb": peak or None,
        "params": sum(p.numel() for p in base.parameters()),
        "batch": f"{pairs} pairs x {batch['tokens', 'full'].shape[-1]} tokens",
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"{summary['batch']}, {summary['params']} parameters, {args.threads} threads")
    print("| step | pairs/s |\n|---|---|")
    for k, v in summary["pairs_per_s"].items():
        print(f"| {k} | {v} |")
    print(f"ours / bare = {summary['ours_over_bare']}x (target >= 0.7x); ours / hand-written = "
          f"{summary['ours_over_hand']}x; ours / TRL = "
          f"{summary['ours_over_trl'] if summary['ours_over_trl'] is not None else 'n/a (TRL not measured: skipped or not installed)'}"
          f"{'x (target >= 1.5x)' if summary['ours_over_trl'] is not None else ''}")


if __name__ == "__main__":
    main()
