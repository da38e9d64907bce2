"""Online RL through the training shell: a user's JSONL task and reward function, learning in a
small budget, exact resume, the exported model, and the CLI's one-line errors."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from offline_plugins.errors import UserError
from offline_plugins.lightning.run import train_algorithm

torch.set_num_threads(1)


def broken_reward(prompts, responses, **columns):
    return [float("nan")] * len(responses)


_SMALL = {"group_size": 4, "prompts_per_round": 6, "batch_size": 8, "max_new_tokens": 4, "eval_prompts": 20}


def _weights(out):
    from safetensors.torch import load_file

    return load_file(str(out / "model" / "model.safetensors"))


@pytest.mark.slow
def test_grpo_raises_the_reward_of_a_user_task_and_exports_the_policy(prompt_file, tmp_path):
    summary = train_algorithm("grpo", str(prompt_file), steps=36, seed=0, out_dir=tmp_path / "run", progress=False,
                    threads=1, reward="_text_rewards:digit_share", eval_every=0,
                    overrides={**_SMALL, "lr": 3e-3})
    assert summary["data_kind"] == "text-rollouts" and summary["rounds"] == 12
    # spread (seeds 0-2, the releases of constraints.txt): rollout reward 0.09-0.16 -> 0.92-0.98,
    # held-out reward 0.0 -> 1.0; the margins below sit 0.3 and 0.5 under the weakest seed
    assert summary["reward_mean"] > summary["reward_mean_first_round"] + 0.5
    assert 0 <= summary["groups_without_signal"] <= 1
    assert summary["exact_match_after"] is None  # prompt rows without answers: reward only
    assert summary["heldout_reward_after"] > summary["heldout_reward_before"] + 0.5
    # the reward-hacking monitor watched the run: the held-out reward is its gold score here
    watch = summary["reward_hacking"]
    assert watch["best_gold"]["gold_gain"] == pytest.approx(summary["heldout_reward_after"]
                                                           - summary["heldout_reward_before"])
    assert (tmp_path / "run" / "checkpoints" / "best_gold.ckpt").is_file()
    from offline_plugins.modules.tiny_lm import load_causal_lm

    model, tok = load_causal_lm(tmp_path / "run" / "model")  # what --model of the next run accepts
    assert tok("ab")["input_ids"] and sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["cispo", "gspo"])
def test_cispo_and_gspo_raise_the_reward_of_a_user_task(algorithm, prompt_file, tmp_path):
    summary = train_algorithm(algorithm, str(prompt_file), steps=36, seed=0, out_dir=tmp_path / "run", progress=False,
                    threads=1, reward="_text_rewards:digit_share", eval_every=0,
                    overrides={**_SMALL, "lr": 3e-3})
    # spread (seeds 0-2, 36 steps, the GRPO test's settings above): rollout reward
    # 0.09-0.16 -> cispo 1.0 in every seed, gspo 0.90-0.98 (gain 0.78-0.85); held-out reward 0.0 -> 1.0
    # in every seed of both; the margins below sit 0.28 and 0.5 under the weakest seed
    assert summary["reward_mean"] > summary["reward_mean_first_round"] + 0.5
    assert summary["heldout_reward_after"] > summary["heldout_reward_before"] + 0.5


@pytest.mark.slow
def test_resume_equals_an_uninterrupted_run(prompt_file, tmp_path):
    kwargs = dict(seed=1, progress=False, threads=1, reward="_text_rewards:digit_share", eval_every=0,
                  overrides={**_SMALL, "lr": 3e-3, "ppo_epochs": 2})
    # 6 prompts x 4 = 24 rollouts, batch 8, 2 epochs: 6 steps per round; step 4 is mid-round
    train_algorithm("dapo", str(prompt_file), steps=10, out_dir=tmp_path / "full", **kwargs)
    train_algorithm("dapo", str(prompt_file), steps=4, out_dir=tmp_path / "part", **kwargs)
    resumed = train_algorithm("dapo", str(prompt_file), steps=10, out_dir=tmp_path / "part", resume=True, **kwargs)
    assert resumed["steps"] == 10 and resumed["rounds"] == 2
    full, part = _weights(tmp_path / "full"), _weights(tmp_path / "part")
    assert all(torch.equal(full[k], part[k]) for k in full)


def test_errors_are_one_line_user_errors(prompt_file, tmp_path):
    with pytest.raises(UserError, match="group_size must be a whole number >= 2"):
        train_algorithm("grpo", str(prompt_file), steps=2, out_dir=tmp_path / "g1", progress=False,
              reward="_text_rewards:digit_share", overrides={**_SMALL, "group_size": 1})
    with pytest.raises(UserError, match="batch_size 7 must divide the 24 rollouts"):
        train_algorithm("grpo", str(prompt_file), steps=2, out_dir=tmp_path / "b", progress=False,
              reward="_text_rewards:digit_share", overrides={**_SMALL, "batch_size": 7})
    with pytest.raises(UserError, match="has no 'answer'"):
        train_algorithm("grpo", str(prompt_file), steps=2, out_dir=tmp_path / "a", progress=False, overrides=_SMALL)
    with pytest.raises(UserError, match="must be finite"):
        train_algorithm("rloo", str(prompt_file), steps=2, out_dir=tmp_path / "n", progress=False, threads=1,
              reward="test_online_train:broken_reward", overrides=_SMALL)
    assert not (tmp_path / "g1").exists()  # refused before anything was written


def test_cli_lists_the_online_algorithms(capsys):
    from offline_plugins.cli import main

    assert main(["list", "--json"]) == 0
    listed = {a["name"]: a for a in json.loads(capsys.readouterr().out)}
    for name in ("grpo", "dapo", "dr-grpo", "rloo", "expert-iteration"):
        assert listed[name]["family"] == "online-llm" and listed[name]["data"] == "text-rollouts"
        assert "arXiv" in listed[name]["paper"]


@pytest.mark.slow
def test_sft_makes_a_reference_that_the_online_algorithms_start_from(tmp_path):
    import csv

    rng = random.Random(1)
    rows = []
    for _ in range(300):
        word = "".join(rng.choice("abc") for _ in range(3))
        rows.append({"prompt": word + "=", "completion": word[::-1], "answer": word[::-1]})
    sft_file, rl_file = tmp_path / "sft.jsonl", tmp_path / "rl.jsonl"
    sft_file.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["completion"]}) + "\n" for r in rows))
    rl_file.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows))
    sft = train_algorithm("sft", str(sft_file), steps=60, seed=0, out_dir=tmp_path / "sft", progress=False, threads=1,
                log_every=10, eval_every=0, overrides={"batch_size": 32})
    assert sft["data_kind"] == "text-completions" and sft["exact_match_before"] == 0.0
    with open(tmp_path / "sft" / "metrics.csv") as fh:
        nll = [float(r["train/loss_nll"]) for r in csv.DictReader(fh) if r.get("train/loss_nll")]
    assert nll[-1] < 0.5 * nll[0]
    # the next run starts from the sft run's save_pretrained folder: its reference scores what sft reached
    ei = train_algorithm("expert-iteration", str(rl_file), steps=6, seed=0, out_dir=tmp_path / "ei", progress=False,
               threads=1, eval_every=0, model=str(tmp_path / "sft" / "model"), overrides=_SMALL)
    assert ei["exact_match_before"] is not None and ei["rounds"] == 2
    assert (tmp_path / "ei" / "model" / "config.json").is_file()
    with pytest.raises(UserError, match="--reward applies to algorithms trained on their own rollouts"):
        train_algorithm("sft", str(sft_file), steps=2, out_dir=tmp_path / "x", progress=False,
              reward="_text_rewards:digit_share")


@pytest.mark.slow
def test_left_padding_samples_the_scored_model():
    """Prompts of different lengths are left-padded into one ``generate``: each row must still be
    read with positions from its first real token, as the losses score it (right-padded). Before
    the fix the tiny model's generate counted positions from the padding: the built-in task's SFT
    reference scored 75.5 % held-out exact match batched against 88.0 % one prompt at a time, and
    the sampling log-probs of padded rows were up to 13 nats off the scoring forward's."""
    from offline_plugins.modules.causal_lm import CausalLMLogProbs
    from offline_plugins.modules.tiny_lm import load_causal_lm
    from offline_plugins.text.data.rollouts import (
        PromptSource,
        RolloutCollector,
        generate_left_padded,
        greedy_responses,
    )
    from offline_plugins.tokens import prompt_token_ids

    model, tok = load_causal_lm("tiny", seed=0)
    with torch.no_grad():  # make positions matter as much as in a trained model
        model.transformer.wpe.weight.mul_(30)
    model.eval()
    prompts = ["7+5=", "12+3=", "45+67=", "1+1=", "3+80="]
    alone = {p: greedy_responses(model, tok, [p], max_new_tokens=5)[0] for p in prompts}
    assert greedy_responses(model, tok, prompts, max_new_tokens=5) == [alone[p] for p in prompts]

    # sampled tokens come from the distribution the scoring forward gives them (importance ratio 1)
    ids = [prompt_token_ids(tok, p) for p in prompts]
    width = max(map(len, ids))
    left = torch.full((len(ids), width), tok.pad_token_id)
    attn = torch.zeros(len(ids), width, dtype=torch.long)
    for i, e in enumerate(ids):
        left[i, width - len(e):] = torch.tensor(e)
        attn[i, width - len(e):] = 1
    torch.manual_seed(0)
    out = generate_left_padded(model, left, attn, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                               max_new_tokens=4, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                               output_scores=True, return_dict_in_generate=True)
    gen = out.sequences[:, width:]
    sampled_lp = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, gen.unsqueeze(-1)).squeeze(-1)
    for i, e in enumerate(ids):
        row = gen[i].tolist()
        n = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
        full = torch.tensor([e + row[:n]])
        scored = CausalLMLogProbs(model).log_probs(full, torch.ones_like(full))[0, len(e):]
        torch.testing.assert_close(sampled_lp[i, :n], scored, atol=1e-4, rtol=0)

    # the collector samples with the same positions: at a near-zero temperature it answers greedily
    source = PromptSource("padding", [], lambda ps, rs, **_: [0.0] * len(rs), "zero",
                          train=[{"prompt": p} for p in prompts], longest_prompts=prompts)
    collector = RolloutCollector(source, tok, model, group_size=2, prompts_per_round=8, max_new_tokens=5,
                                 temperature=1e-4, seed=0)
    td, _ = collector.collect(model, round=0)
    for p, r in zip(td.get(("text", "prompt")).tolist(), td.get(("text", "response")).tolist()):
        assert r == alone[p], (p, r, alone[p])


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_the_recorded_sampling_log_probs_are_the_scoring_forwards(temperature, top_p):
    """The collector records each sampled token's log-prob inside ``generate`` (no second policy
    forward); they must be the model's own (unwarped) log-probs, what the losses' ratio divides
    by, whatever the temperature and top-p it samples with, on left-padded prompts."""
    from offline_plugins.modules.causal_lm import CausalLMLogProbs
    from offline_plugins.modules.tiny_lm import load_causal_lm
    from offline_plugins.text.data.rollouts import PromptSource, RolloutCollector

    model, tok = load_causal_lm("tiny", seed=0)
    model.eval()
    prompts = ["7+5=", "12+3=", "45+67=", "1+1=", "3+80="]
    source = PromptSource("lp", [], lambda ps, rs, **_: [0.0] * len(rs), "zero",
                          train=[{"prompt": p} for p in prompts], longest_prompts=prompts)
    collector = RolloutCollector(source, tok, model, group_size=3, prompts_per_round=5, max_new_tokens=6,
                                 temperature=temperature, top_p=top_p, seed=3)
    td, _ = collector.collect(model, round=0)
    mask = td.get(("masks", "all_assistant_mask"))
    assert mask.sum() > 15
    scored = CausalLMLogProbs(model).log_probs(td.get(("tokens", "full")), td.get(("masks", "all_attention_mask")))
    recorded = td.get(("log_probs", "full"))
    torch.testing.assert_close(recorded[mask], scored[mask], atol=1e-4, rtol=0)
    assert (recorded[~mask] == 0).all()
    # the reference here is the policy itself: its log-probs agree too, so the KL is ~0
    torch.testing.assert_close(td.get(("next", "ref_log_probs", "full"))[mask], scored[mask], atol=1e-5, rtol=0)


def test_an_online_algorithm_given_offline_data_names_the_data_it_got():
    from offline_plugins.algorithms.online import GRPOConfig, build_grpo

    class PendulumTransitions:  # any data object that is not a rollout source
        pass

    with pytest.raises(UserError, match=r"grpo trains on its own rollouts: .*load_rollout_data\), "
                                        r"not a PendulumTransitions$"):
        build_grpo(GRPOConfig(), PendulumTransitions())


def test_the_rollout_defaults_live_in_one_table():
    import dataclasses
    import inspect

    from offline_plugins.algorithms.online import GRPOConfig
    from offline_plugins.algorithms.online_dpo import OnlineDPOConfig
    from offline_plugins.config import ROLLOUT_DEFAULTS
    from offline_plugins.text.data.rollouts import RolloutCollector, load_rollout_data

    for fn in (RolloutCollector.__init__, load_rollout_data):
        params = inspect.signature(fn).parameters
        for key, default in ROLLOUT_DEFAULTS.items():
            # None is "the task's own", resolved by the loader: the collector takes the resolved number
            if key in params and not (default is None and fn is RolloutCollector.__init__):
                assert params[key].default == default, (fn.__qualname__, key)
    grpo = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    assert {k: grpo[k] for k in ROLLOUT_DEFAULTS if k in grpo} == {k: ROLLOUT_DEFAULTS[k] for k in grpo
                                                                  if k in ROLLOUT_DEFAULTS}
    dpo = {f.name: f.default for f in dataclasses.fields(OnlineDPOConfig)}
    for key in ("group_size", "max_new_tokens", "temperature", "top_p", "reference_sft_steps", "eval_prompts"):
        assert dpo[key] == ROLLOUT_DEFAULTS[key], key


@pytest.mark.gpu
def test_grpo_trains_on_cuda_with_the_frozen_reference_following_the_policy(prompt_file, tmp_path):
    # the reference belongs to the data, not to the trained module: the collector moves it to the
    # policy's device before its first forward (it stayed on the CPU, and the round failed)
    summary = train_algorithm("grpo", str(prompt_file), steps=4, seed=0, out_dir=tmp_path / "cuda", progress=False,
                              reward="_text_rewards:digit_share", eval_every=0, accelerator="gpu", devices=1,
                              overrides=_SMALL)
    assert summary["steps"] == 4 and summary["rounds"] >= 1
    assert all(math.isfinite(v) for v in summary["losses"].values())
