"""The gold-reward task of the RLHF over-optimisation study: a length reward on the arithmetic
prompts, its gold-labelled pairs, and the gold score beside the proxy in online evaluation."""

import json

import pytest
import torch

from offline_plugins.errors import UserError
from offline_plugins.text.tasks import ArithmeticTask, LengthTask, TaskError, length_reward, make_task


def test_length_reward_by_hand():
    assert length_reward("", 6) == 0.0
    assert length_reward("12", 6) == pytest.approx(1 - 4 / 6)
    assert length_reward("  123456  ", 6) == 1.0  # surrounding spaces do not count
    assert length_reward("1234567", 6) == pytest.approx(1 - 1 / 6)
    assert length_reward("x" * 12, 6) == 0.0 and length_reward("x" * 30, 6) == 0.0  # never negative
    assert length_reward("abc", 4) == pytest.approx(0.75)
    task = LengthTask(target=6)
    assert task.rewards(["1+2="] * 3, ["3", "3 is 3", "3 is it"]) == [pytest.approx(1 / 6), 1.0, pytest.approx(5 / 6)]
    # the arithmetic task's prompts, answers and SFT reference
    assert task.problems(5, split="test", seed=1) == ArithmeticTask().problems(5, split="test", seed=1)
    assert task.reference_task == ArithmeticTask() and task.name == "arithmetic-2d+-length6"
    assert not task.scores_exact_match and ArithmeticTask.scores_exact_match


class _Tied:
    """A task whose gold reward is the same for every response: every pair ties."""

    name = "tied"

    def problems(self, n, *, split="train", seed=0):
        return ArithmeticTask().problems(n, split=split, seed=seed)

    def rewards(self, prompts, responses):
        return [0.5 for _ in responses]


@pytest.mark.parametrize("vary_length", [True, False])
def test_gold_pairs_agree_with_gold_and_drop_ties(vary_length):
    from offline_plugins.modules.tiny_lm import load_causal_lm
    from offline_plugins.text.data.task_data import gold_preference_rows

    model, tok = load_causal_lm("tiny", seed=0)
    task = LengthTask(target=6)
    rows = gold_preference_rows(task, model, tok, 48, num_samples=2, temperature=1.0, max_new_tokens=5,
                                vary_length=vary_length, seed=0)
    assert rows, "the random tiny model's samples differ in length"
    for r in rows:
        chosen, rejected = task.rewards([r["prompt"]] * 2, [r["chosen"], r["rejected"]])
        assert chosen > rejected  # labelled by gold, no ties kept
        assert len(r["chosen"]) <= 5 and len(r["rejected"]) <= 5  # the budget keeps them under the target
    assert len(rows) <= 48
    if vary_length:  # the cut samples span the budget
        assert len({len(r["chosen"]) for r in rows} | {len(r["rejected"]) for r in rows}) >= 4
    # the same seed gives the same pairs
    assert rows == gold_preference_rows(task, model, tok, 48, num_samples=2, max_new_tokens=5,
                                        vary_length=vary_length, seed=0)
    assert gold_preference_rows(_Tied(), model, tok, 16, num_samples=4, max_new_tokens=5,
                                vary_length=vary_length, seed=0) == []


def test_builtin_gold_pairs_load_for_reward_model_training(monkeypatch, tmp_path):
    from offline_plugins.kinds.sft import supervised_finetune
    from offline_plugins.text.data.preference_sources import BUILTIN_PREFERENCE_DATASETS, load_preference_source

    key = "offline-plugins/arithmetic-length/preference-v0"
    summary, task_settings, data_settings = BUILTIN_PREFERENCE_DATASETS[key]
    assert data_settings["pairs"] == "gold" and data_settings["max_new_tokens"] < task_settings["target"]
    monkeypatch.setitem(BUILTIN_PREFERENCE_DATASETS, key, (summary, task_settings, {
        **data_settings, "n_train": 40, "n_test": 20, "sft_steps": 20, "sft_rows_count": 256}))
    data = load_preference_source("arithmetic-length", kind="preference-pairs", algorithm="reward-model",
                                  cache_dir=tmp_path, progress=False, finetune=supervised_finetune)
    assert data.dataset_id == key and data.train.batch_size[0] > 0 and data.test_pairs.batch_size[0] > 0
    from offline_plugins.audit import _decode_pairs

    task = LengthTask(target=6)
    for r in _decode_pairs(data.train, data.tokenizer) + _decode_pairs(data.test_pairs, data.tokenizer):
        chosen, rejected = task.rewards([r["prompt"]] * 2, [r["chosen"], r["rejected"]])
        assert chosen > rejected
    # its SFT reference is the arithmetic task's, cached under the arithmetic name
    assert any(p.name.startswith("sft-arithmetic-2d+-") and "length" not in p.name for p in tmp_path.iterdir())


def _reward_dir(tmp_path):
    from offline_plugins.modules.causal_lm import CausalLMReward
    from offline_plugins.modules.tiny_lm import load_causal_lm
    from offline_plugins.text.sources.reward_source import save_reward_model

    model, tok = load_causal_lm("tiny", seed=0)
    rm = CausalLMReward(model)
    with torch.no_grad():
        rm.head.bias.fill_(0.25)
    return save_reward_model(rm, tok, tmp_path / "rm" / "reward_model").parent


_SMALL = {"group_size": 1, "prompts_per_round": 4, "max_new_tokens": 8, "eval_prompts": 12,
          "reference_sft_steps": 20}


def test_held_out_gold_is_the_task_verifier_beside_the_reward_model_proxy(tmp_path):
    from offline_plugins.kinds.rollouts import TextRollouts
    from offline_plugins.kinds.sft import supervised_finetune
    from offline_plugins.text.backends.generation import greedy_responses
    from offline_plugins.text.data.rollouts import load_rollout_data

    rm = _reward_dir(tmp_path)
    data = load_rollout_data("arithmetic-length", reward=str(rm), cache_dir=tmp_path / "cache",
                             finetune=supervised_finetune, **_SMALL)
    assert data.gold_key == "heldout_gold"
    scores = data.held_out_scores(data.reference)
    rows = data.source.held_out
    responses = greedy_responses(data.reference, data.tokenizer, [r["prompt"] for r in rows], max_new_tokens=8)
    gold = LengthTask(target=6).rewards([r["prompt"] for r in rows], responses)
    proxy = data.source.reward_fn([r["prompt"] for r in rows], responses)
    assert scores["heldout_gold"] == pytest.approx(sum(gold) / len(gold))
    assert scores["heldout_reward"] == pytest.approx(sum(proxy) / len(proxy), abs=1e-5)
    assert scores["heldout_gold"] != pytest.approx(scores["heldout_reward"])
    assert scores["response_chars"] == pytest.approx(sum(len(r.strip()) for r in responses) / len(responses))
    evaluation = TextRollouts().evaluation(data, every=0, episodes=0, seed=0)
    assert evaluation.monitor.gold == "heldout_gold"
    # without --reward the task's verifier is the reward: no separate gold; the length task's monitor
    # watches the held-out reward, the arithmetic task's exact match
    plain = load_rollout_data("arithmetic-length", cache_dir=tmp_path / "cache", finetune=supervised_finetune,
                              **_SMALL)
    assert plain.gold_key == "heldout_reward" and "heldout_gold" not in plain.held_out_scores(plain.reference)
    assert load_rollout_data("arithmetic", cache_dir=tmp_path / "cache", finetune=supervised_finetune,
                             **_SMALL).gold_key == "exact_match"
    exact = load_rollout_data("arithmetic", reward=str(rm), cache_dir=tmp_path / "cache",
                              finetune=supervised_finetune, **_SMALL)
    s = exact.held_out_scores(exact.reference)
    assert exact.gold_key == "heldout_gold" and s["heldout_gold"] == pytest.approx(s["exact_match"])


def test_ppo_rlhf_run_reports_gold_beside_proxy(tmp_path, monkeypatch, capsys):
    from offline_plugins.cli import main

    monkeypatch.setenv("OFFLINE_PLUGINS_CACHE", str(tmp_path / "cache"))
    rm = _reward_dir(tmp_path)
    out = tmp_path / "ppo"
    args = ["train", "ppo-rlhf", "--dataset", "offline-plugins/arithmetic-length/v0", "--model", "tiny", "--reward",
            str(rm), "--steps", "4", "--eval-every", "2", "--out", str(out), "--no-progress", "--json", "--threads",
            "1", "--set", "batch_size=4", "--set", "ppo_epochs=1"]
    for k, v in _SMALL.items():
        args += ["--set", f"{k}={v}"]
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["gold_key"] == "heldout_gold"
    assert summary["heldout_gold_before"] is not None and summary["heldout_gold_after"] is not None
    assert 0.0 <= summary["heldout_gold_after"] <= 1.0
    history = summary["eval_history"]
    assert [r["step"] for r in history] == [2, 4]
    assert all(r["heldout_gold"] is not None and r["heldout_reward"] is not None for r in history)
    # the monitor judged the proxy against the gold
    best = summary["reward_hacking"]["best_gold"]
    assert best["gold"] in [pytest.approx(r["heldout_gold"]) for r in history]
    from offline_plugins.kinds.rollouts import TextRollouts

    line = TextRollouts().describe(summary)
    assert "held-out gold" in line and "held-out proxy" in line and "held-out exact match" in line


def test_bad_ids_and_settings_are_one_line_errors(tmp_path, capsys):
    from offline_plugins.cli import main
    from offline_plugins.text.data.preference_sources import PreferenceSourceError, load_preference_source
    from offline_plugins.text.data.rollouts import RolloutError, load_rollout_data
    from offline_plugins.text.data.task_data import task_preference_data

    for call, error, pattern in [
        (lambda: make_task("arithmetic-length", target=0), TaskError, r"target must be .* >= 1.*target=6"),
        (lambda: make_task("arithmetic-length", target=6, lenght=3), TaskError, r"its settings are target"),
        (lambda: make_task("length"), TaskError, r"unknown task 'length'; use one of arithmetic, arithmetic-length"),
        (lambda: load_rollout_data("arithmetic-lenght"), RolloutError, r"offline-plugins/arithmetic-length/v0"),
        (lambda: load_preference_source("arithmetic-lenght", kind="preference-pairs", algorithm="reward-model"),
         PreferenceSourceError, r"Did you mean 'arithmetic-length'"),
        (lambda: task_preference_data(LengthTask(), pairs="longer"), UserError, r"pairs must be 'exact-match'"),
    ]:
        with pytest.raises(error, match=pattern) as info:
            call()
        assert "\n" not in str(info.value)
    code = main(["train", "reward-model", "--dataset", "arithmetic-lenght", "--model", "tiny", "--steps", "1",
                 "--out", str(tmp_path / "rm"), "--no-progress", "--threads", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "arithmetic-length" in err and len(err.splitlines()) == 1
