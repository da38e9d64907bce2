"""TextEnv: prompts as states, responses as actions; Gymnasium id; one GRPO step with TorchRL's loss."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from offline_plugins.data.preference import tokenize_completions
from offline_plugins.envs.tasks import ArithmeticTask
from offline_plugins.envs.text import TextEnv, TextEnvError
from offline_plugins.errors import UserError
from offline_plugins.modules.causal_lm import CausalLMLogProbs, CausalLMReward
from offline_plugins.modules.tiny_lm import load_causal_lm, tiny_causal_lm
from offline_plugins.objectives.llm.functional import group_relative_advantage

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def lm():
    return load_causal_lm("tiny", seed=0)


def test_reset_gives_grouped_prompts_and_step_scores_exact_match(lm):
    _, tok = lm
    task = ArithmeticTask()
    env = TextEnv(tok, task=task, batch_size=4, group_size=2, seed=1, max_length=24)
    td = env.reset()
    prompts = list(td["text", "prompt"])
    assert prompts[0] == prompts[1] and prompts[2] == prompts[3]
    assert td["group"].tolist()[0] == td["group"].tolist()[1] != td["group"].tolist()[2]
    # prompt tokens are left-padded for generation
    assert td["tokens", "prompt"].shape[0] == 4 and (td["tokens", "prompt"][:, -1] == tok.convert_tokens_to_ids("=")).all()
    answers = [task.answer(p) for p in prompts]
    td["text", "response"] = [answers[0], "0", answers[2] + "<eos>", " " + answers[3]]
    out = env.step(td)
    assert out["next", "reward"].squeeze(-1).tolist() == [1.0, 0.0, 1.0, 1.0]
    assert out["next", "done"].all() and out["next", "terminated"].all()
    # the episode is tokenised like SFT data: prompt + response + eos, response masked
    rows = [{"prompt": p, "completion": r} for p, r in zip(prompts, [answers[0], "0", answers[2], " " + answers[3]])]
    ref, _ = tokenize_completions(rows, tok, max_length=24)
    width = ref["tokens", "full"].shape[-1]
    assert torch.equal(out["tokens", "full"][:, :width], ref["tokens", "full"])
    assert torch.equal(out["masks", "all_assistant_mask"][:, :width], ref["masks", "all_assistant_mask"])
    # a second reset serves new prompts
    assert list(env.reset()["text", "prompt"]) != prompts


def test_token_actions_are_cut_at_eos(lm):
    _, tok = lm
    env = TextEnv(tok, prompts=["1+1="], reward_fn=lambda p, r: [float(x == "2") for x in r], batch_size=2)
    td = env.reset()
    two, eos, pad = tok.convert_tokens_to_ids("2"), tok.eos_token_id, tok.pad_token_id
    td["tokens", "response"] = torch.tensor([[two, eos, two, pad], [two, two, eos, pad]])
    assert env.step(td)["next", "reward"].squeeze(-1).tolist() == [1.0, 0.0]


def test_reward_model_gives_the_reward(lm):
    _, tok = lm
    rm = CausalLMReward(tiny_causal_lm(tok, seed=2))
    env = TextEnv(tok, prompts=["1+1="], reward_model=rm, batch_size=2)
    td = env.reset()
    td["text", "response"] = ["2", "3"]
    reward = env.step(td)["next", "reward"]
    with torch.no_grad():
        want = rm(td.select(("tokens", "full"), ("masks", "all_attention_mask")).clone())["reward"]
    torch.testing.assert_close(reward.squeeze(-1), want)


def test_bad_setup_and_actions_raise_user_errors(lm):
    _, tok = lm
    with pytest.raises(UserError, match="prompts"):
        TextEnv(tok, batch_size=2)
    with pytest.raises(TextEnvError, match="multiple of group_size"):
        TextEnv(tok, task=ArithmeticTask(), batch_size=3, group_size=2)
    env = TextEnv(tok, task=ArithmeticTask(), batch_size=2)
    with pytest.raises(TextEnvError, match=r"\('text', 'response'\)"):
        env.step(env.reset())


def test_gymnasium_id():
    import gymnasium as gym

    from offline_plugins.envs import register_gymnasium

    register_gymnasium()
    register_gymnasium()  # idempotent
    env = gym.make("offline_plugins/TextArithmetic-v0", digits=3)
    prompt, info = env.reset(seed=3)
    _, reward, terminated, truncated, _ = env.step(info["answer"])
    assert reward == 1.0 and terminated and not truncated
    env.reset(seed=3)
    assert env.step("x")[1] == 0.0


def test_grpo_advantage_matches_seeds_example():
    # example 5.6.2(a): r = (1, 0, 1, 0) -> A = (1, -1, 1, -1); an all-correct group gives 0
    adv = group_relative_advantage(torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 0, 0, 1, 1]))
    assert adv.tolist() == [1.0, -1.0, 1.0, -1.0, 0.0, 0.0]


def test_textenv_rollouts_pass_through_torchrl_grpo_loss_for_one_step(lm):
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.objectives.llm import GRPOLoss

    model, tok = lm
    model = tiny_causal_lm(tok, seed=5)
    task = ArithmeticTask()
    env = TextEnv(tok, task=task, batch_size=8, group_size=4, seed=0, max_length=20)
    td = env.reset()
    # the policy: TorchRL's own TransformersWrapper generating from ("text", "prompt")
    policy = TransformersWrapper(
        model, tokenizer=tok, input_mode="text", generate=True, pad_output=True,
        generate_kwargs={"max_new_tokens": 4, "do_sample": True},
    )
    with torch.no_grad():
        gen = policy(td.clone())
    responses = [r for r in gen["text", "response"]]
    # force a mixed group so the advantage is not all zero: two right answers in group 0
    prompts = list(td["text", "prompt"])
    responses[0] = task.answer(prompts[0])
    responses[2] = task.answer(prompts[2])
    td["text", "response"] = responses
    td = env.step(td)
    reward = td["next", "reward"]
    assert reward[0, 0] == 1.0 and reward[2, 0] == 1.0
    adv = group_relative_advantage(reward, td["group"])
    T = td["tokens", "full"].shape[-1]
    batch = TensorDict(
        {
            "tokens": {"full": td["tokens", "full"]},
            "masks": {
                "all_attention_mask": td["masks", "all_attention_mask"],
                "all_assistant_mask": td["masks", "all_assistant_mask"],
            },
            "advantage": adv.reshape(-1, 1, 1).expand(-1, T, 1).clone(),
        },
        [8],
    )
    scorer = TransformersWrapper(model, tokenizer=tok, input_mode="tokens", generate=False, return_log_probs=True,
                                 pad_output=True)
    with torch.no_grad():
        sample_lp = scorer(batch.clone())["log_probs", "full"]
    # TorchRL's log-probs and ours agree on the same layout
    ours = CausalLMLogProbs(model).log_probs(batch["tokens", "full"], batch["masks", "all_attention_mask"])
    mask = batch["masks", "all_assistant_mask"]
    torch.testing.assert_close(sample_lp[mask], ours[mask], atol=1e-5, rtol=1e-5)
    batch["log_probs", "full"] = sample_lp
    loss_fn = GRPOLoss(scorer, masking_strategy="rlhf")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    out = loss_fn(batch.clone())
    assert torch.isfinite(out.loss_objective)
    assert out.ESS.item() == pytest.approx(1.0)  # on-policy: all importance weights are 1
    opt.zero_grad()
    (out.loss_objective + out.loss_entropy).backward()
    opt.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    with torch.no_grad():
        after = CausalLMLogProbs(model).log_probs(batch["tokens", "full"], batch["masks", "all_attention_mask"])
    seq = lambda lp: (lp * mask).sum(-1)  # noqa: E731
    # positive-advantage responses gained log-probability relative to negative ones
    gain = seq(after) - seq(ours)
    assert gain[adv > 0].mean() > gain[adv < 0].mean()


def test_torchrl_kl_reward_transform_reads_what_textenv_writes(lm):
    from torchrl.envs import TransformedEnv
    from torchrl.envs.llm.transforms.kl import KLRewardTransform
    from torchrl.modules.llm import TransformersWrapper

    _, tok = lm
    reference, policy = tiny_causal_lm(tok, seed=0), tiny_causal_lm(tok, seed=1)
    ref_wrapper = TransformersWrapper(reference, tokenizer=tok, input_mode="tokens", generate=False,
                                      return_log_probs=True, pad_output=True)
    task = ArithmeticTask()
    base = TextEnv(tok, task=task, batch_size=2, max_length=16, reward_per_token=True)
    env = TransformedEnv(base, KLRewardTransform(ref_model=ref_wrapper, assistant_only=True))
    td = env.reset()
    prompts = list(td["text", "prompt"])
    td["text", "response"] = [task.answer(prompts[0]), "0"]
    base.tokenize_responses(td)  # the policy scores its responses on the env's tokens
    mask = td["masks", "all_assistant_mask"]
    with torch.no_grad():
        pol_lp = CausalLMLogProbs(policy).log_probs(td["tokens", "full"], td["masks", "all_attention_mask"])
        ref_lp = CausalLMLogProbs(reference).log_probs(td["tokens", "full"], td["masks", "all_attention_mask"])
    td["log_probs", "full"] = pol_lp
    nxt = env.step(td)["next"]
    kl = ((pol_lp - ref_lp) * mask).sum(-1)
    torch.testing.assert_close(nxt["reward"].detach().sum((-2, -1)), torch.tensor([1.0, 0.0]) - kl, atol=1e-5, rtol=1e-5)
