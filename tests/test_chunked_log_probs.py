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
