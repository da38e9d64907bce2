"""Preference data: JSONL and datasets into [B, 2] / [B] TensorDicts, truncation, drops, reference cache."""

from __future__ import annotations

import json

import pytest
import torch

from offline_plugins.errors import UserError
from offline_plugins.modules.causal_lm import CausalLMLogProbs
from offline_plugins.modules.tiny_lm import char_tokenizer, tiny_causal_lm
from offline_plugins.objectives.llm import DPOLoss, KTOLoss
from offline_plugins.text.data.preference import (
    PreferenceDataError,
    ReferenceMismatchError,
    add_reference_log_probs,
    check_policy_matches_reference,
    load_hf_dataset,
    load_jsonl,
    tokenize_pairs,
    tokenize_unpaired,
)

torch.set_num_threads(1)

PAIRS = [
    {"prompt": "12+34=", "chosen": "46", "rejected": "47"},
    {"prompt": "1+2=", "chosen": "3", "rejected": "4"},
    {"prompt": "5+5=", "chosen": "10", "rejected": "10"},  # chosen == rejected
    {"prompt": "7+1=", "chosen": "", "rejected": "9"},  # empty response
    {"prompt": "9" * 40 + "+1=", "chosen": "1", "rejected": "2"},  # prompt over the context
]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_pairs_become_b2_tensordict_with_drop_counts(tmp_path, tok):
    rows = load_jsonl(_write_jsonl(tmp_path / "p.jsonl", PAIRS))
    td, report = tokenize_pairs(rows, tok, max_length=16)
    assert td.batch_size == (2, 2)
    assert report.total == 5 and report.kept == 2
    assert report.dropped == {"chosen_equals_rejected": 1, "empty_response": 1, "prompt_over_context": 1}
    assert "kept 2 of 5" in report.summary() and "prompt over context" in report.summary()
    # index 0 chosen, 1 rejected: decode the responses back
    for i, row in enumerate(PAIRS[:2]):
        for j, field in enumerate(("chosen", "rejected")):
            ids = td["tokens", "full"][i, j][td["masks", "all_assistant_mask"][i, j]]
            assert tok.decode(ids, skip_special_tokens=True) == row[field]
            assert ids[-1] == tok.eos_token_id
    assert td["tokens", "full"].dtype == torch.long


def test_truncation_keeps_prompt_end_and_response_start(tok):
    rows = [{"prompt": "abcdefghij", "chosen": "0123456789", "rejected": "9876543210"}]
    td, report = tokenize_pairs(rows, tok, max_length=10, max_prompt_length=4)
    toks = td["tokens", "full"][0, 0]
    resp = td["masks", "all_assistant_mask"][0, 0]
    assert tok.decode(toks[~resp]) == "ghij"  # prompt keeps its last 4 tokens
    assert tok.decode(toks[resp]) == "012345"  # response keeps its start
    assert report.truncated_prompts == 2 and report.truncated_responses == 2


def test_unpaired_rows_with_mismatched_kl_rows(tmp_path, tok):
    rows = [
        {"prompt": "1+1=", "completion": "2", "label": True},
        {"prompt": "2+2=", "completion": "5", "label": False},
        {"prompt": "3+3=", "completion": "6", "label": 1},
    ]
    td, report = tokenize_unpaired(load_jsonl(_write_jsonl(tmp_path / "u.jsonl", rows), fields=("prompt", "completion", "label")), tok)
    assert td.batch_size == (3,) and td["label"].tolist() == [True, False, True]
    # the KL row of row 0 is prompt 0 with completion 1
    kl_row = td["kl", "tokens", "full"][0][td["kl", "masks", "all_attention_mask"][0]]
    assert tok.decode(kl_row, skip_special_tokens=True) == "1+1=5"


@pytest.mark.parametrize(
    "row,match",
    [
        ({"prompt": "a", "chosen": "b"}, r"row 1 lacks field\(s\) \['rejected'\]"),
        ({"prompt": "a", "chosen": ["b"], "rejected": "c"}, r"row 1 field 'chosen' is a list"),
        ({"prompt": 3, "chosen": "b", "rejected": "c"}, r"row 1 field 'prompt' is a int"),
    ],
)
def test_bad_rows_raise_one_clear_error_each(tmp_path, tok, row, match):
    path = _write_jsonl(tmp_path / "bad.jsonl", [PAIRS[0], row])
    with pytest.raises(PreferenceDataError, match=match):
        load_jsonl(path)
    assert issubclass(PreferenceDataError, UserError)
    with pytest.raises(PreferenceDataError, match="label"):
        tokenize_unpaired([{"prompt": "a", "completion": "b", "label": "yes"}] * 2, tok)
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"prompt": "a"\n')
    with pytest.raises(PreferenceDataError, match="line 1 is not valid JSON"):
        load_jsonl(bad)


def test_hugging_face_datasets_rows(tok):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(PAIRS[:2])
    td, report = tokenize_pairs(load_hf_dataset(ds), tok, max_length=16)
    assert td.batch_size == (2, 2) and report.kept == 2
    with pytest.raises(PreferenceDataError, match="lacks field"):
        load_hf_dataset(datasets.Dataset.from_list([{"prompt": "a", "chosen": "b"}]))


def test_chat_template_wraps_the_prompt(tok):
    tok2 = char_tokenizer()
    tok2.chat_template = "{% for m in messages %}U:{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    td, _ = tokenize_pairs(PAIRS[:1], tok2, max_length=32)
    toks = td["tokens", "full"][0, 0]
    prompt = toks[td["masks", "all_attention_mask"][0, 0] & ~td["masks", "all_assistant_mask"][0, 0]]
    assert tok2.decode(prompt, skip_special_tokens=True) == "U:12+34=A:"


class _Counting(torch.nn.Module):
    """Wraps a model and counts its forward calls."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config = model.config
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)


def test_reference_log_probs_are_cached_and_training_runs_no_reference_forward(tmp_path, tok):
    td, _ = tokenize_pairs(PAIRS[:2] * 4, tok, max_length=16)
    reference = _Counting(tiny_causal_lm(tok, seed=0))
    add_reference_log_probs(td, reference, cache_dir=tmp_path, dataset_id="toy", batch_size=8)
    assert reference.calls == 2  # 16 rows in batches of 8
    ref = td["ref_log_probs", "response"]
    assert ref.shape == (8, 2) and ref.dtype == torch.float32
    # values equal a direct fp32 computation
    lp = CausalLMLogProbs(reference.model).log_probs(td["tokens", "full"], td["masks", "all_attention_mask"])
    torch.testing.assert_close(ref, (lp * td["masks", "all_assistant_mask"]).sum(-1).detach())
    assert len(list(tmp_path.glob("toy-*.pt"))) == 1
    # same data, same model: read from disk, no forward
    td2, _ = tokenize_pairs(PAIRS[:2] * 4, tok, max_length=16)
    add_reference_log_probs(td2, reference, cache_dir=tmp_path, dataset_id="toy")
    assert reference.calls == 2
    torch.testing.assert_close(td2["ref_log_probs", "response"], ref)
    # training: a policy copy, DPO steps, and still no reference forward
    policy = tiny_causal_lm(tok, seed=0)
    check_policy_matches_reference(policy, td2)
    loss = DPOLoss(CausalLMLogProbs(policy), beta=0.1)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    first = loss(td2)
    # the policy starts at the reference: implicit rewards and the loss are log(2)
    assert first["loss_dpo"].item() == pytest.approx(0.6931, abs=1e-4)
    for _ in range(3):
        out = loss(td2[torch.randperm(8)[:4]])
        opt.zero_grad()
        out["loss_dpo"].backward()
        opt.step()
    assert reference.calls == 2


def test_kto_reference_covers_mismatched_rows(tmp_path, tok):
    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1), "label": i % 2 == 0} for i in range(4)]
    td, _ = tokenize_unpaired(rows, tok)
    reference = _Counting(tiny_causal_lm(tok, seed=0))
    add_reference_log_probs(td, reference, cache_dir=tmp_path)
    assert reference.calls == 2  # the rows and their mismatched partners
    out = KTOLoss(CausalLMLogProbs(tiny_causal_lm(tok, seed=0)))(td)
    assert out["kl_reference_point"].item() == pytest.approx(0.0, abs=1e-5)  # policy == reference


def test_policy_with_another_vocabulary_than_the_reference_is_refused(tmp_path, tok):
    td, _ = tokenize_pairs(PAIRS[:2], tok, max_length=16)
    add_reference_log_probs(td, tiny_causal_lm(tok, seed=0), cache_dir=tmp_path)
    other = char_tokenizer("0123456789+=")
    with pytest.raises(ReferenceMismatchError, match=r"vocabulary of 16 tokens .* one of 99"):
        check_policy_matches_reference(tiny_causal_lm(other, seed=0), td)
    with pytest.raises(ReferenceMismatchError, match="tokenise the data with this model's tokenizer"):
        add_reference_log_probs(td.clone(), tiny_causal_lm(other, seed=0))


def test_pairs_with_cached_reference_sample_from_a_torchrl_replay_buffer(tok):
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    td, _ = tokenize_pairs(PAIRS[:2] * 3, tok, max_length=16)
    add_reference_log_probs(td, tiny_causal_lm(tok, seed=0))
    rb = ReplayBuffer(storage=LazyTensorStorage(len(td)), batch_size=4)
    rb.extend(td)
    batch = rb.sample()
    assert batch.batch_size == (4, 2)
    assert batch["ref_log_probs", "response"].shape == (4, 2)
    out = DPOLoss(CausalLMLogProbs(tiny_causal_lm(tok, seed=0)))(batch)
    assert out["loss_dpo"].item() == pytest.approx(0.6931, abs=1e-4)


def test_kto_partners_come_from_another_prompt(tok):
    rows = [{"prompt": p, "completion": c, "label": lab} for p in ("1+1=", "2+2=", "3+3=") for c, lab in (("ok", True), ("no", False))]
    td, _ = tokenize_unpaired(rows, tok)
    for i in range(6):
        full = td["kl", "tokens", "full"][i][td["kl", "masks", "all_attention_mask"][i]]
        prompt = tok.decode(full, skip_special_tokens=True)[:4]
        assert prompt == rows[i]["prompt"]
        resp = td["kl", "tokens", "full"][i][td["kl", "masks", "all_assistant_mask"][i]]
        j = next(j for j in range(1, 6) if rows[(i + j) % 6]["prompt"] != rows[i]["prompt"])
        assert tok.decode(resp, skip_special_tokens=True) == rows[(i + j) % 6]["completion"]


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("bad", ["garbage", "code", "wrong-rows"])
def test_a_bad_reference_cache_is_discarded_with_a_warning_naming_it_and_rebuilt(tmp_path, tok, bad):
    td, _ = tokenize_pairs(PAIRS[:2] * 4, tok, max_length=16)
    reference = _Counting(tiny_causal_lm(tok, seed=0))
    add_reference_log_probs(td, reference, cache_dir=tmp_path, dataset_id="toy", batch_size=8)
    good = td["ref_log_probs", "response"].clone()
    (path,) = tmp_path.glob("toy-*.pt")
    marker = tmp_path / "code-ran"
    if bad == "garbage":
        path.write_bytes(bytes(range(256)) * 4)
    elif bad == "code":
        torch.save({"response": _RunsCode(str(marker))}, path)
    else:  # a readable file of other rows
        torch.save({"response": torch.zeros(3), "vocab_size": torch.tensor(99)}, path)
    td2, _ = tokenize_pairs(PAIRS[:2] * 4, tok, max_length=16)
    with pytest.warns(UserWarning, match=f"reference log-prob cache {path} .*discarded and rebuilt"):
        add_reference_log_probs(td2, reference, cache_dir=tmp_path, dataset_id="toy", batch_size=8)
    assert reference.calls == 4 and not marker.exists()
    torch.testing.assert_close(td2["ref_log_probs", "response"], good)
    td3, _ = tokenize_pairs(PAIRS[:2] * 4, tok, max_length=16)
    add_reference_log_probs(td3, reference, cache_dir=tmp_path, dataset_id="toy")  # the rebuilt file is read
    assert reference.calls == 4


def test_a_reference_cache_that_cannot_be_written_warns_and_the_run_uses_its_values(tmp_path, tok, monkeypatch):
    import errno

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    td, _ = tokenize_pairs(PAIRS[:2] * 4, tok, max_length=16)
    monkeypatch.setattr(torch, "save", full)
    with pytest.warns(UserWarning, match="could not be written .*No space left on device.*computes them again"):
        add_reference_log_probs(td, tiny_causal_lm(tok, seed=0), cache_dir=tmp_path, dataset_id="toy")
    assert td["ref_log_probs", "response"].shape == (8, 2) and not list(tmp_path.iterdir())
