"""LoRA (peft): DPO trains adapters only, the reference is the base with adapters off, the export reloads."""

from __future__ import annotations

import json

import pytest
import torch

peft = pytest.importorskip("peft")

from offline_plugins.cli import main  # noqa: E402

torch.set_num_threads(1)


def _pairs(tmp_path, n=200):
    rows = [{"prompt": f"q{i}=", "chosen": "good" + "!" * (i % 3), "rejected": "bad"} for i in range(n)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_dpo_with_lora_trains_adapters_only_against_the_base_with_adapters_off(tmp_path, monkeypatch):
    from offline_plugins.algorithms.preference import DPOConfig, build_dpo
    from offline_plugins.lightning.run import train_algorithm
    from offline_plugins.modules.causal_lm import AdaptersOff
    from offline_plugins.text.data.preference_sources import load_preference_source

    monkeypatch.setenv("OFFLINE_PLUGINS_CACHE", str(tmp_path / "cache"))
    data = load_preference_source(str(_pairs(tmp_path)), kind="preference-pairs", progress=False)
    loaded = data.reference
    base = {k: v.clone() for k, v in loaded.state_dict().items()}
    ids = data.test_pairs["tokens", "full"][:4, 0]
    with torch.no_grad():
        before = loaded(input_ids=ids).logits
    # the parts carry the reference (the policy's base seen with the adapters off); the data is not rewritten
    parts = build_dpo(DPOConfig(batch_size=8, lora_r=4, lr=1e-2), data)
    assert data.reference is loaded and isinstance(parts.reference, AdaptersOff)
    policy = parts.reference.peft_model
    assert policy is parts.model
    optimizer = torch.optim.Adam(parts.optimizers[0].params, lr=parts.optimizers[0].lr)
    for step in range(20):  # a plain loop over the parts, as a TorchRL user would write it
        batch = data.train_pairs[(torch.arange(8) + 8 * step) % data.train_pairs.batch_size[0]]
        loss = parts.loss(batch)["loss_dpo"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    after_base = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
                  for k, v in policy.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(after_base[k], v) for k, v in base.items())  # the base weights never moved
    with torch.no_grad():
        assert torch.allclose(parts.reference(input_ids=ids).logits, before, atol=1e-6)  # adapters off: the reference
        assert not torch.allclose(policy(input_ids=ids).logits, before, atol=1e-4)  # the adapters learnt something

    # through the shell: the evaluation compares with the adapters-off reference, and the export
    summary = train_algorithm("dpo", str(_pairs(tmp_path)), steps=20, out_dir=tmp_path / "run", progress=False,
                              eval_every=0, overrides={"batch_size": 8, "lora_r": 4, "lr": 1e-2})
    assert summary["kl_to_reference"] > 0
    # the export: adapters for peft, and the merged model for transformers, giving the policy's log-probs
    from transformers import AutoModelForCausalLM

    from offline_plugins.modules.tiny_lm import load_causal_lm

    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(summary["model_dir"])
    adapters = peft.PeftModel.from_pretrained(load_causal_lm("tiny", seed=0)[0], str(tmp_path / "run" / "adapter"))
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, adapters(input_ids=ids).logits, atol=1e-4)
        assert not torch.allclose(merged(input_ids=ids).logits, before, atol=1e-4)


def test_eval_rebuilds_a_lora_checkpoint(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OFFLINE_PLUGINS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    assert main(["train", "dpo", "--dataset", str(_pairs(tmp_path)), "--model", "tiny", "--steps", "10",
                 "--set", "lora_r=4", "--set", "batch_size=8", "--out", str(out), "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert main(["eval", str(out / "checkpoints" / "last.ckpt"), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["preference_accuracy"] == summary["preference_accuracy"]
    assert again["kl_to_reference"] == pytest.approx(summary["kl_to_reference"], rel=1e-4)


def test_lora_settings_are_checked_by_name(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OFFLINE_PLUGINS_CACHE", str(tmp_path / "cache"))
    data = _pairs(tmp_path)
    code = main(["train", "dpo", "--dataset", str(data), "--model", "tiny", "--steps", "2", "--set", "lora_r=4",
                 "--set", "lora_target=no_such_layer", "--out", str(tmp_path / "r"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "lora_target='no_such_layer'" in err and len(err.strip().splitlines()) == 1, err


def test_grpo_with_lora_samples_and_scores_against_the_base_with_adapters_off(tmp_path):
    """The online family takes the same LoRA settings: adapters only are trained, the rollouts'
    reference log-probs come from the policy's base with adapters off (no second copy), and the
    export merges the adapters into OUT/model."""
    from offline_plugins.lightning.run import train_algorithm
    from offline_plugins.text.data.rollouts import load_rollout_data

    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 40) for b in range(10, 17)]
    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = {"group_size": 4, "prompts_per_round": 4, "batch_size": 8, "max_new_tokens": 3, "eval_prompts": 8}
    data = load_rollout_data(str(path), model="tiny", **{k: v for k, v in settings.items() if k != "batch_size"})
    base = {k: v.clone() for k, v in data.reference.state_dict().items()}
    summary = train_algorithm("grpo", data, steps=6, out_dir=tmp_path / "run", progress=False, eval_every=0, threads=1,
                    overrides={**settings, "lora_r": 4, "lr": 1e-2})
    # peft puts the adapters into the reference's own modules (the weights are held once): the run scored its
    # rollouts against them switched off (RolloutPlan.reference, an AdaptersOff), and the loaded model object
    # now runs with them on, as the policy
    policy = data.reference
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    after_base = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
                  for k, v in policy.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(after_base[k], v) for k, v in base.items())
    assert summary["rounds"] == 3 and (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 6, 7, 8]])
    merged = AutoModelForCausalLM.from_pretrained(summary["model_dir"])
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, policy(input_ids=ids).logits, atol=1e-4)


def test_ppo_rlhf_with_lora_keeps_a_full_critic_and_the_adapters_off_reference(tmp_path):
    from offline_plugins.algorithms.ppo_rlhf import PPORLHFConfig, build
    from offline_plugins.modules.causal_lm import AdaptersOff
    from offline_plugins.text.data.rollouts import load_rollout_data

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(40)))
    data = load_rollout_data(str(path), model="tiny", group_size=1, prompts_per_round=4, max_new_tokens=3)
    parts = build(PPORLHFConfig(group_size=1, prompts_per_round=4, batch_size=4, max_new_tokens=3, lora_r=4), data)
    reference = parts.rollout.reference
    assert isinstance(reference, AdaptersOff) and data.collector_for(parts.rollout).reference is reference
    policy, value = parts.optimizers
    assert all("lora_" in n for n, p in parts.model.named_parameters() if p.requires_grad)
    assert value.params and all(p.requires_grad for p in value.params)  # the critic trains every weight
