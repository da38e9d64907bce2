"""Issue #17 diagnosis: DPO from a random init on the reverse-5-letters task, model by model.

Our DPOLoss and CausalLMLogProbs, tokenize_pairs with the character tokenizer, Adam,
16 pairs a step, 300 steps, beta 0.1, clip 1.0 unless said, the CLI's held-out split of
800 rows (700 train / 100 held out); prints held-out and training-pair accuracy.
These are the numbers behind the tiny model's shape and the from-scratch lr
(docs/results-history.md). One thread:

    python scripts/preference_diagnosis.py
"""
import copy
import random
import string
import sys
import time

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(__import__('pathlib').Path(__file__).parent))
import preference_results as pr

from offline_plugins.eval.preference import pairwise_scores
from offline_plugins.modules.causal_lm import CausalLMLogProbs
from offline_plugins.modules.tiny_lm import char_tokenizer
from offline_plugins.objectives.llm import DPOLoss
from offline_plugins.text.data.preference import add_reference_log_probs, tokenize_pairs

L = string.ascii_lowercase
def rows_for(n=800, seed=1234, lo=5, hi=5):
    rng = random.Random(seed); out = []; seen = set()
    while len(out) < n:
        s = ''.join(rng.choice(L) for _ in range(rng.randint(lo, hi)))
        if s in seen: continue
        seen.add(s); good = s[::-1]; i = rng.randrange(len(good))
        bad = good[:i] + rng.choice([c for c in L if c != good[i]]) + good[i+1:]
        out.append({'prompt': f'rev {s}=', 'chosen': good, 'rejected': bad})
    return out
rows = rows_for(); tr, te = pr.split_rows(rows)
tok = char_tokenizer()
def run(name, make_model, lr=1e-3, clip=1.0, steps=300, opt='adam', seed=0, wd=0.0):
    torch.manual_seed(seed)
    ref = make_model()
    ref.eval()
    trd, _ = tokenize_pairs(tr, tok, max_length=128); ted, _ = tokenize_pairs(te, tok, max_length=128)
    add_reference_log_probs(trd, ref); add_reference_log_probs(ted, ref)
    pol = copy.deepcopy(ref).train()
    actor = CausalLMLogProbs(pol)
    loss = DPOLoss(actor, beta=0.1)
    o = (torch.optim.AdamW if opt == 'adamw' else torch.optim.Adam)(pol.parameters(), lr=lr, **({'weight_decay': wd} if opt=='adam' else {}))
    g = torch.Generator().manual_seed(seed)
    t = time.time()
    for k in range(steps):
        idx = torch.randint(0, trd.batch_size[0], (16,), generator=g)
        out = loss(trd[idx])
        o.zero_grad(); out['loss_dpo'].backward()
        if clip: torch.nn.utils.clip_grad_norm_(pol.parameters(), clip)
        o.step()
    actor.eval()
    acc = pairwise_scores(actor, ted)['preference_accuracy']; tra = pairwise_scores(actor, trd[:200])['preference_accuracy']
    print(f'{name}: lr={lr} clip={clip} opt={opt} heldout={acc:.3f} train={tra:.3f} {time.time()-t:.1f}s', flush=True)
    return acc
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def gpt2(w=128, drop=0.1, layers=2, heads=4):
    return lambda: GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=128, n_embd=w, n_layer=layers, n_head=heads,
        resid_pdrop=drop, embd_pdrop=drop, attn_pdrop=drop, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
def llama(w=128, heads=4, inter=None, **kw):
    def f():
        c = LlamaConfig(vocab_size=len(tok), hidden_size=w, intermediate_size=inter or 4*w, num_hidden_layers=2, num_attention_heads=heads,
            num_key_value_heads=heads, max_position_embeddings=128, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id, tie_word_embeddings=True, **kw)
        return LlamaForCausalLM(c)
    return f
if __name__ == '__main__':
    old_tiny = llama(w=64, inter=192)  # the tiny model before issue #17: a 64-wide RoPE Llama
    run('old tiny llama64', old_tiny, lr=1e-5)
    run('old tiny llama64', old_tiny, lr=1e-3)
    run('old tiny llama64', old_tiny, lr=1e-3, clip=None)
    run('llama128', llama())
    run('gpt2-128', gpt2())
    run('gpt2-128-nodrop', gpt2(drop=0.0))
    run('gpt2-64', gpt2(w=64))
    run('gpt2-128 lr1e-5', gpt2(), lr=1e-5)
    run('llama128 h2', llama(heads=2))
    run('llama128 theta100', llama(rope_theta=100.0))
    run('llama128 noclip', llama(), clip=None)
