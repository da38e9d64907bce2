"""Online and iterative DPO: pairs labelled by the verifier from the policy's own rollouts, any
preference loss inside, CLI runs that export the policy, exact resume, and the one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from tensordict import TensorDict

from offline_plugins.errors import UserError
from offline_plugins.lightning.run import train_algorithm

torch.set_num_threads(1)


_SMALL = {"group_size": 4, "prompts_per_round": 6, "batch_size": 3, "max_new_tokens": 4, "eval_prompts": 20,
          "lr": 3e-3}


def _rollouts(tokenizer, rows, *, group_size):
    """Rollout rows as the collector writes them, from (prompt, response) text, scored by the task."""
    from offline_plugins.text.tasks import ArithmeticTask
    from offline_plugins.tokens import prompt_token_ids, response_token_ids

    task = ArithmeticTask(digits=1, ops="+")
    encoded = [(prompt_token_ids(tokenizer, p), response_token_ids(tokenizer, r)) for p, r in rows]
    width = max(len(p) + len(r) for p, r in encoded)
    n = len(rows)
    full = torch.full((n, width), tokenizer.pad_token_id)
    attn = torch.zeros(n, width, dtype=torch.bool)
    resp = torch.zeros(n, width, dtype=torch.bool)
    for i, (p, r) in enumerate(encoded):
        full[i, :len(p) + len(r)] = torch.tensor(p + r)
        attn[i, :len(p) + len(r)] = True
        resp[i, len(p):len(p) + len(r)] = True
    reward = torch.tensor(task.rewards([p for p, _ in rows], [r for _, r in rows])).reshape(n, 1)
    ref = -torch.rand(n, width, generator=torch.Generator().manual_seed(0))
    td = TensorDict({"tokens": {"full": full}, "masks": {"all_attention_mask": attn, "all_assistant_mask": resp},
                     "log_probs": {"full": ref * 0.5},
                     "next": {"reward": reward, "ref_log_probs": {"full": ref}},
                     "group": torch.arange(n // group_size).repeat_interleave(group_size)}, [n])
    return td


def test_an_online_pair_is_labelled_by_the_verifier():
    from offline_plugins.modules.causal_lm import CausalLMLogProbs
    from offline_plugins.modules.tiny_lm import load_causal_lm
    from offline_plugins.objectives.llm import DPOLoss
    from offline_plugins.objectives.llm.online_dpo import OnlinePreferenceLoss

    model, tok = load_causal_lm("tiny", seed=0)
    # prompt 0: responses 2 and 3 right (8); prompt 1 (4+4=8): all four wrong, a tie
    rows = [("3+5=", "7"), ("3+5=", "8"), ("3+5=", "9"), ("3+5=", "8"),
            ("4+4=", "9"), ("4+4=", "7"), ("4+4=", "1"), ("4+4=", "0")]
    td = _rollouts(tok, rows, group_size=4)
    assert td["next", "reward"].flatten().tolist() == [0, 1, 0, 1, 0, 0, 0, 0]
    actor = CausalLMLogProbs(model)
    loss = OnlinePreferenceLoss(DPOLoss(actor, beta=0.5, reduction="none"), group_size=4)
    td = loss.process_rollouts(td)
    assert td["has_signal"].tolist() == [True] * 4 + [False] * 4
    pairs = loss.pair_rollouts(td)
    assert pairs.batch_size == torch.Size([2, 2])
    # chosen: the first right answer (row 1, "8"); rejected: the first wrong one (row 0, "7")
    assert torch.equal(pairs["tokens", "full"][0, 0], td["tokens", "full"][1])
    assert torch.equal(pairs["tokens", "full"][0, 1], td["tokens", "full"][0])
    assert pairs["next", "reward"][0].flatten().tolist() == [1.0, 0.0]
    assert pairs["pair_weight"].tolist() == [[1.0, 1.0], [0.0, 0.0]]
    # the reference log-prob of a response: its per-token reference log-probs summed over its tokens
    mask = td["masks", "all_assistant_mask"].float()
    ref_sum = (td["next", "ref_log_probs", "full"] * mask).sum(-1)
    assert torch.allclose(pairs["ref_log_probs", "response"][0], torch.stack([ref_sum[1], ref_sum[0]]))

    # the loss is DPO on the one real pair; the tie slot weighs nothing
    out = loss(pairs)
    with torch.no_grad():
        lp = (actor.log_probs(td["tokens", "full"], td["masks", "all_attention_mask"]) * mask).sum(-1)
    margin = (lp[1] - ref_sum[1]) - (lp[0] - ref_sum[0])
    expected = -torch.nn.functional.logsigmoid(0.5 * margin)
    torch.testing.assert_close(out["loss_dpo"].detach(), expected, rtol=1e-5, atol=1e-6)
    assert out["pair_fraction"].item() == 0.5
    out["loss_dpo"].backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())

    # iterative DPO's re-referenced pairs read the sampling policy's log-probs instead
    resampled = OnlinePreferenceLoss(DPOLoss(actor, reduction="none"), group_size=4, reference="sampler")
    sample_sum = (td["log_probs", "full"] * mask).sum(-1)
    assert torch.allclose(resampled.pair_rollouts(td)["ref_log_probs", "response"][0],
                          torch.stack([sample_sum[1], sample_sum[0]]))


def test_the_pairing_refuses_what_it_cannot_pair():
    from offline_plugins.modules.tiny_lm import load_causal_lm
    from offline_plugins.objectives.llm import DPOLoss, KTOLoss
    from offline_plugins.objectives.llm.common import PreferenceInputError
    from offline_plugins.objectives.llm.online_dpo import OnlinePreferenceLoss

    _, tok = load_causal_lm("tiny", seed=0)
    with pytest.raises(PreferenceInputError, match="KTO reads unpaired rows"):
        OnlinePreferenceLoss(KTOLoss(reduction="none"), group_size=4)
    with pytest.raises(PreferenceInputError, match="reduction='none'"):
        OnlinePreferenceLoss(DPOLoss(), group_size=4)
    loss = OnlinePreferenceLoss(DPOLoss(reduction="none"), group_size=3)
    td = _rollouts(tok, [("1+1=", "2")] * 4, group_size=2)
    with pytest.raises(PreferenceInputError, match="G = group_size = 3"):
        loss.pair_rollouts(td)
    td["group"] = torch.tensor([0, 1, 0, 1])
    with pytest.raises(PreferenceInputError, match="contiguous"):
        OnlinePreferenceLoss(DPOLoss(reduction="none"), group_size=2).pair_rollouts(td)


def test_inner_ipo_builds_ipo_with_its_own_hyperparameters(prompt_file):
    from offline_plugins.algorithms.online_dpo import IterativeDPOConfig, OnlineDPOConfig, build_online_dpo
    from offline_plugins.config import apply_overrides
    from offline_plugins.kinds.rollouts.rounds import RolloutDataModule
    from offline_plugins.objectives.llm import IPOLoss, SimPOLoss
    from offline_plugins.text.data.rollouts import load_rollout_data

    def data():
        return load_rollout_data(str(prompt_file), model="tiny", reward="_text_rewards:digit_share",
                                 group_size=4, prompts_per_round=6, eval_prompts=20)

    d = data()
    parts = build_online_dpo(apply_overrides(OnlineDPOConfig(), {"inner": "ipo", "tau": "0.05", "batch_size": 3}), d)
    assert type(parts.loss.inner) is IPOLoss and parts.loss.inner.tau.item() == pytest.approx(0.05)
    assert parts.optimizers[0].loss_keys == ("loss_ipo",) and parts.optimizers[0].lr == 1e-3  # from-scratch tiny
    # one pair slot per prompt: 6 slots, batch 3, one epoch
    rounds = RolloutDataModule(d, parts, batch_size=3)
    assert (rounds.rows_per_round, rounds.updates_per_round) == (6, 2)
    assert parts.rollout.training_rows == parts.loss.pair_rollouts
    d = data()
    parts = build_online_dpo(apply_overrides(IterativeDPOConfig(), {"inner": "simpo", "batch_size": 3}), d)
    assert type(parts.loss.inner) is SimPOLoss and parts.loss.inner.beta.item() == 2.0  # simpo's own default
    assert RolloutDataModule(d, parts, batch_size=3).updates_per_round == 4 * 2  # iterative: 4 epochs per round
    with pytest.raises(UserError, match=r"batch_size 4 must divide the 6 preference-pair slots \(one per prompt of "
                                        r"prompts_per_round\) of a round; fix it with --set batch_size=2"):
        RolloutDataModule(d, parts, batch_size=4)


def test_bad_inner_losses_are_named(prompt_file, tmp_path):
    kwargs = dict(steps=2, progress=False, threads=1, reward="_text_rewards:digit_share")
    with pytest.raises(UserError, match="unknown inner loss 'dop'; choose one of dpo, robust-dpo, rpo, ipo, orpo, "
                                        "simpo"):
        train_algorithm("online-dpo", str(prompt_file), out_dir=tmp_path / "a", overrides={**_SMALL, "inner": "dop"}, **kwargs)
    with pytest.raises(UserError, match="inner=kto is not supported"):
        train_algorithm("online-dpo", str(prompt_file), out_dir=tmp_path / "b", overrides={**_SMALL, "inner": "kto"}, **kwargs)
    with pytest.raises(UserError, match="beta is not a hyperparameter of inner=ipo"):
        train_algorithm("iterative-dpo", str(prompt_file), out_dir=tmp_path / "c",
              overrides={**_SMALL, "inner": "ipo", "beta": 0.2}, **kwargs)
    with pytest.raises(UserError, match="batch_size 4 must divide the 6 preference-pair slots"):
        train_algorithm("online-dpo", str(prompt_file), out_dir=tmp_path / "d", overrides={**_SMALL, "batch_size": 4}, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["online-dpo", "iterative-dpo"])
def test_a_cli_run_writes_its_summary_and_the_policy(prompt_file, tmp_path, algorithm, capsys):
    from offline_plugins.cli import main

    out = tmp_path / algorithm
    args = ["train", algorithm, "--dataset", str(prompt_file), "--model", "tiny", "--reward",
            "_text_rewards:digit_share", "--steps", "8", "--threads", "1", "--no-progress", "--out", str(out),
            "--set", "inner=ipo"]
    for k, v in _SMALL.items():
        args += ["--set", f"{k}={v}"]
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == algorithm and summary["data_kind"] == "text-rollouts"
    # online: 2 updates per round; iterative: 4 epochs x 2
    assert summary["rounds"] == (4 if algorithm == "online-dpo" else 1)
    assert summary["config"]["inner"] == "ipo"
    assert 0 <= summary["groups_without_signal"] < 1  # the share of prompts without a pair
    assert summary["heldout_reward_after"] is not None
    assert (out / "model" / "config.json").is_file() and (out / "model" / "model.safetensors").is_file()
    assert "held-out reward" in capsys.readouterr().out


@pytest.mark.slow
def test_resume_equals_an_uninterrupted_run(prompt_file, tmp_path):
    from safetensors.torch import load_file

    kwargs = dict(seed=1, progress=False, threads=1, reward="_text_rewards:digit_share", eval_every=0,
                  overrides={**_SMALL, "epochs_per_round": 2, "update_reference": True})
    # 6 pair slots, batch 3, 2 epochs: 4 steps per round; step 6 is mid-round
    train_algorithm("iterative-dpo", str(prompt_file), steps=10, out_dir=tmp_path / "full", **kwargs)
    train_algorithm("iterative-dpo", str(prompt_file), steps=6, out_dir=tmp_path / "part", **kwargs)
    resumed = train_algorithm("iterative-dpo", str(prompt_file), steps=10, out_dir=tmp_path / "part", resume=True, **kwargs)
    assert resumed["steps"] == 10 and resumed["rounds"] == 3
    full = load_file(str(tmp_path / "full" / "model" / "model.safetensors"))
    part = load_file(str(tmp_path / "part" / "model" / "model.safetensors"))
    assert all(torch.equal(full[k], part[k]) for k in full)
    from offline_plugins.modules.tiny_lm import load_causal_lm

    reference = load_causal_lm("tiny", seed=0)[0].state_dict()  # the run's reference: training moved it
    assert any(not torch.equal(full[k], reference[k]) for k in full if k in reference)


def test_dynamic_sampling_fills_the_round_with_pairs():
    from offline_plugins.modules.tiny_lm import load_causal_lm
    from offline_plugins.objectives.llm import DPOLoss
    from offline_plugins.objectives.llm.online_dpo import OnlinePreferenceLoss
    from offline_plugins.text.data.rollouts import PromptSource, RolloutCollector

    model, tok = load_causal_lm("tiny", seed=0)
    # prompts starting with "b" get rewards 0, 1, 0, 1 (a pair); the others all 0 (a tie)
    source = PromptSource("half", [], lambda ps, rs, **_: [float(i % 2) if p.startswith("b") else 0.0
                                                         for i, p in enumerate(ps)], "half",
                          train=[{"prompt": c + "x:"} for c in "abab"], longest_prompts=["ax:"])
    collector = RolloutCollector(source, tok, model, group_size=4, prompts_per_round=4, max_new_tokens=2, seed=0,
                                 max_attempts=4)
    for dynamic in (False, True):
        loss = OnlinePreferenceLoss(DPOLoss(reduction="none"), group_size=4, dynamic_sampling=dynamic)
        td, stats = collector.collect(model, round=0, process=loss.process_rollouts,
                                      dynamic_sampling=loss.dynamic_sampling)
        weight = loss.pair_rollouts(td)["pair_weight"][:, 0]
        texts = td.get(("text", "prompt"))
        firsts = [str(p) for p in (texts.tolist() if hasattr(texts, "tolist") else list(texts))][::4]
        b_share = sum(p.startswith("b") for p in firsts) / 4
        assert weight.tolist() == [float(p.startswith("b")) for p in firsts]
        if dynamic:
            assert b_share == 1.0 and stats["sampled_prompts"] > 4  # every slot a real pair
        else:
            assert stats["groups_without_signal"] == 1 - b_share
