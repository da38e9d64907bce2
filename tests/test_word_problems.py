"""The word-problem tasks: GSM8K-shaped stories made from a seed, their verifier, tiers, splits and tool variants."""

from __future__ import annotations

import random
import re

import pytest

from offline_plugins.text.tasks import TaskError
from offline_plugins.text.tasks.word_problems import (
    TIERS,
    CalculatorWordProblemTask,
    PythonWordProblemTask,
    WordProblemTask,
    final_answer,
)

_LINE = re.compile(r"(\d+)([+\-*/])(\d+)=(\d+)")


def _check_solution(solution: str) -> int:
    """Every line's arithmetic is right and chains into the next; returns the answer line's number."""
    *lines, last = solution.split("\n")
    value = None
    for line in lines:
        a, op, b, r = _LINE.fullmatch(line).groups()
        a, b, r = int(a), int(b), int(r)
        assert value is None or a == value, solution
        assert r == (a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a // b), line
        assert op != "/" or a % b == 0, line  # divisions come out even
        value = r
    assert last == f"#### {value}"
    return value


def test_problems_are_seeded_split_and_solved_one_step_a_line():
    task = WordProblemTask()
    a, b = task.problems(300, seed=4), task.problems(300, seed=4)
    assert a == b and a != task.problems(300, seed=5)
    test = task.problems(300, split="test", seed=4)
    assert not {p.prompt for p in a} & {p.prompt for p in test}  # a prompt is in one split only
    for p in a + test:
        value = _check_solution(p.answer)
        assert 0 <= value <= 9_999
        assert task.answer(p.prompt) == str(value)  # read back from the words alone
        assert task.reward(p.prompt, p.answer) == 1.0
        assert p.prompt.endswith("?") and "####" not in p.prompt


@pytest.mark.parametrize("tier", sorted(TIERS))
def test_each_tier_keeps_its_steps_operations_and_numbers(tier):
    spec = TIERS[tier]
    task = WordProblemTask(tiers=(tier,))
    stories = task.stories(400, seed=0)
    counts = {len(s.steps) for s in stories}
    assert counts == set(range(spec.min_steps, spec.max_steps + 1))
    used = {op for s in stories for op, _ in s.steps}
    assert used == set(spec.operations)
    assert all(spec.start[0] <= s.start <= spec.start[1] for s in stories)
    assert "hard" != tier or any(op == "div" for s in stories for op, _ in s.steps)


def test_tiers_are_drawn_in_turn():
    task = WordProblemTask()
    steps = [len(s.steps) for s in task.stories(300, seed=1)]
    easy, medium, hard = steps[0::3], steps[1::3], steps[2::3]
    assert max(easy) <= 3 and 3 <= min(medium) <= max(medium) <= 5 and min(hard) >= 5


def test_the_verifier_reads_the_last_answer_line_and_the_format_reward():
    task = WordProblemTask(format_reward=0.1)
    p = task.problems(1, seed=0)[0]
    right = p.answer.rsplit("#### ", 1)[1]
    wrong = str(int(right) + 1)
    assert task.reward(p.prompt, f"#### {right}") == 1.0
    assert task.reward(p.prompt, f"#### {wrong}\n#### {right}") == 1.0  # the last answer line counts
    assert task.reward(p.prompt, f"#### {right}\n#### {wrong}") == pytest.approx(0.1)
    assert task.reward(p.prompt, f"#### {wrong}") == pytest.approx(0.1)  # right form, wrong number
    assert task.reward(p.prompt, right) == 0.0  # no answer line
    assert task.reward(p.prompt, f"#### {right} apples") == 0.0
    assert WordProblemTask().reward(p.prompt, f"#### {wrong}") == 0.0  # format_reward off by default
    assert final_answer("#### 1,234") == 1234 and final_answer("####") is None


def test_a_corrupted_solution_is_wrong_but_well_formed():
    task = WordProblemTask()
    rng = random.Random(0)
    for p in task.problems(100, seed=2):
        bad = task.corrupt(p.answer, rng)
        _check_solution_with_one_slip(bad)
        assert task.reward(p.prompt, bad) == 0.0 and final_answer(bad) is not None


def _check_solution_with_one_slip(solution: str) -> None:
    *lines, last = solution.split("\n")
    slips, value = 0, None
    for line in lines:
        a, op, b, r = (int(x) if x.isdigit() or x.lstrip("-").isdigit() else x
                       for x in re.fullmatch(r"(-?\d+)([+\-*/])(\d+)=(-?\d+)", line).groups())
        assert value is None or a == value  # carried on from the slip
        slips += r != (a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a // b)
        value = r
    assert slips == 1 and last == f"#### {value}"


def test_bad_settings_and_foreign_prompts_are_refused_by_name():
    with pytest.raises(TaskError, match="tiers must name some of easy, medium, hard, got .*'expert'"):
        WordProblemTask(tiers=("expert",))
    with pytest.raises(TaskError, match=r"format_reward must be a number in \[0, 1\)"):
        WordProblemTask(format_reward=1.5)
    with pytest.raises(TaskError, match="cannot read the story '12\\+34='"):
        WordProblemTask().answer("12+34=")
    with pytest.raises(TaskError, match="cannot read the step"):
        WordProblemTask().answer("Mia has 4 apples. She paints 3 apples. How many apples does Mia have now?")


def test_calculator_episodes_call_once_a_step_and_the_tool_answers_them():
    task = CalculatorWordProblemTask()
    tools = task.multiturn.tools
    assert task.multiturn.max_turns == 9  # 8 steps of the hard tier, then the answer
    for p in task.problems(30, seed=3):
        segments = task.demonstration_segments(p)
        calls = [t for t, trained in segments if trained and t.startswith("<tool")]
        shown = [t for t, trained in segments if not trained]
        for call, observation in zip(calls, shown):
            assert task.multiturn.observe([r.text for r in tools.run_response(call)]) == observation
        assert segments[-1] == (f"#### {p.answer}", True)
        assert task.reward(p.prompt, segments[-1][0]) == 1.0
        assert p.prompt.startswith(task.hint)


@pytest.mark.bwrap
def test_the_python_program_runs_in_the_sandbox_and_prints_the_answer():
    task = PythonWordProblemTask()
    for p in task.problems(6, seed=3):
        (call, _), (observation, trained), (answer, _) = task.demonstration_segments(p)
        assert not trained and observation == f"<result>{p.answer}</result>" and answer == f"#### {p.answer}"
        assert [r.text for r in task.multiturn.tools.run_response(call)] == [p.answer]


def test_the_ids_resolve_to_the_tasks():
    from offline_plugins.text.data.rollouts import _task_of
    from offline_plugins.text.tasks.ids import resolve_rollout_id

    for short, cls in (("word-problems", WordProblemTask), ("word-problems-calculator", CalculatorWordProblemTask),
                       ("word-problems-python", PythonWordProblemTask)):
        resolved = resolve_rollout_id(short)
        assert resolved == f"offline-plugins/{short}/v0"
        assert type(_task_of(short, "")[1]) is cls


def test_a_model_whose_context_the_task_overruns_is_refused_before_training(tmp_path, monkeypatch, capsys):
    from _cli_checks import fails_cleanly

    monkeypatch.setenv("OFFLINE_PLUGINS_CACHE", str(tmp_path / "cache"))
    fails_cleanly(capsys, tmp_path, "grpo", "--dataset", "word-problems", "--model", "tiny", "--steps", "2",
                  match="past the model's context of 128; use a model with a longer context (--model small")
    assert not (tmp_path / "cache" / "preference").exists()  # no reference was trained


def test_the_preference_set_pairs_worked_solutions_on_the_small_model(tmp_path, monkeypatch):
    """word-problems/preference-v0's plumbing on a few rows: whole worked solutions are sampled (the
    task's 128-token budget, not 8), paired right against wrong by the verifier, and tokenised whole;
    the held-out score is the verifier's. The reference is small's init (no training here)."""
    from offline_plugins.text.data.preference_sources import resolve_preference_id
    from offline_plugins.text.data.task_data import exact_match_accuracy, task_preference_data
    from offline_plugins.text.tasks import make_task

    monkeypatch.setenv("OFFLINE_PLUGINS_CACHE", str(tmp_path / "cache"))
    assert resolve_preference_id("word-problems") == "offline-plugins/word-problems/preference-v0"
    task = make_task("word-problems", tiers=("easy",))
    assert isinstance(task, WordProblemTask)
    untrained = lambda model, tokenizer, rows, **kw: []  # noqa: E731
    data = task_preference_data(task, model="small", sft_rows_count=16, sft_steps=1, sft_batch_size=8, n_train=4,
                                n_test=3, num_samples=2, cache_dir=tmp_path / "pref", finetune=untrained)
    assert data.train.batch_size == (4, 2) and data.test.batch_size == (3, 2)
    # an untrained model writes no right solution: every chosen side is the exact worked solution
    chosen = data.tokenizer.batch_decode(
        data.train.get(("tokens", "full"))[:, 0].masked_fill(~data.train.get(("masks", "all_assistant_mask"))[:, 0], 0),
        skip_special_tokens=True)
    assert sorted(c.strip() for c in chosen) == sorted(p.answer for p in task.problems(4, split="train", seed=0))
    assert exact_match_accuracy(task, data.reference, data.tokenizer, n=3) == 0.0  # the verifier, not text equality


@pytest.mark.parametrize("cls", [WordProblemTask, CalculatorWordProblemTask])
def test_the_longest_prompts_bound_every_prompt_the_task_makes(cls):
    """The rollout budget is sized on longest_prompts: a drawn prompt longer than all of them would stop a
    run (a DAPO refill drew one past a bound taken from 64 samples)."""
    from offline_plugins.modules.small_lm import small_tokenizer
    from offline_plugins.tokens import prompt_token_ids

    tok = small_tokenizer()
    task = cls()
    bound = max(len(prompt_token_ids(tok, p)) for p in task.longest_prompts)
    drawn = max(len(prompt_token_ids(tok, p.prompt)) for p in task.problems(5000, seed=11))
    assert drawn <= bound
