"""A judge from a third-party plugin: the example package's ``arith`` judge is discovered through its entry
point, listed, and labels pairs by its criterion (the last number against the prompt's chain)."""

from __future__ import annotations

import json

import pytest

from offline_plugins.cli import main
from offline_plugins.plugins import load_registry

from test_plugins import AWR_PROVIDER, needs_awr

pytestmark = needs_awr


def test_the_example_plugin_registers_the_arithmetic_judge(capsys):
    spec = load_registry().judges["arith"]
    assert (spec.provider, spec.version, spec.plugin) == (AWR_PROVIDER, "0.1.0", "awr")
    assert main(["list"]) == 0
    judges = capsys.readouterr().out.split("\njudges")[1].splitlines()
    listed = [line for line in judges if line.startswith("  arith ")]
    assert len(listed) == 1 and AWR_PROVIDER in listed[0]


def test_the_arithmetic_judge_labels_pairs_by_the_chain_value(tmp_path, capsys):
    # 7+5*3-2 left to right: 12, 36, 34; 9-4*2 = 10
    rows = [{"prompt": "7+5*3-2=", "chosen": "7+5=12\n12*3=36\n36-2=33", "rejected": "7+5=12\n12*3=36\n36-2=34"},
            {"prompt": "9-4*2=", "chosen": "9-4=5\n5*2=10", "rejected": "9-4=5\n5*2=11"},
            {"prompt": "9-4*2=", "chosen": "8", "rejected": "12"},  # both wrong: a tie
            {"prompt": "name a colour", "chosen": "red", "rejected": "2"}]  # no chain: a tie
    src, out = tmp_path / "pairs.jsonl", tmp_path / "labelled.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["data", "label", str(src), "--judge", "arith", "--out", str(out), "--json",
                 "--no-progress"]) == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out)
    assert (summary["judge"], summary["decided"], summary["ties"]) == ("arith", 2, 2)
    assert summary["agrees_with_input"] == pytest.approx(0.5)
    labelled = [json.loads(line) for line in out.read_text().splitlines()]
    # the first row was labelled the wrong way round: the judge puts the right answer (34) as chosen
    assert [r["chosen"].splitlines()[-1] for r in labelled] == ["36-2=34", "5*2=10"]
    assert [r["judge"]["agrees_with_input"] for r in labelled] == [False, True]
