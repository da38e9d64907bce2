"""Shared prefixes (issue 25, item 4): rows that share a prompt forward it once and continue from its
key/value cache. The log-probs equal the one-forward path within 1e-5 (float rounding: the
continuation attends to cached keys, not recomputed ones; measured 4.8e-7 on the tiny model) and
so do their gradients (within 1e-4), on GPT-2 and on Llama (rotary positions)."""

from __future__ import annotations

import json

import pytest
import torch

from offline_plugins.modules.causal_lm import CausalLMLogProbs, shared_prefix_log_probs


def _rows(prompts: list[list[int]], responses: list[list[list[int]]], pad: int):
    """Right-padded rows [prompt i + response ij], their attention and response masks."""
    rows, resp = [], []
    for p, group in zip(prompts, responses):
        for r in group:
            rows.append(p + r)
            resp.append([0] * len(p) + [1] * len(r))
    width = max(map(len, rows))
    tokens = torch.tensor([x + [pad] * (width - len(x)) for x in rows])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in rows]).bool()
    response = torch.tensor([x + [0] * (width - len(x)) for x in resp]).bool()
    return tokens, mask, response


def _gpt2():
    from offline_plugins.modules.tiny_lm import load_causal_lm

    return load_causal_lm("tiny", seed=0)[0]


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64))


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_shared_prefix_log_probs_and_gradients_equal_the_one_forward_path(make):
    model = make()
    g = torch.Generator().manual_seed(3)
    draw = lambda n: torch.randint(3, 40, (n,), generator=g).tolist()  # noqa: E731
    # three prompts of different lengths; groups of 4 and a pair, responses of different lengths
    prompts = [draw(5), draw(9), draw(3)]
    responses = [[draw(k) for k in (2, 6, 1, 4)], [draw(k) for k in (3, 3)], [draw(k) for k in (7, 2, 5)]]
    tokens, mask, response = _rows(prompts, responses, pad=0)
    plain = CausalLMLogProbs(model).log_probs(tokens, mask)
    shared = shared_prefix_log_probs(model, tokens, mask, response)
    assert shared is not None and shared.shape == plain.shape
    assert (shared - plain).abs().max() < 1e-5
    assert (shared[~mask] == 0).all() and (shared[:, 0] == 0).all()
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.randn(plain.shape, generator=g)
    g_plain = torch.autograd.grad((plain * weights).sum(), params)
    g_shared = torch.autograd.grad((shared_prefix_log_probs(model, tokens, mask, response) * weights).sum(), params)
    assert max((a - b).abs().max().item() for a, b in zip(g_plain, g_shared)) < 1e-4


def test_rows_without_a_shared_prompt_take_the_one_forward_path():
    model = _gpt2()
    tokens, mask, response = _rows([[5, 6, 7], [8, 9]], [[[10, 11]], [[12]]], pad=0)
    assert shared_prefix_log_probs(model, tokens, mask, response) is None
    actor = CausalLMLogProbs(model, shared_prefix=True)
    assert torch.equal(actor.log_probs(tokens, mask, response), CausalLMLogProbs(model).log_probs(tokens, mask))


def test_the_module_reads_the_response_mask_from_the_tensordict():
    from tensordict import TensorDict

    model = _gpt2()
    tokens, mask, response = _rows([[5, 6, 7, 8]], [[[10, 11], [12], [13, 14, 15]]], pad=0)
    td = TensorDict({("tokens", "full"): tokens, ("masks", "all_attention_mask"): mask,
                     ("masks", "all_assistant_mask"): response}, batch_size=[3])
    out = CausalLMLogProbs(model, shared_prefix=True)(td.clone()).get(("log_probs", "full"))
    assert (out - CausalLMLogProbs(model).log_probs(tokens, mask)).abs().max() < 1e-5


def test_shared_prefix_refuses_what_it_cannot_share():
    with pytest.raises(ValueError, match="shared_prefix needs a right-padded transformers causal LM"):
        CausalLMLogProbs(_gpt2(), shared_prefix=True, chunk_size=8)
    with pytest.raises(ValueError, match="right-padded"):
        CausalLMLogProbs(_gpt2(), shared_prefix=True, right_padded=False)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["dpo", "grpo"])
def test_a_run_with_shared_prefixes_trains_as_one_without(tmp_path, algorithm):
    from offline_plugins.lightning.run import train_algorithm

    if algorithm == "dpo":
        rows = [{"prompt": f"what is {i} plus {i}? ", "chosen": str(2 * i), "rejected": str(2 * i + 1)}
                for i in range(60)]
        extra = ["batch_size=8"]
    else:
        rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(8) for b in range(8)]
        extra = ["group_size=4", "prompts_per_round=4", "batch_size=16"]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # GRPO: a reward with signal from the random init (shorter is better). With none, the
    # advantages are 0 and the only gradient is the KL's float noise between two ways of computing
    # the same log-probs, which Adam scales up to full-size steps: a comparison of nothing
    reward = None if algorithm == "dpo" else "_text_rewards:length_reward"
    runs = {}
    for shared in (False, True):
        runs[shared] = train_algorithm(algorithm, str(data), model="tiny", steps=3, seed=0, eval_every=0, log_every=1,
                                       out_dir=tmp_path / f"s{int(shared)}", progress=False, reward=reward,
                                       overrides=[*extra, f"shared_prefix={str(shared).lower()}"])
    a, b = runs[False]["losses"], runs[True]["losses"]
    assert a.keys() == b.keys() and a
    for k in a:
        assert a[k] == pytest.approx(b[k], abs=1e-4), k


def test_shared_prefix_with_logprob_chunk_is_refused_in_one_line(tmp_path, capsys):
    from offline_plugins.cli import main

    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}] * 40
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = main(["train", "dpo", "--dataset", str(data), "--model", "tiny", "--steps", "1", "--set",
               "shared_prefix=true", "--set", "logprob_chunk=4", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2 and "shared_prefix and logprob_chunk do not combine" in err and "Traceback" not in err
