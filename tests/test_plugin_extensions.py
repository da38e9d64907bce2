"""What a third-party plugin adds beside algorithms, with nothing of the package edited: the example
plugin (``examples/third_party_plugin``) registers a text task, a tool, a reward function and a dataset
recipe through the same hooks the built-in ones use, and each trains."""

from __future__ import annotations

import json

import pytest

from offline_plugins.cli import main

pytest.importorskip("offline_plugins_awr", reason="pip install ./examples/third_party_plugin (the README's test "
                    "command does)")

SMALL = ["--set", "group_size=2", "--set", "prompts_per_round=2", "--set", "eval_prompts=4", "--set", "batch_size=4",
         "--no-progress", "--steps", "2", "--seed", "0"]


def test_a_plugins_text_task_is_listed_and_trains_by_its_alias(tmp_path, capsys):
    assert main(["data", "list", "--json"]) == 0
    listed = {t["id"]: t["summary"] for t in json.loads(capsys.readouterr().out)["text_tasks"]}
    assert "awr/reverse/v0" in listed and "offline-plugins/arithmetic/v0" in listed
    out = tmp_path / "grpo-reverse"
    assert main(["train", "grpo", "--dataset", "reverse", "--out", str(out), "--set", "reference_sft_steps=5",
                 *SMALL]) == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"] == "awr/reverse/v0" and summary["steps"] == 2


def test_an_unknown_text_task_names_the_plugins_beside_the_built_in_ones(tmp_path, capsys):
    assert main(["train", "grpo", "--dataset", "revers", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "reverse" in err and "arithmetic" in err and "Traceback" not in err


def test_a_plugins_tool_is_made_from_the_registry_and_a_multiturn_task_trains_with_it(tmp_path, capsys):
    from offline_plugins.text.tools.multiturn import make_tools

    box = make_tools(("calculator", "reverse"))
    assert box.tools["reverse"].run("abc").text == "cba" and box.tools["calculator"].run("6*7").text == "42"
    out = tmp_path / "grpo-tool-reverse"
    assert main(["train", "grpo", "--dataset", "awr/tool-arithmetic-reverse/v0", "--out", str(out),
                 "--set", "reference_sft_steps=5", "--set", "max_new_tokens=40", *SMALL]) == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"] == "awr/tool-arithmetic-reverse/v0"
    assert "rollout/tool_calls" in (out / "metrics.csv").read_text().splitlines()[0]


def test_a_plugins_dataset_recipe_is_made_and_trained_on(tmp_path, capsys, minari_store):
    assert main(["data", "make", "awr/pendulum-still-v0", "--no-progress"]) == 0, capsys.readouterr().err
    out = tmp_path / "awr-still"
    assert main(["train", "awr", "--dataset", "awr/pendulum-still-v0", "--steps", "2", "--eval-episodes", "1",
                 "--out", str(out), "--no-progress", "--threads", "1"]) == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"] == "awr/pendulum-still-v0" and summary["return_mean"] is not None


def test_info_describes_a_text_task_and_a_tool_from_their_records(capsys):
    assert main(["info", "reverse"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("awr/reverse/v0 (text task)") and "offline_plugins_awr.tasks:ReverseTask" in out
    assert main(["info", "reverse", "--json"]) == 0  # the tool shares the name: the text task is found first
    assert json.loads(capsys.readouterr().out)["aliases"] == ["reverse"]
    assert main(["info", "calculator"]) == 0
    assert capsys.readouterr().out.startswith("calculator (tool)")


def test_a_plugins_reward_is_listed_and_trains_by_its_name_alone_and_among_others(tmp_path, capsys):
    assert main(["list", "--json", "--all"]) == 0
    listed = {r["name"]: r for r in json.loads(capsys.readouterr().out)["rewards"]}
    assert listed["letter-overlap"]["plugin"] == "awr" and "answer-format" in listed
    out = tmp_path / "grpo-overlap"
    assert main(["train", "grpo", "--dataset", "reverse", "--reward", "letter-overlap", "--out", str(out),
                 "--set", "reference_sft_steps=5", *SMALL]) == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and 0.0 <= summary["reward_mean"] <= 1.0
    out = tmp_path / "gdpo-overlap"
    assert main(["train", "gdpo", "--dataset", "reverse", "--reward", "exact=task", "--reward", "overlap=letter-overlap",
                 "--out", str(out), "--set", "reference_sft_steps=5", *SMALL]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["train", "grpo", "--dataset", "reverse", "--reward", "letter-overlp", "--out", str(tmp_path / "x"),
                 *SMALL]) != 0
    err = capsys.readouterr().err
    assert "did you mean 'letter-overlap'" in err and "Traceback" not in err
