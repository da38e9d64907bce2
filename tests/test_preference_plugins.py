"""The preference algorithms as plugins: registered, built from PreferenceData, one step each."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from offline_plugins.modules.tiny_lm import char_tokenizer, model_fingerprint, tiny_causal_lm
from offline_plugins.plugins import load_registry
from offline_plugins.text.data.preference import (
    PreferenceData,
    PreferenceDataError,
    add_reference_log_probs,
    tokenize_pairs,
    tokenize_unpaired,
)

torch.set_num_threads(1)

NAMES = ("dpo", "robust-dpo", "rpo", "ipo", "kto", "orpo", "simpo", "reward-model")


@pytest.fixture(scope="module")
def data():
    tok = char_tokenizer()
    reference = tiny_causal_lm(tok, seed=0)
    pairs = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)} for a in range(3) for b in range(3)]
    unpaired = [{"prompt": r["prompt"], "completion": r[k], "label": k == "chosen"} for r in pairs for k in ("chosen", "rejected")]
    td_pairs, _ = tokenize_pairs(pairs, tok, max_length=16)
    td_unpaired, _ = tokenize_unpaired(unpaired, tok, max_length=16)
    add_reference_log_probs(td_pairs, reference)
    add_reference_log_probs(td_unpaired, reference)
    return {
        "preference-pairs": PreferenceData("preference-pairs", td_pairs, reference, tok),
        "unpaired-feedback": PreferenceData("unpaired-feedback", td_unpaired, reference, tok),
    }


def test_all_registered_with_family_and_data():
    registry = load_registry()
    for name in NAMES:
        spec = registry.algorithm(name)
        assert spec.family == "preference"
        assert spec.data == ("unpaired-feedback" if name == "kto" else "preference-pairs")
        assert spec.load_loss_class().__name__.endswith("Loss")


def test_glue_module_imports_no_torch():
    code = "import sys, offline_plugins.algorithms.preference; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", NAMES)
def test_build_and_one_step(name, data):
    spec = load_registry().algorithm(name)
    d = data[spec.data]
    ref_fp = model_fingerprint(d.reference)
    parts = spec.load_build()(spec.default_config(), d)
    group = parts.optimizers[0]
    opt = group.make_optimizer()
    before = [p.detach().clone() for p in group.params]
    out = parts.loss(d.train[:4])
    total = sum(out[k] for k in group.loss_keys)
    assert torch.isfinite(total)
    assert "preference_accuracy" in out.keys()
    if hasattr(type(parts.loss), "optimised_terms"):  # the loss says what a trainer minimises: every loss_* it writes
        assert tuple(group.loss_keys) == type(parts.loss).optimised_terms
        assert sorted(k for k in out.keys() if k.startswith("loss_")) == sorted(group.loss_keys)
    opt.zero_grad()
    total.backward()
    opt.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, group.params))
    assert model_fingerprint(d.reference) == ref_fp  # the reference is never trained


def test_wrong_data_kind_is_refused(data):
    spec = load_registry().algorithm("kto")
    with pytest.raises(PreferenceDataError, match="kto trains on unpaired-feedback data"):
        spec.load_build()(spec.default_config(), data["preference-pairs"])
    d = data["preference-pairs"]
    bare = PreferenceData("preference-pairs", d.train.exclude("ref_log_probs"), d.reference, d.tokenizer)
    spec = load_registry().algorithm("dpo")
    with pytest.raises(PreferenceDataError, match="add_reference_log_probs"):
        spec.load_build()(spec.default_config(), bare)
