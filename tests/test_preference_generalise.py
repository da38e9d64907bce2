"""Issue #17: DPO with ``--model tiny`` on a user's own JSONL task generalises to held-out prompts.

The task is not one the package ships: reverse a random 5-letter string; the rejected
answer is the correct one with one character replaced. It trains from the tiny model's
random initialisation through the real CLI, and must reach the held-out preference
accuracy of a plain DPO loop written here (a 2-layer, 128-wide GPT-2 from a config, a
character vocabulary, AdamW at 1e-3, beta 0.1, the same 300 steps of 16 pairs), scored
on the same held-out pairs.
"""

from __future__ import annotations

import copy
import json
import random
import string

import pytest
import torch
import torch.nn.functional as F

from offline_plugins.cli import main

torch.set_num_threads(1)

STEPS, BATCH, BETA = 300, 16, 0.1


def _rows(n: int, seed: int) -> list[dict]:
    rng, rows, seen = random.Random(seed), [], set()
    while len(rows) < n:
        s = "".join(rng.choice(string.ascii_lowercase) for _ in range(5))
        if s in seen:
            continue
        seen.add(s)
        good, i = s[::-1], rng.randrange(5)
        bad = good[:i] + rng.choice([c for c in string.ascii_lowercase if c != good[i]]) + good[i + 1:]
        rows.append({"prompt": f"rev {s}=", "chosen": good, "rejected": bad})
    return rows


def plain_dpo(train_rows, test_rows, seed: int, *, steps: int = STEPS, batch: int = BATCH, beta: float = BETA,
              lr: float = 1e-3) -> float:
    """A plain DPO loop: GPT-2 2x128 from a config, character vocabulary, AdamW 1e-3; held-out accuracy.

    ``scripts/preference_results.py`` imports this loop for its reference rows of docs/results-history.md.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab = {c: i + 3 for i, c in enumerate(string.printable[:95])}  # 0 pad, 1 bos, 2 eos

    def encode(rows):
        seqs = [([1] + [vocab[c] for c in r["prompt"]], [vocab[c] for c in r[k]] + [2])
                for r in rows for k in ("chosen", "rejected")]
        T = max(len(p) + len(a) for p, a in seqs)
        ids, resp = torch.zeros(len(seqs), T, dtype=torch.long), torch.zeros(len(seqs), T)
        for i, (p, a) in enumerate(seqs):
            ids[i, : len(p) + len(a)] = torch.tensor(p + a)
            resp[i, len(p): len(p) + len(a)] = 1
        return ids, resp

    def logp(model, ids, resp):  # [N, 2] summed response log-probs
        lp = model(input_ids=ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return (lp * resp[:, 1:]).sum(-1).view(-1, 2)

    torch.manual_seed(seed)
    policy = GPT2LMHeadModel(GPT2Config(vocab_size=98, n_positions=64, n_embd=128, n_layer=2, n_head=4,
                                        bos_token_id=1, eos_token_id=2))
    reference = copy.deepcopy(policy).eval()
    opt = torch.optim.AdamW(policy.parameters(), lr=lr)
    (tr_ids, tr_resp), (te_ids, te_resp) = encode(train_rows), encode(test_rows)
    with torch.no_grad():
        tr_ref, te_ref = logp(reference, tr_ids, tr_resp), logp(reference, te_ids, te_resp)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(train_rows), (batch,), generator=g)
        rows = (2 * idx[:, None] + torch.arange(2)).reshape(-1)
        ratio = logp(policy, tr_ids[rows], tr_resp[rows]) - tr_ref[idx]
        loss = -F.logsigmoid(beta * (ratio[:, 0] - ratio[:, 1])).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    policy.eval()
    with torch.no_grad():
        ratio = logp(policy, te_ids, te_resp) - te_ref
    return float((ratio[:, 0] > ratio[:, 1]).float().mean())


@pytest.mark.slow
def test_dpo_with_the_tiny_model_generalises_as_a_plain_dpo_loop(tmp_path, monkeypatch):
    from offline_plugins.text.data.preference_sources import held_out_prompts

    monkeypatch.setenv("OFFLINE_PLUGINS_CACHE", str(tmp_path / "cache"))
    rows = _rows(600, seed=3)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    code = main(["train", "dpo", "--dataset", str(data), "--model", "tiny", "--steps", str(STEPS), "--seed", "0",
                 "--threads", "1", "--out", str(out), "--no-progress"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    held = held_out_prompts([r["prompt"] for r in rows])
    assert summary["heldout_pairs"] == len(held) == 100 and summary["train_pairs"] == 500
    assert summary["config"]["lr"] == 1e-3  # the tiny model's from-scratch default, recorded
    assert summary["train_preference_accuracy"] is not None

    reference = plain_dpo([r for r in rows if r["prompt"] not in held], [r for r in rows if r["prompt"] in held], 0)
    cli = summary["preference_accuracy"]
    # Spread these margins come from (docs/results-history.md, 300 steps, seeds 0-2): the plain loop
    # 0.59-0.79 and the CLI 0.85-0.88 with torchrl 0.10 / transformers 4.5x; seed 0 gives the
    # plain loop 0.70 and the CLI 0.78 with the releases of constraints.txt. On 100 held-out
    # pairs one binomial sd at chance is 0.05.
    assert reference > 0.5, f"the plain loop itself did not beat chance ({reference:.2f})"
    assert cli >= 0.65, f"the CLI's DPO did not learn the task: {cli:.2f} held-out accuracy (chance 0.5)"
    assert cli >= reference - 0.1, f"CLI {cli:.2f} fell behind the plain DPO loop's {reference:.2f}"


def test_held_out_split_is_large_enough_and_whole_prompts():
    from offline_plugins.text.data.preference_sources import held_out_prompts

    prompts = [f"q{i}" for i in range(800)]
    assert len(held_out_prompts(prompts)) == 100  # 100 beats 10 % of 800
    assert len(held_out_prompts([f"q{i}" for i in range(3000)])) == 300  # 10 % beats 100
    assert held_out_prompts(prompts) == held_out_prompts(prompts[::-1])  # order does not matter
    repeated = [f"q{i % 150}" for i in range(600)]  # 4 rows a prompt
    held = held_out_prompts(repeated)
    assert sum(p in held for p in repeated) == 100
    assert len(held_out_prompts([f"q{i}" for i in range(40)])) == 20  # at most half of a small file
    with pytest.raises(ValueError, match="fraction"):
        held_out_prompts(prompts, fraction=1.5)


def test_lr_defaults_follow_the_reference_and_bad_lr_is_named(tmp_path):
    from offline_plugins.errors import UserError
    from offline_plugins.plugins import load_registry
    from offline_plugins.text.data.preference_sources import load_preference_source

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(40, seed=0)))
    pref = load_preference_source(str(data), kind="preference-pairs", cache_dir=tmp_path / "c", progress=False)
    assert pref.from_scratch
    spec = load_registry().algorithm("dpo")
    build = spec.load_build()
    config = spec.default_config()
    assert config.lr is None and "1e-05" in spec.to_dict()["config"][0]["help"]
    build(config, pref)
    assert config.lr == 1e-3
    pref.from_scratch = False  # a pretrained or SFT reference
    config = spec.default_config()
    build(config, pref)
    assert config.lr == 1e-5
    for bad in (0.0, -1.0, "fast"):
        config = spec.default_config()
        config.lr = bad
        with pytest.raises(UserError, match="lr must be a positive number"):
            build(config, pref)
