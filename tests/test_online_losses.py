"""Online RL losses on text: advantages and objectives against hand computations, TorchRL's GRPOLoss
reading our rollout buffer, and the collector's errors on bad reward functions and settings."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from offline_plugins.errors import UserError
from offline_plugins.modules.causal_lm import CausalLMLogProbs
from offline_plugins.modules.tiny_lm import load_causal_lm, tiny_causal_lm
from offline_plugins.objectives.llm.online import (
    DAPOLoss,
    DrGRPOLoss,
    ExpertIterationLoss,
    RLOOLoss,
    TextCISPOLoss,
    TextGRPOLoss,
    TextGSPOLoss,
    TextSFTLoss,
    group_advantages,
    k3_kl,
    overlong_penalty,
)
from offline_plugins.text.data.rollouts import (
    PromptSource,
    RolloutCollector,
    RolloutError,
    jsonl_prompt_source,
    load_reward_function,
    score_responses,
    task_prompt_source,
)
from offline_plugins.text.tasks import ArithmeticTask

torch.set_num_threads(1)


# -- advantages ---------------------------------------------------------------------------
def test_worked_example_and_all_equal_group():
    # seeds, example 5.6.2(a): r = (1, 0, 1, 0), population std 0.5 -> A = (1, -1, 1, -1)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv, signal = group_advantages(rewards, groups)
    assert adv.tolist() == [1.0, -1.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0]
    assert torch.isfinite(adv).all()
    assert signal.tolist() == [True] * 4 + [False] * 4
    # Bessel's std would give 0.577 and advantages +-0.866: we use the population std
    assert not math.isclose(adv[0].item(), 0.5 / torch.tensor([1.0, 0.0, 1.0, 0.0]).std().item())


@pytest.mark.parametrize("loss_cls, expected", [
    (TextGRPOLoss, [1.0, -1.0, 1.0, -1.0]),                  # (r - mean) / population std
    (DrGRPOLoss, [0.5, -0.5, 0.5, -0.5]),                # r - mean
    (RLOOLoss, [2 / 3, -2 / 3, 2 / 3, -2 / 3]),          # r_i - mean of the other three
    (ExpertIterationLoss, [1.0, 0.0, 1.0, 0.0]),         # kept (reward >= 1) or not
])
def test_advantage_per_variant_on_the_worked_example(loss_cls, expected):
    adv, _ = loss_cls(None).advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(adv, torch.tensor(expected))


def test_rloo_leave_one_out_by_hand_on_uneven_rewards():
    # r = (3, 1, 0): baselines (1+0)/2, (3+0)/2, (3+1)/2 -> 2.5, -0.5, -2
    adv, _ = group_advantages(torch.tensor([3.0, 1.0, 0.0]), torch.zeros(3, dtype=torch.long), leave_one_out=True)
    torch.testing.assert_close(adv, torch.tensor([2.5, -0.5, -2.0]))


def _rows(rewards, *, resp_lengths, t=5, sample_lp=-1.0, ref_lp=-1.0):
    b = len(rewards)
    resp = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate(resp_lengths):
        resp[i, 1:1 + n] = True
    attn = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate(resp_lengths):
        attn[i, : 1 + n] = True
    return TensorDict({
        "tokens": {"full": torch.zeros(b, t, dtype=torch.long)},
        "masks": {"all_attention_mask": attn, "all_assistant_mask": resp},
        "log_probs": {"full": torch.full((b, t), sample_lp)},
        "next": {"reward": torch.tensor(rewards).reshape(b, 1), "ref_log_probs": {"full": torch.full((b, t), ref_lp)}},
        "group": torch.zeros(b, dtype=torch.long),
    }, [b])


class _FixedLogProbs(torch.nn.Module):
    """An actor whose log-probs are a constant (a parameter), so objectives can be computed by hand."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = torch.nn.Parameter(torch.tensor(value))

    def log_probs(self, tokens, mask):
        return self.value.expand(tokens.shape).clone()


def test_rloo_puts_the_sequence_kl_in_the_reward():
    # sample log-prob -1, reference -2 on 2 response tokens: KL sum 2, beta 0.05 -> reward - 0.1
    td = _rows([1.0, 0.0], resp_lengths=[2, 2], sample_lp=-1.0, ref_lp=-2.0)
    loss = RLOOLoss(None, beta=0.05)
    torch.testing.assert_close(loss.rollout_rewards(td), torch.tensor([0.9, -0.1]))
    assert not loss.has_kl_term


def test_aggregation_per_variant_by_hand():
    # on-policy (ratio 1): each token's gain is its row's advantage; row 0 has 3 response tokens
    # with A = +1, row 1 one token with A = -1
    td = _rows([1.0, 0.0], resp_lengths=[3, 1])
    TextGRPOLoss(None).process_rollouts(td)  # DAPO's advantages are GRPO's
    adv = td["advantage"][..., 0]
    assert adv[0, 1:4].tolist() == [1.0] * 3 and adv[1, 1].item() == -1.0 and adv[:, 0].abs().sum() == 0
    grpo = TextGRPOLoss(_FixedLogProbs(-1.0))(td)
    dapo = DAPOLoss(_FixedLogProbs(-1.0))(td)
    td_dr = DrGRPOLoss(None).process_rollouts(td.clone())  # advantages +-0.5
    dr = DrGRPOLoss(_FixedLogProbs(-1.0), length_normalizer=4)(td_dr)
    # GRPO: mean over rows of each row's token mean: (1 + (-1)) / 2 = 0
    assert grpo["loss_objective"].item() == pytest.approx(0.0, abs=1e-6)
    # DAPO: over all 4 response tokens: (3 - 1) / 4 = 0.5
    assert dapo["loss_objective"].item() == pytest.approx(-0.5)
    # Dr. GRPO: (3 * 0.5 / 4 + 1 * (-0.5) / 4) / 2 = 0.125
    assert dr["loss_objective"].item() == pytest.approx(-0.125)
    assert grpo["kl_to_reference"].item() == pytest.approx(0.0, abs=1e-6)


def test_clipping_and_k3_kl_by_hand():
    # current log-prob log(1.5) above the sampling one: ratio 1.5
    td = _rows([1.0, 0.0], resp_lengths=[2, 2], sample_lp=-1.0, ref_lp=-1.5)
    lp = -1.0 + math.log(1.5)
    grpo = TextGRPOLoss(_FixedLogProbs(lp), beta=0.04)
    grpo.process_rollouts(td)
    out = grpo(td)
    # A = +1: min(1.5, 1.2) = 1.2; A = -1: min(-1.5, -1.2) = -1.5 -> loss -(1.2 - 1.5) / 2
    assert out["loss_objective"].item() == pytest.approx(0.15, rel=1e-5)
    assert out["clip_fraction"].item() == pytest.approx(0.5)  # the positive row's tokens
    d = -1.5 - lp
    assert out["loss_kl"].item() == pytest.approx(0.04 * (math.exp(d) - d - 1), rel=1e-5)
    # DAPO's clip-higher: 1 + 0.28
    dapo = DAPOLoss(_FixedLogProbs(lp))(td)
    assert dapo["loss_objective"].item() == pytest.approx(-(2 * 1.28 - 2 * 1.5) / 4, rel=1e-5)
    assert "loss_kl" not in dapo.keys()  # DAPO has no KL term


def test_k3_and_overlong_penalty():
    assert k3_kl(torch.tensor(0.0), torch.tensor(math.log(0.5))).item() == pytest.approx(0.5 - math.log(0.5) - 1)
    torch.testing.assert_close(overlong_penalty(torch.tensor([3, 5, 6, 7]), max_length=6, cache=2),
                               torch.tensor([0.0, -0.5, -1.0, -1.0]))
    # DAPO's rollout reward adds the penalty
    td = _rows([1.0, 1.0], resp_lengths=[2, 4], t=6)
    torch.testing.assert_close(DAPOLoss(None, max_new_tokens=4, overlong_cache=2).rollout_rewards(td),
                               torch.tensor([1.0, 0.0]))


def test_gradients_push_the_better_response_up_and_sft_is_nll():
    td = _rows([1.0, 0.0], resp_lengths=[2, 2])
    actor = _FixedLogProbs(-1.0)
    loss = ExpertIterationLoss(actor)
    loss.process_rollouts(td)
    out = loss(td)
    assert out["loss_nll"].item() == pytest.approx(1.0)  # -mean log-prob of the kept row's tokens
    out["loss_nll"].backward()
    assert actor.value.grad.item() < 0  # raising log-probs lowers the loss
    assert TextSFTLoss(_FixedLogProbs(-2.0))(td)["loss_nll"].item() == pytest.approx(2.0)


# -- the collector and TorchRL --------------------------------------------------------------
@pytest.fixture(scope="module")
def lm():
    model, tok = load_causal_lm("tiny", seed=0)
    return model, tok


def test_rollouts_in_a_torchrl_buffer_read_by_torchrl_grpo_loss(lm):
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.objectives.llm import GRPOLoss as TorchRLGRPOLoss

    model, tok = lm
    task = ArithmeticTask()
    source = task_prompt_source(task, n_held_out=4)
    # make two right answers in group 0, so its advantages are not all zero
    reward_calls = []

    def reward(prompts, responses, **row):
        reward_calls.append(row)
        out = task.rewards(prompts, responses)
        out[0], out[1] = 1.0, 1.0
        return out

    source.reward_fn = reward
    collector = RolloutCollector(source, tok, tiny_causal_lm(tok, seed=3), group_size=4, prompts_per_round=2,
                                 max_new_tokens=4, seed=0)
    ours = TextGRPOLoss(CausalLMLogProbs(model))
    td, stats = collector.collect(model, round=0, process=ours.process_rollouts)
    assert "answer" in reward_calls[0]  # the rows' other columns reach the reward function
    assert td.batch_size == torch.Size([8]) and stats["groups_without_signal"] == pytest.approx(0.5)
    assert td["group"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert list(td["text", "prompt"])[0] == list(td["text", "prompt"])[3]
    buffer = TensorDictReplayBuffer(storage=LazyTensorStorage(8), batch_size=8)
    buffer.extend(td)
    batch = buffer[torch.arange(8)]
    # the response tokens are the sampled ones, right after the prompt, and the text decodes from them
    first = batch["masks", "all_assistant_mask"][0]
    decoded = tok.decode(batch["tokens", "full"][0][first].tolist(), skip_special_tokens=True)
    assert decoded == list(batch["text", "response"])[0]
    scorer = TransformersWrapper(model, tokenizer=tok, input_mode="tokens", generate=False, return_log_probs=True,
                                 pad_output=True)
    torchrl_loss = TorchRLGRPOLoss(scorer, masking_strategy="rlhf", kl_to_ref_coeff=0.04)
    out = torchrl_loss(batch.clone())
    assert torch.isfinite(out.loss_objective) and torch.isfinite(out.loss_kl_to_ref)
    assert out.ESS.item() == pytest.approx(1.0, abs=1e-4)  # the buffer's log-probs are the sampling policy's
    mine = ours(batch.clone())
    assert mine["ratio_mean"].item() == pytest.approx(1.0, abs=1e-5)
    assert torch.isfinite(mine["loss_objective"])


def test_same_seed_same_rollouts_other_rank_other_prompts(lm):
    model, tok = lm
    source = task_prompt_source(ArithmeticTask(), n_held_out=4)
    make = lambda: RolloutCollector(source, tok, None, group_size=2, prompts_per_round=3, max_new_tokens=3, seed=5)  # noqa: E731
    a, _ = make().collect(model, round=2)
    b, _ = make().collect(model, round=2)
    c, _ = make().collect(model, round=2, rank=1)
    assert torch.equal(a["tokens", "full"], b["tokens", "full"])
    assert list(a["text", "prompt"]) != list(c["text", "prompt"])


@pytest.mark.parametrize("fn, match", [
    (lambda p, r, **k: 1 / 0, "raised ZeroDivisionError"),
    (lambda p, r, **k: [1.0], "returned 1 rewards for 4 responses"),
    (lambda p, r, **k: [float("nan")] * len(r), "must be finite"),
    (lambda p, r, **k: ["yes"] * len(r), "return floats"),
    (lambda p, r, **k: 3.0, "expected a list"),
])
def test_bad_reward_functions_get_one_clear_error(lm, fn, match):
    model, tok = lm
    source = PromptSource("prompts.jsonl", held_out=[], reward_fn=fn, reward_name="mymod:score",
                          train=[{"prompt": "1+1="}], longest_prompts=["1+1="])
    collector = RolloutCollector(source, tok, None, group_size=2, prompts_per_round=2, max_new_tokens=2)
    with pytest.raises(RolloutError, match=match) as info:
        collector.collect(model, round=0)
    assert "mymod:score" in str(info.value)


def test_bad_settings_and_files(lm, tmp_path):
    model, tok = lm
    source = task_prompt_source(ArithmeticTask(), n_held_out=2)
    with pytest.raises(UserError, match="group_size must be a whole number >= 2"):
        RolloutCollector(source, tok, None, group_size=1)
    long = PromptSource("long.jsonl", held_out=[], reward_fn=lambda p, r, **k: [0.0] * len(r), reward_name="f",
                        train=[{"prompt": "9" * 200}], longest_prompts=["9" * 200])
    with pytest.raises(UserError, match="exceeds the model's context of 128 tokens"):
        RolloutCollector(long, tok, model, group_size=2)
    with pytest.raises(UserError, match="unknown reward 'nocolon'.*takes a registered reward's name .*a "
                                         "module:function"):
        load_reward_function("nocolon")
    with pytest.raises(UserError, match="cannot import module"):
        load_reward_function("no_such_module_xyz:f")
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"prompt": "1+1="}\n')
    with pytest.raises(UserError, match="has no 'answer'"):
        jsonl_prompt_source(str(bad))
    listed = tmp_path / "list.jsonl"  # str() of a list never matches a response: refused, not a silent 0 % run
    listed.write_text('{"prompt": "1+1=", "answer": ["2", "two"]}\n')
    with pytest.raises(UserError, match=r"line 1.*has an 'answer' of type list \(\[\"2\", \"two\"\]\).*string or a number"):
        jsonl_prompt_source(str(listed))
    ok = tmp_path / "ok.jsonl"
    ok.write_text("".join(f'{{"prompt": "{i}+{i}=", "answer": "{2 * i}"}}\n' for i in range(300)))
    s1, s2 = jsonl_prompt_source(str(ok)), jsonl_prompt_source(str(ok))
    assert len(s1.held_out) == 100 and [r["prompt"] for r in s1.held_out] == [r["prompt"] for r in s2.held_out]
    assert score_responses(s1, s1.held_out[:2], [s1.held_out[0]["answer"], "x"]) == [1.0, 0.0]


def test_group_advantages_are_torchrls_mcadvantage_up_to_bessels_correction():
    """TorchRL's ``MCAdvantage`` (a replay-buffer transform that groups rows by prompt) reads the
    collector's rows unchanged; its advantages are ours times ``sqrt((G - 1) / G)`` (it divides by
    the Bessel std, we by the population std, docs/online.md), and both give an all-equal group 0."""
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.objectives.llm.grpo import MCAdvantage

    from offline_plugins.modules.causal_lm import CausalLMLogProbs
    from offline_plugins.modules.tiny_lm import load_causal_lm
    from offline_plugins.objectives.llm.online import TextGRPOLoss
    from offline_plugins.text.data.rollouts import PromptSource, RolloutCollector

    model, tok = load_causal_lm("tiny", seed=0)
    model.eval()
    prompts = ["7+5=", "12+3=", "45+67="]
    source = PromptSource("mc", [], lambda ps, rs, **_: [0.0] * len(rs), "zero",
                          train=[{"prompt": p} for p in prompts], longest_prompts=prompts)
    g = 4
    collector = RolloutCollector(source, tok, model, group_size=g, prompts_per_round=3, max_new_tokens=4, seed=0)
    td, _ = collector.collect(model, round=0)
    td.set(("next", "reward"), torch.tensor([1., 0., 1., 0., 3., 3., 3., 3., 2., 0., 1., 5.]).reshape(-1, 1))
    ours = TextGRPOLoss(CausalLMLogProbs(model)).process_rollouts(td.clone())
    mask = ours.get(("masks", "all_assistant_mask"))
    ours_adv = (ours.get("advantage").squeeze(-1) * mask).sum(-1) / mask.sum(-1)

    buffer = ReplayBuffer(storage=LazyStackStorage(16))
    buffer.append_transform(MCAdvantage(grpo_size=g, prompt_key=("text", "prompt")))
    for start in range(0, len(td), g):  # one group at a time, as a rollout round arrives
        buffer.extend(td[start:start + g])
    rows = buffer[:]  # the groups as they completed, in order
    assert rows.get(("text", "prompt")).tolist() == td.get(("text", "prompt")).tolist()
    assert torch.equal(rows.get(("next", "reward")), td.get(("next", "reward")))
    torch.testing.assert_close(rows.get("advantage").reshape(-1), ours_adv * math.sqrt((g - 1) / g),
                               atol=1e-5, rtol=0)
    assert ours_adv[:4].tolist() == [1.0, -1.0, 1.0, -1.0] and (ours_adv[4:8] == 0).all()


# -- CISPO and GSPO -------------------------------------------------------------------------
class _TableLogProbs(torch.nn.Module):
    """An actor whose log-probs are a ``[B, T]`` table (a parameter): per-token ratios by hand."""

    def __init__(self, table) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.tensor(table, dtype=torch.float32))

    def log_probs(self, tokens, mask):
        return self.table.clone()


def test_cispo_and_gspo_defaults():
    cispo, gspo = TextCISPOLoss(None), TextGSPOLoss(None)
    assert (cispo.clip_low.item(), cispo.clip_high.item()) == pytest.approx((0.2, 0.2))  # TorchRL's CISPOLoss
    assert (gspo.clip_low.item(), gspo.clip_high.item()) == pytest.approx((3e-4, 4e-4))  # GSPO paper v2, 5.1
    assert not cispo.has_kl_term and not gspo.has_kl_term


@pytest.mark.parametrize("ratio, weight", [(1.5, 1.2), (1.1, 1.1), (0.5, 0.8)])
def test_cispo_value_and_gradient_by_hand(ratio, weight):
    # row 0: 3 response tokens with A = +1, row 1: 1 token with A = -1, every token at ratio `ratio`;
    # CISPO: -sum_t sg(clip(ratio)) * A * log(ratio) / 4 tokens, gradient -sum_t w * A / 4 per unit of lp
    td = _rows([1.0, 0.0], resp_lengths=[3, 1])
    actor = _FixedLogProbs(-1.0 + math.log(ratio))
    loss = TextCISPOLoss(actor)
    loss.process_rollouts(td)
    out = loss(td)
    assert out["loss_objective"].item() == pytest.approx(-(3 - 1) * weight * math.log(ratio) / 4, rel=1e-5)
    assert out["clip_fraction"].item() == pytest.approx(float(weight != ratio))
    out["loss_objective"].backward()
    assert actor.value.grad.item() == pytest.approx(-(3 - 1) * weight / 4, rel=1e-5)


def test_cispo_keeps_the_gradient_grpo_clips_away():
    # ratio 1.5, clip 0.2: GRPO's min keeps 1.2 (a constant) on the A = +1 row, so only the A = -1 row
    # pushes: loss -(1.2 - 1.5 * e^(v - v0)) / 2, gradient +1.5 / 2. CISPO weighs every token by 1.2:
    # gradient -(3 * 1.2 - 1 * 1.2) / 4 = -0.6, raising the better row as GRPO does not.
    td = _rows([1.0, 0.0], resp_lengths=[3, 1])
    grads = {}
    for cls in (TextGRPOLoss, TextCISPOLoss):
        actor = _FixedLogProbs(-1.0 + math.log(1.5))
        loss = cls(actor, clip_epsilon=0.2, beta=0.0)
        loss.process_rollouts(td)
        loss(td)["loss_objective"].backward()
        grads[cls] = actor.value.grad.item()
    assert grads[TextGRPOLoss] == pytest.approx(0.75, rel=1e-5)
    assert grads[TextCISPOLoss] == pytest.approx(-0.6, rel=1e-5)


def test_gspo_sequence_ratio_value_and_gradient_by_hand():
    # responses at positions 1-2, sampling log-prob -1. Row 0 (A = +1): token ratios 1.5, 1.0, so
    # s_0 = sqrt(1.5) = 1.2247 > 1.2: clipped, a constant. Row 1 (A = -1): ratios 0.9, 1.0, s_1 = sqrt(0.9),
    # inside the clip: gain -s_1, d(-s_1)/d lp_t = -s_1 / 2. Loss -(1.2 - s_1) / 2; gradient s_1 / 4 on
    # row 1's response tokens, 0 elsewhere.
    td = _rows([1.0, 0.0], resp_lengths=[2, 2], t=4)
    table = [[-1.0, -1.0 + math.log(1.5), -1.0, -1.0], [-1.0, -1.0 + math.log(0.9), -1.0, -1.0]]
    actor = _TableLogProbs(table)
    gspo = TextGSPOLoss(actor, clip_epsilon=0.2)
    gspo.process_rollouts(td)
    out = gspo(td)
    s1 = math.sqrt(0.9)
    assert out["loss_objective"].item() == pytest.approx(-(1.2 - s1) / 2, rel=1e-5)
    assert out["clip_fraction"].item() == pytest.approx(0.5)  # row 0's two tokens
    out["loss_objective"].backward()
    expected = torch.zeros(2, 4)
    expected[1, 1:3] = s1 / 4
    torch.testing.assert_close(actor.table.grad, expected)
    # GRPO on the same batch clips per token: row 0 keeps 1.2 and 1.0 (mean 1.1), row 1 -0.9 and -1.0
    # (mean -0.95): loss -0.075, gradient -1/4 on row 0's unclipped token, 0.9/4 and 1/4 on row 1's
    grpo_actor = _TableLogProbs(table)
    grpo = TextGRPOLoss(grpo_actor, clip_epsilon=0.2, beta=0.0)(td)["loss_objective"]
    assert grpo.item() == pytest.approx(-0.075, rel=1e-5)
    grpo.backward()
    torch.testing.assert_close(grpo_actor.table.grad,
                               torch.tensor([[0.0, 0.0, -0.25, 0.0], [0.0, 0.225, 0.25, 0.0]]))


def test_gspo_on_policy_gradient_is_grpos():
    # at ratio 1 nothing is clipped and d s_i / d lp_t = 1 / |o_i|: GRPO's per-token gradient
    td = _rows([1.0, 0.0, 0.0], resp_lengths=[3, 1, 2])
    grads = []
    for cls in (TextGRPOLoss, TextGSPOLoss):
        actor = _TableLogProbs([[-1.0] * 5] * 3)
        loss = cls(actor, beta=0.0)
        loss.process_rollouts(td)
        loss(td)["loss_objective"].backward()
        grads.append(actor.table.grad)
    torch.testing.assert_close(grads[0], grads[1])
