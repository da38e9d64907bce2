"""Multi-turn text episodes with tools: the rows' masks and log-probs against a scripted policy,
tool failures as observations, the turn limit, the verifier on the final answer, the round's tool
counts, seeded episodes, and GRPO / expert iteration on ``tool-arithmetic`` through the CLI."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
from tensordict import TensorDict

from offline_plugins.modules.tiny_lm import char_tokenizer
from offline_plugins.text.backends.generation import Generation
from offline_plugins.text.collectors.collector import RolloutCollector
from offline_plugins.text.collectors.multiturn import run_episodes
from offline_plugins.text.sources.prompts import task_prompt_source
from offline_plugins.text.tasks.tools import ToolArithmeticTask
from offline_plugins.text.tools.multiturn import MultiTurn
from offline_plugins.text.tools.tools import Calculator, PythonTool, ToolBox, ToolError

torch.set_num_threads(1)

TOK = char_tokenizer()
EOS = TOK.eos_token_id


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


class Scripted:
    """A policy that writes ``script(prompt_text, turn)`` (a string; ``"$"`` stands for eos), with the
    log-prob of its ``k``-th token of a turn ``-(k + 1) / 10``; it records the budgets it was given."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def generate(self, prompt_ids, *, device, max_new_tokens, pad_id, eos_id, **_):
        turn = len(self.calls)
        self.calls.append(max_new_tokens)
        texts = [self.script(TOK.decode(p, skip_special_tokens=True), turn) for p in prompt_ids]
        rows = [(ids(t.replace("$", "")) + [eos_id] * t.endswith("$"))[:max_new_tokens] for t in texts]
        k = max(len(r) for r in rows)
        tokens = torch.tensor([r + [pad_id] * (k - len(r)) for r in rows])
        lengths = torch.tensor([len(r) for r in rows])
        steps = torch.arange(k).expand(len(rows), k)
        lp = torch.where(steps < lengths[:, None], -(steps + 1) / 10, torch.zeros(()))
        return Generation(tokens, torch.ones_like(tokens), tokens, lengths, lp)


MODEL = torch.nn.Linear(1, 1)  # only its device is read: the scripted policy samples
CALC = MultiTurn(ToolBox([Calculator()]), max_turns=3)


def test_rows_mask_and_log_probs_cover_the_policys_tokens_only():
    call, answer = '<tool name="calculator">12*34</tool>', "408$"
    policy = Scripted(lambda prompt, turn: call + " and more" if turn == 0 else answer)
    prompt = ids("Q=")
    ep = run_episodes(MODEL, TOK, [prompt], CALC, width=96, max_new_tokens=48, generator=policy)
    obs = ids("<result>408</result>")
    # by hand: prompt, the call (cut after </tool>: " and more" dropped), the observation, the answer and eos
    row = prompt + ids(call) + obs + ids("408") + [EOS]
    assert ep.tokens[0, :len(row)].tolist() == row and ep.attention_mask[0].sum() == len(row)
    expected_mask = [0] * len(prompt) + [1] * len(call) + [0] * len(obs) + [1] * 4
    assert ep.assistant_mask[0, :len(row)].int().tolist() == expected_mask and not ep.assistant_mask[0, len(row):].any()
    turn1 = [-(k + 1) / 10 for k in range(len(call))]
    turn2 = [-(k + 1) / 10 for k in range(4)]
    expected_lp = [0.0] * len(prompt) + turn1 + [0.0] * len(obs) + turn2
    assert ep.log_probs[0, :len(row)].tolist() == pytest.approx(expected_lp)
    assert (ep.log_probs[0, len(row):] == 0).all()
    assert ep.answers == ["408"] and ep.transcripts == [call + "<result>408</result>408"]
    assert {k: v.item() for k, v in ep.counts.items() if v.item()} == {"turns": 2.0, "tool_calls": 1.0}


@pytest.mark.bwrap
def test_a_hanging_python_tool_ends_in_a_timeout_observation_within_its_limit():
    mt = MultiTurn(ToolBox([PythonTool(timeout=1)]), max_turns=2)
    policy = Scripted(lambda prompt, turn: '<tool name="python">while True: pass</tool>' if turn == 0 else "7$")
    start = time.monotonic()
    ep = run_episodes(MODEL, TOK, [ids("Q=")], mt, width=120, max_new_tokens=48, generator=policy)
    assert time.monotonic() - start < 10
    assert "<result>python timeout: no answer within 1 s</result>" in ep.transcripts[0] and ep.answers == ["7"]
    assert ep.counts["tool_failures_timeout"].item() == 1 and ep.counts["tool_failures"].item() == 1


def test_a_malformed_call_gets_the_malformed_observation_and_the_policy_goes_on():
    policy = Scripted(lambda prompt, turn: '<tool name="calculator">2+2' if turn == 0 else "4$")
    ep = run_episodes(MODEL, TOK, [ids("Q=")], CALC, width=120, max_new_tokens=30, generator=policy)
    assert ep.transcripts == ['<tool name="calculator">2+2<result>malformed tool call: write '
                              '<tool name="NAME">ARGUMENT</tool></result>4']
    assert ep.answers == ["4"]
    assert ep.counts["tool_failures_malformed"].item() == 1 and ep.counts["tool_calls"].item() == 0


def test_the_turn_limit_ends_the_episode_and_zero_turns_are_refused():
    policy = Scripted(lambda prompt, turn: '<tool name="calculator">1+1</tool>')  # calls forever
    ep = run_episodes(MODEL, TOK, [ids("Q=")], MultiTurn(ToolBox([Calculator()]), max_turns=2), width=120,
                      max_new_tokens=40, generator=policy)
    assert len(policy.calls) == 2 and ep.counts["turns"].item() == 2 and ep.counts["tool_calls"].item() == 1
    assert ep.answers == ['<tool name="calculator">1+1</tool>']  # what it said last: not an answer
    for bad in (0, -1, 1.5):
        with pytest.raises(ToolError, match=f"max_turns must be a whole number >= 1.*got {bad}"):
            MultiTurn(ToolBox([Calculator()]), max_turns=bad)


def test_an_episode_stops_where_the_width_is_full():
    policy = Scripted(lambda prompt, turn: '<tool name="calculator">1+1</tool>')
    ep = run_episodes(MODEL, TOK, [ids("Q=")], CALC, width=60, max_new_tokens=40, generator=policy)
    assert policy.calls[0] == 40 and sum(policy.calls) <= 60 - 3 and ep.attention_mask.sum() <= 60


def test_a_row_near_the_width_does_not_cut_the_other_rows_turns_short():
    # row Q writes a long call, row R a short one; both then answer with 30 characters
    calls = {"Q=": '<tool name="calculator">' + "1+" * 10 + "1</tool>", "R=": '<tool name="calculator">1+1</tool>'}
    answer = "0123456789" * 3
    policy = Scripted(lambda prompt, turn: calls[prompt[:2]] if turn == 0 else answer + "$")
    ep = run_episodes(MODEL, TOK, [ids("Q="), ids("R=")], CALC, width=100, max_new_tokens=60, generator=policy)
    # by hand: Q holds 2 + 52 (call) + 19 ("<result>11</result>") = 73 tokens, 27 left; R 2 + 34 + 18 = 54, 46 left
    assert policy.calls == [60, 46, 27]
    assert ep.answers == [answer[:27], answer]  # R's answer whole (before, both were cut at Q's 27)
    assert ((ep.log_probs != 0) == ep.assistant_mask).all() and ep.attention_mask.sum(-1).tolist() == [100, 54 + 31]


def _collector(script, **kw):
    task = ToolArithmeticTask()
    collector = RolloutCollector(task_prompt_source(task), TOK, None, group_size=2, prompts_per_round=3,
                                 max_new_tokens=40, seed=0, context=128, **kw)
    collector.generator = Scripted(script)
    return task, collector


def _operands(text: str) -> str:
    return re.search(r"(\d+\*\d+)\)?=", text).group(1)


def _product(text: str) -> int:
    a, b = _operands(text).split("*")
    return int(a) * int(b)


def test_the_round_scores_the_final_answer_and_counts_the_tool_calls():
    answered = {}

    def script(prompt, turn):
        if turn == 0:  # one episode per group calls the calculator, the other guesses
            answered[prompt] = answered.get(prompt, -1) + 1
            return f'<tool name="calculator">{_operands(prompt)}</tool>' if answered[prompt] % 2 == 0 else "1$"
        return f"{_product(prompt)}$"

    task, collector = _collector(script)
    td, stats = collector.collect(MODEL, round=0)
    assert td["next", "reward"].squeeze(-1).tolist() == [1.0, 0.0] * 3
    assert stats["tool_calls"] == 0.5 and stats["turns"] == 1.5 and stats["tool_failures"] == 0
    assert stats["reward_mean"] == 0.5
    # the observation's tokens are in the row, outside the assistant mask
    row, mask = td["tokens", "full"][0], td["masks", "all_assistant_mask"][0]
    obs = ids(f"<result>{_product(td['text', 'prompt'][0])}</result>")
    start = next(i for i in range(len(row)) if row[i:i + len(obs)].tolist() == obs)
    assert not mask[start:start + len(obs)].any() and mask[start - 1] and mask[start + len(obs)]
    assert td["response_length"][0] == mask.sum()
    # the prompt is told the format; a rollout round of the task resolves by name
    assert td["text", "prompt"][0].startswith('<tool name="calculator">...</tool> ')


def test_a_reward_function_that_raises_on_an_episode_gives_it_the_defined_reward_and_a_count():
    seen = {}

    def script(prompt, turn):  # the first of each group answers right, the second "1"
        seen[prompt] = seen.get(prompt, -1) + 1
        return f"{_product(prompt)}$" if seen[prompt] % 2 == 0 else "1$"

    task, collector = _collector(script, reward_on_failure=0.0)

    def fragile(prompts, responses, **_):
        if "1" in responses:
            raise RuntimeError("cannot score 1")
        return task.rewards(prompts, responses)

    collector.source.reward_fn, collector.source.reward_name = fragile, "fragile"
    td, stats = collector.collect(MODEL, round=0)
    assert td["next", "reward"].squeeze(-1).tolist() == [1.0, 0.0] * 3 and stats["reward_failed"] == 3


def test_episodes_of_the_tiny_model_are_seeded():
    from offline_plugins.modules.tiny_lm import load_causal_lm

    model, tok = load_causal_lm("tiny", seed=0)
    prompts = [ids("Q=")] * 3
    a, b, c = (run_episodes(model, tok, prompts, CALC, width=64, max_new_tokens=20, seed=s) for s in (5, 5, 6))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.log_probs, b.log_probs)
    assert not torch.equal(a.tokens, c.tokens)
    assert ((a.log_probs != 0) == a.assistant_mask).all() and (a.log_probs <= 0).all()


def test_tool_tasks_sft_then_grpo_expert_iteration_and_reinforce_pp_run_through_the_cli(tmp_path, capsys):
    from offline_plugins.cli import main

    small = ["--set", "reference_sft_steps=10", "--set", "group_size=2", "--set", "prompts_per_round=2",
             "--set", "max_new_tokens=40", "--set", "eval_prompts=4", "--set", "batch_size=4"]
    for algo, task, more in (("grpo", "tool-arithmetic", []), ("expert-iteration", "tool-arithmetic", []),
                             ("reinforce-pp", "tool-arithmetic", ["--set", "tool_reward=0.2", "--set", "max_turns=2"])):
        out = tmp_path / f"{algo}-{task}"
        assert main(["train", algo, "--dataset", task, "--steps", "2", "--seed", "0", "--out", str(out),
                     "--no-progress", *small, *more]) == 0, capsys.readouterr().err
        summary = json.loads((out / "summary.json").read_text())
        assert summary["dataset"] == f"offline-plugins/{task}/v0"
        header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
        assert {"rollout/tool_calls", "rollout/tool_failures_malformed", "rollout/turns",
                "rollout/turn_reward"} <= set(header)
    assert json.loads((tmp_path / "reinforce-pp-tool-arithmetic" / "summary.json").read_text())["config"]["max_turns"] == 2


SMALL = ["--set", "reference_sft_steps=10", "--set", "group_size=2", "--set", "prompts_per_round=2",
         "--set", "max_new_tokens=40", "--set", "eval_prompts=4", "--set", "batch_size=4"]


@pytest.mark.bwrap
def test_grpo_on_tool_python_runs_through_the_cli_in_the_bwrap_sandbox(tmp_path, capsys):
    from offline_plugins.cli import main

    out = tmp_path / "grpo-tool-python"
    assert main(["train", "grpo", "--dataset", "tool-python", "--steps", "2", "--seed", "0", "--out", str(out),
                 "--no-progress", *SMALL, "--set", "tool_timeout=2"]) == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"] == "offline-plugins/tool-python/v0" and summary["config"]["tool_sandbox"] is None
    assert "WITHOUT isolation" not in capsys.readouterr().err


def test_tool_python_without_bwrap_is_refused_before_the_run_and_the_opt_out_warns(tmp_path, capsys, monkeypatch):
    from offline_plugins.cli import main

    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    out = tmp_path / "refused"
    assert main(["train", "grpo", "--dataset", "tool-python", "--steps", "1", "--out", str(out), "--no-progress",
                 *SMALL]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "bwrap program is not installed" in err and "apt-get install -y bubblewrap" in err
    assert "--set tool_sandbox=unsafe-subprocess" in err
    assert not (out / "summary.json").exists()
    assert main(["train", "grpo", "--dataset", "tool-python", "--steps", "1", "--out", str(tmp_path / "unsafe"),
                 "--no-progress", *SMALL, "--set", "tool_sandbox=unsafe-subprocess"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "WITHOUT isolation" in line]
    assert len(warned) == 1 and warned[0].startswith("offline-plugins: warning: tool_sandbox=unsafe-subprocess")
    assert main(["train", "grpo", "--dataset", "tool-python", "--steps", "1", "--out", str(tmp_path / "x"),
                 "--no-progress", *SMALL, "--set", "tool_sandbox=docker"]) == 2
    err = capsys.readouterr().err
    assert "unknown sandbox 'docker'" in err and "Traceback" not in err


@pytest.mark.parametrize("setting, message", [
    (["--dataset", "tool-arithmetic", "--set", "max_turns=0"], "max_turns"),
    (["--dataset", "arithmetic", "--set", "max_turns=2"], "max_turns applies to multi-turn tasks"),
    (["--dataset", "tool-arithmetic", "--set", "tools=calculator,abacus"], "unknown tool 'abacus'"),
    (["--dataset", "tool-arithmetic", "--set", "tool_timeout=0"], "tool_timeout"),
])
def test_bad_turn_settings_are_refused_in_one_line(setting, message, tmp_path, capsys):
    from offline_plugins.cli import main

    assert main(["train", "grpo", *setting, "--steps", "1", "--out", str(tmp_path / "x"), "--no-progress",
                 "--set", "reference_sft_steps=1"]) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_turn_rewards_sit_on_each_turns_last_token_and_sum_to_the_return():
    task = ToolArithmeticTask(tool_reward=0.25)
    prompt = task.problems(1, seed=3)[0].prompt
    call = f'<tool name="calculator">{_operands(prompt)}</tool>'
    policy = Scripted(lambda text, turn: call if turn == 0 else f"{_product(text)}$")
    ep = run_episodes(MODEL, TOK, [ids(prompt)], task.multiturn, width=128, max_new_tokens=40, generator=policy)
    end_of_call = len(ids(prompt)) + len(ids(call)) - 1  # the call's last token: ">" of </tool>
    assert ep.turn_rewards[0, end_of_call] == 0.25 and ep.turn_rewards.sum() == 0.25
    assert ep.counts["turn_reward"].tolist() == [0.25]
    # a call of the wrong product earns nothing
    wrong = Scripted(lambda text, turn: '<tool name="calculator">2*3</tool>' if turn == 0 else "6$")
    assert run_episodes(MODEL, TOK, [ids(prompt)], task.multiturn, width=128, max_new_tokens=40,
                        generator=wrong).turn_rewards.sum() == 0
    # through the collector: the verifier's 1 on the last token, the return is 1.25
    collector = RolloutCollector(task_prompt_source(task), TOK, None, group_size=2, prompts_per_round=1,
                                 max_new_tokens=40, seed=0, context=128)
    collector.generator = Scripted(lambda text, turn: f'<tool name="calculator">{_operands(text)}</tool>'
                                   if turn == 0 else f"{_product(text)}$")
    td, stats = collector.collect(MODEL, round=0)
    dense, mask = td["next", "turn_reward"], td["masks", "all_assistant_mask"]
    last = [int(torch.nonzero(m).max()) for m in mask]
    assert [dense[i, last[i]].item() for i in range(2)] == [1.0, 1.0]
    assert td["next", "reward"].squeeze(-1).tolist() == [1.25, 1.25] and dense.sum(-1).tolist() == [1.25, 1.25]
    assert stats["turn_reward"] == 0.25


def test_reinforce_pp_returns_the_rewards_earned_at_or_after_each_token():
    from offline_plugins.objectives.llm.online import REINFORCEPPLoss

    loss = REINFORCEPPLoss(None)
    mask = torch.tensor([[False, True, True, True, True, True]])
    dense = torch.tensor([[0.0, 0.0, 0.25, 0.0, 0.0, 1.0]])  # a turn reward, then the verifier's
    td = TensorDict({"next": {"reward": dense.sum(-1, keepdim=True), "turn_reward": dense}}, [1])
    to_go = [1.25, 1.25, 1.0, 1.0, 1.0]  # by hand: sum of the rewards at or after each response token
    mean = sum(to_go) / 5
    std = (sum((x - mean) ** 2 for x in to_go) / 5) ** 0.5
    expected = [0.0] + [(x - mean) / std for x in to_go]
    assert torch.allclose(loss.token_advantages(td, mask)[0], torch.tensor(expected), atol=1e-5)
    # without per-token rewards every token's return is the episode's: no signal within one row
    td.del_(("next", "turn_reward"))
    assert torch.allclose(loss.token_advantages(td, mask), torch.zeros(1, 6), atol=1e-3)


@pytest.mark.bwrap
def test_a_round_whose_every_tool_call_crashes_stops_with_one_line():
    from offline_plugins.text.tools.tools import Tool

    class Broken(Tool):
        name = "calculator"

        def run(self, argument):
            raise RuntimeError("the tool's own bug")

    box = MultiTurn(ToolBox([Broken()]), max_turns=2)
    policy = Scripted(lambda text, turn: '<tool name="calculator">1+1</tool>')
    with pytest.raises(ToolError, match=r"a tool is broken: calculator: every call of the round crashed and the tool "
                                        r"has no health call.*\(2 of the round's 2 calls crashed; the last: "
                                        r"calculator crashed: RuntimeError: the tool's own bug\).*fix the tool"):
        run_episodes(MODEL, TOK, [ids("Q="), ids("R=")], box, width=96, max_new_tokens=40, generator=policy)
    # one call that crashes among good ones is the policy's observation, not the run's end
    mixed = MultiTurn(ToolBox([Broken(), PythonTool(timeout=5)]), max_turns=2)
    calls = ['<tool name="calculator">1+1</tool>', '<tool name="python">print(6*7)</tool>']
    policy = Scripted(lambda text, turn: calls[text.startswith("R")] if turn == 0 else "done$")
    ep = run_episodes(MODEL, TOK, [ids("Q="), ids("R=")], mixed, width=96, max_new_tokens=40, generator=policy)
    assert ep.counts["tool_failures_crash"].tolist() == [1.0, 0.0] and "<result>42</result>" in ep.transcripts[1]


def test_the_tools_setting_adds_the_python_tool_with_its_time_limit():
    from offline_plugins.text.data.rollouts import _with_turn_settings

    task = _with_turn_settings("offline-plugins/tool-arithmetic/v0", ToolArithmeticTask(), max_turns=2,
                               tools="calculator, python", tool_timeout=1.5, tool_reward=0.0)
    turns = task.multiturn
    assert turns.max_turns == 2 and list(turns.tools.tools) == ["calculator", "python"]
    assert turns.tools.tools["python"].timeout == 1.5 and turns.turn_reward is None


def test_the_losses_and_the_kl_read_no_observation_token():
    from offline_plugins.modules.causal_lm import CausalLMLogProbs
    from offline_plugins.modules.tiny_lm import tiny_causal_lm
    from offline_plugins.objectives.llm.online import ExpertIterationLoss, TextGRPOLoss

    seen = {}

    def script(prompt, turn):
        seen[prompt] = seen.get(prompt, -1) + 1
        if turn == 0:
            return f'<tool name="calculator">{_operands(prompt)}</tool>'
        return f"{_product(prompt)}$" if seen[prompt] % 2 else "12$"

    task, collector = _collector(script)
    policy = tiny_causal_lm(TOK, seed=1)
    collector.reference = tiny_causal_lm(TOK, seed=2)
    grpo, ei = TextGRPOLoss(CausalLMLogProbs(policy), beta=0.04), ExpertIterationLoss(CausalLMLogProbs(policy))
    td, _ = collector.collect(MODEL, round=0)
    assert td["next", "reward"].squeeze(-1).tolist() == [0.0, 1.0] * 3
    outside = td["masks", "all_attention_mask"] & ~td["masks", "all_assistant_mask"]  # prompt and observations
    assert outside.sum(-1).min() > len(ids(task.hint)) + 8
    # garbage at the prompt's and the observations' positions changes nothing the losses report
    noisy = td.clone()
    for key in (("log_probs", "full"), ("next", "ref_log_probs", "full")):
        noisy.set(key, torch.where(outside, torch.full_like(td.get(key), 5.0), td.get(key)))
    for loss in (grpo, ei):
        a, b = loss(loss.process_rollouts(td.clone())), loss(loss.process_rollouts(noisy))
        for k in a.keys():
            assert torch.allclose(a[k], b[k]), (type(loss).__name__, k)
    assert set(grpo(grpo.process_rollouts(td.clone())).keys()) >= {"loss_objective", "loss_kl", "kl_to_reference"}


@pytest.mark.bwrap
def test_tool_python_needs_the_python_tool_and_its_episodes_are_scored_by_the_reversed_product():
    from offline_plugins.text.tasks.tools import ToolPythonTask

    task = ToolPythonTask(tool_reward=0.5)
    prompt = task.problems(1, split="test", seed=2)[0].prompt
    a, b = (int(x) for x in _operands(prompt).split("*"))
    assert task.answer(prompt) == str(a * b)[::-1] and prompt.startswith('<tool name="python">')
    policy = Scripted(lambda text, turn: f'<tool name="python">print(str({a}*{b})[::-1])</tool>' if turn == 0
                      else f"{str(a * b)[::-1]}$")
    ep = run_episodes(MODEL, TOK, [ids(prompt)], task.multiturn, width=128, max_new_tokens=56, generator=policy)
    assert f"<result>{str(a * b)[::-1]}</result>" in ep.transcripts[0] and task.reward(prompt, ep.answers[0]) == 1.0
    assert ep.turn_rewards.sum() == 0.5
    # the calculator is not in this task's box: calling it is an unknown tool, not an answer
    calc = Scripted(lambda text, turn: f'<tool name="calculator">{a}*{b}</tool>' if turn == 0 else "1$")
    ep = run_episodes(MODEL, TOK, [ids(prompt)], task.multiturn, width=128, max_new_tokens=56, generator=calc)
    assert ep.counts["tool_failures_unknown_tool"].tolist() == [1.0] and ep.turn_rewards.sum() == 0


class Flaky(Calculator):
    """A calculator that crashes on the calls a response can craft (``boom``) and answers its health call."""

    def run(self, argument):
        if "boom" in argument:
            raise RuntimeError("a response made me crash")
        return super().run(argument)


def test_crashes_a_response_causes_are_counted_and_a_tool_failing_its_health_call_stops_the_run():
    policy = Scripted(lambda text, turn: "done$" if "<result>" in text else '<tool name="calculator">boom</tool>')
    ep = run_episodes(MODEL, TOK, [ids("Q="), ids("R=")], MultiTurn(ToolBox([Flaky()]), max_turns=2), width=200,
                      max_new_tokens=40, generator=policy)  # every call crashed, but the tool answers 6*7
    assert ep.counts["tool_failures_crash"].tolist() == [1.0, 1.0] and ep.answers == ["done", "done"]

    class Broken(Flaky):
        def run(self, argument):
            if argument == "6*7":
                raise RuntimeError("broken for everyone")
            return super().run(argument)

    good = Scripted(lambda text, turn: "done$" if "<result>" in text else
                    '<tool name="calculator">boom</tool>' if text.startswith("Q") else '<tool name="calculator">1+1</tool>')
    with pytest.raises(ToolError, match=r"a tool is broken: calculator fails its health call '6\*7' \(expected "
                                        r"'42'\): calculator crashed: RuntimeError: broken for everyone \(1 of the "
                                        r"round's 2 calls crashed"):
        run_episodes(MODEL, TOK, [ids("Q="), ids("R=")], MultiTurn(ToolBox([Broken()]), max_turns=2), width=96,
                     max_new_tokens=40, generator=good)


# calls a hostile policy makes; {pid} is the trainer's (this test process)
HOSTILE = [  # one line each: the character tokenizer has no newline (exec reads the escaped ones)
    "import os; os.kill({pid}, 9)",
    "import os; os.kill({pid}, 19)",
    "import os; os.killpg(0, 9)",
    "exec('while 1:print(9**6*chr(121))')",
    "exec('import os\\nwhile 1: os.fork()')",
    "open('/tmp/op-hostile-{pid}','w').write('x')",
    "print(1)\x00",
    "x = [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
]


@pytest.mark.bwrap
def test_a_grpo_round_on_tool_python_survives_hostile_calls_and_scores_them_as_errors(tmp_path):
    import os
    from pathlib import Path

    from offline_plugins.modules.causal_lm import CausalLMLogProbs
    from offline_plugins.modules.tiny_lm import tiny_causal_lm
    from offline_plugins.objectives.llm.online import TextGRPOLoss
    from offline_plugins.text.tasks.tools import ToolPythonTask
    from offline_plugins.text.tools.sandbox import no_process_filter

    if no_process_filter() is None:  # no seccomp table for this machine: a root trainer's sandbox could fork freely
        pytest.skip("the fork bomb needs bwrap's no-process filter, which has no syscall table for this machine")
    task = ToolPythonTask(tool_timeout=1.5)
    collector = RolloutCollector(task_prompt_source(task), TOK, None, group_size=2, prompts_per_round=4,
                                 max_new_tokens=80, seed=0, context=128)
    seen: dict = {}
    played: list = []

    def script(prompt, turn):  # the first of each group attacks, the second answers with the tool's help
        if "</tool>" not in prompt[len(task.hint):]:  # the episode's first turn
            seen[prompt] = seen.get(prompt, -1) + 1
            if seen[prompt] % 2 == 0:
                attack = HOSTILE[len(played) % len(HOSTILE)]
                played.append(attack)
                return f'<tool name="python">{attack.format(pid=os.getpid())}</tool>'
            a, b = _operands(prompt).split("*")
            return f'<tool name="python">print(str({a}*{b})[::-1])</tool>'
        return f"{str(_product(prompt))[::-1]}$" if "print(str(" in prompt else "0$"

    collector.generator = Scripted(script)
    policy = tiny_causal_lm(TOK, seed=1)
    collector.reference = tiny_causal_lm(TOK, seed=2)
    loss = TextGRPOLoss(CausalLMLogProbs(policy), beta=0.04)
    optim = torch.optim.SGD(policy.parameters(), lr=1e-3)
    for round in range(2):
        td, stats = collector.collect(MODEL, round=round)
        assert td["next", "reward"].squeeze(-1).tolist() == [0.0, 1.0] * 4
        responses = list(td["text", "response"])
        for response in responses[0::2]:  # the attacks: a failed call or harmless output, the episode scored 0
            if "kill(" in response:
                assert "<result>python error" in response, response  # no such process, or its own group killed
        assert stats["tool_calls"] == 1.0 and stats["tool_failures"] >= 0.125
        assert stats["tool_failures_crash"] == 0
        losses = loss(loss.process_rollouts(td))
        optim.zero_grad()
        losses["loss_objective"].backward()
        optim.step()
        assert torch.isfinite(losses["loss_objective"])
    assert played == HOSTILE  # every attack was made, and this process lives on
    assert not Path(f"/tmp/op-hostile-{os.getpid()}").exists()


@pytest.mark.parametrize("model", ["tiny", "small"])
def test_sft_on_a_tool_task_trains_the_calls_and_the_answer_not_the_tools_output(model):
    from offline_plugins.modules.tiny_lm import load_causal_lm
    from offline_plugins.text.data.preference import tokenize_completions
    from offline_plugins.text.data.task_data import sft_rows
    from offline_plugins.text.tasks.tools import ToolPythonTask

    _, tok = load_causal_lm(model, seed=0)
    for task in (ToolArithmeticTask(), ToolPythonTask()):
        rows = sft_rows(task, 3)
        td, _ = tokenize_completions(rows, tok, max_length=128)
        for i, row in enumerate(rows):
            tokens, mask = td["tokens", "full"][i], td["masks", "all_assistant_mask"][i]
            trained = tok.decode(tokens[mask].tolist(), skip_special_tokens=True)
            answer = row["completion"].rsplit("</result>", 1)[1]
            call = row["completion"].split("<result>", 1)[0]
            assert trained == call + answer  # the result the tool wrote is not a training target
            untrained = tok.decode(tokens[td["masks", "all_attention_mask"][i] & ~mask].tolist())
            assert untrained.endswith(f"<result>{answer}</result>")


def test_the_text_env_steps_one_turn_at_a_time():
    """A multi-turn ``TextEnv``: the first step (a calculator call) leaves the episode running with the
    observation appended, the second (the answer, then eos) ends it and the verifier scores the answer;
    the turn's tokens past the call's closing tag are dropped with their log-probs."""
    from offline_plugins.text.envs.text import TextEnv, TextEnvError

    task = ToolArithmeticTask(digits=2)
    env = TextEnv(TOK, task=task, batch_size=2, group_size=2, max_length=128, max_new_tokens=40, seed=0)
    td = env.reset(round=0)
    prompt = td["text", "prompt"][0]
    a, b = (int(x) for x in re.findall(r"(\d+)\*(\d+)=", prompt)[0])
    (batch,) = env.turn_batches()
    assert batch.rows == [0, 1] and batch.max_new_tokens == 40 and batch.seed_parts == (0,)

    def act(texts):
        rows = [(ids(t.replace("$", "")) + [EOS] * t.endswith("$")) for t in texts]
        k = max(len(r) for r in rows)
        td["tokens", "response"] = torch.tensor([r + [TOK.pad_token_id] * (k - len(r)) for r in rows])
        td["turn_length"] = torch.tensor([len(r) for r in rows])
        td["log_probs", "response"] = torch.full((2, k), -0.5)
        return env.step(td)

    call = f'<tool name="calculator">{a}*{b}</tool>'
    td = act([call + "junk", "7$"])  # row 0 calls the calculator, row 1 answers at once
    assert not env.episode_done
    assert td["next", "done"].squeeze(-1).tolist() == [False, True]
    (batch,) = env.turn_batches()
    assert batch.rows == [0] and batch.seed_parts == (1,)
    assert TOK.decode(batch.prompt_ids[0]).endswith(f"{call}<result>{a * b}</result>")  # "junk" dropped
    td = act([f"{a * b}$", "ignored"])
    assert env.episode_done
    assert td["next", "reward"].squeeze(-1).tolist() == [1.0, float(a * b == 7)]
    assert list(td["text", "answer"]) == [str(a * b), "7"]
    assert td["stats", "turns"].tolist() == [2.0, 1.0] and td["stats", "tool_calls"].tolist() == [1.0, 0.0]
    # the policy's tokens only: the call and the answer (with eos), not the observation
    policy = td["masks", "all_assistant_mask"][0]
    assert int(policy.sum()) == len(ids(call)) + len(ids(str(a * b))) + 1
    assert torch.all(td["log_probs", "full"][0][policy] == -0.5) and torch.all(td["log_probs", "full"][0][~policy] == 0)
    with pytest.raises(TextEnvError, match="after every episode ended"):
        act(["1$", "1$"])
    with pytest.raises(TextEnvError, match="need max_new_tokens"):
        TextEnv(TOK, task=task, batch_size=2, max_length=96)
