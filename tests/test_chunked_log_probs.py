"""Log-probs of the chosen tokens in chunks (issue 25, item 5): the same values and gradients as
the one-forward path, without the [N, T, V] logits held at once; and the models it refuses."""

from __future__ import annotations

import pytest
import torch

from offline_plugins.modules.causal_lm import CausalLMLogProbs


def _gpt2(vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


@pytest.mark.parametrize("chunk_size", [1, 5, 19, 64])
def test_chunked_log_probs_equal_the_one_forward_path_with_their_gradients(chunk_size):
    model = _gpt2(3000)
    ids = torch.randint(0, 3000, (4, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, 20, dtype=torch.bool)
    mask[1, 12:] = False  # a right-padded row: 0 on its padding
    full = CausalLMLogProbs(model).log_probs(ids, mask)
    chunked = CausalLMLogProbs(model, chunk_size=chunk_size).log_probs(ids, mask)
    assert torch.allclose(chunked, full, atol=1e-6) and (chunked[1, 12:] == 0).all() and (chunked[:, 0] == 0).all()
    params = [p for p in model.parameters() if p.requires_grad]
    g_full = torch.autograd.grad(full.sum(), params)
    g_chunked = torch.autograd.grad(chunked.sum(), params)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g_full, g_chunked))


def test_a_chunk_never_holds_the_whole_vocabulary_for_every_position():
    # the output layer sees [N, chunk, H] at a time: count what it is asked for
    model = _gpt2(500)
    seen = []
    model.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
    ids = torch.randint(0, 500, (2, 30))
    lp = CausalLMLogProbs(model, chunk_size=8).log_probs(ids, torch.ones(2, 30, dtype=torch.bool))
    lp.sum().backward()
    assert seen and max(s[1] for s in seen) == 8 and all(s[-1] == 500 for s in seen)


def test_a_model_without_a_separate_output_layer_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"chunk_size needs a transformers causal LM .* Embedding .*leave chunk_size=None"):
        CausalLMLogProbs(torch.nn.Embedding(7, 7), chunk_size=4)
    with pytest.raises(ValueError, match=r"chunk_size must be a whole number >= 1 or None, got 0"):
        CausalLMLogProbs(_gpt2(50), chunk_size=0)


@pytest.mark.parametrize("lora_r", [0, 4])
def test_dpo_with_logprob_chunk_trains_the_same_step(tmp_path, monkeypatch, lora_r):
    """``--set logprob_chunk=N`` on a language-model algorithm: the same loss and gradients as one
    forward, with and without LoRA adapters (peft's model is unwrapped to its transformer)."""
    import json

    from offline_plugins.algorithms.preference import DPOConfig, build_dpo
    from offline_plugins.text.data.preference_sources import load_preference_source

    monkeypatch.setenv("OFFLINE_PLUGINS_CACHE", str(tmp_path / "cache"))
    rows = [{"prompt": f"q{i}=", "chosen": "good" + "!" * (i % 3), "rejected": "bad"} for i in range(200)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    batch = None
    results = []
    for chunk in (0, 3):
        data = load_preference_source(str(path), kind="preference-pairs", progress=False)  # LoRA adapts it in place
        batch = data.train[:8] if batch is None else batch
        torch.manual_seed(0)  # the adapters' random initialisation, the same for both
        parts = build_dpo(DPOConfig(logprob_chunk=chunk, lora_r=lora_r), data)
        assert parts.policy.chunk_size == (chunk or None)
        out = parts.loss(batch.clone())
        out["loss_dpo"].backward()
        results.append((out["loss_dpo"].detach(),
                        {n: p.grad.clone() for n, p in parts.model.named_parameters() if p.grad is not None}))
    (loss0, g0), (loss1, g1) = results
    assert torch.allclose(loss0, loss1, atol=1e-6) and g0.keys() == g1.keys() and g0
    assert all(torch.allclose(g0[n], g1[n], atol=1e-5) for n in g0)


def test_a_bad_logprob_chunk_is_a_one_line_error_naming_the_fix(tmp_path, monkeypatch):
    import json

    from offline_plugins.algorithms.preference import DPOConfig, build_dpo
    from offline_plugins.errors import UserError
    from offline_plugins.text.data.preference_sources import load_preference_source

    monkeypatch.setenv("OFFLINE_PLUGINS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}=", "chosen": "a", "rejected": "b"}) + "\n" for i in range(150)))
    data = load_preference_source(str(path), kind="preference-pairs", progress=False)
    with pytest.raises(UserError, match=r"dpo: logprob_chunk must be a whole number >= 0, got -2; fix it with "
                                        r"--set logprob_chunk=0"):
        build_dpo(DPOConfig(logprob_chunk=-2), data)
