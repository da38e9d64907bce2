"""Training precision: Lightning's precision plugins, and what stays fp32 whatever they are."""

from __future__ import annotations

import json

import torch

torch.set_num_threads(1)


def test_bf16_mixed_training_keeps_the_cached_reference_log_probs_in_fp32(tmp_path, monkeypatch):
    """The seeds: bf16 reference log-probs drown the DPO signal; they are computed once, in fp32, at load."""
    from offline_plugins.data.preference_sources import load_preference_source
    from offline_plugins.lightning.run import train

    monkeypatch.setenv("OFFLINE_PLUGINS_CACHE", str(tmp_path / "cache"))
    rows = [{"prompt": f"q{i}=", "chosen": "good", "rejected": "bad"} for i in range(200)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_preference_source(str(path), kind="preference-pairs", progress=False)
    before = data.train["ref_log_probs"].clone()
    summary = train("dpo", data, steps=4, precision="bf16-mixed", out_dir=tmp_path / "run", progress=False,
                    eval_every=0, overrides={"batch_size": 4})
    assert summary["precision"] == "bf16-mixed" and summary["peak_memory_mb"]["host_max_rss"] > 0
    after = data.train["ref_log_probs"]
    assert after["response"].dtype == torch.float32
    assert all(torch.equal(after[k], before[k]) for k in before.keys(True, True))


def test_gradient_checkpointing_gives_the_same_dpo_gradients(tmp_path, monkeypatch):
    from offline_plugins.algorithms.preference import DPOConfig, build_dpo
    from offline_plugins.data.preference_sources import load_preference_source

    monkeypatch.setenv("OFFLINE_PLUGINS_CACHE", str(tmp_path / "cache"))
    rows = [{"prompt": f"q{i}=", "chosen": "good" + "!" * (i % 3), "rejected": "bad"} for i in range(200)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_preference_source(str(path), kind="preference-pairs", progress=False)
    batch = data.train[:8]
    grads = []
    for checkpointing in (False, True):
        parts = build_dpo(DPOConfig(gradient_checkpointing=checkpointing), data)
        assert parts.model.is_gradient_checkpointing == checkpointing
        parts.loss(batch.clone())["loss_dpo"].backward()
        grads.append({n: p.grad.clone() for n, p in parts.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], atol=1e-6), name
