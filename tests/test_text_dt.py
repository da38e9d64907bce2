"""text-dt: the reward token's conditioning, hindsight relabelling against hand-made rows, the
conditioned prompt source and buffer width, the CLI run and its export, bad settings, and a
learnt conditioning in a small budget."""

from __future__ import annotations

import json

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from offline_plugins.algorithms.text_dt import TextDTConfig, build_text_dt, return_token
from offline_plugins.errors import UserError
from offline_plugins.objectives.llm.text_dt import TextDTLoss, relabel_return_tokens, return_buckets

torch.set_num_threads(1)

R0, R1 = "<|return=0|>", "<|return=1|>"


def _rollout_data(prompts_per_round=2, group_size=2, max_new_tokens=4):
    from offline_plugins.modules.tiny_lm import char_tokenizer, tiny_causal_lm
    from offline_plugins.text.collectors.collector import SamplingSettings
    from offline_plugins.text.data.rollouts import RolloutData, task_prompt_source
    from offline_plugins.text.tasks import ArithmeticTask

    source = task_prompt_source(ArithmeticTask(digits=2, ops="+"), n_held_out=6)
    tokenizer = char_tokenizer()
    reference = tiny_causal_lm(tokenizer, seed=0).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    settings = SamplingSettings.checked(group_size=group_size, prompts_per_round=prompts_per_round,
                                        max_new_tokens=max_new_tokens)
    return RolloutData(source, reference, tokenizer, settings, dataset_id="offline-plugins/arithmetic/v0",
                       model="tiny")


@pytest.fixture()
def data():
    return _rollout_data()


# -- the reward token of a return ------------------------------------------------------------
def test_a_reward_gets_the_token_of_the_highest_level_it_reaches():
    levels = torch.tensor([0.0, 0.5, 1.0])
    rewards = torch.tensor([-0.3, 0.0, 0.49, 0.5, 0.99, 1.0, 7.0])
    # below l_0 -> 0; [0, 0.5) -> 0; [0.5, 1) -> 1; >= 1 -> 2
    assert return_buckets(rewards, levels).tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert return_buckets(torch.tensor([[0.0], [1.0]]), torch.tensor([0.0, 1.0])).tolist() == [[0], [1]]
    assert return_token(1) == R1 and return_token(0.0) == R0 and return_token(0.5) == "<|return=0.5|>"


def test_relabel_replaces_only_the_return_tokens():
    tokens = torch.tensor([[1, 7, 3, 4, 0], [1, 8, 3, 8, 0]])  # 7, 8: the return tokens
    out, count = relabel_return_tokens(tokens, torch.tensor([7, 8]), torch.tensor([1, 0]))
    assert out.tolist() == [[1, 8, 3, 4, 0], [1, 7, 3, 7, 0]] and count.tolist() == [1, 2]


# -- the conditioned prompt source and the buffer's width ----------------------------------------
def test_build_conditions_sampled_and_held_out_prompts_on_the_best_return(data):
    from offline_plugins.tokens import prompt_token_ids

    base, tok0, ref0 = data.source, data.tokenizer, data.reference
    vocab = len(tok0)
    width = data.width
    emb = data.reference.get_input_embeddings().weight.detach().clone()
    parts = build_text_dt(TextDTConfig(), data)
    plan = parts.rollout
    tok = plan.tokenizer
    ids = tok.convert_tokens_to_ids([R0, R1])
    assert ids == [len(tok) - 2, len(tok) - 1] and parts.loss.target_token_id == ids[1] and parts.tokenizer is tok
    # the target's token starts as a copy of bos's, the other at the mean row, in the reference and the policy
    for model in (plan.reference, parts.model):
        w = model.get_input_embeddings().weight.detach()
        assert w.shape[0] == len(tok) and torch.equal(w[: emb.shape[0]], emb)
        assert torch.equal(w[ids[1]], emb[tok.bos_token_id]) and torch.allclose(w[ids[0]], emb.mean(0))
    source = plan.source
    rows, plain = source.sample(5, seed=3), base.sample(5, seed=3)
    assert [r["prompt"] for r in rows] == [R1 + r["prompt"] for r in plain]
    assert [r["answer"] for r in rows] == [r["answer"] for r in plain]
    assert all(r["prompt"] == R1 + b["prompt"] for r, b in zip(source.held_out, base.held_out))
    assert source.has_answers
    # the task's verifier parses the prompt: it gets it without the reward token
    assert source.reward_fn([R1 + "12+30=", R0 + "12+30="], ["42", "41"], answer=["42", "42"]) == [1.0, 0.0]
    # the token takes bos's place (same positions as the reference's prompts, same width); a plain prompt keeps bos
    assert prompt_token_ids(tok, R1 + "12+30=") == [ids[1]] + prompt_token_ids(tok, "12+30=")[1:]
    assert prompt_token_ids(tok, "12+30=")[0] == tok.bos_token_id
    run = data.collector_for(plan)
    assert run.source is source and run.reference is plan.reference and run.tokenizer is tok
    assert run.width == width and run.max_prompt_tokens == width - 4
    # the loaded data is as it was: its source, tokenizer, reference and width
    assert (data.source, data.tokenizer, data.reference) == (base, tok0, ref0) and len(tok0) == vocab
    assert data.width == width
    assert ref0.get_input_embeddings().weight.shape[0] == emb.shape[0]
    # building again (a resume) neither prefixes twice nor grows the vocabulary
    again = build_text_dt(TextDTConfig(), data).rollout
    assert len(again.tokenizer) == len(tok) and again.source.held_out[0]["prompt"].count(R1) == 1


def test_at_step_zero_the_policy_conditioned_on_the_target_is_the_reference(data):
    from offline_plugins.tokens import prompt_token_ids, response_token_ids

    old = len(data.tokenizer)
    plain = torch.tensor([prompt_token_ids(data.tokenizer, "12+30=") + response_token_ids(data.tokenizer, "42")])
    with torch.no_grad():
        before = data.reference(plain).logits
    parts = build_text_dt(TextDTConfig(), data)
    tok = parts.tokenizer
    logits = {}
    for token in (R0, R1):
        ids = torch.tensor([prompt_token_ids(tok, token + "12+30=") + response_token_ids(tok, "42")])
        assert ids.shape == plain.shape and ids[0, 0].item() == tok.convert_tokens_to_ids(token)
        with torch.no_grad():
            logits[token] = parts.model(ids).logits
    # the reference's logits over its own vocabulary (the same greedy answers); the softmax also
    # gives the two new tokens some mass, so log-probs are not bit-equal
    assert torch.allclose(logits[R1][..., :old], before, atol=1e-5)
    assert not torch.allclose(logits[R0][..., :old], before, atol=1e-2)  # the low-return token starts elsewhere


def test_a_tokenizer_with_a_chat_template_keeps_it_and_rows_grow_by_the_token(data):
    from offline_plugins.tokens import prompt_token_ids

    data.tokenizer.chat_template = "{{ bos_token }}{{ messages[0]['content'] }}"
    width = data.collector_for().width
    parts = build_text_dt(TextDTConfig(), data)
    tok = parts.tokenizer
    r1 = tok.convert_tokens_to_ids(R1)
    assert tok.chat_template == "{{ bos_token }}{{ messages[0]['content'] }}"
    assert prompt_token_ids(tok, R1 + "1+2=")[:2] == [tok.bos_token_id, r1]
    assert data.collector_for(parts.rollout).width == width + 1


def test_a_round_of_rollouts_is_relabelled_with_the_achieved_returns(data):
    parts = build_text_dt(TextDTConfig(), data)
    ids = torch.tensor(parts.tokenizer.convert_tokens_to_ids([R0, R1]))
    collector = data.collector_for(parts.rollout)
    td, _ = collector.collect(parts.model, round=0, process=parts.rollout.process)
    n, t = td.shape[0], td.get(("tokens", "full")).shape[1]
    assert (n, t) == (4, collector.width)
    reward = td.get(("next", "reward")).reshape(-1)
    tokens = td.get(("tokens", "full"))
    # the first token is the achieved return's; no other prompt token is one
    assert torch.equal(tokens[:, 0], ids[(reward >= 1).long()])
    prompt = td.get(("masks", "all_attention_mask")) & ~td.get(("masks", "all_assistant_mask"))
    assert (torch.isin(tokens, ids) & prompt).sum(-1).tolist() == [1] * n
    texts = [str(x) for x in td.get(("text", "prompt")).tolist()]
    assert all(p.startswith(R1 if r >= 1 else R0) and p.count("|>") == 1 for p, r in zip(texts, reward.tolist()))
    assert torch.equal(td.get("advantage")[..., 0], td.get(("masks", "all_assistant_mask")).float())
    # has_signal: the group's rewards differ (groups of 2 rows here)
    by_group = reward.reshape(2, 2)
    assert td.get("has_signal").tolist() == [bool(g[0] != g[1]) for g in by_group for _ in range(2)]


def _hand_rows(tok):
    """Two rollouts of "12+30=": "42" (reward 1) and "41" (reward 0), both sampled at the best return."""
    from offline_plugins.tokens import prompt_token_ids, response_token_ids

    p = prompt_token_ids(tok, R1 + "12+30=")
    rows = [p + response_token_ids(tok, "42"), p + response_token_ids(tok, "41")]
    width = len(rows[0]) + 2
    full = torch.full((2, width), tok.pad_token_id)
    attn = torch.zeros(2, width, dtype=torch.bool)
    resp = torch.zeros(2, width, dtype=torch.bool)
    for i, r in enumerate(rows):
        full[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = True
        resp[i, len(p): len(r)] = True
    td = TensorDict({"tokens": {"full": full}, "masks": {"all_attention_mask": attn, "all_assistant_mask": resp},
                     "next": {"reward": torch.tensor([[1.0], [0.0]])}}, [2])
    td.set(("text", "prompt"), NonTensorStack(R1 + "12+30=", R1 + "12+30=", batch_size=[2]))
    return td, p


class _FixedLogProbs(torch.nn.Module):
    """An actor whose per-token log-prob is -(token id) / 100: the NLL is then a hand sum."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))

    def log_probs(self, tokens, attention_mask):
        return -self.w * tokens.float() / 100


def test_hand_checked_relabelled_tokens_masks_and_nll(data):
    parts = build_text_dt(TextDTConfig(), data)
    tok = parts.tokenizer
    r0, r1 = tok.convert_tokens_to_ids([R0, R1])
    td, p = _hand_rows(tok)
    before = td.clone()
    loss = TextDTLoss(_FixedLogProbs(), return_token_ids=[r0, r1], return_levels=[0.0, 1.0],
                      return_token_texts=[R0, R1])
    out = loss.process_rollouts(td)
    eos = tok.eos_token_id
    digits = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert out.get(("tokens", "full"))[0, : len(p) + 3].tolist() == [r1] + digits("12+30=") + digits("42") + [eos]
    assert out.get(("tokens", "full"))[1, : len(p) + 3].tolist() == [r0] + digits("12+30=") + digits("41") + [eos]
    assert out.get("return_bucket").tolist() == [1, 0]
    # the masks and the padding are untouched; only position 0 of row 1 changed
    for key in (("masks", "all_attention_mask"), ("masks", "all_assistant_mask")):
        assert torch.equal(out.get(key), before.get(key))
    changed = out.get(("tokens", "full")) != before.get(("tokens", "full"))
    assert changed.nonzero().tolist() == [[1, 0]]
    assert [str(x) for x in out.get(("text", "prompt")).tolist()] == [R1 + "12+30=", R0 + "12+30="]
    # NLL: token mean of -log p over the 3 response tokens of each row (2 digits and eos)
    resp = digits("42") + [eos] + digits("41") + [eos]
    result = loss(out)
    assert result["loss_nll"].item() == pytest.approx(sum(resp) / 100 / 6)
    assert result["target_return_fraction"].item() == pytest.approx(0.5)
    assert parts.loss.target_token_id == r1
    assert torch.equal(out.get("advantage")[..., 0], out.get(("masks", "all_assistant_mask")).float())
    # rows short of the target weigh low_return_weight: (sum row 0 + 0.25 * sum row 1) / (3 + 0.25 * 3)
    td, _ = _hand_rows(tok)
    weighted = TextDTLoss(_FixedLogProbs(), return_token_ids=[r0, r1], return_levels=[0.0, 1.0],
                          low_return_weight=0.25)
    out = weighted.process_rollouts(td)
    assert out.get("advantage")[:, :, 0].amax(-1).tolist() == [1.0, 0.25]
    row0, row1 = sum(digits("42") + [eos]) / 100, sum(digits("41") + [eos]) / 100
    assert weighted(out)["loss_nll"].item() == pytest.approx((row0 + 0.25 * row1) / (3 + 0.75))
    # 0: only the rows that reached the target (expert iteration with a token)
    only = TextDTLoss(_FixedLogProbs(), return_token_ids=[r0, r1], return_levels=[0.0, 1.0], low_return_weight=0.0)
    td, _ = _hand_rows(tok)
    assert only(only.process_rollouts(td))["loss_nll"].item() == pytest.approx(row0 / 3)


def test_a_response_that_emits_a_return_token_is_not_relabelled(data):
    tok = build_text_dt(TextDTConfig(), data).tokenizer
    r0, r1 = tok.convert_tokens_to_ids([R0, R1])
    td, p = _hand_rows(tok)
    tokens = td.get(("tokens", "full"))
    tokens[1, len(p)] = r1  # the sampled response's first token is a return token
    loss = TextDTLoss(_FixedLogProbs(), return_token_ids=[r0, r1], return_levels=[0.0, 1.0])
    out = loss.process_rollouts(td)
    assert out.get(("tokens", "full"))[1, 0].item() == r0 and out.get(("tokens", "full"))[1, len(p)].item() == r1


def test_rows_without_the_conditioning_are_refused_naming_the_fix(data):
    tok = build_text_dt(TextDTConfig(), data).tokenizer
    r0, r1 = tok.convert_tokens_to_ids([R0, R1])
    td, p = _hand_rows(tok)
    td.get(("tokens", "full"))[0, 0] = tok.bos_token_id  # row 0 lost its token
    loss = TextDTLoss(_FixedLogProbs(), return_token_ids=[r0, r1], return_levels=[0.0, 1.0])
    with pytest.raises(ValueError, match=r"row 0 holds 0 return tokens.*build_text_dt conditions the prompts"):
        loss.process_rollouts(td)


# -- bad settings ------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, match", [
    ({"target_return": 0.5}, r"target_return 0.5 is none of the return levels \[0.0, 1.0\].*--set target_return=1"),
    ({"target_return": "best"}, r"target_return 'best' is none of the return levels"),
    ({"return_levels": (1.0, 0.0)}, r"return_levels must be increasing.*--set return_levels=\[0,1\]"),
    ({"return_levels": ()}, r"return_levels must be increasing"),
    ({"return_levels": (0.0, float("nan"))}, r"return_levels must be increasing finite"),
    ({"low_return_weight": 2.0}, r"low_return_weight must be a number in \[0, 1\], got 2.0.*--set low_return_weight=1"),
])
def test_bad_conditioning_settings_name_the_fix(data, overrides, match):
    config = TextDTConfig(**overrides)
    with pytest.raises(UserError, match=match):
        build_text_dt(config, data)


def test_a_conditioned_prompt_that_no_longer_fits_the_context_is_refused():
    data = _rollout_data(max_new_tokens=128 - 7)  # "99+99=" is 7 tokens with bos: exactly the context
    data.tokenizer.chat_template = "{{ bos_token }}{{ messages[0]['content'] }}"  # the token adds one
    with pytest.raises(UserError, match=r"conditioned prompt .* is 8 tokens; with max_new_tokens=121 it exceeds "
                                         r"the model's context of 128 tokens; lower max_new_tokens"):
        build_text_dt(TextDTConfig(), data)


def test_a_target_level_is_set_from_the_command_line_form():
    from offline_plugins.config import ConfigError, apply_overrides

    cfg = apply_overrides(TextDTConfig(), {"return_levels": "[0, 0.5, 1]", "target_return": "0.5"})
    assert cfg.return_levels == (0, 0.5, 1) and cfg.target_return == 0.5
    with pytest.raises(ConfigError, match="return_levels"):
        apply_overrides(TextDTConfig(), {"return_levels": "low"})


# -- the CLI run and its export ----------------------------------------------------------------
_QUICK = ["--dataset", "arithmetic", "--model", "tiny", "--threads", "1", "--set", "reference_sft_steps=20"]


def test_cli_run_writes_a_summary_and_a_model_that_reloads_with_its_reward_tokens(tmp_path, capsys):
    from offline_plugins.cli import main
    from offline_plugins.tokens import prompt_token_ids

    out = tmp_path / "run"
    code = main(["train", "text-dt", *_QUICK, "--steps", "8", "--set", "eval_prompts=20", "--no-progress",
                 "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err[-2000:]
    assert "text-dt on offline-plugins/arithmetic/v0, 8 steps" in printed.out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "text-dt" and summary["data_kind"] == "text-rollouts"
    assert summary["rounds"] == 2 and summary["heldout_prompts"] == 20
    assert 0 <= summary["exact_match_after"] <= 1 and 0 <= summary["groups_without_signal"] <= 1

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "model")
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    r0, r1 = tok.convert_tokens_to_ids([R0, R1])
    w = model.get_input_embeddings().weight.detach()
    assert w.shape[0] == len(tok) and {r0, r1} == {len(tok) - 2, len(tok) - 1}
    # they started equal (the mean row); training moved them apart
    assert not torch.equal(w[r0], w[r1])
    # the exported chat template puts the token in bos's place, as in training
    ids = prompt_token_ids(tok, R1 + "12+30=")
    assert ids == [r1] + prompt_token_ids(tok, "12+30=")[1:] and len(ids) == 7
    assert tok.decode(ids, skip_special_tokens=True) == "12+30="

    # the checkpoint rebuilds (build grows the fresh reference the same way) and scores as the run did
    code = main(["eval", str(out / "checkpoints" / "last.ckpt"), "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["exact_match"] == pytest.approx(summary["exact_match_after"])


def test_cli_refuses_an_unknown_target_return_in_one_line(tmp_path, capsys):
    from offline_plugins.cli import main

    out = tmp_path / "run"
    code = main(["train", "text-dt", *_QUICK, "--steps", "2", "--set", "target_return=2", "--no-progress",
                 "--out", str(out)])
    # one error line (transformers' own "Loading weights" bar of the cached reference may come before it)
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code == 2 and len(errors) == 1, errors
    assert errors[0].startswith("offline-plugins: error: text-dt: target_return 2 is none of the return levels "
                                "[0.0, 1.0]; condition on one of them, e.g. --set target_return=1")
    assert not (out / "summary.json").exists()


def test_the_reward_token_steers_the_policy_when_low_returns_are_systematic(data):
    """Learning happens through the package's build and loss: rows that earned 1 answer the sum, rows
    that earned 0 answer the sum + 1; after relabelling and a few hundred NLL steps, the policy
    answers the sum under the return-1 token and the sum + 1 under the return-0 token (the tiny
    model from its random init, four prompts). On the built-in task the failures are the policy's
    own unsystematic errors and the token steers nothing (docs/results-history.md, text-dt)."""
    from offline_plugins.text.data.rollouts import greedy_responses
    from offline_plugins.tokens import prompt_token_ids, response_token_ids

    torch.manual_seed(0)
    parts = build_text_dt(TextDTConfig(), data)
    tok, loss = parts.tokenizer, parts.loss
    problems = [("12+30=", 42), ("25+14=", 39), ("61+27=", 88), ("33+45=", 78)]
    rows, rewards = [], []
    for prompt, answer in problems:
        for reward, said in ((1.0, answer), (0.0, answer + 1)):
            p = prompt_token_ids(tok, R1 + prompt)  # sampled at the best return, as a round is
            rows.append((p, p + response_token_ids(tok, str(said))))
            rewards.append(reward)
    width = max(len(r) for _, r in rows)
    full = torch.full((len(rows), width), tok.pad_token_id)
    attn = torch.zeros(len(rows), width, dtype=torch.bool)
    resp = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (p, r) in enumerate(rows):
        full[i, : len(r)], attn[i, : len(r)], resp[i, len(p): len(r)] = torch.tensor(r), True, True
    td = TensorDict({"tokens": {"full": full}, "masks": {"all_attention_mask": attn, "all_assistant_mask": resp},
                     "next": {"reward": torch.tensor(rewards)[:, None]}}, [len(rows)])
    td = loss.process_rollouts(td)
    opt = torch.optim.Adam(parts.model.parameters(), lr=3e-3)
    for _ in range(300):
        opt.zero_grad()
        loss(td)["loss_nll"].backward()
        opt.step()
    parts.model.eval()
    prompts = [p for p, _ in problems]
    at_best = greedy_responses(parts.model, tok, [R1 + p for p in prompts], max_new_tokens=4)
    at_worst = greedy_responses(parts.model, tok, [R0 + p for p in prompts], max_new_tokens=4)
    assert [a.strip() for a in at_best] == [str(a) for _, a in problems]
    assert [a.strip() for a in at_worst] == [str(a + 1) for _, a in problems]
