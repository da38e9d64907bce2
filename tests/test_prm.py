"""Process reward models: the step task's labels, the step-labelled data, the PRM loss, ``train prm``, search."""

from __future__ import annotations

import json
import math
import random
import re

import pytest
import torch
from tensordict import TensorDict

from _cli_checks import fails_cleanly
from offline_plugins.cli import main
from offline_plugins.data.steps import StepDataError, load_step_jsonl, tokenize_steps, validate_step_rows
from offline_plugins.envs.steps import StepChainTask
from offline_plugins.eval.search import (PRMScorer, StepSampler, aggregate_steps, beam_search, best_of_n,
                                         compare_search, exhaustive_search, load_prm)
from offline_plugins.modules.tiny_lm import char_tokenizer, tiny_causal_lm
from offline_plugins.objectives.llm import CausalLMStepReward, ProcessRewardLoss


def test_the_task_labels_steps_by_the_first_error_convention():
    task = StepChainTask()
    assert task.solution("3+4*2=") == ["3+4=7", "7*2=14"] and task.answer("3+4*2=") == "14"
    problem = task.problems(1, seed=3)[0]  # what SFT of a solution writer reads: the whole solution
    assert problem.answer == "\n".join(task.solution(problem.prompt))
    # a planted error at step 0: the next step is right from the wrong value, and still labelled bad
    assert task.solution("3+4*2=", error_at=0, delta=1) == ["3+4=8", "8*2=16"]
    assert task.step_labels("3+4*2=", ["3+4=8", "8*2=16"]) == [-1, -1]
    assert task.step_labels("3+4*2=", ["3+4=7", "7*2=15"]) == [1, -1]
    assert task.step_labels("3+4*2=", ["3+5=8", "8*2=16"]) == [-1, -1]  # the wrong operand
    assert task.step_labels("3+4*2=", ["3+4=7", "7*2=14", "14+1=15"]) == [1, 1, -1]  # beyond the chain
    assert task.step_labels("3+4*2=", ["seven", "7*2=14"]) == [-1, -1]
    # the outcome verifier sees only the answer: a lucky final line passes it, the steps do not
    assert task.reward("3+4*2=", "3+4=8\n8*2=14") == 1.0 and task.first_error("3+4*2=", ["3+4=8", "8*2=14"]) == 0
    rows = task.rows(400, seed=1, error_rate=0.5)
    wrong = [r for r in rows if -1 in r["labels"]]
    assert 150 < len(wrong) < 250
    for r in wrong:  # 1s, then -1s to the end
        k = r["labels"].index(-1)
        assert r["labels"] == [1] * k + [-1] * (len(r["steps"]) - k)


@pytest.mark.parametrize("row, match", [
    ({"prompt": "1+1=", "steps": ["1+1=2"]}, "row 0 lacks field(s) ['labels']"),
    ({"prompt": "1+1=", "steps": ["1+1=2", "2+1=3"], "labels": [1]}, "has 2 steps but labels 1"),
    ({"prompt": "1+1=", "steps": ["1+1=2"], "labels": [2]}, "label 0 is 2, expected a PRM800K rating"),
    ({"prompt": "1+1=", "steps": ["1+1=2"], "labels": [True]}, "label 0 is True"),
    ({"prompt": "1+1=", "steps": [], "labels": []}, "has no steps"),
    ({"prompt": "1+1=", "steps": ["1+1=2", " "], "labels": [1, 1]}, "step 1 is ' ', expected non-empty text"),
    ({"prompt": "", "steps": ["1+1=2"], "labels": [1]}, "no non-empty string 'prompt'"),
])
def test_each_bad_row_meets_one_clear_error(row, match):
    with pytest.raises(StepDataError, match=re.escape(match)):
        validate_step_rows([row])


def test_a_bad_line_of_a_file_is_named(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "steps": ["1+1=2"], "labels": [1]}) + "\n"
                    + json.dumps({"prompt": "1+2=", "steps": ["1+2=3"], "labels": [1, 1]}) + "\n")
    with pytest.raises(StepDataError, match="line 2 has 1 steps but labels 2"):
        load_step_jsonl(path)


def test_tokenized_steps_are_read_at_their_separators():
    rows = [{"prompt": "1+2=", "steps": ["1+2=3", "3*1=4"], "labels": [1, -1]},
            {"prompt": "5=", "steps": ["5"], "labels": [0]}]
    td, report = tokenize_steps(rows, char_tokenizer(), max_length=32)
    # bos + 4 prompt characters (0..4); "1+2=3\n" fills 5..10; "3*1=4\n" fills 11..16;
    # bos + "5=" (0..2), then "5\n" (3..4)
    assert td["steps", "position"].tolist() == [[10, 16], [4, 0]]
    assert td["steps", "mask"].tolist() == [[True, True], [True, False]]
    assert td["steps", "label"].tolist() == [[1.0, 0.0], [1.0, 0.0]]  # neutral (0) is no error
    assert td["masks", "all_attention_mask"].sum(-1).tolist() == [17, 5]
    short, report = tokenize_steps(rows[:1], char_tokenizer(), max_length=12)
    assert short["steps", "position"].tolist() == [[10]] and report.truncated_responses == 1


def _batch(score, label, mask):
    return TensorDict({("steps", "score"): torch.tensor(score), ("steps", "label"): torch.tensor(label),
                       ("steps", "mask"): torch.tensor(mask)}, [len(score)])


def test_the_loss_against_a_hand_computation():
    batch = _batch([[0.5, -2.0, 1.0], [-1.0, 3.0, 0.0]], [[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]],
                   [[True, True, False], [True, True, True]])
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    terms = [-math.log(sig(0.5)), -math.log(1 - sig(-2.0)), -math.log(sig(-1.0)), -math.log(sig(3.0)),
             -math.log(1 - sig(0.0))]
    out = ProcessRewardLoss()(batch)
    assert out["loss_prm"].item() == pytest.approx(sum(terms) / 5, rel=1e-6)
    # steps called right: row 0 both; row 1 the first (-1 on a good step) is wrong, 3.0 right, 0.0 (p = 0.5) right
    assert out["step_accuracy"].item() == pytest.approx(4 / 5)
    # first errors: row 0 called at 1, true 1; row 1 called at 0, true 2
    assert out["first_error_accuracy"].item() == pytest.approx(0.5)
    per = ProcessRewardLoss(reduction="none")(batch)["loss_prm"]
    assert per[0, 2].item() == 0.0 and per[1, 2].item() == pytest.approx(terms[4])
    with pytest.raises(Exception, match=r"label at key \('steps', 'label'\) has shape \(2, 2\)"):
        ProcessRewardLoss()(batch.set(("steps", "label"), torch.ones(2, 2)))
    renamed = ProcessRewardLoss()
    renamed.set_keys(score="logit")
    with pytest.raises(Exception, match="'logit'"):
        renamed(batch)


def test_a_step_score_sees_only_the_steps_up_to_it():
    tok = char_tokenizer()
    prm = CausalLMStepReward(tiny_causal_lm(tok, seed=0)).eval()
    scorer = PRMScorer(prm, tok, "2+3*4=")
    probs, _ = scorer.step_probs([["2+3=5", "5*4=20"], ["2+3=5", "5*4=21"]])
    assert probs[0, 0].item() == pytest.approx(probs[1, 0].item(), abs=1e-6)
    assert probs[0, 1].item() != pytest.approx(probs[1, 1].item(), abs=1e-6)


def _write_form_rows(path, n, seed=0):
    """Rows whose bad steps show by their form ("oops"), and whose later steps are labelled bad after
    it although they look good: the PRM must read the context (the first-error convention)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            steps = [rng.choice(("fine", "fine", "oops")) for _ in range(3)]
            k = steps.index("oops") if "oops" in steps else 3
            f.write(json.dumps({"prompt": f"q{i}", "steps": steps, "labels": [1] * k + [-1] * (3 - k)}) + "\n")
    return path


def test_train_prm_learns_step_labels_and_exports_the_prm(capsys, tmp_path):
    data = _write_form_rows(tmp_path / "form.jsonl", 600)
    out = tmp_path / "run"
    code = main(["train", "prm", "--dataset", f"steps:{data}", "--steps", "150", "--seed", "0",
                 "--set", "batch_size=16", "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    labels = [v for r in rows for v in r["labels"]]
    majority = max(labels.count(1), labels.count(-1)) / len(labels)
    assert summary["heldout_rows"] == 100 and majority < 0.65
    assert summary["step_accuracy"] > 0.95 and summary["first_error_accuracy"] > 0.9
    prm, tok = load_prm(out)  # the exported PRM scores as the trained one did: the "oops" step and after low
    probs, _ = PRMScorer(prm, tok, "q9999").step_probs([["fine", "oops", "fine"]])
    assert probs[0, 0] > 0.5 > probs[0, 1] and probs[0, 2] < 0.5
    assert "held-out step accuracy" in capsys.readouterr().out


def test_cli_refuses_a_bad_step_file_and_lists_prm(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1=", "steps": ["1+1=2"], "labels": ["good"]}) + "\n")
    fails_cleanly(capsys, tmp_path, "prm", "--dataset", f"steps:{bad}", match="label 0 is 'good'")
    assert main(["list"]) == 0 and any(line.startswith("prm ") for line in capsys.readouterr().out.splitlines())
    assert main(["info", "prm"]) == 0 and "arXiv:2305.20050" in capsys.readouterr().out


def test_best_of_n_by_min_and_by_product_and_by_the_outcome():
    probs = torch.tensor([[0.9, 0.9, 0.5], [0.6, 0.6, 0.6]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    by = {how: aggregate_steps(probs, mask, how).tolist() for how in ("min", "prod")}
    assert by["min"] == pytest.approx([0.5, 0.6]) and by["prod"] == pytest.approx([0.405, 0.216])
    solutions = [["a"], ["b"]]
    assert best_of_n(solutions, lambda s: by["min"][solutions.index(s)]) == (1, pytest.approx(0.6))
    assert best_of_n(solutions, lambda s: by["prod"][solutions.index(s)]) == (0, pytest.approx(0.405))
    task = StepChainTask()
    candidates = [["3+4=8", "8*2=14"], ["3+4=7", "7*2=14"], ["3+4=7", "7*2=15"]]
    orm = lambda s: task.reward("3+4*2=", "\n".join(s))  # noqa: E731
    assert best_of_n(candidates, orm) == (0, 1.0)  # the outcome verifier takes the first lucky answer


def _tree(depth, branching, seed):
    rng = random.Random(seed)
    children = {}
    frontier = [()]
    for _ in range(depth):
        frontier = [node + (f"{len(node)}{b}",) for node in frontier for b in range(branching)]
        for node in frontier:
            children.setdefault(node[:-1], []).append(node[-1])
    value = {}
    for node in list(children) + frontier:
        if node:
            value[node] = round(rng.random(), 3)
    return (lambda s: children.get(tuple(s), [])), (lambda s: value[tuple(s)])


def test_beam_search_equals_exhaustive_search_when_its_beam_holds_a_level():
    for seed in range(5):
        expand, score = _tree(3, 2, seed)
        assert beam_search(expand, score, beam_width=8, max_steps=3) == exhaustive_search(expand, score, max_steps=3)


def test_a_narrow_beam_prunes_by_hand():
    tree = {(): ["x", "y"], ("x",): ["x1", "x2"], ("y",): ["y1", "y2"]}
    value = {("x",): 0.9, ("y",): 0.6, ("x", "x1"): 0.2, ("x", "x2"): 0.3, ("y", "y1"): 0.8, ("y", "y2"): 0.1}
    expand, score = (lambda s: tree.get(tuple(s), [])), (lambda s: value[tuple(s)])
    assert beam_search(expand, score, beam_width=1, max_steps=2) == (["x", "x2"], 0.3)  # y was pruned
    assert beam_search(expand, score, beam_width=2, max_steps=2) == (["y", "y1"], 0.8)
    assert exhaustive_search(expand, score, max_steps=2) == (["y", "y1"], 0.8)


def test_beam_search_with_a_language_model_and_a_prm_counts_its_tokens():
    tok = char_tokenizer()
    model, prm = tiny_causal_lm(tok, seed=0), CausalLMStepReward(tiny_causal_lm(tok, seed=1)).eval()
    sampler = StepSampler(model, tok, "2+3*4=", num_samples=3, max_steps=2, max_step_tokens=6, seed=0)
    steps, value = beam_search(sampler, PRMScorer(prm, tok, "2+3*4=", aggregate="prod"), beam_width=2, max_steps=2)
    assert 1 <= len(steps) <= 2 and all(isinstance(s, str) and s for s in steps) and 0.0 < value < 1.0
    assert 0 < sampler.generated_tokens <= (1 + 2) * 3 * 6


def test_compare_search_scores_every_method_by_the_outcome_and_counts_tokens():
    tok = char_tokenizer()
    policy, prm = tiny_causal_lm(tok, seed=0), CausalLMStepReward(tiny_causal_lm(tok, seed=1)).eval()
    prompts = StepChainTask().prompts(2, split="test")
    out = compare_search(StepChainTask(), policy, tok, prm, prompts, n=2, beam_width=2, max_steps=2)
    assert set(out) == {"greedy", "best_of_n_orm", "best_of_n_prm", "beam_prm", "beam_gold_steps"}
    assert all(0.0 <= m["exact_match"] <= 1.0 for m in out.values())
    # best-of-2 ranks the same two samples by either judge; beam search spends more than greedy
    assert out["best_of_n_orm"]["tokens_per_prompt"] == out["best_of_n_prm"]["tokens_per_prompt"]
    assert out["beam_prm"]["tokens_per_prompt"] > out["greedy"]["tokens_per_prompt"] > 0
