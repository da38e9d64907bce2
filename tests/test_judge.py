"""AI feedback as the labeller: the order-swap tie rule, the rubric judge's probability, labelling, the audit."""

from __future__ import annotations

import json
import math

import pytest
import torch

from offline_plugins.audit import audit_preference_data
from offline_plugins.cli import main
from offline_plugins.errors import UserError
from offline_plugins.eval.judge import FunctionJudge, JudgeError, RubricJudge, judge_from, label_pairs

torch.set_num_threads(1)


def _good_first(prompt, first, second):
    """Knows the answer: the response starting with "good" is better; no position bias."""
    return 1.0 if first.startswith("good") else 0.0 if second.startswith("good") else 0.5


def _biased(bonus):
    """Right about content by 0.2 either way, plus ``bonus`` for whatever is shown first."""
    def judge(prompt, first, second):
        return min(1.0, max(0.0, 0.5 + (0.2 if first.startswith("good") else -0.2) + bonus))

    return judge


def test_the_order_swap_tie_rule():
    # shown "good" first: 0.5 + 0.2 + bonus; shown second: P(good first... ) = 1 - (0.5 - 0.2 + bonus)
    # bonus 0.1: 0.8 and 1 - 0.4 = 0.6 -> both orders pick "good": decided, consistent
    j = FunctionJudge(_biased(0.1)).compare("Q", "good", "bad")
    assert (j.verdict, j.consistent) == ("a", True)
    assert j.p_ab == pytest.approx(0.8) and j.p_ba == pytest.approx(0.6) and j.p_a == pytest.approx(0.7)
    # bonus 0.35: 1.0 (clipped) and 1 - 0.65 = 0.35 -> "good" when first, "bad" when first: a tie
    j = FunctionJudge(_biased(0.35)).compare("Q", "good", "bad")
    assert (j.verdict, j.consistent) == ("tie", False)
    assert j.p_ab == 1.0 and j.p_ba == pytest.approx(0.35)
    # the tie does not depend on which response is called a
    assert FunctionJudge(_biased(0.35)).compare("Q", "bad", "good").verdict == "tie"
    # a judge that always prefers the first shown never decides; one that reads the content always does
    always_first = FunctionJudge(lambda p, f, s: True)
    assert [x.verdict for x in always_first.compare_many([("Q", "good", "bad"), ("Q", "bad", "good")])] == ["tie"] * 2
    assert FunctionJudge(_good_first).compare("Q", "bad", "good").verdict == "b"
    # the margin: 0.8 and 0.6 are both preferences at margin 0.05, 0.6 is not at margin 0.15
    assert FunctionJudge(_biased(0.1), margin=0.05).compare("Q", "good", "bad").verdict == "a"
    j = FunctionJudge(_biased(0.1), margin=0.15).compare("Q", "good", "bad")
    assert (j.verdict, j.consistent) == ("tie", False)
    # no preference in either order is a consistent tie
    j = FunctionJudge(lambda p, f, s: 0.5).compare("Q", "x", "y")
    assert (j.verdict, j.consistent) == ("tie", True)


def test_ranking_a_group_counts_ties_as_half():
    judge = FunctionJudge(lambda p, f, s: float(len(f) > len(s)) if len(f) != len(s) else 0.5)
    # by length: "ccc" beats both, "bb" beats "a"; "a" and "d" tie (1/2 each)
    assert judge.rank("Q", ["a", "bb", "ccc", "d"]) == [(2, 3.0), (1, 2.0), (0, 0.5), (3, 0.5)]
    # a judge that always prefers the first shown ties everything: no ranking
    assert [w for _, w in FunctionJudge(lambda p, f, s: 1.0).rank("Q", ["a", "b", "c"])] == [1.0, 1.0, 1.0]


def test_a_bad_judge_answer_is_named():
    with pytest.raises(JudgeError, match=r"judge .*answered 1.5 for prompt 'Q'; expected P\(first shown is better\)"):
        FunctionJudge(lambda p, f, s: 1.5).compare("Q", "x", "y")
    with pytest.raises(JudgeError, match=r"answered nan"):
        FunctionJudge(lambda p, f, s: math.nan).compare("Q", "x", "y")
    with pytest.raises(JudgeError, match=r"margin must be in \[0, 0.5\)"):
        FunctionJudge(_good_first, margin=0.5)
    with pytest.raises(JudgeError, match=r"cannot import 'nope' from 'test_judge'"):
        judge_from("test_judge:nope")
    assert issubclass(JudgeError, UserError)


def test_the_rubric_judge_scores_the_answers_as_computed_by_hand(tmp_path):
    from offline_plugins.modules.tiny_lm import char_tokenizer, tiny_causal_lm

    tok = char_tokenizer()
    lm = tiny_causal_lm(tok, seed=3)
    lm.save_pretrained(tmp_path / "judge")
    tok.save_pretrained(tmp_path / "judge")
    template = "{prompt}|{first}|{second}?"
    judge = RubricJudge(str(tmp_path / "judge"), template=template)
    p = judge.prefer_first([("2+2=", "4", "5"), ("hi", "hello", "go away")])

    def by_hand(text):
        # char tokenizer: bos, one id per character; each answer " A" / " B" then eos, scored token by token
        ids = [tok.bos_token_id] + tok.convert_tokens_to_ids(list(text))
        logp = {}
        for answer in (" A", " B"):
            full = ids + tok.convert_tokens_to_ids(list(answer)) + [tok.eos_token_id]
            with torch.no_grad():
                lsm = torch.log_softmax(lm(torch.tensor([full])).logits[0].double(), -1)
            logp[answer] = sum(lsm[t - 1, full[t]].item() for t in range(len(ids), len(full)))
        return 1 / (1 + math.exp(-(logp[" A"] - logp[" B"])))

    assert p[0] == pytest.approx(by_hand("2+2=|4|5?"), abs=1e-5)
    assert p[1] == pytest.approx(by_hand("hi|hello|go away?"), abs=1e-5)
    assert judge.truncated_prompts == 0
    # the default rubric is longer than the tiny model's 128-token context: its start is cut, and counted
    long = RubricJudge(str(tmp_path / "judge"))
    long.prefer_first([("2+2=", "4", "5")])
    assert long.truncated_prompts == 1
    with pytest.raises(JudgeError, match=r"rubric template .* does not format"):
        RubricJudge("tiny", template="{answer}")


def test_an_untrained_lm_judge_is_position_inconsistent_and_its_pairs_become_ties():
    # an untrained model prefers one answer letter whatever the responses: its verdict flips with the order
    judge = RubricJudge("tiny", template="{prompt}|{first}|{second}?")
    judged = judge.compare_many([("2+2=", "4", "5"), ("Q", "good", "bad"), ("Name a colour.", "red", "no")])
    assert all(not j.consistent and j.verdict == "tie" for j in judged)
    assert all((j.p_ab - 0.5) * (j.p_ba - 0.5) < 0 for j in judged)  # each order prefers the other response


def _rows():
    return [
        {"prompt": "p0", "chosen": "good 0", "rejected": "bad 0", "shown_first": "chosen",
         "annotations": [{"annotator": "h", "preferred": "chosen"}]},
        # labelled the wrong way round: the judge swaps it, and the annotations and shown_first follow
        {"prompt": "p1", "chosen": "bad 1", "rejected": "good 1", "shown_first": "chosen",
         "annotations": [{"annotator": "h", "preferred": "chosen"}]},
        {"prompt": "p2", "chosen": "same a", "rejected": "same b"},  # no preference: a tie
    ]


def test_label_pairs_drops_or_doubles_ties():
    labelled, summary = label_pairs(FunctionJudge(_good_first), _rows())
    assert [r["chosen"] for r in labelled] == ["good 0", "good 1"]
    assert labelled[1]["rejected"] == "bad 1" and labelled[1]["shown_first"] == "rejected"
    assert labelled[1]["annotations"] == [{"annotator": "h", "preferred": "rejected"}]
    assert [r["judge"]["agrees_with_input"] for r in labelled] == [True, False]
    assert labelled[0]["judge"]["p_chosen"] == 1.0 and labelled[0]["judge"]["verdict"] == "chosen"
    assert summary == {"judge": "_good_first", "pairs": 3, "decided": 2, "ties": 1, "position_consistency": 1.0,
                       "agrees_with_input": 0.5, "rows_written": 2, "ties_policy": "drop"}
    both, summary = label_pairs(FunctionJudge(_good_first), _rows(), ties="both")
    assert summary["rows_written"] == 4
    tie_rows = [r for r in both if r["judge"]["verdict"] == "tie"]
    assert [(r["chosen"], r["rejected"]) for r in tie_rows] == [("same a", "same b"), ("same b", "same a")]
    with pytest.raises(JudgeError, match=r"ties='keep' is not one of drop, both"):
        label_pairs(FunctionJudge(_good_first), _rows(), ties="keep")


def test_data_label_writes_a_file_the_loaders_read(tmp_path, capsys):
    from offline_plugins.text.data.preference_sources import _rows_from

    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    out = tmp_path / "labelled.jsonl"
    assert main(["data", "label", str(src), "--judge", "test_judge:_good_first", "--out", str(out), "--json",
                 "--no-progress"]) == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out)
    assert (summary["decided"], summary["ties"], summary["rows_written"]) == (2, 1, 2)
    rows, layout = _rows_from(str(out))
    assert layout == "pairs" and [r["chosen"] for r in rows] == ["good 0", "good 1"]
    assert rows[1]["annotations"] == [{"annotator": "h", "preferred": "rejected"}]
    # an untrained rubric judge from the CLI: every pair a tie, nothing written but the summary says why
    assert main(["data", "label", str(src), "--judge", "tiny", "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "0 decided, 3 ties (drop); position consistency 0.000" in text
    code = main(["data", "label", str(src), "--judge", "tiny", "--out", str(tmp_path / "x.txt"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "should name a .jsonl file" in err and len(err.strip().splitlines()) == 1


def test_the_audit_reports_the_judges_kappa_and_position_consistency(capsys, tmp_path):
    # six pairs, two annotators; the judge reads the content ("good" wins)
    def ann(x, y):
        return [{"annotator": "x", "preferred": x}, {"annotator": "y", "preferred": y}]

    rows = [{"prompt": f"p{i}", "chosen": c, "rejected": r, "annotations": ann(*a)} for i, (c, r, a) in enumerate([
        ("good 0", "bad 0", ("chosen", "chosen")),
        ("good 1", "bad 1", ("chosen", "rejected")),
        ("bad 2", "good 2", ("chosen", "rejected")),  # the row label is the bad one
        ("good 3", "worse 3", ("chosen", "chosen")),
        ("same 4", "same 5", ("chosen", "chosen")),  # the judge has no preference: a tie
        ("bad 6", "good 6", ("rejected", "rejected")),
    ])]
    jd = audit_preference_data(rows, judge=_good_first, progress=False)["judge"]
    assert jd["pairs"] == 6 and jd["position_consistency"] == 1.0 and jd["ties"] == pytest.approx(1 / 6)
    # by hand, each pair coded by position in sorted order ("bad" < "good" < "worse"); decided pairs 0,1,2,3,5:
    #   judge (the "good" one)  1, 1, 1, 0, 1
    #   row label (chosen)      1, 1, 0, 0, 0   -> agreement 3/5
    #   p_e = P_j(1) P_r(1) + P_j(0) P_r(0) = 4/5 * 2/5 + 1/5 * 3/5 = 11/25; kappa = (3/5 - 11/25) / (14/25) = 2/7
    assert jd["agrees_with_row_label"] == pytest.approx(0.6)
    assert jd["cohen_kappa_with_row_label"] == pytest.approx(2 / 7)
    per = {a["annotator"]: a for a in jd["per_annotator"]}
    #   annotator y             1, 0, 1, 0, 1   -> agreement 4/5
    #   p_e = 4/5 * 3/5 + 1/5 * 2/5 = 14/25; kappa = (4/5 - 14/25) / (11/25) = 6/11
    assert per["y"]["pairs"] == 5 and per["y"]["agreement"] == pytest.approx(0.8)
    assert per["y"]["cohen_kappa"] == pytest.approx(6 / 11)
    # a judge biased to the first shown: every pair a tie, consistency 0, no kappa
    jd = audit_preference_data(rows, judge=lambda p, f, s: 0.9, progress=False)["judge"]
    assert jd["position_consistency"] == 0.0 and jd["ties"] == 1.0 and jd["cohen_kappa_with_row_label"] is None
    assert audit_preference_data(rows, progress=False)["judge"] is None
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["data", "audit", str(src), "--judge", "test_judge:_good_first", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "judge test_judge:_good_first (each pair judged in both display orders" in text
    assert "position consistency           1.000  (6 pairs" in text
    assert "agrees with the row label      0.600  (Cohen's kappa 0.286)" in text
