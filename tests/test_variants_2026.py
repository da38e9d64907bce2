"""The 2026 loss variants (gdpo, maxrl, luspo, vespo) and the GRPO family's new options (the optimal
token baseline, DeepSeek-V3.2's unbiased KL and off-policy sequence masking): each against a hand
computation, the gradients where they differ from GRPO's, a shell run of each, and the bad inputs."""

from __future__ import annotations

import math

import pytest
import torch
from _rollout_rows import CURRENT, SAMPLE, _Fixed, _rows, _run

from offline_plugins.modules.causal_lm import CausalLMLogProbs
from offline_plugins.objectives.llm.estimators import k3_kl, optimal_token_advantages
from offline_plugins.objectives.llm.online import (
    DrGRPOLoss,
    REINFORCEPPLoss,
    TextCISPOLoss,
    TextGRPOLoss,
    TextGSPOLoss,
)
from offline_plugins.objectives.llm.online_variants import (
    RewardRangeError,
    TextGDPOLoss,
    TextLUSPOLoss,
    TextMaxRLLoss,
    TextVESPOLoss,
)

torch.set_num_threads(1)


# -- gdpo ------------------------------------------------------------------------------------------
def test_gdpo_keeps_apart_the_reward_mixes_grpo_collapses():
    # two groups of two: group 0's responses score (0,0) and (0,1), group 1's (0,0) and (1,1). GRPO on the sums
    # (0 vs 1, 0 vs 2) gives both groups -1, +1; GDPO standardises each reward on its own first, so group 1's
    # second response, better on both rewards, gets twice the advantage of group 0's
    comps = [[0.0, 0.0], [0.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
    sample = torch.zeros(4, 3)
    rows = _rows(sample, [sum(c) for c in comps], [0, 0, 1, 1], components=comps)
    grpo = TextGRPOLoss(None, beta=0.0)
    grpo.actor_network = _Fixed(sample)
    assert grpo.process_rollouts(rows.clone()).get("advantage")[:, -1, 0].tolist() == [-1.0, 1.0, -1.0, 1.0]
    gdpo = TextGDPOLoss(None, reward_weights=[1.0, 1.0])
    gdpo.actor_network = _Fixed(sample)
    adv = gdpo.process_rollouts(rows.clone()).get("advantage")[:, -1, 0]
    raw = torch.tensor([-1.0, 1.0, -2.0, 2.0])  # per-reward group advantages summed
    assert torch.allclose(adv, raw / raw.pow(2).mean().sqrt(), atol=1e-5)
    assert gdpo.process_rollouts(rows.clone()).get("has_signal").tolist() == [True] * 4


def test_gdpo_weights_scale_each_rewards_advantage():
    comps = [[1.0, 0.0], [0.0, 1.0]]
    gdpo = TextGDPOLoss(None, reward_weights=[2.0, 1.0])
    gdpo.actor_network = _Fixed(torch.zeros(2, 3))
    adv = gdpo.process_rollouts(_rows(torch.zeros(2, 3), [1.0, 1.0], [0, 0], components=comps)).get("advantage")
    raw = torch.tensor([2 * 1 + 1 * -1, 2 * -1 + 1 * 1.0])  # GRPO on the equal sums would give 0, 0
    assert torch.allclose(adv[:, -1, 0], raw / raw.pow(2).mean().sqrt(), atol=1e-5)


def test_gdpo_refuses_one_reward_and_a_wrong_weight_count():
    gdpo = TextGDPOLoss(None)
    gdpo.actor_network = _Fixed(torch.zeros(2, 3))
    with pytest.raises(Exception, match="give two or more"):
        gdpo.process_rollouts(_rows(torch.zeros(2, 3), [1.0, 0.0], [0, 0], components=[[1.0], [0.0]]))
    with pytest.raises(Exception, match="needs each response's rewards side by side"):
        gdpo.process_rollouts(_rows(torch.zeros(2, 3), [1.0, 0.0], [0, 0]))
    three = TextGDPOLoss(None, reward_weights=[1.0, 1.0, 1.0])
    three.actor_network = _Fixed(torch.zeros(2, 3))
    with pytest.raises(Exception, match="3 reward_weights for 2 rewards"):
        three.process_rollouts(_rows(torch.zeros(2, 3), [1.0, 0.0], [0, 0], components=[[1.0, 0.0], [0.0, 1.0]]))


# -- maxrl -----------------------------------------------------------------------------------------
def test_maxrl_weighs_a_rarely_solved_prompt_by_one_over_its_success_rate():
    # group 0: 1 of 4 correct (p = 1/4); group 1: 3 of 4 (p = 3/4). REINFORCE's advantage r - p; MaxRL's (r - p) / p
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    loss = TextMaxRLLoss(None)
    loss.actor_network = _Fixed(torch.zeros(8, 3))
    adv = loss.process_rollouts(_rows(torch.zeros(8, 3), rewards, [0] * 4 + [1] * 4)).get("advantage")[:, -1, 0]
    want = [0.75 / 0.25, -1.0, -1.0, -1.0, 0.25 / 0.75, 0.25 / 0.75, 0.25 / 0.75, -1.0]
    assert adv.tolist() == pytest.approx(want, rel=1e-6)
    # the sum over a group's correct responses of A is (1 - p) G / p ... its update is the correct responses' mean score
    # minus the group's mean: with one correct of four, that response's weight is 3/4 / (1/4 * 4) * 4 = 3
    out, lp, _ = _run(TextMaxRLLoss(None), torch.zeros(8, 3),
                      _rows(torch.zeros(8, 3), rewards, [0] * 4 + [1] * 4))
    out["loss_objective"].backward()
    # on-policy GRPO-style aggregation: d/d lp of -mean_i mean_t A_i * ratio = -A_i / (T_i * B)
    assert lp.grad[0, 1].item() == pytest.approx(-3.0 / 2 / 8, rel=1e-5)


def test_maxrl_refuses_rewards_outside_zero_one():
    loss = TextMaxRLLoss(None)
    loss.actor_network = _Fixed(torch.zeros(2, 3))
    with pytest.raises(RewardRangeError, match=r"rewards in \[0, 1\].*lie in \[-1, 1\]"):
        loss.process_rollouts(_rows(torch.zeros(2, 3), [1.0, -1.0], [0, 0]))


# -- luspo -----------------------------------------------------------------------------------------
def test_luspo_is_gspo_with_each_response_weighted_by_its_length():
    # response 0 has 2 tokens, response 1 has 1 (then padding); rewards 1, 0 -> A = +1, -1
    sample = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.4, 0.9]]))
    current = torch.log(torch.tensor([[0.5, 0.6, 0.7], [0.5, 0.3, 0.9]]))
    rows = _rows(sample, [1.0, 0.0], [0, 0], response=[2, 1])
    gspo, _, _ = _run(TextGSPOLoss(None, clip_epsilon=0.2), current, rows.clone())
    luspo, _, _ = _run(TextLUSPOLoss(None, clip_epsilon=0.2), current, rows.clone())
    lr = (current - sample)[:, 1:]
    s0, s1 = math.exp(lr[0].mean().item()), math.exp(lr[1, 0].item())  # 1.296 (clipped at 1.2), 0.75
    clip = lambda s, a: min(s * a, min(max(s, 0.8), 1.2) * a)  # noqa: E731
    assert gspo["loss_objective"].item() == pytest.approx(-(clip(s0, 1) + clip(s1, -1)) / 2, rel=1e-5)
    assert luspo["loss_objective"].item() == pytest.approx(-(2 * clip(s0, 1) + 1 * clip(s1, -1)) / 2, rel=1e-5)


def test_luspo_gradient_per_token_does_not_shrink_with_the_length():
    # on-policy: GSPO's gradient on a token of a response of length n is A / (n * B); LUSPO's A / B for any n
    sample = torch.log(torch.full((2, 4), 0.5))
    rows = _rows(sample, [1.0, 0.0], [0, 0], response=[3, 1])
    out, lp, _ = _run(TextLUSPOLoss(None), sample, rows)
    out["loss_objective"].backward()
    assert lp.grad[0, 1].item() == pytest.approx(-1.0 / 2, rel=1e-5)
    assert lp.grad[1, 1].item() == pytest.approx(1.0 / 2, rel=1e-5)
    out, lp, _ = _run(TextGSPOLoss(None), sample, _rows(sample, [1.0, 0.0], [0, 0], response=[3, 1]))
    out["loss_objective"].backward()
    assert lp.grad[0, 1].item() == pytest.approx(-1.0 / 3 / 2, rel=1e-5)


# -- vespo -----------------------------------------------------------------------------------------
def test_vespo_weighs_each_response_by_the_reshaped_sequence_ratio():
    out, lp, _ = _run(TextVESPOLoss(None), CURRENT, _rows(SAMPLE, [1.0, 0.0], [0, 0]))
    l = (CURRENT - SAMPLE)[:, 1:]
    w = l.sum(-1).exp()
    phi0 = w[0].item() ** 2 * math.exp(3.0 * (1 - w[0].item()))  # A > 0: k 2, lambda 3
    phi1 = w[1].item() ** 3 * math.exp(2.0 * (1 - w[1].item()))  # A < 0: k 3, lambda 2
    terms = torch.stack([phi0 * 1.0 * l[0], phi1 * -1.0 * l[1]])
    assert out["loss_objective"].item() == pytest.approx(-terms.mean().item(), rel=1e-5)
    out["loss_objective"].backward()
    # the weight is detached: the gradient on a token is -phi * A / (tokens of the batch)
    assert lp.grad[0, 1].item() == pytest.approx(-phi0 / 4, rel=1e-5)
    assert lp.grad[1, 2].item() == pytest.approx(phi1 / 4, rel=1e-5)


def test_vespo_is_reinforce_on_policy_and_quiets_a_response_whose_ratio_exploded():
    out, lp, _ = _run(TextVESPOLoss(None), SAMPLE, _rows(SAMPLE, [1.0, 0.0], [0, 0]))
    out["loss_objective"].backward()
    assert lp.grad[0, 1].item() == pytest.approx(-1.0 / 4, rel=1e-6)  # phi(1) = 1
    stale = SAMPLE.clone()
    stale[0, 1:] += 2.0  # a ratio of e^4 over the response
    out, lp, _ = _run(TextVESPOLoss(None), stale, _rows(SAMPLE, [1.0, 0.0], [0, 0]))
    out["loss_objective"].backward()
    assert abs(lp.grad[0, 1].item()) < 1e-10 < abs(lp.grad[1, 1].item())
    assert out["clip_fraction"].item() == pytest.approx(0.5)


@pytest.mark.parametrize("kwargs, match", [({"lam_pos": 0.0}, "lam_pos must be a number > 0"),
                                           ({"k_neg": -1.0}, "k_neg must be a number >= 0")])
def test_vespo_refuses_a_bad_shape(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TextVESPOLoss(None, **kwargs)


# -- the optimal token baseline --------------------------------------------------------------------
def test_optimal_token_baseline_with_equal_score_norms_is_the_group_mean():
    # every token drawn with the same probability from the same distribution: W is the same for every response,
    # so the baseline at each position is the plain mean of the returns there (Dr. GRPO's advantage)
    lp = torch.log(torch.full((3, 3), 0.5))
    adv = optimal_token_advantages(torch.tensor([[1.0] * 3, [0.0] * 3, [0.5] * 3]), lp, torch.full((3, 3), 0.5),
                                   torch.ones(3, 3, dtype=torch.bool), torch.tensor([0, 0, 0]))
    assert torch.allclose(adv, torch.tensor([[0.5] * 3, [-0.5] * 3, [0.0] * 3]), atol=1e-6)


def test_optimal_token_baseline_hand_computed_and_zero_where_one_response_runs_on():
    # response 0: tokens of p .9 then .5; response 1: one token of p .5. sum p^2 = .82 at every position
    lp = torch.log(torch.tensor([[0.9, 0.5], [0.5, 0.5]]))
    mask = torch.tensor([[True, True], [True, False]])
    adv = optimal_token_advantages(torch.tensor([[1.0, 1.0], [0.0, 0.0]]), lp, torch.full((2, 2), 0.82), mask,
                                   torch.tensor([4, 4]))
    w0, w1 = 1 - 1.8 + 0.82, 1 - 1.0 + 0.82  # each first token's score norm
    b = (1.0 * w0 + 0.0 * w1) / (w0 + w1)
    assert adv[0, 0].item() == pytest.approx(1 - b, rel=1e-5) and adv[1, 0].item() == pytest.approx(-b, rel=1e-5)
    assert adv[0, 1].item() == pytest.approx(1.0)  # alone at position 1: no baseline, its own return
    assert adv[1, 1].item() == 0.0


def test_the_optimal_token_baseline_option_reads_the_policys_distribution():
    torch.manual_seed(0)
    actor = CausalLMLogProbs(torch.nn.Embedding(6, 6))
    tokens = torch.randint(0, 6, (4, 5))
    with torch.no_grad():
        lp = actor.log_probs(tokens, torch.ones(4, 5, dtype=torch.bool))
        p2 = torch.nn.functional.pad(actor.logits(tokens, torch.ones(4, 5))[:, :-1].softmax(-1).pow(2).sum(-1), (1, 0))
    rows = _rows(lp, [1.0, 0.0, 1.0, 0.0], [0, 0, 0, 0])
    rows.set(("tokens", "full"), tokens)
    loss = TextGRPOLoss(actor, token_baseline="optimal")
    td = loss.process_rollouts(rows)
    mask = rows.get(("masks", "all_assistant_mask"))
    want = optimal_token_advantages(torch.tensor([[1.0], [0.0], [1.0], [0.0]]).expand(4, 5), lp, p2, mask,
                                    rows.get("group"))
    assert torch.allclose(td.get("advantage")[..., 0], want, atol=1e-6)
    assert not torch.allclose(td.get("advantage")[..., 0][mask].abs(), torch.ones(16))  # not GRPO's +-1
    assert math.isfinite(loss(td)["loss_objective"].item())


def test_the_optimal_token_baseline_is_refused_where_the_advantage_is_per_token_already():
    with pytest.raises(ValueError, match="token_baseline='optimal' replaces a per-response group advantage"):
        REINFORCEPPLoss(None, token_baseline="optimal")
    with pytest.raises(ValueError, match="token_baseline must be one of group, optimal"):
        TextGRPOLoss(None, token_baseline="best")


# -- DeepSeek-V3.2's unbiased KL and off-policy sequence masking -----------------------------------
def test_unbiased_kl_is_k3_times_the_ratio_and_its_gradient_is_the_kls():
    ref = SAMPLE - torch.tensor([[0.0, 0.3, -0.2], [0.0, 0.1, 0.4]])
    rows = _rows(SAMPLE, [1.0, 0.0], [0, 0], ref_lp=ref)
    plain, lp_k3, _ = _run(DrGRPOLoss(None, beta=1.0), CURRENT, rows.clone())
    fixed, lp_u, _ = _run(DrGRPOLoss(None, beta=1.0, unbiased_kl=True), CURRENT, rows.clone())
    rho = (CURRENT - SAMPLE).exp()[:, 1:]
    k3 = k3_kl(CURRENT, ref)[:, 1:]
    # Dr. GRPO's aggregation: each response's token sum over the constant normaliser (T = 3), then the mean
    assert plain["loss_kl"].item() == pytest.approx((k3.sum(-1) / 3).mean().item(), rel=1e-5)
    assert fixed["loss_kl"].item() == pytest.approx(((rho * k3).sum(-1) / 3).mean().item(), rel=1e-5)
    fixed["loss_kl"].backward()
    plain["loss_kl"].backward()
    # d/d lp of rho * k3 = rho * (lp - ref); of k3 = 1 - exp(ref - lp)
    log_ratio_ref = (CURRENT - ref)[:, 1:]
    assert torch.allclose(lp_u.grad[:, 1:], rho * log_ratio_ref / 3 / 2, atol=1e-6)
    assert torch.allclose(lp_k3.grad[:, 1:], (1 - (-log_ratio_ref).exp()) / 3 / 2, atol=1e-6)
    on, _, _ = _run(DrGRPOLoss(None, beta=1.0, unbiased_kl=True), SAMPLE, rows.clone())
    off, _, _ = _run(DrGRPOLoss(None, beta=1.0), SAMPLE, rows.clone())
    assert on["loss_kl"].item() == pytest.approx(off["loss_kl"].item(), rel=1e-6)  # on-policy: the same


def test_off_policy_mask_drops_only_drifted_responses_with_a_negative_advantage():
    # CISPO keeps a gradient on every token (its weight is clipped, not the term), so what the mask drops shows
    current = SAMPLE.clone()
    current[:, 1:] -= 1.5  # both responses drifted: mean log(pi_sample / pi) = 1.5
    rows = _rows(SAMPLE, [1.0, 0.0], [0, 0])
    out, lp, _ = _run(TextCISPOLoss(None, off_policy_mask=1.0), current, rows.clone())
    out["loss_objective"].backward()
    assert out["masked_sequences"].item() == pytest.approx(0.5)
    assert lp.grad[1].abs().sum().item() == 0.0  # A < 0 and drifted past delta: left out
    assert lp.grad[0].abs().sum().item() > 0.0  # A > 0: kept however far it drifted
    loose, lp, _ = _run(TextCISPOLoss(None, off_policy_mask=2.0), current, rows.clone())
    loose["loss_objective"].backward()
    assert loose["masked_sequences"].item() == 0.0 and lp.grad[1].abs().sum().item() > 0
    with pytest.raises(ValueError, match="off_policy_mask is the threshold"):
        TextGRPOLoss(None, off_policy_mask=-1.0)


# -- through the shell --------------------------------------------------------------------------------
def _train(algorithm, prompt_file, out, reward, **overrides):
    from offline_plugins.lightning.run import train_algorithm

    return train_algorithm(algorithm, str(prompt_file), steps=4, seed=0, out_dir=out, progress=False, threads=1,
                           reward=reward, eval_every=0, log_every=1,
                           overrides={"group_size": 4, "prompts_per_round": 6, "batch_size": 8, "max_new_tokens": 4,
                                      "eval_prompts": 20, "lr": 3e-3, **overrides})


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, overrides", [
    ("maxrl", {}), ("luspo", {}), ("vespo", {}),
    ("grpo", {"token_baseline": "optimal", "unbiased_kl": True, "off_policy_mask": 0.5, "ppo_epochs": 2}),
])
def test_each_2026_variant_trains_through_the_shell(algorithm, overrides, prompt_file, tmp_path):
    summary = _train(algorithm, prompt_file, tmp_path / "run", "_text_rewards:digit_share", **overrides)
    assert summary["steps"] == 4 and math.isfinite(summary["losses"]["train/loss_objective"])


@pytest.mark.slow
def test_gdpo_trains_on_two_named_rewards_and_the_rollouts_carry_both(prompt_file, tmp_path):
    from offline_plugins.text.data.rollouts import load_rollout_data

    rewards = ["digits=_text_rewards:digit_share", "short=_text_rewards:brevity"]
    summary = _train("gdpo", prompt_file, tmp_path / "run", rewards, reward_weights="1,0.5")
    assert summary["steps"] == 4 and math.isfinite(summary["losses"]["train/loss_objective"])
    data = load_rollout_data(str(prompt_file), reward=rewards, reward_weights="1,0.5", group_size=4,
                             prompts_per_round=2, max_new_tokens=4, eval_prompts=4)
    td, _ = data.collector_for().collect(data.reference, round=0)
    comps = td.get(("next", "reward_components"))
    assert comps.shape == (8, 2)
    assert torch.allclose(td.get(("next", "reward"))[:, 0], comps[:, 0] + 0.5 * comps[:, 1])
    texts = td.get(("text", "response")).tolist()
    from _text_rewards import brevity

    assert comps[:, 1].tolist() == brevity(None, texts)


@pytest.mark.parametrize("argv, match", [
    (["--reward", "_text_rewards:digit_share"], "gdpo combines several rewards"),
    (["--reward", "a=_text_rewards:digit_share", "--reward", "_text_rewards:brevity"],
     "several rewards are given as NAME=SPEC"),
    (["--reward", "a=_text_rewards:digit_share", "--reward", "a=_text_rewards:brevity"],
     "the name 'a' is given twice"),
    (["--reward", "a=_text_rewards:digit_share", "--reward", "b=_text_rewards:brevity",
      "--set", "reward_weights=1,2,3"], "reward_weights='1,2,3' must be 2 finite numbers"),
])
def test_bad_reward_settings_are_one_line_each(argv, match, prompt_file, tmp_path, capsys):
    from offline_plugins.cli import main

    rc = main(["train", "gdpo", "--dataset", str(prompt_file), "--steps", "1", "--out", str(tmp_path / "r"),
               "--no-progress", *argv])
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err
    assert match in err, err
