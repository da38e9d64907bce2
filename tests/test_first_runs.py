"""First runs that finish: each built-in task's reference recipe is the one its documented results use, a
reference being made says so in one line, and its progress bar counts its own steps."""

from __future__ import annotations

import pytest
import torch

from offline_plugins.text.data.rollouts import load_rollout_data

torch.set_num_threads(1)


class Recorder:
    """A finetune that records what it was asked for and trains nothing (the reference stays the init)."""

    def __init__(self):
        self.calls = []

    def __call__(self, model, tokenizer, rows, **kwargs):
        self.calls.append({"rows": len(rows), **kwargs})
        return []


@pytest.mark.parametrize("task, steps, budget", [("arithmetic", 2000, 6), ("tool-arithmetic", 130, 40),
                                                 ("tool-python", 130, 56), ("steps-arithmetic", 800, 32),
                                                 ("arithmetic-length", 2000, 12), ("word-problems", 900, 128)])
def test_each_task_makes_its_reference_with_its_documented_steps_and_says_so(task, steps, budget, tmp_path, capsys,
                                                                             monkeypatch):
    if task == "tool-python":  # the sandbox is checked before the reference; this test is about the reference
        monkeypatch.setattr("offline_plugins.text.tools.tools.ToolBox.check", lambda self: None)
    model = "small" if task == "word-problems" else "tiny"  # its stories overrun tiny's 128 positions
    finetune = Recorder()
    data = load_rollout_data(task, model=model, cache_dir=tmp_path, finetune=finetune, eval_prompts=4)
    assert [c["steps"] for c in finetune.calls] == [steps]
    assert data.settings.max_new_tokens == budget  # the response budget its documented results use
    assert finetune.calls[0]["title"] == "reference sft"
    lines = [line for line in capsys.readouterr().err.splitlines() if "SFT reference" in line]
    assert len(lines) == 1
    assert f"{steps} steps of sft" in lines[0] and "reference_sft_steps" in lines[0] and str(tmp_path) in lines[0]
    # the second run reads the cache: nothing trained, one line saying which reference and how it was made
    load_rollout_data(task, model=model, cache_dir=tmp_path, finetune=finetune, eval_prompts=4)
    reused = [line for line in capsys.readouterr().err.splitlines() if "SFT reference" in line]
    assert len(finetune.calls) == 1 and len(reused) == 1 and "making" not in reused[0]
    assert f"{steps} steps, batch 64" in reused[0] and "1 thread on the cpu" in reused[0]


def test_a_set_reference_sft_steps_wins_over_the_tasks_own(tmp_path, capsys):
    finetune = Recorder()
    load_rollout_data("tool-arithmetic", model="tiny", cache_dir=tmp_path, finetune=finetune, eval_prompts=4,
                      reference_sft_steps=7)
    assert [c["steps"] for c in finetune.calls] == [7]


def test_the_reference_progress_bar_counts_its_steps(tmp_path, capsys):
    from offline_plugins.kinds.sft import supervised_finetune
    from offline_plugins.modules.tiny_lm import load_causal_lm
    from offline_plugins.text.tasks import ArithmeticTask

    model, tok = load_causal_lm("tiny", seed=0)
    rows = [{"prompt": p.prompt, "completion": p.answer} for p in ArithmeticTask().problems(64)]
    supervised_finetune(model, tok, rows, steps=16, batch_size=8, progress=True, title="reference sft")
    seen = capsys.readouterr()
    bar = (seen.out + seen.err).replace("\r", "\n")
    assert "reference sft: 100%" in bar and "16/16" in bar
    assert "/-" not in bar  # not Lightning's epoch bar of an unbounded run ("Epoch 0/-2 ... 230/2000")


@pytest.mark.parametrize("algorithm, rows, tiny_lr", [
    ("sft", [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(40)], 3e-3),
    ("dpo", [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i)} for i in range(40)], 1e-3)])
def test_small_from_its_init_takes_a_third_of_tinys_learning_rate(algorithm, rows, tiny_lr, tmp_path):
    import json

    from offline_plugins.lightning.run import train_algorithm

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lrs = {}
    for model in ("tiny", "small"):
        summary = train_algorithm(algorithm, str(path), model=model, steps=1, out_dir=tmp_path / model, progress=False,
                                  threads=1, eval_every=0, overrides={"batch_size": 4})
        lrs[model] = summary["config"]["lr"]
    assert lrs["tiny"] == pytest.approx(tiny_lr) and lrs["small"] == pytest.approx(tiny_lr / 3)


@pytest.mark.parametrize("rows, says", [
    ([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}], "it has a single row"),
    ([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}] * 50,
     "its 50 rows share one prompt.*only 1 of them distinct")])
def test_a_preference_file_without_a_held_out_split_says_why(rows, says, tmp_path, capsys):
    import json
    import re

    from offline_plugins.cli import main

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["train", "dpo", "--dataset", str(path), "--steps", "1", "--no-progress", "--set", "batch_size=1",
                 "--out", str(tmp_path / "run")]) == 0
    seen = capsys.readouterr()
    warning = [line for line in seen.err.splitlines() if "no rows held out" in line]
    assert len(warning) == 1 and re.search(says, warning[0]) and "held-out figures will read n/a" in warning[0]
    assert "held-out preference accuracy n/a" in seen.out


@pytest.mark.parametrize("model, from_scratch, lr", [
    ("tiny", False, 1e-4), ("small", False, 1e-4 / 3), ("/runs/my-sft/model", False, 1e-4),
    ("tiny", True, 1e-3), ("small", True, 1e-3 / 3)])
def test_small_from_its_sft_reference_takes_a_third_of_the_pretrained_learning_rate(model, from_scratch, lr):
    """GRPO's unset ``lr``: the pretrained rate from an SFT reference, the from-scratch rate from a random
    init, each a third for ``small`` (at tiny's 1e-4 GRPO on small's word-problems reference fell below it);
    a model that is not built in keeps the rate."""
    from types import SimpleNamespace

    from offline_plugins.algorithms.llm import resolve_lr
    from offline_plugins.plugins import load_registry

    config = load_registry().algorithm("grpo").default_config()
    assert config.lr is None
    assert resolve_lr(config, SimpleNamespace(model=model, from_scratch=from_scratch), "grpo") == pytest.approx(lr)
    assert config.lr == pytest.approx(lr)  # written back: the summary records the rate used


def test_online_dpo_takes_its_inner_losss_rate_and_a_bad_rate_is_named():
    """Online DPO has no rate of its own: unset, it takes the inner loss's pretrained rate, scaled like every
    other's (a third for ``small``); a rate that is not a positive number names the default to use."""
    from types import SimpleNamespace

    from offline_plugins.algorithms.llm import resolve_lr
    from offline_plugins.errors import UserError
    from offline_plugins.plugins import load_registry

    registry = load_registry()
    inner = registry.algorithm("dpo").default_config()
    config = registry.algorithm("online-dpo").default_config()
    small = SimpleNamespace(model="small", from_scratch=False)
    assert resolve_lr(config, small, "online-dpo", type(inner).pretrained_lr) == pytest.approx(1e-5 / 3)
    config.lr = -1.0
    with pytest.raises(UserError, match=r"online-dpo: lr must be a positive number .* got -1.0; fix it with --set "
                                        r"lr=1e-05"):
        resolve_lr(config, small, "online-dpo", type(inner).pretrained_lr)
