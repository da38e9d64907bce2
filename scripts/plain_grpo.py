"""A plain GRPO loop on the built-in task, independent of the package's collector and losses.

    OFFLINE_PLUGINS_CACHE=~/.cache/offline-plugins python scripts/plain_grpo.py --rounds 300 --seed 0

The reference point for ``offline-plugins train grpo --dataset arithmetic``: the same cached
SFT reference, prompts and held-out problems, and the registered defaults (16 prompts x G 8
per round, minibatches of 32, one epoch, lr 1e-4, beta 0.04, temperature 1), but no
padding anywhere: prompts are generated in groups of equal token length, so no position
question arises. On-policy with one epoch the PPO ratio is 1, so the loss is
``-A * log pi`` per response token (mean over each response's tokens, then over responses)
plus ``beta * k3``. Prints held-out greedy exact match before and after.
"""

from __future__ import annotations

import argparse
import copy
import random
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--beta", type=float, default=0.04)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    from offline_plugins.text.data.preference_sources import cache_root
    from offline_plugins.text.data.rollouts import sft_reference
    from offline_plugins.text.tasks import ArithmeticTask
    from offline_plugins.tokens import prompt_token_ids

    task = ArithmeticTask(digits=2, ops="+")
    from offline_plugins.kinds.sft import supervised_finetune

    ref, tok = sft_reference(task, cache_dir=cache_root() / "preference", finetune=supervised_finetune)
    ref.eval()
    policy = copy.deepcopy(ref)
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    held = task.problems(200, split="test", seed=1)

    def by_length(prompts):
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault(len(prompt_token_ids(tok, p)), []).append(i)
        return groups

    @torch.no_grad()
    def answer(model, prompts, n=1, sample=False):
        out: list = [None] * (len(prompts) * n)
        model.eval()
        for _, idx in by_length(prompts).items():
            ids = torch.tensor([prompt_token_ids(tok, prompts[i]) for i in idx]).repeat_interleave(n, 0)
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=sample,
                                 temperature=1.0 if sample else None, top_k=0 if sample else None, top_p=None,
                                 max_new_tokens=6, pad_token_id=pad, eos_token_id=eos)[:, ids.shape[1]:]
            for k, i in enumerate(idx):
                for j in range(n):
                    row = gen[k * n + j].tolist()
                    out[i * n + j] = row[:row.index(eos) + 1] if eos in row else row
        return out

    def exact(model):
        outs = answer(model, [p.prompt for p in held])
        return sum(tok.decode(o, skip_special_tokens=True).strip() == p.answer for o, p in zip(outs, held)) / len(held)

    def logp(model, prompt_ids, resp):  # per-token log-probs of resp, one row at a time: no padding
        full = torch.tensor([prompt_ids + resp])
        lp = model(input_ids=full).logits[0, :-1].log_softmax(-1).gather(-1, full[0, 1:, None])[:, 0]
        return lp[len(prompt_ids) - 1:]

    before, t0 = exact(policy), time.time()
    g = 8
    for r in range(args.rounds):
        probs = task.problems(16, split="train", seed=1_000_000 * args.seed + r)
        prompts = [p.prompt for p in probs]
        resps = answer(policy, prompts, n=g, sample=True)
        rewards = torch.tensor([float(tok.decode(o, skip_special_tokens=True).strip() == probs[i // g].answer)
                                for i, o in enumerate(resps)]).view(16, g)
        std = rewards.std(1, correction=0, keepdim=True)
        adv = torch.where(std > 1e-6, (rewards - rewards.mean(1, keepdim=True)) / std.clamp_min(1e-6),
                          torch.zeros_like(rewards)).view(-1)
        order = torch.randperm(16 * g)
        policy.train()
        for m in range(4):
            loss = 0.0
            for i in order[m * 32:(m + 1) * 32].tolist():
                pid = prompt_token_ids(tok, prompts[i // g])
                lp = logp(policy, pid, resps[i])
                with torch.no_grad():
                    ref_lp = logp(ref, pid, resps[i])
                d = ref_lp - lp
                kl = torch.expm1(d) - d
                loss = loss + (-(adv[i] * lp) + args.beta * kl).mean() / 32
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
    print(f"plain GRPO, seed {args.seed}, {args.rounds} rounds ({4 * args.rounds} steps): held-out exact match "
          f"{100 * before:.1f}% -> {100 * exact(policy):.1f}% in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    random.seed(0)
    main()
