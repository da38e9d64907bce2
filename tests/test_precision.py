"""Training precision: Lightning's precision plugins, and what stays fp32 whatever they are."""

from __future__ import annotations

import json

import torch

torch.set_num_threads(1)


def test_bf16_mixed_training_keeps_the_cached_reference_log_probs_in_fp32(tmp_path, preference_pairs):
    """The seeds: bf16 reference log-probs drown the DPO signal; they are computed once, in fp32, at load."""
    from offline_plugins.lightning.run import train_algorithm

    data = preference_pairs([{"prompt": f"q{i}=", "chosen": "good", "rejected": "bad"} for i in range(200)])
    before = data.train["ref_log_probs"].clone()
    summary = train_algorithm("dpo", data, steps=4, precision="bf16-mixed", out_dir=tmp_path / "run", progress=False,
                    eval_every=0, overrides={"batch_size": 4})
    assert summary["precision"] == "bf16-mixed" and summary["peak_memory_mb"]["host_max_rss"] > 0
    after = data.train["ref_log_probs"]
    assert after["response"].dtype == torch.float32
    assert all(torch.equal(after[k], before[k]) for k in before.keys(True, True))


def test_gradient_checkpointing_gives_the_same_dpo_gradients(preference_pairs):
    from offline_plugins.algorithms.preference import DPOConfig, build_dpo

    data = preference_pairs([{"prompt": f"q{i}=", "chosen": "good" + "!" * (i % 3), "rejected": "bad"}
                             for i in range(200)])
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


def test_summary_reports_the_tokens_trained_and_their_rate(tmp_path, preference_pairs):
    """``tokens_trained`` is every real token of every pair the steps read: here each step reads
    4 pairs whose prompt + response lengths are known, so the count is exact."""
    from offline_plugins.lightning.run import train_algorithm

    data = preference_pairs([{"prompt": f"q{i:03d}=", "chosen": "good", "rejected": "bad"} for i in range(200)])
    per_pair = int(data.train[0]["masks", "all_attention_mask"].sum())
    assert (data.train["masks", "all_attention_mask"].sum((-1, -2)) == per_pair).all()
    summary = train_algorithm("dpo", data, steps=6, out_dir=tmp_path / "run", progress=False, eval_every=0,
                    overrides={"batch_size": 4})
    assert summary["tokens_trained"] == 6 * 4 * per_pair
    assert summary["tokens_per_s"] > 0 and summary["tokens_per_s_all_ranks"] == summary["tokens_per_s"]
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["tokens_trained"] == summary["tokens_trained"]


def test_offline_rl_batches_report_no_tokens(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _lightning_fixtures import FakeOfflineData

    from offline_plugins.lightning.run import train_algorithm

    summary = train_algorithm("iql", FakeOfflineData(), steps=3, out_dir=tmp_path / "run", progress=False, eval_episodes=1,
                    eval_every=0, overrides=["hidden=[16,16]", "batch_size=32"])
    assert "tokens_trained" not in summary and "tokens_per_s" not in summary
