"""Process reward models: the step task's labels, the step-labelled data, the PRM loss, ``train prm``, search."""

from __future__ import annotations

import json
import math
import random
import re

import pytest
import torch
from _cli_checks import fails_cleanly
from tensordict import TensorDict

from offline_plugins.cli import main
from offline_plugins.eval.search import (
    PRMScorer,
    StepSampler,
    aggregate_steps,
    beam_search,
    best_of_n,
    compare_search,
    exhaustive_search,
    load_prm,
)
from offline_plugins.modules.tiny_lm import char_tokenizer, tiny_causal_lm
from offline_plugins.objectives.llm import CausalLMStepReward, ProcessRewardLoss
from offline_plugins.text.data.steps import (
    BUILTIN_STEP_ROWS,
    StepDataError,
    load_step_jsonl,
    tokenize_steps,
    validate_step_rows,
)
from offline_plugins.text.tasks.steps import StepChainTask


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


def test_the_language_modelling_term_against_a_hand_computation():
    # one row: bos, prompt "1=" (tokens 0..2), step 0 "a\n" (3..4), step 1 "b\n" (5..6), then padding (7);
    # step 0 is labelled correct, step 1 wrong: only tokens 3 and 4 are imitated, each predicted from the
    # token before it (logits at 2 and 3)
    vocab, T = 4, 8
    tokens = torch.tensor([[0, 1, 2, 3, 1, 2, 3, 0]])
    logits = torch.arange(T * vocab, dtype=torch.float).reshape(1, T, vocab).sin() * 3
    batch = TensorDict({("steps", "score"): torch.tensor([[1.0, -1.0]]), ("steps", "label"): torch.tensor([[1.0, 0.0]]),
                        ("steps", "mask"): torch.tensor([[True, True]]), ("steps", "position"): torch.tensor([[4, 6]]),
                        ("tokens", "full"): tokens, ("steps", "lm_logits"): logits,
                        ("masks", "all_assistant_mask"): torch.tensor([[False] * 3 + [True] * 4 + [False]])}, [1])

    def nll(t):  # -log softmax(logits[t - 1])[tokens[t]], by hand
        row = logits[0, t - 1].tolist()
        return -(row[tokens[0, t]] - math.log(sum(math.exp(v) for v in row)))

    out = ProcessRewardLoss(lm_coef=0.5)(batch)
    assert out["loss_lm"].item() == pytest.approx(0.5 * (nll(3) + nll(4)) / 2, rel=1e-5)
    both_good = ProcessRewardLoss(lm_coef=1.0)(batch.clone().set(("steps", "label"), torch.ones(1, 2)))
    assert both_good["loss_lm"].item() == pytest.approx(sum(nll(t) for t in (3, 4, 5, 6)) / 4, rel=1e-5)
    plain = ProcessRewardLoss()
    assert "loss_lm" not in plain(batch).keys() and ("steps", "lm_logits") not in plain.in_keys
    with pytest.raises(Exception, match="lm_coef must be >= 0"):
        ProcessRewardLoss(lm_coef=-1.0)


def test_the_step_network_writes_the_logits_of_its_one_forward():
    tok = char_tokenizer()
    td, _ = tokenize_steps([{"prompt": "2+3=", "steps": ["2+3=5"], "labels": [1]}], tok, max_length=32)
    assert td["masks", "all_assistant_mask"].tolist() == [[False] * 5 + [True] * 6]  # bos + "2+3=", then "2+3=5\n"
    prm = CausalLMStepReward(tiny_causal_lm(tok, seed=0), logits_key=("steps", "lm_logits")).eval()
    out = prm(td.clone())
    expected = prm.model(input_ids=td["tokens", "full"]).logits
    torch.testing.assert_close(out["steps", "lm_logits"], expected)
    loss = ProcessRewardLoss(prm, lm_coef=1.0)(td)
    loss["loss_lm"].backward()
    assert prm.model.transformer.wte.weight.grad.abs().sum() > 0


def test_v1_holds_v0s_rows_and_more():
    task = StepChainTask()
    v1 = task.rows(BUILTIN_STEP_ROWS["steps/arithmetic-v1"], seed=0)
    assert v1[: BUILTIN_STEP_ROWS["steps/arithmetic-v0"]] == task.rows(BUILTIN_STEP_ROWS["steps/arithmetic-v0"], seed=0)
    assert len({r["prompt"] for r in v1}) > 10_000  # distinct chains, not 2000 rows repeated
    held_out = {r["prompt"] for r in task.rows(200, split="test", seed=0)}
    assert not held_out & {r["prompt"] for r in v1}


def _search_folders(tmp_path, prm_tokenizer=None):
    """A tiny policy (save_pretrained) and a tiny PRM (as train prm exports it) in tmp_path."""
    from offline_plugins.text.sources.reward_source import save_reward_model

    tok = char_tokenizer()
    policy = tiny_causal_lm(tok, seed=0)
    policy.save_pretrained(tmp_path / "policy")
    tok.save_pretrained(tmp_path / "policy")
    prm_tok = prm_tokenizer or tok
    save_reward_model(CausalLMStepReward(tiny_causal_lm(prm_tok, seed=1)), prm_tok, tmp_path / "prm" / "reward_model")
    return tmp_path / "policy", tmp_path / "prm"


def test_search_command_prints_each_method_and_writes_json_and_a_plot(capsys, tmp_path):
    policy, prm = _search_folders(tmp_path)
    out = tmp_path / "res" / "search.json"
    code = main(["search", "--policy", str(policy), "--prm", str(prm), "--n", "1", "2", "--beam-width", "1",
                 "--prompts", "2", "--max-steps", "2", "--seed", "3", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    for label in ("greedy", "best-of-N, outcome verifier", "best-of-N, PRM", "beam search, PRM", "step checker"):
        assert label in printed
    rows = json.loads(out.read_text())["results"]
    # greedy once, then each of the four searches at n = 1 and n = 2
    assert [(r["method"], r["n"]) for r in rows] == [("greedy", 1)] + [
        (m, k) for m in ("best_of_n_orm", "best_of_n_prm", "beam_prm", "beam_gold_steps") for k in (1, 2)]
    tokens = {(r["method"], r["n"]): r["tokens_per_prompt"] for r in rows}
    assert 0 < tokens["best_of_n_prm", 1] < tokens["best_of_n_prm", 2] == tokens["best_of_n_orm", 2]
    assert out.with_suffix(".png").stat().st_size > 0
    # a train run's OUT folder is read through its OUT/model
    (tmp_path / "run").mkdir()
    policy.rename(tmp_path / "run" / "model")
    assert main(["search", "--policy", str(tmp_path / "run"), "--prm", str(prm), "--n", "1", "--prompts", "1",
                 "--max-steps", "1"]) == 0
    assert "wrote" not in capsys.readouterr().out  # no --out: nothing written


def _search_fails(capsys, *args, match):
    capsys.readouterr()  # what making the folders printed
    code = main(["search", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("offline-plugins: error:"), err
    assert match in err, err


def test_search_refuses_bad_inputs_in_one_line(capsys, tmp_path):
    policy, prm = _search_folders(tmp_path)
    _search_fails(capsys, "--policy", str(tmp_path / "nope"), "--prm", str(prm), match="does not exist")
    _search_fails(capsys, "--policy", str(policy), "--prm", str(tmp_path / "nope"), match="is no PRM folder")
    _search_fails(capsys, "--policy", str(policy), "--prm", str(prm), "--n", "0", match="n=0")
    _search_fails(capsys, "--policy", str(policy), "--prm", str(prm), "--beam-width", "2", "-1",
                  match="beam_width=-1")
    _search_fails(capsys, "--policy", str(policy), "--prm", str(prm), "--dataset", "arithmetic",
                  match="no step task")
    other = tmp_path / "other"
    other.mkdir()
    _, digits_prm = _search_folders(other, prm_tokenizer=char_tokenizer("0123456789+-*="))
    _search_fails(capsys, "--policy", str(policy), "--prm", str(digits_prm), match="reads another tokenizer")


def test_train_prm_from_the_tasks_sft_reference_with_the_language_modelling_term(tmp_path, capsys):
    from offline_plugins.text.data.preference_sources import cache_root

    out = tmp_path / "run"
    assert main(["train", "prm", "--dataset", "steps/arithmetic-v0", "--steps", "2", "--seed", "0", "--log-every", "1",
                 "--set", "reference_sft_steps=10", "--set", "lm_coef=0.5", "--set", "batch_size=8",
                 "--out", str(out), "--no-progress"]) == 0, capsys.readouterr().err
    assert list((cache_root() / "preference").glob("sft-steps-2to3x9-muladdsub-*-n10-b64-r*"))  # shared with grpo's
    rows = [line.split(",") for line in (out / "metrics.csv").read_text().splitlines()]
    col = rows[0].index("train/loss_lm")
    lm = [float(r[col]) for r in rows[1:] if r[col]]
    assert lm and all(0 < v < 0.5 * math.log(99) for v in lm)  # weighted, and below a uniform guess: it is read
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["lm_coef"] == 0.5 and summary["config"]["reference_sft_steps"] == 10


def test_sampled_rows_are_the_models_own_solutions_labelled_by_the_task():
    from offline_plugins.text.data.steps import sampled_rows

    tok, task = char_tokenizer(), StepChainTask()
    prompts = task.prompts(3, seed=5)
    rows = sampled_rows(task, tiny_causal_lm(tok, seed=0), tok, prompts, num_samples=2, max_new_tokens=12, seed=0)
    assert 0 < len(rows) <= 6 and {r["prompt"] for r in rows} <= set(prompts)
    for r in validate_step_rows(rows):
        assert r["labels"] == task.step_labels(r["prompt"], r["steps"]) and all("\n" not in s for s in r["steps"])
    again = sampled_rows(task, tiny_causal_lm(tok, seed=0), tok, prompts, num_samples=2, max_new_tokens=12, seed=0)
    assert again == rows  # seeded
    from offline_plugins.text.data.steps import load_step_source

    plain = load_step_source("steps/arithmetic-v0", n_train=10, n_test=4)
    mixed = load_step_source("steps/arithmetic-v0", n_train=10, n_test=4, policy_rows=6)
    assert plain.train.batch_size[0] == 10 and 10 < mixed.train.batch_size[0] <= 16
    assert mixed.test.batch_size[0] == plain.test.batch_size[0] == 4  # held out: the planted rows only
