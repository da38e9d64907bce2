"""PPO-RLHF with a PRM's step rewards (``ppo-prm``, issue 27): the dense per-token rewards and the GAE they
give by hand, the real PRM's scores placed on the step ends, the refusal of a folder holding no PRM, and
``ppo-prm`` on ``steps-arithmetic`` through the CLI."""

from __future__ import annotations

import pytest
import torch
from _cli_checks import trains_with_a_prm
from tensordict import TensorDict

from offline_plugins.algorithms.prm_rl import PPOPRMConfig, build_ppo_prm
from offline_plugins.errors import UserError
from offline_plugins.modules.causal_lm import CausalLMLogProbs
from offline_plugins.objectives.llm.prm_rl import PRMRewardPPOLoss


def _rollouts(tokens, response, sample, ref, outcome, prompts):
    return TensorDict({"tokens": {"full": tokens},
                       "masks": {"all_attention_mask": torch.ones_like(response), "all_assistant_mask": response},
                       "log_probs": {"full": sample},
                       "next": {"reward": torch.tensor(outcome).reshape(-1, 1), "ref_log_probs": {"full": ref}},
                       "text": {"prompt": prompts}}, [len(prompts)])


def _loss(values, tokenizer, prm=None, **kwargs):
    from offline_plugins.text.data.steps import tokenize_steps

    cfg = PPOPRMConfig()
    return PRMRewardPPOLoss(CausalLMLogProbs(torch.nn.Embedding(64, 64)), lambda tokens, attn: values,
                            prm=prm if prm is not None else torch.nn.Linear(1, 1), prm_tokenizer=tokenizer,
                            tokenizer=tokenizer, tokenize_steps=tokenize_steps, kl_coef=0.1, gamma=cfg.gamma,
                            lmbda=cfg.lmbda, **kwargs)


def test_dense_step_rewards_and_their_gae_by_hand():
    from offline_plugins.modules.tiny_lm import load_causal_lm

    _, tok = load_causal_lm("tiny", seed=0)
    # two prompts of 2 tokens; response A is tokens 2-7 (3 steps, ending at 3, 5, 7), response B tokens 2-6
    # (2 steps, ending at 4, 6), token 7 padding
    response = torch.zeros(2, 8, dtype=torch.bool)
    response[0, 2:], response[1, 2:7] = True, True
    step_scores = torch.tensor([[0.9, 0.6, 0.2], [0.8, 0.5, 0.0]])  # made-up PRM probabilities
    step_mask = torch.tensor([[True, True, True], [True, True, False]])
    ends = torch.tensor([[3, 5, 7], [4, 6, 0]])
    # per-token KL (k1 = sample - ref), response tokens: A 0.1 -0.2 0.3 0 0.1 0.2, B 0.2 0 -0.1 0.1 0.3
    sample = torch.full((2, 8), -1.0)
    ref = sample - torch.tensor([[0, 0, 0.1, -0.2, 0.3, 0.0, 0.1, 0.2], [0, 0, 0.2, 0.0, -0.1, 0.1, 0.3, 0]])
    values = torch.tensor([[0, 0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.1], [0, 0, 1.0, 1.0, 1.0, 1.0, 1.0, 0]])
    td = _rollouts(torch.randint(0, 60, (2, 8)), response, sample, ref, [0.0, 1.0], ["1+2=", "3*4="])

    loss = _loss(values, tok, whiten_advantages=False)
    loss.step_rewards = lambda td: (step_scores, step_mask, ends)
    out = loss.process_rollouts(td.clone())
    # by hand, kl_coef 0.1: A's last step (0.2) and its outcome (0) share token 7; B's last step (0.5) and
    # its outcome (1) share token 6
    want = [[0, 0, -0.01, 0.02 + 0.9, -0.03, 0.0 + 0.6, -0.01, -0.02 + 0.2 + 0.0],
            [0, 0, -0.02, 0.0, 0.01 + 0.8, -0.01, -0.03 + 0.5 + 1.0, 0]]
    torch.testing.assert_close(out["token_reward"], torch.tensor(want), atol=1e-6, rtol=0)
    # GAE with the config's gamma = 1, lambda = 0.95, backwards over each response, nothing after its last token
    for row, (first, last) in enumerate(((2, 7), (2, 6))):
        adv, ret, nxt_adv = {}, {}, 0.0
        for t in range(last, first - 1, -1):
            nxt_v = values[row, t + 1].item() if t < last else 0.0
            delta = want[row][t] + 1.0 * nxt_v - values[row, t].item()
            adv[t] = nxt_adv = delta + 1.0 * 0.95 * nxt_adv
            ret[t] = adv[t] + values[row, t].item()
        for t in range(first, last + 1):
            assert out["advantage"][row, t, 0].item() == pytest.approx(adv[t], abs=1e-5)
            assert out["value_target"][row, t].item() == pytest.approx(ret[t], abs=1e-5)
    # the logged rollout reward stays the outcome verifier's
    assert out["next", "reward"].reshape(-1).tolist() == [0.0, 1.0]

    # the step rewards alone, weighted by prm_coef = 2: B's outcome leaves its last token
    alone = _loss(values, tok, whiten_advantages=False, prm_coef=2.0, outcome_reward=False)
    alone.step_rewards = lambda td: (step_scores, step_mask, ends)
    got = alone.process_rollouts(td.clone())["token_reward"]
    assert got[1, 6].item() == pytest.approx(-0.03 + 2 * 0.5) and got[0, 3].item() == pytest.approx(0.02 + 1.8)


def test_ppo_prm_refuses_a_folder_without_a_prm(tmp_path):
    with pytest.raises(UserError, match=r"ppo-prm: prm=None is not a trained PRM; pass --set prm=OUT"):
        build_ppo_prm(PPOPRMConfig(), data=None)
    with pytest.raises(UserError, match=f"ppo-prm: prm='{tmp_path}' is not a trained PRM"):
        build_ppo_prm(PPOPRMConfig(prm=str(tmp_path)), data=None)


SMALL = ["--set", "reference_sft_steps=10", "--set", "prompts_per_round=4", "--set", "batch_size=4",
         "--set", "max_new_tokens=24", "--set", "eval_prompts=4"]


def test_ppo_prm_trains_on_steps_arithmetic_and_rewards_each_step_end_with_the_prm(tmp_path, capsys, tiny_prm):
    from offline_plugins.eval.search import PRMScorer, load_prm

    prm_dir = tiny_prm
    assert trains_with_a_prm(capsys, tmp_path, "ppo-prm", prm_dir, SMALL)["algorithm"] == "ppo-prm"

    # the trained PRM's own step probabilities (by the search's scorer) land on the separator and the last token
    prm, tok = load_prm(prm_dir)
    prompt, steps = "3+4*2=", ["3+4=7", "7*2=14"]
    ids = tok(prompt + "\n".join(steps), add_special_tokens=False)["input_ids"]
    n, sep = len(ids), len(prompt) + len(steps[0])  # one token a character
    response = torch.zeros(1, n, dtype=torch.bool)
    response[0, len(prompt):] = True
    zeros = torch.zeros(1, n)
    td = _rollouts(torch.tensor([ids]), response, zeros, zeros, [0.0], [prompt])
    td = _loss(zeros, tok, prm=prm, outcome_reward=False).process_rollouts(td)
    got = td["token_reward"][0]
    probs, _ = PRMScorer(prm, tok, prompt).step_probs([steps])
    assert td["stats", "prm_step_reward"][0].item() == pytest.approx(probs[0].mean().item(), abs=1e-5)
    assert got[sep].item() == pytest.approx(probs[0, 0].item(), abs=1e-5)
    assert got[n - 1].item() == pytest.approx(probs[0, 1].item(), abs=1e-5)
    assert (got.abs() > 0).nonzero().reshape(-1).tolist() == [sep, n - 1]  # no KL (sample = ref), no other reward
