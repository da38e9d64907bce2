"""The tiny model generates the same from a left-padded batch as from each prompt alone."""

from __future__ import annotations

import torch

from offline_plugins.modules.tiny_lm import load_causal_lm
from offline_plugins.text.backends.generation import generate_texts as generate

torch.set_num_threads(1)


def test_left_padded_batches_generate_what_single_prompts_do():
    # prompts of different lengths: in a batch the short ones are left-padded, and their
    # positions must still count from their first real token (a forward that does not name
    # position_ids gets them counted from the padding: measured 75.0 % against 86.8 %
    # held-out exact match for the same SFT reference)
    model, tok = load_causal_lm("tiny", seed=0)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # a model with sharp preferences, so greedy answers differ by position
            p.mul_(3.0)
    prompts = ["1+2=", "31+47=", "5+60=", "12+9=", "88+11="]
    batched = [r[0] for r in generate(model, tok, prompts, greedy=True, max_new_tokens=6)]
    alone = [generate(model, tok, [p], greedy=True, max_new_tokens=6)[0][0] for p in prompts]
    assert batched == alone
