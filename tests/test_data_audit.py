"""``offline-plugins data audit``: statistics against textbook examples, bias and flip detection, the CLI."""

from __future__ import annotations

import json
import random

import pytest
import torch

from offline_plugins.audit import (
    AuditError,
    audit_preference_data,
    cohen_kappa,
    krippendorff_alpha,
    wilson_interval,
)
from offline_plugins.cli import main
from offline_plugins.errors import UserError
from offline_plugins.text.data.preference_sources import PreferenceSourceError, _rows_from

torch.set_num_threads(1)
N = None


# ---- statistics: textbook examples -------------------------------------------------------------


def test_krippendorff_alpha_on_krippendorffs_own_example_with_missing_data():
    # Krippendorff, K. (2011), "Computing Krippendorff's Alpha-Reliability", University of
    # Pennsylvania (https://repository.upenn.edu/asc_papers/43), example C: 4 observers, 12 units,
    # nominal values 1-5, missing values; the paper gives alpha_nominal = 0.743.
    data = [[1, 2, 3, 3, 2, 1, 4, 1, 2, N, N, N],
            [1, 2, 3, 3, 2, 2, 4, 1, 2, 5, N, 3],
            [N, 3, 3, 3, 2, 3, 4, 2, 2, 5, 1, N],
            [1, 2, 3, 3, 2, 4, 4, 1, 2, 5, 1, N]]
    # By hand: unit 12 has one value, so it is not pairable; the others hold
    # m_u = 3,4,4,4,4,4,4,4,4,3,2 values, n = 40. Disagreeing ordered pairs / (m_u - 1):
    # unit 2 (2,2,3,2): 3*1*2/3 = 2; unit 6 (1,2,3,4): 12/3 = 4; unit 8 (1,1,2,1): 6/3 = 2; total 8.
    # n_c: value 1 -> 9, 2 -> 13, 3 -> 10, 4 -> 5, 5 -> 3; sum_{c != k} n_c n_k = 40^2 - 384 = 1216.
    # alpha = 1 - (n - 1) * 8 / 1216 = 1 - 312 / 1216 = 0.74342...
    assert krippendorff_alpha(data) == pytest.approx(1 - 312 / 1216, abs=1e-12)
    assert round(krippendorff_alpha(data), 3) == 0.743
    # the order of annotators and units does not matter; a missing label is not a label
    assert krippendorff_alpha(data[::-1]) == pytest.approx(krippendorff_alpha(data))
    assert krippendorff_alpha([row[::-1] for row in data]) == pytest.approx(krippendorff_alpha(data))


def test_krippendorff_alpha_limits():
    assert krippendorff_alpha([[1, 2, 1, 2], [1, 2, 1, 2]]) == 1.0  # perfect agreement
    assert krippendorff_alpha([[1, 1, 1], [1, 1, 1]]) is None  # one value throughout: D_e = 0, undefined
    assert krippendorff_alpha([[1, N], [N, 2]]) is None  # no unit with two labels
    # systematic disagreement is below chance: two units, each labelled 1 and 2 -> n = 4,
    # o_12 = o_21 = 2, n_1 = n_2 = 2, alpha = 1 - 3 * 4 / 8 = -0.5
    assert krippendorff_alpha([[1, 2], [2, 1]]) == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="one entry per unit"):
        krippendorff_alpha([[1, 2], [1]])


def test_cohen_kappa_on_a_textbook_table():
    # The worked example of the Wikipedia article "Cohen's kappa" (section "Simple example"): 50
    # grant proposals, two readers, Yes/No; Yes-Yes 20, Yes-No 5, No-Yes 10, No-No 15. The formula
    # is Cohen's: Cohen, J. (1960), A coefficient of agreement for nominal scales, Educational and
    # Psychological Measurement 20(1), 37-46.
    # By hand: p_o = (20 + 15) / 50 = 0.7; reader A says Yes 25/50 = 0.5, reader B 30/50 = 0.6;
    # p_e = 0.5 * 0.6 + 0.5 * 0.4 = 0.5; kappa = (0.7 - 0.5) / (1 - 0.5) = 0.4.
    a = ["yes"] * 20 + ["yes"] * 5 + ["no"] * 10 + ["no"] * 15
    b = ["yes"] * 20 + ["no"] * 5 + ["yes"] * 10 + ["no"] * 15
    assert cohen_kappa(a, b) == pytest.approx(0.4, abs=1e-12)
    assert cohen_kappa(b, a) == pytest.approx(0.4, abs=1e-12)  # symmetric
    # A 3x3 table by hand (rows: annotator 1, columns: annotator 2), 100 units:
    #   [[40, 5, 5], [5, 20, 5], [0, 5, 15]] -> p_o = 75/100; marginals .50/.30/.20 and .45/.30/.25
    #   -> p_e = .225 + .09 + .05 = .365; kappa = (.75 - .365) / .635 = 0.60630 (to 5 places)
    table = [[40, 5, 5], [5, 20, 5], [0, 5, 15]]
    a, b = [], []
    for i, row in enumerate(table):
        for j, count in enumerate(row):
            a += [i] * count
            b += [j] * count
    assert cohen_kappa(a, b) == pytest.approx(0.385 / 0.635, abs=1e-12)
    assert round(cohen_kappa(a, b), 5) == 0.6063
    # missing labels are left out; a single shared label has p_e = 1 and no kappa
    assert cohen_kappa(["y", None, "n"], ["y", "n", "n"]) == pytest.approx(1.0)
    assert cohen_kappa(["y"], ["y"]) is None
    with pytest.raises(ValueError, match="one label per unit"):
        cohen_kappa(["y"], ["y", "n"])


def test_wilson_interval():
    # Wilson (1927); the classic check: 8 successes in 10 -> 0.490..0.943 (e.g. Newcombe 1998, Stat. Med. 17, 857-872)
    lo, hi = wilson_interval(8, 10)
    assert (round(lo, 3), round(hi, 3)) == (0.49, 0.943)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    lo, hi = wilson_interval(0, 20)
    assert lo == 0.0 and 0 < hi < 0.2


# ---- the loaders keep shown_first and annotations ----------------------------------------------


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_loader_keeps_and_checks_the_optional_fields(tmp_path):
    rows = [{"prompt": "p", "chosen": "a", "rejected": "b", "shown_first": "rejected",
             "annotations": [{"annotator": 1, "preferred": "chosen"}, {"annotator": "x", "preferred": "rejected"}]},
            {"prompt": "q", "chosen": "c", "rejected": "d", "shown_first": None}]
    loaded, layout = _rows_from(str(_write(tmp_path / "ok.jsonl", rows)))
    assert layout == "pairs"
    assert loaded[0]["shown_first"] == "rejected"
    assert loaded[0]["annotations"] == [{"annotator": "1", "preferred": "chosen"},
                                        {"annotator": "x", "preferred": "rejected"}]
    assert "shown_first" not in loaded[1] and "annotations" not in loaded[1]


@pytest.mark.parametrize("extra,match", [
    ({"shown_first": "left"}, r"row 1 \(line 2\) field 'shown_first' is 'left'; expected \"chosen\" or \"rejected\""),
    ({"annotations": "alice"}, r"row 1 \(line 2\) field 'annotations' is a str .*expected a list of"),
    ({"annotations": [{"who": "a"}]}, r"row 1 \(line 2\) field 'annotations\[0\]' has keys \['who'\]; expected an object"),
    ({"annotations": [{"annotator": "a", "preferred": "first"}]}, r"'annotations\[0\]' has preferred 'first'"),
    ({"annotations": [{"annotator": True, "preferred": "chosen"}]}, r"has annotator True; expected a non-empty"),
    ({"annotations": [{"annotator": "a", "preferred": "chosen"}, {"annotator": "a", "preferred": "rejected"}]},
     r"'annotations\[1\]': annotator 'a' labels this row twice"),
])
def test_malformed_optional_fields_name_the_row_and_field(tmp_path, extra, match):
    path = _write(tmp_path / "bad.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"},
                                           {"prompt": "q", "chosen": "c", "rejected": "d", **extra}])
    with pytest.raises(PreferenceSourceError, match=match):
        _rows_from(str(path))
    assert issubclass(PreferenceSourceError, UserError)


def test_hugging_face_rows_keep_the_optional_fields(monkeypatch):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([
        {"prompt": "p", "chosen": "a", "rejected": "b", "shown_first": "chosen",
         "annotations": [{"annotator": "u1", "preferred": "chosen"}]},
        {"prompt": "q", "chosen": "c", "rejected": "d", "shown_first": None, "annotations": None},
    ])
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: ds)
    rows, _ = _rows_from("hf:someone/pairs")
    assert rows[0]["shown_first"] == "chosen" and rows[0]["annotations"] == [{"annotator": "u1", "preferred": "chosen"}]
    assert "shown_first" not in rows[1] and "annotations" not in rows[1]
    ds_bad = datasets.Dataset.from_list([{"prompt": "p", "chosen": "a", "rejected": "b", "shown_first": "top"}])
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: ds_bad)
    with pytest.raises(PreferenceSourceError, match=r"hf:x: row 0 field 'shown_first' is 'top'"):
        _rows_from("hf:x")


# ---- the audit on data built with known properties ---------------------------------------------


def _biased_rows(n: int = 200, n_flipped: int = 10, seed: int = 0):
    """Pairs where the good response is "a..." and the bad "b..."; the chosen is the longer one in
    exactly 80% of rows (i % 5 != 0), and ``n_flipped`` rows have their label flipped (chosen = the bad one).

    All rows share one prompt: a reward model reads the response alone, so it cannot memorise a flipped
    label without contradicting the other pairs (with a prompt per row it can; see docs/audit.md)."""
    rng = random.Random(seed)
    flipped = sorted(rng.sample(range(n), n_flipped))
    rows = []
    for i in range(n):
        short, long_ = rng.randint(2, 8), rng.randint(10, 16)
        chosen_len, rejected_len = (long_, short) if i % 5 else (short, long_)
        good, bad = ("b", "a") if i in flipped else ("a", "b")
        rows.append({"prompt": "Q:", "chosen": good * chosen_len, "rejected": bad * rejected_len})
    return rows, flipped


def test_known_length_bias_is_measured():
    rows, _ = _biased_rows()
    report = audit_preference_data(rows, progress=False)
    ln = report["length"]
    assert ln["chosen_longer"] == pytest.approx(0.8) and ln["ties"] == 0.0
    assert ln["length_only_accuracy"] == pytest.approx(0.8) and ln["length_only_rule"] == "longer"
    lo, hi = ln["chosen_longer_untied_ci95"]
    assert lo < 0.8 < hi and lo > 0.5
    assert sum(ln["histogram"]["counts"]) == 200
    assert ln["difference"]["min"] < 0 < ln["difference"]["median"]
    # no length bias: the held-out rule scores about 0.5 (not the optimistic max(p, 1 - p))
    rng = random.Random(1)
    even = [{"prompt": "p", "chosen": "x" * rng.randint(1, 9), "rejected": "y" * rng.randint(1, 9)} for _ in range(400)]
    assert abs(audit_preference_data(even, progress=False)["length"]["length_only_accuracy"] - 0.5) < 0.08
    # words as the unit
    words = audit_preference_data([{"prompt": "p", "chosen": "one two three", "rejected": "a b"}], length_unit="words",
                                  progress=False)["length"]
    assert words["chosen_mean"] == 3 and words["rejected_mean"] == 2


def test_position_bias_agreement_contradictions_and_row_issues():
    def ann(*labels):
        return [{"annotator": who, "preferred": lab} for who, lab in zip("ABC", labels) if lab is not None]

    rows = [
        {"prompt": "p0", "chosen": "x", "rejected": "y", "shown_first": "chosen", "annotations": ann("chosen", "chosen")},
        {"prompt": "p1", "chosen": "x", "rejected": "y", "shown_first": "chosen", "annotations": ann("chosen", "rejected")},
        {"prompt": "p2", "chosen": "x", "rejected": "y", "shown_first": "chosen", "annotations": ann("rejected", "rejected")},
        {"prompt": "p3", "chosen": "x", "rejected": "y", "shown_first": "chosen", "annotations": ann("chosen", "chosen")},
        # the pair of row 3, reversed and labelled the other way: a contradiction across rows
        {"prompt": "p3", "chosen": "y", "rejected": "x"},
        {"prompt": "p4", "chosen": "same", "rejected": "same "},
        {"prompt": "p5", "chosen": "", "rejected": "z"},
        {"prompt": "p6", "chosen": "u", "rejected": "v", "shown_first": "rejected"},
        {"prompt": "p6", "chosen": "u", "rejected": "v"},
        {"prompt": "P" * 200, "chosen": "u", "rejected": "v"},
    ]
    report = audit_preference_data(rows, progress=False)
    pos = report["position"]
    assert pos["pairs"] == 5 and pos["first_preferred"] == 0.8
    ag = report["agreement"]
    assert ag["annotators"] == 2 and ag["pairs"] == 4 and ag["labels"] == 8
    # pairs 0..3, coded by the position shown (x first in all four): A prefers first, first, second,
    # first; B first, second, second, first -> p_o = 3/4, p_A(first) = 3/4, p_B(first) = 1/2,
    # p_e = 3/4 * 1/2 + 1/4 * 1/2 = 1/2, kappa = (3/4 - 1/2) / (1/2) = 0.5
    assert ag["cohen_kappa"] == pytest.approx(0.5)
    assert ag["krippendorff_alpha"] == pytest.approx(krippendorff_alpha([[0, 0, 1, 0], [0, 1, 1, 0]]))
    assert ag["observed_agreement"] == pytest.approx(0.75)
    per = {a["annotator"]: a for a in ag["per_annotator"]}
    assert per["A"]["agreement_with_others"] == 0.75 and per["B"]["agrees_with_row_label"] == 0.5
    cp = report["contradictory_pairs"]
    assert cp["count"] == 2  # row 1 (annotators split) and rows 3+4 (the same pair both ways)
    assert sorted(c["rows"] for c in cp["pairs"]) == [[1], [3, 4]]
    both_ways = next(c for c in cp["pairs"] if c["rows"] == [3, 4])
    assert (both_ways["votes_chosen"], both_ways["votes_rejected"]) == (2, 1)
    iss = report["issues"]
    assert iss["duplicate_rows"] == 1 and iss["examples"]["duplicate_rows"] == [8]
    assert iss["chosen_equals_rejected"] == 1 and iss["examples"]["chosen_equals_rejected"] == [5]
    assert iss["empty_responses"] == 1 and iss["examples"]["empty_responses"] == [6]
    assert iss["prompts_over_context"] == 1 and iss["examples"]["prompts_over_context"] == [9]
    assert iss["context_tokens"] == 128  # the tiny model's, as training with --model tiny would use
    assert report["model"] is None
    # more than two annotators: no Cohen's kappa, alpha still defined
    three = [dict(r, annotations=ann("chosen", "chosen", "rejected")) for r in rows[:3]]
    ag3 = audit_preference_data(three, progress=False)["agreement"]
    assert ag3["annotators"] == 3 and ag3["cohen_kappa"] is None and ag3["krippendorff_alpha"] is not None


def test_agreement_does_not_depend_on_which_response_the_row_calls_chosen():
    # the same two annotators' judgements, once with every row's chosen = A's pick, once as stored
    # by a different convention; without shown_first the pair is coded in sorted order, so kappa agrees
    picks_a = ["x", "x", "y", "x", "y", "y"]
    picks_b = ["x", "y", "y", "x", "y", "x"]

    def rows(chosen_is_a_pick: bool):
        out = []
        for i, (pa, pb) in enumerate(zip(picks_a, picks_b)):
            chosen = pa if chosen_is_a_pick else ("x" if i % 2 else "y")
            rejected = "y" if chosen == "x" else "x"
            out.append({"prompt": f"p{i}", "chosen": chosen, "rejected": rejected, "annotations": [
                {"annotator": "A", "preferred": "chosen" if pa == chosen else "rejected"},
                {"annotator": "B", "preferred": "chosen" if pb == chosen else "rejected"}]})
        return out

    k1 = audit_preference_data(rows(True), progress=False)["agreement"]["cohen_kappa"]
    k2 = audit_preference_data(rows(False), progress=False)["agreement"]["cohen_kappa"]
    # by hand, coding x = 0: A = 0,0,1,0,1,1; B = 0,1,1,0,1,0 -> p_o = 4/6, p_e = 1/2 * 1/2 + 1/2 * 1/2
    # = 1/2, kappa = (2/3 - 1/2) / (1/2) = 1/3
    assert k1 == pytest.approx(1 / 3) and k2 == pytest.approx(1 / 3)


def test_bad_inputs_raise_user_errors(tmp_path):
    with pytest.raises(AuditError, match=r"data audit reads preference data, but 'pendulum/medium-v0' is not one.*\.jsonl file"):
        audit_preference_data("pendulum/medium-v0")
    with pytest.raises(AuditError, match="no rows to audit"):
        audit_preference_data([])
    with pytest.raises(AuditError, match="length unit 'bytes'"):
        audit_preference_data([{"prompt": "p", "chosen": "a", "rejected": "b"}], length_unit="bytes")
    unpaired = _write(tmp_path / "u.jsonl", [{"prompt": "p", "completion": "a", "label": True}])
    with pytest.raises(AuditError, match="holds unpaired"):
        audit_preference_data(str(unpaired))
    with pytest.raises(AuditError, match=r"is not a preference run: expected a run folder OUT"):
        audit_preference_data([{"prompt": "p", "chosen": "a", "rejected": "b"}], model=tmp_path)


# ---- the CLI ---------------------------------------------------------------------------------


def _fails_cleanly(capsys, *args, match: str) -> None:
    code = main(["data", "audit", *args, "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("offline-plugins: error:") and match in err, err


def test_cli_json_text_and_plot(tmp_path, capsys):
    rows, _ = _biased_rows()
    rows[0] = dict(rows[0], shown_first="chosen", annotations=[{"annotator": "a", "preferred": "chosen"},
                                                               {"annotator": "b", "preferred": "rejected"}])
    data = _write(tmp_path / "pairs.jsonl", rows)
    png = tmp_path / "audit.png"
    assert main(["data", "audit", str(data), "--json", "--plot", str(png), "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rows"] == 200 and report["length"]["chosen_longer"] == pytest.approx(0.8)
    assert report["position"]["pairs"] == 1 and report["agreement"]["annotators"] == 2
    assert report["plot"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert main(["data", "audit", str(data), "--length-unit", "tokens", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "length-only classifier         0.800" in text and "length in tokens" in text
    assert "Krippendorff's alpha" in text and "model: none" in text


def test_cli_errors_are_one_line(tmp_path, capsys):
    _fails_cleanly(capsys, "no-such-dataset", match="'no-such-dataset' is not one")
    _fails_cleanly(capsys, str(tmp_path / "missing.jsonl"), match="does not exist")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    _fails_cleanly(capsys, str(empty), match="holds no rows")
    bad = _write(tmp_path / "bad.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b",
                                           "annotations": [{"annotator": "a", "preferred": "yes"}]}])
    _fails_cleanly(capsys, str(bad), match="row 0 (line 1) field 'annotations[0]' has preferred 'yes'")
    good = _write(tmp_path / "good.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}])
    _fails_cleanly(capsys, str(good), "--model", str(tmp_path), match="is not a preference run")
    not_ckpt = tmp_path / "x.ckpt"
    not_ckpt.write_bytes(b"not a checkpoint")
    _fails_cleanly(capsys, str(good), "--model", str(not_ckpt), match="x.ckpt")
    _fails_cleanly(capsys, str(good), "--plot", str(tmp_path / "nowhere" / "a.png"), match="does not exist")
    _fails_cleanly(capsys, str(good), "--plot", str(tmp_path / "a.jpg"), match="should name a .png file")


def test_cli_rejects_a_run_that_is_not_a_preference_run(tmp_path, capsys):
    # a checkpoint of an offline-RL algorithm (its metadata is all the audit reads before refusing it)
    ckpt = tmp_path / "bc.ckpt"
    torch.save({"state_dict": {}, "offline_plugins": {"algorithm": "bc", "dataset": "pendulum/medium-v0",
                                                       "config": {}, "seed": 0}}, ckpt)
    good = _write(tmp_path / "good.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}])
    _fails_cleanly(capsys, str(good), "--model", str(ckpt), match="is a bc run, trained on transitions")


# ---- with a trained reward model: the flipped labels are found --------------------------------


@pytest.mark.slow
def test_a_reward_model_finds_the_flipped_labels(tmp_path, capsys):
    rows, flipped = _biased_rows()
    data = _write(tmp_path / "biased.jsonl", rows)
    out = tmp_path / "rm"
    assert main(["train", "reward-model", "--dataset", str(data), "--model", "tiny", "--steps", "200",
                 "--out", str(out), "--no-progress", "--json"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["data", "audit", str(data), "--model", str(out), "--top", "10", "--json", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    m = report["model"]
    assert m["algorithm"] == "reward-model" and m["pairs_scored"] == 200
    found = [f["row"] for f in m["candidate_flips"]]
    # the ten flipped pairs are the ten pairs the model ranks most confidently against their label
    assert len(set(found) & set(flipped)) >= 9, (found, flipped)
    assert all(f["margin"] < 0 and 0 <= f["p_label"] < 0.5 for f in m["candidate_flips"])
    assert m["accuracy"] >= 0.9
    # the model learned the content, not the length: its margin hardly follows the length difference
    assert abs(m["margin_length_difference_spearman"]) < 0.3
    # every pair labelled both ways involves a flipped row (the flips reverse unflipped duplicates)
    assert all(set(c["rows"]) & set(flipped) for c in report["contradictory_pairs"]["pairs"])
    # the audit's per-pair scores rank the pairs as the package's own scoring does
    from offline_plugins.audit import _load_scorer
    from offline_plugins.eval.preference import pairwise_scores
    from offline_plugins.text.data.preference import tokenize_pairs

    scorer = _load_scorer(out, registry=None, device="cpu", progress=False)
    td, _ = tokenize_pairs(rows, scorer.tokenizer, max_length=scorer.context)
    assert pairwise_scores(scorer.policy, td)["preference_accuracy"] == pytest.approx(m["accuracy"])
    # the text table names the flips
    assert main(["data", "audit", str(data), "--model", str(out / "checkpoints" / "last.ckpt"), "--top", "3",
                 "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "candidate label flips" in text and f"row {found[0]}:" in text
