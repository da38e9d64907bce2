"""Preference algorithms through the training shell: ``offline-plugins train dpo --dataset ID --model tiny``.

The runs here use small data (a JSONL file the test writes, or the built-in task with
a few SFT steps) so each finishes in seconds; the full built-in dataset is what
docs/results-history.md reports.
"""

from __future__ import annotations

import csv
import json

import pytest
import torch
from _cli_checks import fails_cleanly

from offline_plugins.cli import main

torch.set_num_threads(1)


def _write_pairs(path, n: int, *, start: int = 0):
    # the chosen answer is always "yes", the rejected "no": a preference any policy can learn
    with path.open("w") as fh:
        for i in range(start, start + n):
            fh.write(json.dumps({"prompt": f"{i}*{i}=", "chosen": "yes", "rejected": "no"}) + "\n")
    return path


@pytest.fixture(scope="module")
def small_task_data(tmp_path_factory):
    from offline_plugins.kinds.sft import supervised_finetune
    from offline_plugins.text.data.task_data import task_preference_data
    from offline_plugins.text.tasks import ArithmeticTask

    kw = dict(sft_rows_count=200, sft_steps=30, sft_batch_size=16, n_train=48, n_test=24, num_samples=2,
              cache_dir=tmp_path_factory.mktemp("pref-cache"), finetune=supervised_finetune)
    task = ArithmeticTask(digits=1)
    return {kind: task_preference_data(task, kind=kind, **kw) for kind in ("preference-pairs", "unpaired-feedback")}


def test_dpo_on_a_jsonl_file_learns_the_preference_and_writes_the_run(capsys, tmp_path):
    data = _write_pairs(tmp_path / "pairs.jsonl", 200)
    out = tmp_path / "run"
    code = main(["train", "dpo", "--dataset", str(data), "--model", "tiny", "--steps", "60", "--eval-every", "30",
                 "--set", "lr=3e-3", "--set", "batch_size=8", "--out", str(out), "--no-progress", "--json"])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "dpo" and summary["steps"] == 60
    # held-out prompts, same responses: the implicit reward ranks "yes" over "no" on every pair
    assert summary["preference_accuracy"] == 1.0
    assert summary["kl_to_reference"] > 0
    assert summary["exact_match_before"] is None and summary["exact_match_after"] is None  # no task to score
    with (out / "metrics.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["step"] for r in rows if r.get("eval/preference_accuracy")] == ["29", "59"]
    assert (out / "learning_curve.png").stat().st_size > 0 and (out / "checkpoints" / "last.ckpt").is_file()

    # the trained policy loads back with transformers and prefers the chosen answer
    from offline_plugins.modules.causal_lm import CausalLMLogProbs
    from offline_plugins.modules.tiny_lm import load_causal_lm

    model, tok = load_causal_lm(out / "model")
    from offline_plugins.text.data.preference import tokenize_pairs

    td, _ = tokenize_pairs([{"prompt": "7*8=", "chosen": "yes", "rejected": "no"}], tok)
    lp = CausalLMLogProbs(model).log_probs(td["tokens", "full"], td["masks", "all_attention_mask"])
    resp = (lp * td["masks", "all_assistant_mask"]).sum(-1)
    assert resp[0, 0] > resp[0, 1]

    # eval re-scores the checkpoint to the same held-out accuracy
    capsys.readouterr()
    assert main(["eval", str(out / "checkpoints" / "last.ckpt"), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["preference_accuracy"] == summary["preference_accuracy"]
    assert again["kl_to_reference"] == pytest.approx(summary["kl_to_reference"], rel=1e-4)


@pytest.mark.parametrize("algorithm", ["dpo", "kto", "orpo", "reward-model"])
def test_task_runs_report_exact_match_before_and_after(small_task_data, tmp_path, algorithm):
    from offline_plugins.lightning.run import train_algorithm

    kind = "unpaired-feedback" if algorithm == "kto" else "preference-pairs"
    summary = train_algorithm(algorithm, small_task_data[kind], steps=6, eval_every=3, out_dir=tmp_path / "run",
                    progress=False, overrides={"batch_size": 4})
    acc = summary["preference_accuracy"]
    assert acc is not None and 0.0 <= acc <= 1.0
    assert len(summary["eval_history"]) == 2
    if algorithm == "reward-model":
        # a reward model ranks pairs; it does not answer prompts
        assert summary["exact_match_after"] is None and summary["kl_to_reference"] is None
        assert summary["model_dir"] is None
    else:
        assert 0.0 <= summary["exact_match_before"] <= 1.0 and 0.0 <= summary["exact_match_after"] <= 1.0
        assert summary["kl_to_reference"] >= 0.0
        assert (tmp_path / "run" / "model" / "config.json").is_file()


def test_kto_reads_a_paired_file_as_desirable_and_undesirable_rows(tmp_path):
    from offline_plugins.text.data.preference_sources import load_preference_source

    data = load_preference_source(str(_write_pairs(tmp_path / "p.jsonl", 60)), kind="unpaired-feedback",
                                  cache_dir=tmp_path / "cache", progress=False)
    n_pairs = data.train.batch_size[0] // 2
    assert data.kind == "unpaired-feedback" and data.train["label"].sum() == n_pairs
    assert data.test_pairs is not None and data.test_pairs.batch_dims == 2  # scored on held-out pairs
    assert n_pairs + data.test_pairs.batch_size[0] == 60


def test_preference_algorithm_on_a_minari_dataset(capsys, tmp_path):
    fails_cleanly(capsys, tmp_path, "dpo", "--dataset", "pendulum/medium-v0",
                   match="dpo trains on preference data, but 'pendulum/medium-v0' is not one")


def test_offline_rl_algorithm_on_a_preference_dataset(capsys, tmp_path):
    fails_cleanly(capsys, tmp_path, "iql", "--dataset", "arithmetic/preference-v0",
                   match="is a preference dataset")


def test_model_flag_for_an_offline_rl_algorithm(capsys, tmp_path):
    fails_cleanly(capsys, tmp_path, "iql", "--dataset", "pendulum/medium-v0", "--model", "tiny",
                   match="--model applies to preference algorithms")


def test_missing_file_and_unpaired_rows_for_dpo(capsys, tmp_path):
    fails_cleanly(capsys, tmp_path, "dpo", "--dataset", str(tmp_path / "nope.jsonl"), match="does not exist")
    rows = tmp_path / "unpaired.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1=", "completion": "2", "label": True}) + "\n")
    fails_cleanly(capsys, tmp_path, "dpo", "--dataset", str(rows), match="holds unpaired (prompt, completion, label) rows")


def test_bad_row_and_bad_model(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1=", "chosen": "2"}) + "\n")
    fails_cleanly(capsys, tmp_path, "dpo", "--dataset", str(bad), match="row 0 lacks field(s) ['rejected']")
    good = _write_pairs(tmp_path / "good.jsonl", 4)
    fails_cleanly(capsys, tmp_path, "dpo", "--dataset", str(good), "--model", str(tmp_path / "no-model"),
                   match="cannot load model")
