"""``data audit``'s style bias, gold-row accuracy and length-bucketed model accuracy, on planted data."""

from __future__ import annotations

import json
import math
import random
import re

import pytest

from offline_plugins.audit import STYLE_FEATURES, AuditError, audit_preference_data, wilson_interval
from offline_plugins.cli import main


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _styled_rows():
    """Ten pairs whose markdown can be counted by eye (one line per row)."""
    return (
        # rows 0-5: the chosen has a heading and two list items, the rejected none
        [{"prompt": f"p{i}", "chosen": "# Title\n- a\n- b", "rejected": "a and b"} for i in range(6)]
        + [
            {"prompt": "p6", "chosen": "plain", "rejected": "**bold** text"},
            # a list and a heading inside a code block count as the code block only
            {"prompt": "p7", "chosen": "plain", "rejected": "```\n- not a list\n# not a heading\n```"},
            {"prompt": "p8", "chosen": "use __this__ one", "rejected": "- one item"},
            {"prompt": "p9", "chosen": "same style", "rejected": "other style"},
        ]
    )


def test_style_bias_on_a_planted_file(tmp_path, capsys):
    path = _write(tmp_path / "styled.jsonl", _styled_rows())
    st = audit_preference_data(str(path), progress=False)["style"]
    assert tuple(st["features"]) == STYLE_FEATURES
    assert st["pairs"] == 10 and st["pairs_with_style"] == 9  # row 9 has none
    f = st["features"]
    # headings: +1 in rows 0-5 -> chosen mean 6/10, 6 pairs differ, chosen has more in all 6
    assert (f["headings"]["chosen_mean"], f["headings"]["rejected_mean"]) == (0.6, 0.0)
    assert (f["headings"]["pairs_differing"], f["headings"]["chosen_more_untied"]) == (6, 1.0)
    # list items: +2 in rows 0-5, -1 in row 8 -> means 12/10 and 1/10, 7 differ, 6 of them chosen-more
    assert f["list_items"]["chosen_mean"] == pytest.approx(1.2) and f["list_items"]["rejected_mean"] == 0.1
    assert f["list_items"]["pairs_differing"] == 7 and f["list_items"]["chosen_more_untied"] == pytest.approx(6 / 7)
    assert f["list_items"]["chosen_more_untied_ci95"] == list(wilson_interval(6, 7))
    # bold: -1 in row 6, +1 in row 8 -> one each way
    assert (f["bold"]["pairs_differing"], f["bold"]["chosen_more_untied"]) == (2, 0.5)
    # code blocks: only row 7's rejected -> 1 pair, chosen never has more
    assert (f["code_blocks"]["rejected_mean"], f["code_blocks"]["pairs_differing"]) == (0.1, 1)
    assert f["code_blocks"]["chosen_more_untied"] == 0.0
    # all features summed: +3 (rows 0-5), -1 (rows 6, 7), 0 (rows 8, 9)
    c = st["combined"]
    assert (c["chosen_more"], c["rejected_more"], c["ties"]) == (0.6, 0.2, 0.2)
    assert c["pairs_differing"] == 8 and c["chosen_more_untied"] == 0.75
    lo, hi = c["chosen_more_untied_ci95"]
    assert lo < 0.75 < hi and hi < 1  # 6 of 8 is not far enough from 0.5 to exclude it
    assert lo < 0.5
    # the style-only classifier, by hand: folds are i % 5 with sums {0: +2, 1: 0, 2: 0, 3: +1, 4: +1},
    # total +4; every fold's other four sum to >= 2, so every rule is "more style is chosen": rows 0-5
    # right, rows 6-7 wrong, rows 8-9 ties at 1/2 -> (6 + 1) / 10
    assert st["style_only_accuracy"] == pytest.approx(0.7) and st["style_only_rule"] == "more"
    # the text report
    assert main(["data", "audit", str(path), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "style bias (markdown outside code blocks; 9 of 10 pairs have any)" in text
    assert "style-only classifier          0.700" in text
    assert "  list_items             1.20 / 0.10       7        0.857" in text


def test_no_style_bias_scores_about_one_half():
    # the same styled and plain responses, the styled one chosen in every other pair
    rows = [{"prompt": f"p{i}", "chosen": "- x\n- y" if i % 2 else "x y", "rejected": "x y" if i % 2 else "- x\n- y"}
            for i in range(200)]
    st = audit_preference_data(rows, progress=False)["style"]
    assert st["combined"]["chosen_more_untied"] == 0.5
    lo, hi = st["combined"]["chosen_more_untied_ci95"]
    assert lo < 0.5 < hi
    assert abs(st["style_only_accuracy"] - 0.5) <= 0.1


def _ann(**labels):
    return [{"annotator": who, "preferred": lab} for who, lab in labels.items()]


def test_gold_accuracy_on_a_planted_file(tmp_path, capsys):
    rows = [
        {"prompt": "g0", "chosen": "right", "rejected": "wrong", "gold": True, "annotations": _ann(A="chosen", B="chosen")},
        {"prompt": "g1", "chosen": "right", "rejected": "wrong", "gold": True, "annotations": _ann(A="chosen", B="rejected")},
        {"prompt": "g2", "chosen": "right", "rejected": "wrong", "gold": True, "annotations": _ann(A="rejected")},
        {"prompt": "g3", "chosen": "right", "rejected": "wrong", "gold": True, "annotations": _ann(A="chosen")},
        {"prompt": "g4", "chosen": "right", "rejected": "wrong", "gold": True},  # gold, but nobody labelled it
        # not gold: these labels do not count, however they go
        {"prompt": "n0", "chosen": "x", "rejected": "y", "gold": False, "annotations": _ann(A="rejected", B="rejected")},
        {"prompt": "n1", "chosen": "x", "rejected": "y", "annotations": _ann(B="rejected", C="rejected")},
    ]
    path = _write(tmp_path / "gold.jsonl", rows)
    gold = audit_preference_data(str(path), progress=False)["gold"]
    # by hand: A labels g0..g3 and is right on 3 of 4; B labels g0, g1 and is right on 1 of 2; C no gold row
    assert (gold["rows"], gold["annotated_rows"], gold["labels"]) == (5, 4, 6)
    assert gold["accuracy"] == pytest.approx(4 / 6)
    per = {a["annotator"]: a for a in gold["per_annotator"]}
    assert set(per) == {"A", "B"}
    assert (per["A"]["correct"], per["A"]["gold_labels"], per["A"]["accuracy"]) == (3, 4, 0.75)
    assert (per["B"]["correct"], per["B"]["gold_labels"], per["B"]["accuracy"]) == (1, 2, 0.5)
    # Wilson's interval for 3 of 4, by hand: z^2 = 3.8415, centre (0.75 + z^2/8) / (1 + z^2/4) = 0.6275,
    # half-width z sqrt(0.75 * 0.25 / 4 + z^2 / 64) / (1 + z^2/4) = 0.3269
    lo, hi = per["A"]["accuracy_ci95"]
    assert (round(lo, 3), round(hi, 3)) == (0.301, 0.954)
    # the same rows as Python objects give the same section; rows without gold give none
    assert audit_preference_data(rows, progress=False)["gold"] == gold
    assert audit_preference_data(rows[5:], progress=False)["gold"] is None
    assert main(["data", "audit", str(path), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "5 gold rows, 4 with annotations; accuracy of all 6 labels on them 0.667" in text
    assert "GOLD-CORRECT  GOLD-ACCURACY (95% CI)" in text
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("  ") and line.split()}
    assert lines["A"].endswith("      3/4     0.750 (0.301..0.954)") and lines["B"].endswith("1/2     0.500 (0.095..0.905)")
    assert lines["C"].endswith("           -  -")  # labels no gold row


@pytest.mark.parametrize("value", ["yes", 1, [True]])
def test_a_bad_gold_marker_names_the_row_and_line(tmp_path, capsys, value):
    rows = [{"prompt": "p", "chosen": "a", "rejected": "b", "gold": True},
            {"prompt": "q", "chosen": "c", "rejected": "d", "gold": value}]
    path = _write(tmp_path / "bad.jsonl", rows)
    message = f"row 1 (line 2) field 'gold' is {value!r}; expected true (the row's chosen is the known right answer)"
    with pytest.raises(AuditError, match=re.escape(message)):
        audit_preference_data(str(path), progress=False)
    with pytest.raises(AuditError, match=r"rows: row 1 field 'gold'"):
        audit_preference_data(rows, progress=False)
    assert main(["data", "audit", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("offline-plugins: error:") and message in err


def _length_rows():
    """Pairs whose length difference d = len(chosen) - len(rejected) is -4, -2, -1, 0, 1, 2, 3, 6.

    The chosen is always the "good..." answer, so a content scorer is always right."""
    out = []
    for d in (-4, -2, -1, 0, 1, 2, 3, 6):
        out.append({"prompt": "Q:", "chosen": "good" + "!" * (6 + d), "rejected": "bad!" + "!" * 6})
    return out


def test_length_bucketed_accuracy_of_a_hand_made_scorer():
    rows = _length_rows()

    def length_lover(prompt, response):  # rewards length alone
        return float(len(response))

    def reader(prompt, response):  # rewards the content
        return 1.0 if response.startswith("good") else 0.0

    m = audit_preference_data(rows, model=length_lover, progress=False)["model"]
    assert m["algorithm"] == "function" and m["path"].endswith("length_lover") and m["pairs_scored"] == 8
    # by hand: |d| of the unequal pairs 4, 2, 1, 1, 2, 3, 6 -> sorted 1 1 2 2 3 4 6, median t = 2;
    # margin = d, right when d > 0: d < -2 {-4} 0/1; -2 <= d < 0 {-2, -1} 0/2; d = 0 0/1 (a zero
    # margin does not rank the chosen first); 0 < d <= 2 {1, 2} 2/2; d > 2 {3, 6} 2/2
    lb = m["length_buckets"]
    assert lb["threshold"] == 2.0
    got = [(b["bucket"], b["pairs"], b["accuracy"]) for b in lb["buckets"]]
    assert got == [("d < -2", 1, 0.0), ("-2 <= d < 0", 2, 0.0), ("d = 0", 1, 0.0), ("0 < d <= 2", 2, 1.0),
                   ("d > 2", 2, 1.0)]
    assert m["accuracy"] == 0.5
    assert lb["buckets"][3]["accuracy_ci95"] == list(wilson_interval(2, 2))
    # a scorer that reads the content is right in every bucket, whatever the length
    m = audit_preference_data(rows, model=reader, progress=False)["model"]
    assert [b["accuracy"] for b in m["length_buckets"]["buckets"]] == [1.0] * 5 and m["accuracy"] == 1.0
    # no pair of unequal length: t = 0 and one non-empty bucket
    same = [{"prompt": "Q:", "chosen": "good", "rejected": "bad!"}]
    m = audit_preference_data(same, model=reader, progress=False)["model"]
    assert [b["pairs"] for b in m["length_buckets"]["buckets"]] == [0, 0, 1, 0, 0]
    assert m["length_buckets"]["buckets"][0]["accuracy"] is None


def test_a_scorer_that_returns_no_number_is_named():
    with pytest.raises(AuditError, match=r"model function .*bad scored row 0 as \[nan, nan\]; expected two finite"):
        def bad(prompt, response):
            return math.nan

        audit_preference_data(_length_rows(), model=bad, progress=False)


def _styled_file_rows(n: int = 200, n_gold: int = 20, seed: int = 0):
    """docs/audit.md's example: the good answer is ``a...``, the bad ``b...``; one response carries
    markdown (a heading, a list item, bold or a code block, by turns in blocks of four rows): the
    chosen in 3 of 4 pairs (``i % 4 != 0``), the rejected in the rest. Rows ``i < n_gold`` are gold; three annotators label every row: A agrees
    with the row's label always, B with probability 0.85, C is a coin flip."""
    rng = random.Random(seed)
    styles = ("# {}", "- {}", "**{}**", "```\n{}\n```")
    rows = []
    for i in range(n):
        chosen, rejected = "a" * rng.randint(3, 12), "b" * rng.randint(3, 12)
        style = styles[i // 4 % len(styles)]
        chosen, rejected = (style.format(chosen), rejected) if i % 4 else (chosen, style.format(rejected))
        who = {"A": True, "B": rng.random() < 0.85, "C": rng.random() < 0.5}
        rows.append({"prompt": "Q:", "chosen": chosen, "rejected": rejected, **({"gold": True} if i < n_gold else {}),
                     "annotations": _ann(**{k: "chosen" if v else "rejected" for k, v in who.items()})})
    return rows


def test_the_documented_example_measures_what_was_planted(tmp_path):
    path = _write(tmp_path / "styled.jsonl", _styled_file_rows())
    report = audit_preference_data(str(path), progress=False)
    st = report["style"]
    assert st["pairs_with_style"] == 200 and st["combined"]["chosen_more"] == 0.75
    assert st["style_only_accuracy"] == 0.75 and st["style_only_rule"] == "more"
    assert sum(st["features"][f]["pairs_differing"] for f in STYLE_FEATURES) == 200
    assert all(st["features"][f]["chosen_more_untied"] == 0.75 for f in STYLE_FEATURES)
    per = {a["annotator"]: a for a in report["gold"]["per_annotator"]}
    assert per["A"]["accuracy"] == 1.0 and per["B"]["accuracy"] > per["C"]["accuracy"]
    assert report["gold"]["rows"] == 20 and per["C"]["gold_labels"] == 20


def _length_labelled_rows(n: int, seed: int):
    """Pairs of random letter strings with nothing to read in them: the chosen is the longer one in
    4 of 5 pairs (``i % 5 != 0``), the shorter in the rest. A model trained on them can learn length only."""
    rng = random.Random(seed)

    def text(k):
        return "".join(rng.choice("abcdefgh") for _ in range(k))

    rows = []
    for i in range(n):
        short, long_ = rng.randint(2, 9), rng.randint(10, 20)
        chosen, rejected = (long_, short) if i % 5 else (short, long_)
        rows.append({"prompt": "Q:", "chosen": text(chosen), "rejected": text(rejected)})
    return rows


@pytest.mark.slow
def test_length_buckets_expose_a_reward_model_that_learned_length(tmp_path, capsys):
    train = _write(tmp_path / "train.jsonl", _length_labelled_rows(400, seed=0))
    held_out = _write(tmp_path / "held_out.jsonl", _length_labelled_rows(200, seed=1))
    out = tmp_path / "rm"
    assert main(["train", "reward-model", "--dataset", str(train), "--model", "tiny", "--steps", "300",
                 "--out", str(out), "--no-progress", "--json"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["data", "audit", str(held_out), "--model", str(out), "--json", "--no-progress"]) == 0
    m = json.loads(capsys.readouterr().out)["model"]
    buckets = {b["bucket"]: b for b in m["length_buckets"]["buckets"]}
    shorter = [b for name, b in buckets.items() if name.startswith(("d <", "-"))]
    longer = [b for name, b in buckets.items() if name.startswith(("0 <", "d >"))]
    # the overall accuracy looks like learning (about the 0.8 that length alone gives) ...
    assert 0.65 <= m["accuracy"] <= 0.85  # 0.750 when written
    # ... but the buckets show it is length: right where the chosen is longer, wrong where it is shorter
    assert sum(b["pairs"] for b in shorter) == 40 and sum(b["pairs"] for b in longer) == 160
    # (0.059, 0.217 and 0.922, 0.860 when written)
    assert all(b["accuracy"] <= 0.35 for b in shorter) and all(b["accuracy"] >= 0.8 for b in longer)
