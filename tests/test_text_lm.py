"""Network-free LM defaults: tokenizer, tiny model, log-prob actor, arithmetic task, SFT."""

from __future__ import annotations

import pytest
import torch

from offline_plugins.errors import UserError
from offline_plugins.kinds.sft import supervised_finetune
from offline_plugins.modules.causal_lm import CausalLMLogProbs, CausalLMReward
from offline_plugins.modules.tiny_lm import (
    ModelLoadError,
    char_tokenizer,
    ensure_pad_token,
    load_causal_lm,
    model_fingerprint,
    tiny_causal_lm,
)
from offline_plugins.text.data.preference import tokenize_pairs
from offline_plugins.text.data.task_data import (
    exact_match_accuracy,
    preference_rows,
    sft_rows,
    unpaired_rows,
)
from offline_plugins.text.tasks import ArithmeticTask, TaskError

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def lm():
    return load_causal_lm("tiny", seed=0)


def test_tokenizer_round_trips_through_save_pretrained(tmp_path):
    from transformers import AutoTokenizer

    tok = char_tokenizer()
    text = "123*45=5535 and (x)!"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text)["input_ids"] == ids
    assert (again.pad_token_id, again.eos_token_id, again.bos_token_id) == (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id)


def test_model_and_tokenizer_reload_from_a_local_path(tmp_path, lm):
    model, tok = lm
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model2, tok2 = load_causal_lm(tmp_path)
    assert model_fingerprint(model2, tok2) == model_fingerprint(model, tok)
    with pytest.raises(ModelLoadError, match="'tiny'"):
        load_causal_lm(tmp_path / "nowhere")


def test_tiny_model_size_and_determinism():
    tok = char_tokenizer()
    a, b = tiny_causal_lm(tok, seed=3), tiny_causal_lm(tok, seed=3)
    n = sum(p.numel() for p in a.parameters())
    assert 50_000 < n < 1_000_000
    assert model_fingerprint(a) == model_fingerprint(b)


def test_tokenizer_without_pad_token_gets_one_and_says_so(caplog):
    tok = char_tokenizer()
    tok.pad_token = None
    assert tok.pad_token_id is None
    note = ensure_pad_token(tok)
    assert tok.pad_token_id == tok.eos_token_id and "no pad token" in note
    tok2 = char_tokenizer()
    tok2.pad_token = None
    td, report = tokenize_pairs([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}], tok2, max_length=16)
    assert any("no pad token" in n for n in report.notes)


def _naive_response_logps(model, tokens, attn, resp):
    out = torch.zeros(tokens.shape[:-1])
    flat_t, flat_a, flat_r = (x.reshape(-1, x.shape[-1]) for x in (tokens, attn, resp))
    res = out.reshape(-1)
    for i in range(flat_t.shape[0]):
        n = int(flat_a[i].sum())
        logits = model(input_ids=flat_t[i : i + 1, :n]).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        res[i] = sum(lp[t - 1, flat_t[i, t]] for t in range(1, n) if flat_r[i, t])
    return out


def test_log_probs_match_naive_per_row_computation(lm):
    model, tok = lm
    rows = [
        {"prompt": "12+34=", "chosen": "46", "rejected": "47"},
        {"prompt": "1+2=", "chosen": "3", "rejected": "30000"},
        {"prompt": "99+99=", "chosen": "198", "rejected": "1"},
    ]
    td, _ = tokenize_pairs(rows, tok, max_length=32)
    assert td.batch_size == (3, 2)
    assert not td["masks", "all_attention_mask"].all()  # there is padding to handle
    calls = []
    hook = model.register_forward_pre_hook(lambda m, a, k: calls.append(k["input_ids"].shape[0]), with_kwargs=True)
    with torch.no_grad():
        lp = CausalLMLogProbs(model)(td.clone())["log_probs", "full"]
    hook.remove()
    assert calls == [6]  # chosen and rejected in one forward over B*2 rows
    resp = td["masks", "all_assistant_mask"]
    got = (lp * resp).sum(-1)
    with torch.no_grad():
        want = _naive_response_logps(model, td["tokens", "full"], td["masks", "all_attention_mask"], resp)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # skipping the padding mask on right-padded rows changes no real token's log-prob
    with torch.no_grad():
        masked = CausalLMLogProbs(model, right_padded=False)(td.clone())["log_probs", "full"]
    torch.testing.assert_close(masked, lp, atol=1e-5, rtol=1e-5)
    # padding and the first position carry no log-prob
    assert (lp[~td["masks", "all_attention_mask"]] == 0).all() and (lp[..., 0] == 0).all()
    # the response mask covers the answer plus eos, never the prompt
    n_prompt = 1 + len("12+34=")  # bos + the prompt characters
    assert not resp[0, 0, :n_prompt].any() and resp[0, 0].sum() == len("46") + 1


def test_reward_model_scores_each_sequence(lm):
    model, tok = lm
    td, _ = tokenize_pairs([{"prompt": "1+1=", "chosen": "2", "rejected": "33"}], tok, max_length=16)
    rm = CausalLMReward(tiny_causal_lm(tok, seed=1))
    out = rm(td.clone())
    assert out["reward"].shape == (1, 2)


def test_arithmetic_task_splits_and_exact_match():
    task = ArithmeticTask(digits=2)
    train = {p.prompt for p in task.problems(300, split="train", seed=0)}
    test = {p.prompt for p in task.problems(100, split="test", seed=0)}
    assert not train & test
    assert task.reward("12+34=", "46") == 1.0 and task.reward("12+34=", "046") == 0.0
    assert task.reward("12+34=", " 46 ") == 1.0
    assert ArithmeticTask(digits=3, ops="*-").answer("120-300=") == "-180"
    with pytest.raises(TaskError, match="12\\+34="):
        task.answer("hello")
    assert isinstance(TaskError("x"), UserError)


def test_preference_and_unpaired_rows_pair_right_with_wrong(lm):
    model, tok = lm
    task = ArithmeticTask(digits=2)
    rows = preference_rows(task, model, tok, 8, num_samples=2, seed=0)
    assert len(rows) == 8
    for r in rows:
        assert task.reward(r["prompt"], r["chosen"]) == 1.0
        assert task.reward(r["prompt"], r["rejected"]) == 0.0
    un = unpaired_rows(task, model, tok, 3, seed=0)
    assert [r["label"] for r in un] == [True, False] * 3


def test_sft_step_lowers_the_loss_and_accuracy_is_measured():
    tok = char_tokenizer()
    model = tiny_causal_lm(tok, seed=0)
    task = ArithmeticTask(digits=1)
    losses = supervised_finetune(model, tok, sft_rows(task, 200), steps=40, batch_size=16, lr=1e-2)
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    acc = exact_match_accuracy(task, model, tok, n=20)
    assert 0.0 <= acc <= 1.0


def test_task_preference_data_end_to_end_with_cached_reference(tmp_path):
    from offline_plugins.text.data.task_data import task_preference_data

    task = ArithmeticTask(digits=1)
    kw = dict(sft_rows_count=50, sft_steps=5, sft_batch_size=8, n_train=6, n_test=4, num_samples=2, cache_dir=tmp_path,
              finetune=supervised_finetune)
    data = task_preference_data(task, **kw)
    assert data.kind == "preference-pairs" and data.train.batch_size == (6, 2) and data.test.batch_size == (4, 2)
    assert ("ref_log_probs", "response") in data.test.keys(True)
    assert not any(p.requires_grad for p in data.reference.parameters())
    saved = list(tmp_path.glob("sft-*"))
    assert len(saved) == 1
    again = task_preference_data(task, kind="unpaired-feedback", **kw)  # reuses the saved SFT reference
    assert model_fingerprint(again.reference) == model_fingerprint(data.reference)
    assert again.train.batch_size == (12,) and again.train["label"].sum() == 6


def test_the_sft_reference_is_the_same_whatever_the_threads_and_says_how_it_was_made(tmp_path, capsys):
    """The reference every text result starts from: made with one thread whatever the caller set
    (two threads sum in another order and gave another reference), keyed on its whole recipe, and
    reused with a line saying when, at which commit and with which versions it was made."""
    import json

    import torch

    from offline_plugins.text.data.task_data import reference_dir, sft_reference

    task = ArithmeticTask(digits=1)
    kw = dict(model="tiny", steps=6, batch_size=8, rows=64, finetune=supervised_finetune)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two, _ = sft_reference(task, cache_dir=tmp_path / "a", **kw)
        assert torch.get_num_threads() == 2  # the caller's setting is given back
        torch.set_num_threads(1)
        one, _ = sft_reference(task, cache_dir=tmp_path / "b", **kw)
    finally:
        torch.set_num_threads(threads)
    assert model_fingerprint(one) == model_fingerprint(two)
    folder = reference_dir(task, cache_dir=tmp_path / "a", model="tiny", steps=6, batch_size=8, rows=64)
    made = json.loads((folder / "reference.json").read_text())
    assert made["recipe"]["steps"] == 6 and made["recipe"]["threads"] == 1 and made["recipe"]["lr"] == 3e-3
    assert made["recipe"]["versions"]["torch"] == torch.__version__ and made["commit"] and made["wall_s"] > 0
    # another recipe is another folder: a learning rate, a seed, a count of rows
    assert reference_dir(task, cache_dir=tmp_path / "a", model="tiny", steps=6, batch_size=8, rows=64, lr=1e-3) != folder
    assert reference_dir(task, cache_dir=tmp_path / "a", model="tiny", steps=6, batch_size=8, rows=32) != folder
    capsys.readouterr()
    again, _ = sft_reference(task, cache_dir=tmp_path / "a", **kw)
    err = capsys.readouterr().err
    assert model_fingerprint(again) == model_fingerprint(one)
    assert f"{folder}, made {made['date']} at {made['commit']}" in err and "making" not in err
