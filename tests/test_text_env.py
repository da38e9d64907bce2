"""TextEnv (and the collector's RolloutEnv) as the rollout collector steps it: prompts as a function of (seed, rank, round, attempt),
response tokens as actions, the source's reward; text actions; Gymnasium id; TorchRL's GRPO loss and KL transform."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from offline_plugins.errors import UserError
from offline_plugins.modules.causal_lm import CausalLMLogProbs, CausalLMReward
from offline_plugins.modules.tiny_lm import load_causal_lm, tiny_causal_lm
from offline_plugins.objectives.llm.functional import group_relative_advantage
from offline_plugins.text.backends.generation import generate
from offline_plugins.text.collectors.collector import RolloutEnv
from offline_plugins.text.data.preference import tokenize_completions
from offline_plugins.text.data.rollouts import RolloutCollector
from offline_plugins.text.envs.text import TextEnv, TextEnvError
from offline_plugins.text.sources.prompts import PromptSource, RolloutError, rollout_seed, task_prompt_source
from offline_plugins.text.tasks import ArithmeticTask
from offline_plugins.tokens import prompt_token_ids

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def lm():
    return load_causal_lm("tiny", seed=0)


def _ids(tok, text):
    return tok.convert_tokens_to_ids(list(text))


def test_reset_prompts_are_a_function_of_seed_rank_round_and_attempt(lm):
    _, tok = lm
    source = task_prompt_source(ArithmeticTask(), n_held_out=0)
    env = RolloutEnv(tok, source, batch_size=6, group_size=2, seed=3, max_attempts=4)
    prompts = lambda **k: list(env.reset(**k)["text", "prompt"])  # noqa: E731
    first = prompts(round=5, rank=1, attempt=2)
    env.reset(round=0)
    env.reset(round=9, rank=3)  # what came before does not matter: a resumed run gets the same prompts
    again = RolloutEnv(tok, source, batch_size=6, group_size=2, seed=3, max_attempts=4)
    assert prompts(round=5, rank=1, attempt=2) == first == list(again.reset(round=5, rank=1, attempt=2)["text", "prompt"])
    assert first == [r["prompt"] for r in source.sample(3, rollout_seed(3, 1, 5, 2)) for _ in range(2)]
    for other in (dict(round=6, rank=1, attempt=2), dict(round=5, rank=0, attempt=2), dict(round=5, rank=1, attempt=3)):
        assert prompts(**other) != first, other
    # each prompt group_size times in a row; prompt ids unique within the run and rank
    td = env.reset(round=5, rank=1, attempt=2)
    assert td["group"].tolist() == [v for i in range(3) for v in [(5 * 4 + 2) * 3 + i] * 2]
    # prompt tokens left-padded for generation
    assert (td["tokens", "prompt"][:, -1] == tok.convert_tokens_to_ids("=")).all()
    # a reset naming no round counts rounds itself
    plain = RolloutEnv(tok, source, batch_size=6, group_size=2, seed=3)
    assert [list(plain.reset()["text", "prompt"]) for _ in range(2)] == [prompts(round=r) for r in range(2)]


def test_step_scores_the_token_actions_with_the_verifier(lm):
    _, tok = lm
    task = ArithmeticTask()
    env = TextEnv(tok, task=task, batch_size=4, group_size=2, seed=1, max_length=24)
    td = env.reset(round=0)
    prompts = list(td["text", "prompt"])
    answers = [task.answer(p) for p in prompts]
    texts = [answers[0], "0", answers[2] + "7", answers[3]]
    width = max(len(t) for t in texts) + 2
    eos, pad = tok.eos_token_id, tok.pad_token_id
    rows = [_ids(tok, t) + [eos] for t in texts]
    rows[3] = rows[3] + _ids(tok, "12")  # after eos: not part of the response
    td["tokens", "response"] = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    out = env.step(td)
    reward = out["next", "reward"].squeeze(-1)
    assert reward.tolist() == task.rewards(prompts, texts) == [1.0, 0.0, 0.0, 1.0]
    assert out["next", "done"].all() and out["next", "terminated"].all()
    assert list(out["text", "response"]) == texts
    assert out["response_length"].tolist() == [len(t) + 1.0 for t in texts]
    # the episode: prompt, then the response (its eos included) right after it, right-padded
    full, resp = out["tokens", "full"], out["masks", "all_assistant_mask"]
    for i, p in enumerate(prompts):
        n = len(prompt_token_ids(tok, p))
        assert full[i, :n].tolist() == prompt_token_ids(tok, p)
        assert full[i][resp[i]].tolist() == _ids(tok, texts[i]) + [eos]
        assert out["masks", "all_attention_mask"][i].sum() == n + len(texts[i]) + 1


def test_the_rows_hold_exactly_the_generated_tokens(lm):
    """No decode / re-tokenise round trip: the action's tokens are the episode's, even where text
    would not give them back (a pad token inside a response decodes to nothing)."""
    model, tok = lm
    env = TextEnv(tok, prompts=["1+1="], reward_fn=lambda p, r: [float(x == "2") for x in r], batch_size=2)
    env.reset()
    two, eos, pad = tok.convert_tokens_to_ids("2"), tok.eos_token_id, tok.pad_token_id
    td = env.reset()
    td["tokens", "response"] = torch.tensor([[two, pad, eos], [two, eos, two]])
    out = env.step(td)
    assert out["next", "reward"].squeeze(-1).tolist() == [1.0, 1.0]  # "2" both times, as text
    resp = out["masks", "all_assistant_mask"]
    assert out["tokens", "full"][0][resp[0]].tolist() == [two, pad, eos]
    assert out["tokens", "full"][1][resp[1]].tolist() == [two, eos]

    # the collector's rows: exactly generate's samples for (seed, rank, round), with their log-probs
    source = task_prompt_source(ArithmeticTask(), n_held_out=0)
    collector = RolloutCollector(source, tok, None, group_size=3, prompts_per_round=2, max_new_tokens=5, seed=4)
    td, _ = collector.collect(model, round=2, rank=1)
    seed = rollout_seed(4, 1, 2, 0)
    rows = source.sample(2, seed)
    assert list(td["text", "prompt"]) == [r["prompt"] for r in rows for _ in range(3)]
    gen = generate(model, [prompt_token_ids(tok, r["prompt"]) for r in rows], pad_id=collector.pad_id,
                   eos_id=tok.eos_token_id, max_new_tokens=5, num_samples=3, seed=seed, log_probs=True)
    mask = td["masks", "all_assistant_mask"]
    for i in range(6):
        n = int(gen.lengths[i])
        assert td["tokens", "full"][i][mask[i]].tolist() == gen.tokens[i, :n].tolist()
        assert torch.equal(td["log_probs", "full"][i][mask[i]], gen.log_probs[i, :n])
    assert list(td["text", "response"]) == gen.texts(tok)
    assert td["next", "reward"].squeeze(-1).tolist() == source.reward_fn(list(td["text", "prompt"]),
                                                                        gen.texts(tok))


def test_a_bad_reward_function_is_named(lm):
    model, tok = lm
    source = PromptSource("prompts.jsonl", held_out=[], reward_fn=lambda p, r, **k: 1 / 0, reward_name="mymod:score",
                          train=[{"prompt": "1+1="}], longest_prompts=["1+1="])
    env = RolloutEnv(tok, source, batch_size=2)
    td = env.reset()
    td["tokens", "response"] = torch.tensor([[tok.eos_token_id]] * 2)
    with pytest.raises(RolloutError, match=r"reward function mymod:score raised ZeroDivisionError"):
        env.step(td)
    collector = RolloutCollector(source, tok, None, group_size=2, prompts_per_round=2, max_new_tokens=2)
    with pytest.raises(RolloutError, match="mymod:score"):
        collector.collect(model, round=0)
    source.reward_fn = lambda p, r, **k: [1.0]  # the collector reads the source it holds now
    with pytest.raises(RolloutError, match="mymod:score returned 1 rewards for 4 responses"):
        collector.collect(model, round=0)


def test_text_actions_and_a_reward_model(lm):
    _, tok = lm
    rm = CausalLMReward(tiny_causal_lm(tok, seed=2))
    env = TextEnv(tok, prompts=["1+1="], reward_model=rm, batch_size=2)
    td = env.reset()
    td["text", "response"] = ["2", "3<eos>"]
    out = env.step(td)
    # text is tokenised as SFT data is: prompt + response + eos, response masked
    ref, _ = tokenize_completions([{"prompt": "1+1=", "completion": c} for c in ("2", "3")], tok, max_length=64)
    width = ref["tokens", "full"].shape[-1]
    assert torch.equal(out["tokens", "full"][:, :width], ref["tokens", "full"])
    assert torch.equal(out["masks", "all_assistant_mask"][:, :width], ref["masks", "all_assistant_mask"])
    with torch.no_grad():
        want = rm(out.select(("tokens", "full"), ("masks", "all_attention_mask")).clone())["reward"]
    torch.testing.assert_close(out["next", "reward"].squeeze(-1), want)


def test_bad_setup_and_actions_raise_user_errors(lm):
    _, tok = lm
    with pytest.raises(UserError, match="prompts"):
        TextEnv(tok, batch_size=2)
    with pytest.raises(TextEnvError, match="multiple of group_size"):
        TextEnv(tok, task=ArithmeticTask(), batch_size=3, group_size=2)
    env = TextEnv(tok, task=ArithmeticTask(), batch_size=2)
    with pytest.raises(TextEnvError, match=r"\('tokens', 'response'\)"):
        env.step(env.reset())
    long = PromptSource("long.jsonl", held_out=[], reward_fn=lambda p, r, **k: [0.0] * len(r), reward_name="f",
                        train=[{"prompt": "9" * 40}], longest_prompts=["1+1="])
    with pytest.raises(UserError, match="long.jsonl: prompt '9999.* is 41 tokens; the rollout budget is 10"):
        RolloutEnv(tok, long, batch_size=2, max_length=16, max_new_tokens=6).reset()


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


def test_a_single_turn_env_asks_for_one_batch_of_group_size_samples_within_its_width():
    from offline_plugins.modules.tiny_lm import char_tokenizer
    from offline_plugins.text.envs.text import TextEnv
    from offline_plugins.text.tasks import ArithmeticTask

    tok = char_tokenizer()
    env = TextEnv(tok, task=ArithmeticTask(), batch_size=4, group_size=2, max_length=16, seed=0)
    env.reset(round=0)
    (batch,) = env.turn_batches()
    longest = max(len(p) for p in env.prompt_ids)
    assert batch.rows is None and batch.num_samples == 2 and len(batch.prompt_ids) == 2
    assert batch.max_new_tokens == 16 - longest and batch.seed_parts == ()  # the room the width leaves
    env = TextEnv(tok, task=ArithmeticTask(), batch_size=4, group_size=2, max_length=16, max_new_tokens=5, seed=0)
    env.reset(round=0)
    assert env.turn_batches()[0].max_new_tokens == 5 and not env.episode_done
