"""offline_plugins.torchrl_llm: TorchRL LLM collector rows -> our TED text layout, value by value, and every
bad input's one-line error. Hand-built rows in the layouts TorchRL 0.14's wrappers write (see the module
docstring), then one real ChatEnv + TransformersWrapper + LLMCollector round in history mode, two turns."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, set_list_to_stack

from offline_plugins.errors import UserError
from offline_plugins.torchrl_llm import (
    FromTorchRLRows,
    RowsContextError,
    TaskReward,
    TorchRLRowsError,
    advantage_on_tokens,
    from_torchrl_rows,
)

torch.set_num_threads(1)
PAD = 0


def _texts(value):
    return list(value.tolist() if hasattr(value, "tolist") else value)


class _Scorer:
    """A stand-in scorer: the log-prob of token ``x`` at any position is ``-x / 10`` (0 on padding)."""

    def log_probs(self, tokens, attention_mask):
        return -(tokens.float() / 10) * attention_mask


def _text_rows():
    """Three single-turn rows ``[3, 1]`` as ``TransformersWrapper(generate=True, pad_output=True)`` writes them:
    prompts left-padded to 3, responses right-padded to 3 (row 1's response ends early), reward [3, 1, 1, 1]."""
    prompt = torch.tensor([[0, 11, 12], [21, 22, 23], [0, 0, 31]])
    response = torch.tensor([[13, 14, 15], [24, 0, 0], [32, 33, 0]])
    full = torch.cat([prompt, response], -1)
    rows = TensorDict({
        "tokens": {"prompt": prompt.unsqueeze(1), "response": response.unsqueeze(1), "full": full.unsqueeze(1)},
        "masks": {"all_attention_mask": (full != PAD).unsqueeze(1)},
        "log_probs": {"response": torch.zeros(3, 1, 3)},
        "next": {"reward": torch.tensor([1.0, 0.0, 1.0]).reshape(3, 1, 1, 1),
                 "done": torch.ones(3, 1, 1, dtype=torch.bool)},
    }, batch_size=[3, 1])
    rows.set(("text", "prompt"), [["p"], ["q"], ["p"]])
    rows.set(("text", "response"), [["a"], ["b"], ["c"]])
    return rows


def test_text_rows_are_right_aligned_with_the_response_mask_and_scored_log_probs():
    ted = from_torchrl_rows(_text_rows(), pad_id=PAD, policy_scorer=_Scorer(), reference_scorer=_Scorer())
    assert ted.batch_size == (3,)
    assert ted["tokens", "full"].tolist() == [[11, 12, 13, 14, 15], [21, 22, 23, 24, 0], [31, 32, 33, 0, 0]]
    assert ted["masks", "all_attention_mask"].int().tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0],
                                                                  [1, 1, 1, 0, 0]]
    assert ted["masks", "all_assistant_mask"].int().tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 1, 0],
                                                                  [0, 1, 1, 0, 0]]
    # the log-probs sit on the tokens they score: -token / 10 at every real position
    torch.testing.assert_close(ted["log_probs", "full"], -(ted["tokens", "full"].float() / 10)
                               * ted["masks", "all_attention_mask"])
    torch.testing.assert_close(ted["next", "ref_log_probs", "full"], ted["log_probs", "full"])
    assert ted["next", "reward"].tolist() == [[1.0], [0.0], [1.0]]
    assert ted["next", "done"].all() and ted["next", "done"].shape == (3, 1)
    assert ted["group"].tolist() == [0, 1, 0]  # numbered by prompt, in order of appearance
    assert _texts(ted["text", "prompt"]) == ["p", "q", "p"] and _texts(ted["text", "response"]) == ["a", "b", "c"]
    assert ("next", "turn_reward") not in ted.keys(True, True)


def test_a_flat_batch_is_one_turn_per_row():
    flat = _text_rows().reshape(-1)
    ted = from_torchrl_rows(flat, pad_id=PAD, policy_scorer=_Scorer())
    assert ted["tokens", "full"][2].tolist() == [31, 32, 33, 0, 0]


def test_rows_own_assistant_mask_and_log_probs_are_used_as_vllm_writes_them():
    """vLLMWrapper's token/history generate: the assistant mask and ("log_probs", "full") are in the rows,
    prompt log-probs NaN where the engine gave none."""
    rows = _text_rows()
    full = rows["tokens", "full"]
    assistant = torch.zeros_like(full, dtype=torch.bool)
    assistant[..., 3:] = full[..., 3:] != PAD
    rows.set(("masks", "all_assistant_mask"), assistant)
    lp = torch.full(full.shape, float("nan"))
    lp[..., 3:] = -full[..., 3:].float()
    rows.set(("log_probs", "full"), lp)
    ted = from_torchrl_rows(rows, pad_id=PAD)  # no scorer: the rows' own log-probs
    assert ted["log_probs", "full"].tolist() == [[0, 0, -13, -14, -15], [0, 0, 0, -24, 0], [0, -32, -33, 0, 0]]
    assert ted["masks", "all_assistant_mask"].int().tolist()[2] == [0, 1, 1, 0, 0]
    assert ("next", "ref_log_probs", "full") not in ted.keys(True, True)


def test_ragged_rows_of_pad_output_false():
    from tensordict import lazy_stack

    rows = lazy_stack([TensorDict({"tokens": {"prompt": p, "full": f}}, batch_size=[])
                       for p, f in ((torch.tensor([5, 6]), torch.tensor([5, 6, 8])),
                                    (torch.tensor([7]), torch.tensor([7, 9, 9])))]).unsqueeze(-1)
    rows.set(("next", "reward"), torch.tensor([0.5, 1.0]).reshape(2, 1, 1, 1))
    rows.set(("text", "prompt"), [["a"], ["b"]])
    ted = from_torchrl_rows(rows, pad_id=PAD, policy_scorer=_Scorer())  # no done: each row's last turn ends it
    assert ted["tokens", "full"].tolist() == [[5, 6, 8], [7, 9, 9]]
    assert ted["masks", "all_assistant_mask"].int().tolist() == [[0, 0, 1], [0, 1, 1]]
    assert ted["next", "reward"].tolist() == [[0.5], [1.0]]


def test_vllm_text_rows_tokenise_the_prompt_text():
    from offline_plugins.modules.tiny_lm import char_tokenizer

    tok = char_tokenizer()
    rows = TensorDict({"tokens": {"response": torch.tensor([[[tok.convert_tokens_to_ids("7"), tok.eos_token_id]]])},
                       "next": {"reward": torch.ones(1, 1, 1, 1)}}, batch_size=[1, 1])
    rows.set(("text", "prompt"), [["<bos>3+4="]])
    ted = from_torchrl_rows(rows, pad_id=tok.pad_token_id, tokenizer=tok, policy_scorer=_Scorer())
    assert tok.decode(ted["tokens", "full"][0].tolist()) == "<bos>3+4=7<eos>"
    assert ted["masks", "all_assistant_mask"].int().tolist() == [[0, 0, 0, 0, 0, 1, 1]]


def test_pad_equal_to_eos_keeps_the_response_eos():
    """TransformersWrapper's mask is tokens != pad: with pad == eos the response's eos looks like padding."""
    eos = 2
    full = torch.tensor([[[eos, 5, 6, 7, eos, eos]]])  # a left pad, prompt 5 6, response 7 <eos>, right pad
    rows = TensorDict({"tokens": {"prompt": torch.tensor([[[eos, 5, 6]]]), "full": full},
                       "masks": {"all_attention_mask": full != eos},
                       "next": {"reward": torch.ones(1, 1, 1, 1)}}, batch_size=[1, 1])
    rows.set(("text", "prompt"), [["x"]])
    ted = from_torchrl_rows(rows, pad_id=eos, eos_id=eos, policy_scorer=_Scorer())
    assert ted["tokens", "full"].tolist() == [[5, 6, 7, eos]]
    assert ted["masks", "all_assistant_mask"].int().tolist() == [[0, 0, 1, 1]]
    without = from_torchrl_rows(rows, pad_id=eos, policy_scorer=_Scorer())  # not told: the eos is lost
    assert without["masks", "all_assistant_mask"].int().tolist() == [[0, 0, 1]]


def _small():
    from offline_plugins.modules.tiny_lm import load_causal_lm

    return load_causal_lm("small", seed=0)


def _history(chats):
    from torchrl.data.llm import History

    return History.from_chats(chats)


def test_multi_turn_history_rows_take_tokens_and_assistant_mask_from_the_chat_template():
    """A two-turn ChatEnv episode, rows [N=1, T=2]: one TED row holding both turns, each reply masked, each
    turn's reward on its reply's last token, the episode's return their sum."""
    _, tok = _small()
    chat = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"},
            {"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}]
    rows = torch.stack([TensorDict({"next": {"reward": torch.tensor([[[r]]]), "done": torch.tensor([[d]])}},
                                   batch_size=[1]) for r, d in ((0.25, False), (1.0, True))], 1)
    rows.set(("history", "full"), _stack_histories([chat[:2], chat]))
    rows.set(("history", "prompt"), _stack_histories([chat[:1], chat[:3]]))
    ted = from_torchrl_rows(rows, pad_id=tok.pad_token_id, tokenizer=tok, policy_scorer=_Scorer())
    assert ted.batch_size == (1,)
    expected = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
    tokens = ted["tokens", "full"][0]
    mask = ted["masks", "all_assistant_mask"][0]
    assert tok.decode(tokens.tolist()) == expected
    assert tok.decode(tokens[mask].tolist()) == "3<|im_end|>7<|im_end|>"
    assert ted["next", "reward"].tolist() == [[1.25]]
    turn_reward = ted["next", "turn_reward"][0]
    ends = [int(i) for i in turn_reward.nonzero().reshape(-1)]
    assert [tok.decode([int(tokens[i])]) for i in ends] == ["<|im_end|>", "<|im_end|>"]
    assert turn_reward[ends].tolist() == [0.25, 1.0]
    assert _texts(ted["text", "prompt"]) == ["user: 1+2="] and _texts(ted["text", "response"]) == ["37"]


def _stack_histories(chats):
    """One env row's turns ``[1, T, M]`` as TorchRL stacks them: shorter chats padded with ``<none>`` messages."""
    width = max(len(c) for c in chats)
    padded = [c + [{"role": "<none>", "content": ""}] * (width - len(c)) for c in chats]
    return torch.stack([_history([c]) for c in padded], 1)


def test_unfinished_turns_after_the_last_done_are_dropped():
    rows = torch.cat([_text_rows(), _text_rows()], 1)  # [3, 2]: two single-turn episodes per row...
    rows.set(("next", "done"), torch.tensor([[True, False], [True, True], [True, False]]).reshape(3, 2, 1))
    rows.set(("next", "reward"), torch.tensor([[1.0, 5.0], [0.0, 2.0], [1.0, 7.0]]).reshape(3, 2, 1, 1))
    ted = from_torchrl_rows(rows, pad_id=PAD, policy_scorer=_Scorer())
    # ... row 1 ends two episodes, rows 0 and 2 one each (their second turn is unfinished, dropped); a text
    # episode of one turn each, so each reward is its own turn's
    assert ted["next", "reward"].reshape(-1).tolist() == [1.0, 0.0, 2.0, 1.0]


def test_mcadvantage_on_a_replay_buffer_then_the_advantage_on_the_tokens():
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.objectives.llm import MCAdvantage

    rows = torch.cat([_text_rows(), _text_rows()[1:2]], 0)  # prompts p q p q: groups of 2
    rows.set(("next", "reward"), torch.tensor([1.0, 0.0, 0.0, 1.0]).reshape(4, 1, 1, 1))
    buffer = ReplayBuffer(storage=LazyStackStorage(8))
    buffer.append_transform(MCAdvantage(grpo_size=2, prompt_key=("text", "prompt")))
    buffer.append_transform(FromTorchRLRows(pad_id=PAD, policy_scorer=_Scorer()), invert=True)
    buffer.extend(rows)
    batch = buffer[:]
    assert batch.batch_size == (4,)
    adv = batch["advantage"]
    assert adv.shape == (4, 5, 1)
    mask = batch["masks", "all_assistant_mask"]
    per_row = {p: [] for p in ("p", "q")}
    for i, p in enumerate(_texts(batch["text", "prompt"])):
        values = adv[i, :, 0][mask[i]]
        assert torch.allclose(values, values[0].expand_as(values)) and (adv[i, :, 0][~mask[i]] == 0).all()
        per_row[p].append((float(batch["next", "reward"][i]), float(values[0])))
    # TorchRL's group advantage: (r - mean) / Bessel std = +-0.7071 for rewards {0, 1}
    for pairs in per_row.values():
        (r0, a0), (r1, a1) = sorted(pairs)
        assert (r0, r1) == (0.0, 1.0) and a0 == pytest.approx(-0.7071068) and a1 == pytest.approx(0.7071068)


def test_advantage_on_tokens_broadcasts_and_leaves_token_advantages():
    td = TensorDict({"masks": {"all_assistant_mask": torch.tensor([[False, True, True], [False, False, True]])},
                     "advantage": torch.tensor([[2.0], [-1.0]])}, batch_size=[2])
    assert advantage_on_tokens(td)["advantage"].squeeze(-1).tolist() == [[0.0, 2.0, 2.0], [0.0, 0.0, -1.0]]
    assert advantage_on_tokens(td)["advantage"].shape == (2, 3, 1)  # already on the tokens: unchanged


# -- bad inputs: one line each, naming the input, what was expected and the fix ---------------------------
def _without(key):
    rows = _text_rows()
    del rows[key]
    return rows


@pytest.mark.parametrize("make, kwargs, match", [
    (lambda: _text_rows(), {"pad_id": None}, r"pad_id must be the tokenizer's pad id \(an int\), got None; give the "
     r"tokenizer a pad token"),
    (lambda: _without(("next", "reward")), {}, r"the rows lack \('next', 'reward'\) \(each turn's reward\).*append a "
     r"reward transform"),
    (lambda: _without(("tokens", "prompt")), {}, r"the rows lack \('tokens', 'prompt'\) \(the prompt tokens, to tell "
     r"prompt from response\)"),
    (lambda: _without(("tokens", "full")).exclude(("tokens", "response")), {},
     r"lack \('tokens', 'full'\) and \('tokens', 'response'\)"),
    (lambda: _without(("text", "prompt")), {}, r"lack \('text', 'prompt'\) and \('history', 'prompt'\)"),
    (lambda: _text_rows()[0, 0], {}, r"rows must have batch \[N, T\] \(env rows x dialog turns\) or \[N\], got \(\)"),
    (lambda: _text_rows().unsqueeze(-1), {}, r"got \(3, 1, 1\)"),
    (lambda: _text_rows().set(("next", "reward"), torch.zeros(3, 1, 2)), {},
     r"\('next', 'reward'\) has shape \(3, 1, 2\), not one value per row"),
    (lambda: _text_rows().set(("next", "done"), torch.zeros(3, 1, 1, dtype=torch.bool)), {},
     r"no row ends an episode"),
    (lambda: _text_rows(), {"tokens_from": "chat_template"}, r"tokens_from='chat_template' reads \('history', 'full'\)"),
    (lambda: _text_rows(), {"tokens_from": "template"}, r"tokens_from must be one of"),
    (lambda: 5, {}, r"rows must be a TensorDict as LLMCollector yields, got int"),
])
def test_bad_inputs_raise_a_one_line_user_error(make, kwargs, match):
    kwargs = {"pad_id": PAD, "policy_scorer": _Scorer(), **kwargs}
    with pytest.raises(TorchRLRowsError, match=match) as info:
        from_torchrl_rows(make(), **kwargs)
    assert isinstance(info.value, UserError) and "\n" not in str(info.value)


def test_without_a_scorer_transformers_rows_need_one():
    with pytest.raises(TorchRLRowsError, match=r"no \('log_probs', 'full'\) .*first token set to 0\); pass "
                                               r"policy_scorer=CausalLMLogProbs\(model\)"):
        from_torchrl_rows(_text_rows(), pad_id=PAD)


def test_a_prompt_longer_than_the_context_is_refused():
    with pytest.raises(RowsContextError, match=r"row 0's prompt is 2 tokens, the model's context max_length=2 leaves "
                                               r"no room for its response; shorten the prompts"):
        from_torchrl_rows(_text_rows(), pad_id=PAD, policy_scorer=_Scorer(), max_length=2)
    with pytest.raises(RowsContextError, match=r"row 0 is 5 tokens \(prompt 2 \+ response\), longer than the model's "
                                               r"context max_length=4; lower the wrapper's max_new_tokens"):
        from_torchrl_rows(_text_rows(), pad_id=PAD, policy_scorer=_Scorer(), max_length=4)


def test_the_context_defaults_to_the_scorers_model():
    from offline_plugins.modules.causal_lm import CausalLMLogProbs
    from offline_plugins.modules.tiny_lm import load_causal_lm

    model, _ = load_causal_lm("tiny", seed=0)
    context = model.config.n_positions
    rows = _text_rows()
    long = torch.full((3, 1, context + 4), 5)
    rows.set(("tokens", "prompt"), long[..., :context])
    rows.set(("tokens", "full"), long)
    rows.set(("masks", "all_attention_mask"), torch.ones_like(long, dtype=torch.bool))
    with pytest.raises(RowsContextError, match=f"prompt is {context} tokens, the model's context max_length={context}"):
        from_torchrl_rows(rows, pad_id=PAD, policy_scorer=CausalLMLogProbs(model))


def test_a_multi_turn_history_needs_the_tokenizer():
    chat = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"},
            {"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}]
    rows = TensorDict({"next": {"reward": torch.ones(1, 1, 1, 1)}}, batch_size=[1, 1])
    rows.set(("history", "full"), _history([chat]).unsqueeze(0))
    rows.set(("history", "prompt"), _history([chat[:3]]).unsqueeze(0))
    with pytest.raises(TorchRLRowsError, match=r"a multi-turn History episode takes its tokens and assistant mask from "
                                               r"the chat template; pass tokenizer="):
        from_torchrl_rows(rows, pad_id=PAD, policy_scorer=_Scorer())


def test_task_reward_refuses_a_task_without_rewards_and_multi_turn_text():
    with pytest.raises(TorchRLRowsError, match=r"TaskReward: task must have rewards\(prompts, responses\), got int"):
        TaskReward(3)
    with pytest.raises(TorchRLRowsError, match=r"turns must be a whole number >= 1, got 0"):
        TaskReward(type("T", (), {"rewards": None})(), turns=0)


# -- one real round: ChatEnv (history) + TransformersWrapper + LLMCollector, two turns per episode -------
def test_a_two_turn_chat_env_episode_through_the_collector():
    from torchrl.collectors.llm import LLMCollector
    from torchrl.envs.llm import ChatEnv
    from torchrl.modules.llm import TransformersWrapper

    set_list_to_stack(True).set()
    model, tok = _small()
    model.eval()

    class Task:  # reward 1 for every reply, so each turn's reward is visible in the episode's sum
        def rewards(self, prompts, responses):
            return [1.0 if p == "2+3=" else 0.0 for p in prompts]

    def loader():
        while True:
            yield {"query": ["2+3=", "10+20="]}

    torch.manual_seed(0)
    env = ChatEnv.from_dataloader(loader(), batch_size=(2,), tokenizer=tok, input_mode="history",
                                  template_kwargs={"chat_template": tok.chat_template})
    env = env.append_transform(TaskReward(Task(), tok, turns=2))
    policy = TransformersWrapper(model, tokenizer=tok, input_mode="history", generate=True, return_log_probs=True,
                                 pad_output=True, chat_template=tok.chat_template,
                                 generate_kwargs={"max_new_tokens": 3, "do_sample": True,
                                                  "bad_words_ids": [[tok.pad_token_id]]})
    collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=4, total_dialog_turns=4)
    data = next(iter(collector))
    collector.shutdown()
    assert data.batch_size == (2, 2)  # env rows x turns
    assert data["next", "done"].reshape(2, 2).tolist() == [[False, True], [False, True]]
    ted = FromTorchRLRows(pad_id=tok.pad_token_id, tokenizer=tok, chat_template=tok.chat_template,
                          policy_scorer=_Scorer())(data)
    assert ted.batch_size == (2,)
    assert ted["next", "reward"].tolist() == [[2.0], [0.0]]  # two turns of reward 1 for "2+3="
    for i in range(2):
        history = data[i, 1]["history", "full"]
        expected = history.apply_chat_template(tokenizer=tok, chat_template=tok.chat_template,
                                               add_generation_prompt=False)
        tokens, mask = ted["tokens", "full"][i], ted["masks", "all_assistant_mask"][i]
        assert tok.decode(tokens[ted["masks", "all_attention_mask"][i]].tolist()) == expected
        replies = [c for r, c in zip(history.role, history.content) if r == "assistant"]
        assert len(replies) == 2
        # the mask covers both replies (each closed by <|im_end|>), nothing else
        assert tok.decode(tokens[mask].tolist()) == "".join(c + "<|im_end|>" for c in replies)
