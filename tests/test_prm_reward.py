"""The PRM as a dense reward for GRPO (issue 27): step-end advantages by hand, the step splitting at the
separator, the refusal of a folder that holds no PRM, and ``grpo-prm`` on ``steps-arithmetic`` through the CLI."""

from __future__ import annotations

import math

import pytest
import torch

from offline_plugins.objectives.llm.prm_rl import split_steps, step_token_advantages

from _cli_checks import trains_with_a_prm


def test_token_advantages_are_the_group_normalised_step_rewards_still_to_come():
    # group 0: response A (3 steps: PRM scores 0.9, 0.6, 0.3), response B (2 steps: 0.2, 0.5);
    # group 1: response C (one step: 0.7), alone, so its normalised reward is 0
    rewards = torch.tensor([[0.9, 0.6, 0.3], [0.2, 0.5, 0.0], [0.7, 0.0, 0.0]])
    step_mask = torch.tensor([[True, True, True], [True, True, False], [True, False, False]])
    ends = torch.tensor([[3, 5, 7], [4, 6, 0], [5, 0, 0]])
    response = torch.zeros(3, 8, dtype=torch.bool)
    response[0, 2:8], response[1, 2:7], response[2, 3:6] = True, True, True
    # by hand: group 0's five step rewards have mean 2.5 / 5 = 0.5 and variance
    # (0.4^2 + 0.1^2 + 0.2^2 + 0.3^2 + 0^2) / 5 = 0.06
    std = math.sqrt(0.06)
    a = [0.4 / std, 0.1 / std, -0.2 / std]
    b = [-0.3 / std, 0.0]
    expected = torch.tensor([
        [0, 0, sum(a), sum(a), a[1] + a[2], a[1] + a[2], a[2], a[2]],  # tokens 2-3 end with step 1, 4-5 step 2, ...
        [0, 0, sum(b), sum(b), sum(b), b[1], b[1], 0],  # token 7 is padding
        [0] * 8,
    ])
    got = step_token_advantages(rewards, step_mask, ends, torch.tensor([0, 0, 1]), response)
    torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=0)
    # min form: a token gets the smallest normalised reward still to come
    got_min = step_token_advantages(rewards, step_mask, ends, torch.tensor([0, 0, 1]), response, aggregate="min")
    assert got_min[0, 2:].tolist() == pytest.approx([a[2]] * 6, abs=1e-5)
    assert got_min[1, 2:7].tolist() == pytest.approx([b[0]] * 3 + [b[1]] * 2, abs=1e-5)


def test_steps_are_split_at_the_separator_token_and_end_there():
    from offline_plugins.modules.tiny_lm import load_causal_lm

    _, tok = load_causal_lm("tiny", seed=0)
    text = "3+4=7\n7*2=14"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token a character
    sep = tok("\n", add_special_tokens=False)["input_ids"][0]
    decode = lambda x: tok.decode(x, skip_special_tokens=True)  # noqa: E731
    # the response starts at token 10: "3+4=7" is 10..14, "\n" 15 (the first step's end), "7*2=14" 16..21
    assert split_steps(ids, list(range(10, 22)), sep, decode) == (["3+4=7", "7*2=14"], [15, 21])
    # a trailing separator and an EOS belong to the last step; a blank line is no step
    ids2 = tok("3+4=7\n\n7*2=14\n", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    texts, ends = split_steps(ids2, list(range(len(ids2))), sep, decode)
    assert texts == ["3+4=7", "7*2=14"] and ends == [5, len(ids2) - 1]


def test_grpo_prm_refuses_a_folder_without_a_prm(tmp_path):
    from offline_plugins.algorithms.prm_rl import GRPOPRMConfig, build_grpo_prm
    from offline_plugins.errors import UserError

    with pytest.raises(UserError, match=r"prm=None is not a trained PRM; pass --set prm=OUT"):
        build_grpo_prm(GRPOPRMConfig(), data=None)
    with pytest.raises(UserError, match=f"prm='{tmp_path}' is not a trained PRM"):
        build_grpo_prm(GRPOPRMConfig(prm=str(tmp_path)), data=None)


SMALL = ["--set", "reference_sft_steps=10", "--set", "group_size=2", "--set", "prompts_per_round=2",
         "--set", "max_new_tokens=24", "--set", "eval_prompts=4", "--set", "batch_size=4"]


def test_grpo_prm_trains_on_steps_arithmetic_with_a_tiny_prm(tmp_path, capsys, tiny_prm):
    trains_with_a_prm(capsys, tmp_path, "grpo-prm", tiny_prm, SMALL)
