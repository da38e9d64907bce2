"""The policy-loss variants of the GRPO base (sapo, gmpo, dppo, reinforce-pp, reinforce-pp-baseline):
each surrogate and advantage against a hand computation, their gradients where they differ from
GRPO's, and a short run of each through the shell."""

from __future__ import annotations

import math

import pytest
import torch

from _rollout_rows import CURRENT, SAMPLE, _Fixed, _rows, _run

from offline_plugins.objectives.llm.online import (
    REINFORCEPPBaselineLoss,
    REINFORCEPPLoss,
    TextDPPOLoss,
    TextGMPOLoss,
    TextGRPOLoss,
    TextSAPOLoss,
)

torch.set_num_threads(1)


# by default _rollout_rows' two responses of one prompt (SAMPLE, CURRENT) with rewards 1 and 0 -> A = +1, -1
def _loss_value(loss, current=CURRENT, sample=SAMPLE, rewards=(1.0, 0.0), groups=(0, 0), **rows):
    out, lp, _ = _run(loss, current, _rows(sample, list(rewards), list(groups), **rows))
    return out, lp


def test_sapo_is_the_soft_gate_with_its_temperatures():
    out, _ = _loss_value(TextSAPOLoss(None, tau_pos=1.0, tau_neg=2.0))
    ratio = (CURRENT - SAMPLE).exp()[:, 1:]
    gate = lambda r, tau: 4 / tau / (1 + math.exp(-tau * (r - 1)))  # noqa: E731
    row0 = (gate(ratio[0, 0], 1.0) + gate(ratio[0, 1], 1.0)) / 2 * 1.0
    row1 = (gate(ratio[1, 0], 2.0) + gate(ratio[1, 1], 2.0)) / 2 * -1.0
    assert out["loss_objective"].item() == pytest.approx(-(row0 + row1) / 2, rel=1e-5)


def test_sapo_gradient_is_grpos_on_policy_and_softer_off_it():
    # on-policy (current = sample): the gate's gradient weight is 1, GRPO's exactly
    sapo, lp_s = _loss_value(TextSAPOLoss(None), current=SAMPLE)
    grpo, lp_g = _loss_value(TextGRPOLoss(None, beta=0.0), current=SAMPLE)
    sapo["loss_objective"].backward()
    grpo["loss_objective"].backward()
    assert torch.allclose(lp_s.grad, lp_g.grad, atol=1e-6)
    # a ratio of 2 on a positive-advantage token: PPO's clip gives it no gradient, SAPO a small one
    far = SAMPLE.clone()
    far[0, 1] = SAMPLE[0, 1] + math.log(2.0)
    sapo, lp_s = _loss_value(TextSAPOLoss(None), current=far)
    sapo["loss_objective"].backward()
    s = 1 / (1 + math.exp(-1.0))
    assert lp_s.grad[0, 1].item() == pytest.approx(-4 * s * (1 - s) * 2.0 / 2 / 2, rel=1e-5)


def test_gmpo_is_the_geometric_mean_of_the_one_sided_clipped_ratios():
    out, _ = _loss_value(TextGMPOLoss(None, clip_epsilon=(0.4, 0.4)))
    l = (CURRENT - SAMPLE)[:, 1:]  # row 0: log 1.2, log 2 (A > 0: clipped above at 0.4); row 1: log .5, log 1.5
    row0 = math.exp((math.log(1.2) + 0.4) / 2) * 1.0
    row1 = math.exp((max(math.log(0.5), -0.4) + math.log(1.5)) / 2) * -1.0  # A < 0: clipped below at -0.4
    assert l[0, 1].item() > 0.4 and l[1, 0].item() < -0.4
    assert out["loss_objective"].item() == pytest.approx(-(row0 + row1) / 2, rel=1e-5)
    assert out["clip_fraction"].item() == pytest.approx(2 / 4)


def test_gmpo_clips_only_on_the_side_of_the_advantage():
    # row 0 (A > 0) with a token far below 1: not clipped (PPO's region is open below for A > 0)
    current = SAMPLE.clone()
    current[0, 1] = SAMPLE[0, 1] - 1.0
    out, lp = _loss_value(TextGMPOLoss(None), current=current)
    out["loss_objective"].backward()
    assert lp.grad[0, 1].item() != 0.0


def test_dppo_masks_tokens_whose_probability_moved_past_the_threshold():
    out, lp = _loss_value(TextDPPOLoss(None, clip_epsilon=(0.15, 0.15), cap=20.0))
    p, p0 = CURRENT.exp()[:, 1:], SAMPLE.exp()[:, 1:]
    # row 0 (A = +1): moves +0.1 (inside), +0.25 (outside); row 1 (A = -1): -0.1 (inside), +0.2 (inside: not the
    # direction the advantage pushes)
    inside = torch.tensor([[True, False], [True, True]])
    assert torch.equal((p - p0 <= 0.15)[0], inside[0]) and bool((p - p0 >= -0.15)[1].all())
    l = (CURRENT - SAMPLE)[:, 1:]
    ratio = l.exp()
    terms = torch.where(inside, ratio * torch.tensor([[1.0], [-1.0]]) * l, torch.zeros_like(l))
    assert out["loss_objective"].item() == pytest.approx(-(terms.mean(-1)).mean().item(), rel=1e-5)
    out["loss_objective"].backward()
    assert lp.grad[0, 2].item() == 0.0 and lp.grad[0, 1].item() != 0.0
    assert out["clip_fraction"].item() == pytest.approx(1 / 4)


def test_reinforce_pp_charges_each_token_the_kl_that_follows_and_normalises_over_the_round():
    ref = SAMPLE - torch.tensor([[0.0, 0.1, 0.3], [0.0, 0.2, 0.0]])  # k1 KL per response token: .1 .3 / .2 0
    loss = REINFORCEPPLoss(None, beta=0.5)
    loss.actor_network = _Fixed(CURRENT)
    td = loss.process_rollouts(_rows(SAMPLE, [1.0, 0.0], [0, 0], ref_lp=ref))
    returns = torch.tensor([1 - 0.5 * 0.4, 1 - 0.5 * 0.3, 0 - 0.5 * 0.2, 0 - 0.5 * 0.0])
    want = (returns - returns.mean()) / returns.std(unbiased=False)
    got = td.get("advantage")[:, 1:, 0].reshape(-1)
    assert torch.allclose(got, want, atol=1e-5)
    assert td.get("advantage")[:, 0].abs().sum().item() == 0.0  # nothing on the prompt
    assert not loss.has_kl_term  # the KL is in the reward


def test_reinforce_pp_baseline_centres_on_the_group_and_scales_by_the_round():
    loss = REINFORCEPPBaselineLoss(None, beta=0.0)
    loss.actor_network = _Fixed(torch.zeros(4, 3))
    td = loss.process_rollouts(_rows(torch.zeros(4, 3), [1.0, 0.0, 3.0, 3.0], [0, 0, 1, 1]))
    centred = torch.tensor([0.5, -0.5, 0.0, 0.0])
    want = centred / centred.std(unbiased=False)  # the round's std, not each group's (group 1 has none)
    assert torch.allclose(td.get("advantage")[:, -1, 0], want, atol=1e-6)
    assert td.get("has_signal").tolist() == [True, True, False, False]


@pytest.mark.parametrize("kwargs, match", [({"tau_pos": 0}, "tau_pos must be a positive temperature"),
                                           ({"tau_neg": -1.0}, "tau_neg must be a positive temperature")])
def test_sapo_refuses_a_bad_temperature(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TextSAPOLoss(None, **kwargs)


def test_dppo_refuses_a_cap_below_one():
    with pytest.raises(ValueError, match="cap truncates the importance weight"):
        TextDPPOLoss(None, cap=0.5)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["sapo", "gmpo", "dppo", "reinforce-pp", "reinforce-pp-baseline"])
def test_each_variant_trains_through_the_shell(algorithm, prompt_file, tmp_path):
    from offline_plugins.lightning.run import train_algorithm

    summary = train_algorithm(algorithm, str(prompt_file), steps=4, seed=0, out_dir=tmp_path / "run", progress=False,
                              threads=1, reward="_text_rewards:digit_share", eval_every=0, log_every=1,
                              overrides={"group_size": 4, "prompts_per_round": 6, "batch_size": 8,
                                         "max_new_tokens": 4, "eval_prompts": 20, "lr": 3e-3})
    assert summary["steps"] == 4 and math.isfinite(summary["losses"]["train/loss_objective"])
    assert (tmp_path / "run" / "model" / "config.json").is_file()
