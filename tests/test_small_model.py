"""The built-in ``small`` model: a BPE tokenizer with a chat template and a Qwen2 model, read like a hub model."""

from __future__ import annotations

import json

import pytest
import torch

from offline_plugins.modules.small_lm import (
    SMALL_CONFIG,
    SMALL_MODEL_VERSION,
    small_causal_lm,
    small_model_folder,
    small_tokenizer,
    vocab_hash,
)
from offline_plugins.modules.tiny_lm import is_builtin_model, load_causal_lm, model_cache_tag

#: the vocabulary ``small_tokenizer`` trains with tokenizers 0.22 on ``task_corpus(0)``; a version of the
#: library that learns other merges fails here, and SMALL_MODEL_VERSION must then change with it
VOCAB_SHA = "f6af103955648ea5"


@pytest.fixture(scope="module")
def tok():
    return small_tokenizer()


def test_the_tokenizer_trains_to_the_same_vocabulary(tok):
    assert vocab_hash(tok) == VOCAB_SHA
    assert 600 < len(tok) <= 1024


def test_digits_are_one_token_each_and_any_text_round_trips(tok):
    ids = tok("1234+56=", add_special_tokens=False)["input_ids"]
    assert [tok.decode([i]) for i in ids] == list("1234+56=")
    for text in ["a\nb", "\tx  y ", "héllo — wörld ✓", 'print(str(329*165)[::-1])\n', ""]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    # the merges learnt the tasks' words: a tool call is far fewer tokens than characters
    call = '<tool name="calculator">329*165</tool>'
    assert len(tok(call, add_special_tokens=False)["input_ids"]) <= len(call) // 2


def test_the_corpus_is_the_built_in_tasks_text(tok):
    """The corpus is made below the environments, in their formats: each task's real demonstrations
    round-trip and the tool tasks' merge well (far fewer tokens than characters)."""
    from offline_plugins.text.data.task_data import sft_rows
    from offline_plugins.text.tasks import ArithmeticTask
    from offline_plugins.text.tasks.steps import StepChainTask
    from offline_plugins.text.tasks.tools import ToolArithmeticTask, ToolPythonTask
    from offline_plugins.text.tasks.word_problems import (
        CalculatorWordProblemTask,
        PythonWordProblemTask,
        WordProblemTask,
    )

    for task, most in ((ArithmeticTask(), 1.0), (StepChainTask(), 1.0), (ToolArithmeticTask(), 0.6),
                       (ToolPythonTask(), 0.6), (WordProblemTask(), 0.5), (CalculatorWordProblemTask(), 0.4),
                       (PythonWordProblemTask(), 0.45)):
        for row in sft_rows(task, 20):
            text = row["prompt"] + row["completion"]
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert tok.decode(ids) == text
            assert len(ids) <= most * len(text), (task.name, text, len(ids))


def test_special_tokens_are_single_ids_and_not_split(tok):
    for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert tok(t, add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids(t)]
    assert tok.bos_token is None and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.pad_token_id != tok.eos_token_id


def _masked_texts(tok, messages):
    out = tok.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    kept = tok.decode([i for i, m in zip(ids, mask) if m])
    dropped = tok.decode([i for i, m in zip(ids, mask) if not m])
    return ids, kept, dropped


def test_chat_template_single_turn_masks_the_answer_and_its_eos_only(tok):
    ids, kept, dropped = _masked_texts(tok, [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}])
    assert tok.decode(ids) == "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    assert kept == "4<|im_end|>"
    assert "2+2=" in dropped and "user" in dropped


def test_chat_template_multi_turn_tool_episode_masks_assistant_turns_only(tok):
    messages = [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": "329*165="},
        {"role": "assistant", "content": '<tool name="calculator">329*165</tool>'},
        {"role": "tool", "content": "<result>54285</result>"},
        {"role": "assistant", "content": "54285"},
    ]
    ids, kept, dropped = _masked_texts(tok, messages)
    assert kept == '<tool name="calculator">329*165</tool><|im_end|>54285<|im_end|>'
    assert "<result>54285</result>" in dropped and "Use the calculator." in dropped and "329*165=" in dropped
    # the generation prompt ends where the assistant's first token starts
    prompt = tok.apply_chat_template(messages[:2], add_generation_prompt=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    assert ids[: len(prompt)] == list(prompt)


def test_chat_template_refuses_an_unknown_role(tok):
    with pytest.raises(Exception, match="unknown role narrator"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)


def test_the_model_has_the_qwen2_architecture(tok):
    model = small_causal_lm(tok, seed=0)
    cfg = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM" and cfg.model_type == "qwen2"
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # grouped-query attention
    assert cfg.hidden_act == "silu" and hasattr(model.model.layers[0].mlp, "gate_proj")  # SwiGLU
    assert type(model.model.norm).__name__ == "Qwen2RMSNorm"
    assert hasattr(model.model, "rotary_emb") and not hasattr(model.model, "embed_positions")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert 1_000_000 < sum(p.numel() for p in model.parameters()) < 2_500_000
    assert cfg.hidden_size == SMALL_CONFIG["hidden_size"] and cfg.vocab_size == len(tok)


def test_same_seed_same_weights_other_seed_other_weights(tok):
    a, b, c = (small_causal_lm(tok, seed=s) for s in (0, 0, 1))
    assert torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_load_goes_through_a_save_pretrained_folder_read_by_auto_classes(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("OFFLINE_PLUGINS_CACHE", str(tmp_path))
    model, tok = load_causal_lm("small", seed=3)
    folder = small_model_folder("small", seed=3)
    assert folder.parent == tmp_path / "models" and SMALL_MODEL_VERSION in folder.name
    assert json.loads((folder / "fingerprint.json").read_text())["vocab_sha256"] == VOCAB_SHA
    plain = AutoModelForCausalLM.from_pretrained(folder)
    plain_tok = AutoTokenizer.from_pretrained(folder)
    assert plain_tok.chat_template == tok.chat_template and plain_tok.get_vocab() == tok.get_vocab()
    for (n, p), (m, q) in zip(model.state_dict().items(), plain.state_dict().items()):
        assert n == m and torch.equal(p, q)
    # the second load reads the folder (same weights) instead of writing it again
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    again, _ = load_causal_lm("small", seed=3)
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_pad_eos_variant_has_no_pad_token_until_loaded(tmp_path, monkeypatch, caplog):
    from transformers import AutoTokenizer

    monkeypatch.setenv("OFFLINE_PLUGINS_CACHE", str(tmp_path))
    folder = small_model_folder("small-pad-eos", seed=0)
    assert AutoTokenizer.from_pretrained(folder).pad_token is None
    assert json.loads((folder / "config.json").read_text()).get("pad_token_id") is None
    model, tok = load_causal_lm("small-pad-eos", seed=0)
    assert tok.pad_token_id == tok.eos_token_id and "using its eos token" in caplog.text
    # no embedding row is a padding_idx frozen at zero: the eos row is a trained row like any other
    assert model.model.embed_tokens.padding_idx is None


def test_builtin_names_and_cache_tags():
    assert all(is_builtin_model(n) for n in ("tiny", "small", "small-pad-eos"))
    assert not is_builtin_model("small2")
    assert model_cache_tag("small") == f"small-{SMALL_MODEL_VERSION}"
    assert model_cache_tag("small-pad-eos") != model_cache_tag("small")


def test_a_prompt_files_rollout_width_is_sized_on_its_longest_prompt_in_tokens(tmp_path, tok):
    # prompts of one length in characters: common words are one BPE token each, random letters several, so the
    # longest in tokens is not among the last few by characters; the width must cover it, or its round stops mid-run
    import random

    from offline_plugins.text.data.rollouts import load_rollout_data
    from offline_plugins.text.sources.prompts import _prompt_ids

    rng = random.Random(0)
    prompts = ["Write: " + "".join(rng.choice("abcdefgh") for _ in range(6)) for _ in range(300)]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    counts = [len(_prompt_ids(tok, p)) for p in prompts]
    assert len({len(p) for p in prompts}) == 1 and len(set(counts)) > 1
    data = load_rollout_data(str(path), model="small", reward="test_small_model:_zero", max_new_tokens=4,
                             eval_prompts=4)
    assert data.max_prompt_tokens == max(counts)


def _zero(prompts, responses, **columns):
    return [0.0] * len(responses)
