"""An AI judge as the labeller of online DPO (--judge): the pair is the judge's, both display orders, ties
dropped or weighted, the round's tie rate and agreement logged; the judge registry, list and info."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

from offline_plugins.cli import main

torch.set_num_threads(1)


def shorter(prompt, first, second):
    """Prefers the shorter response (P(first better) 1, 0, or 1/2 for equal lengths): order-consistent."""
    return 0.5 if len(first) == len(second) else float(len(first) < len(second))


def first_shown(prompt, first, second):
    """A fully position-biased judge: whatever is shown first wins."""
    return 1.0


def leans_on_digits(prompt, first, second):
    """Position-biased, with a preference: 0.75 for the first shown, +-0.25 for a digit in either response."""
    digit = lambda text: float(any(c.isdigit() for c in text))  # noqa: E731
    return 0.75 + 0.25 * digit(first) - 0.25 * digit(second)


def _collect(judge, *, judge_ties="drop", group_size=2, prompts=8):
    """One round of the tiny model's rollouts on letter prompts, paired by ``judge``: (rollouts, stats, pairs)."""
    from offline_plugins.eval.judge import FunctionJudge
    from offline_plugins.modules.tiny_lm import load_causal_lm
    from offline_plugins.objectives.llm import DPOLoss
    from offline_plugins.objectives.llm.online_dpo import OnlinePreferenceLoss
    from offline_plugins.text.data.rollouts import PromptSource, RolloutCollector

    model, tok = load_causal_lm("tiny", seed=0)
    # the task's reward: 1 for a response holding a digit
    source = PromptSource("letters", [], lambda ps, rs, **_: [float(any(c.isdigit() for c in r)) for r in rs],
                          "letters", train=[{"prompt": c + "x:"} for c in "abcdefgh"], longest_prompts=["ax:"])
    collector = RolloutCollector(source, tok, model, group_size=group_size, prompts_per_round=prompts,
                                 max_new_tokens=6, seed=0)
    loss = OnlinePreferenceLoss(DPOLoss(reduction="none"), group_size=group_size, judge=FunctionJudge(judge),
                                judge_ties=judge_ties)
    td, stats = collector.collect(model, round=0, process=loss.process_rollouts)
    return td, stats, loss.pair_rollouts(td)


def _texts(td):
    return [str(t) for t in td.get(("text", "response")).tolist()]


def test_the_pair_is_the_judges_chosen_the_shorter():
    td, stats, pairs = _collect(shorter, group_size=3)
    responses, tokens = _texts(td), td["tokens", "full"]
    ties, picked = 0, []
    reward = td["next", "reward"].flatten().tolist()
    for k in range(8):
        lengths = [len(r) for r in responses[3 * k:3 * k + 3]]
        # round robin by hand: the shorter of two wins 1, equal lengths 1/2 each
        wins = [sum(1.0 if lengths[i] < lengths[j] else 0.5 if lengths[i] == lengths[j] else 0.0
                    for j in range(3) if j != i) for i in range(3)]
        if max(wins) == min(wins):
            ties += 1
            assert pairs["pair_weight"][k].tolist() == [0.0, 0.0]
            continue
        best, worst = wins.index(max(wins)), wins.index(min(wins))
        assert pairs["pair_weight"][k].tolist() == [1.0, 1.0]
        assert torch.equal(pairs["tokens", "full"][k, 0], tokens[3 * k + best])
        assert torch.equal(pairs["tokens", "full"][k, 1], tokens[3 * k + worst])
        assert lengths[best] < lengths[worst]
        picked.append((reward[3 * k + best], reward[3 * k + worst]))
    assert 0 < ties < 8  # the test sees both kinds
    assert stats["judge_ties"] == pytest.approx(ties / 8)
    assert stats["groups_without_signal"] == pytest.approx(ties / 8)  # a tie gives no pair
    # agreement with the reward (a digit in the response), by hand over the decided pairs whose rewards differ
    differ = [float(c > r) for c, r in picked if c != r]
    if differ:
        assert stats["judge_agreement"] == pytest.approx(sum(differ) / len(differ))
    else:
        assert math.isnan(stats["judge_agreement"])


def test_a_position_biased_judge_gives_only_ties_dropped_or_weighted_by_its_order_averaged_confidence():
    # always the first shown: every verdict flips with the order, so every pair is a tie
    _, stats, pairs = _collect(first_shown)
    assert stats["judge_ties"] == 1.0 and pairs["pair_weight"].sum().item() == 0.0
    _, stats, pairs = _collect(first_shown, judge_ties="weight")  # P averaged over orders: 1/2, no confidence
    assert stats["judge_ties"] == 1.0 and pairs["pair_weight"].sum().item() == 0.0

    # digits: with a digit in a only, P(a | a first) = 1, P(a | b first) = 1 - 0.5 = 0.5: a tie (no verdict
    # shown second); order-averaged 0.75, so "weight" keeps a as chosen with weight |2 * 0.75 - 1| = 0.5;
    # a digit in both or neither: 0.75 and 0.25, inconsistent, order-averaged 1/2, weight 0
    td, stats, pairs = _collect(leans_on_digits)
    assert stats["judge_ties"] == 1.0 and pairs["pair_weight"].sum().item() == 0.0
    td, stats, pairs = _collect(leans_on_digits, judge_ties="weight")
    responses, tokens = _texts(td), td["tokens", "full"]
    digit = [any(c.isdigit() for c in r) for r in responses]
    one_sided = [k for k in range(8) if digit[2 * k] != digit[2 * k + 1]]
    assert one_sided, "the round must hold a pair with a digit in one response only"
    for k in range(8):
        if k in one_sided:
            assert pairs["pair_weight"][k, 0].item() == pytest.approx(0.5)
            assert torch.equal(pairs["tokens", "full"][k, 0], tokens[2 * k + (0 if digit[2 * k] else 1)])
        else:
            assert pairs["pair_weight"][k, 0].item() == 0.0
    assert stats["groups_without_signal"] == pytest.approx(1 - len(one_sided) / 8)


def test_judge_ties_and_a_judge_without_text_are_refused_by_name():
    from offline_plugins.eval.judge import FunctionJudge
    from offline_plugins.objectives.llm import DPOLoss
    from offline_plugins.objectives.llm.common import PreferenceInputError
    from offline_plugins.objectives.llm.online_dpo import OnlinePreferenceLoss

    with pytest.raises(PreferenceInputError, match="judge_ties must be one of drop, weight, got 'keep'"):
        OnlinePreferenceLoss(DPOLoss(reduction="none"), group_size=2, judge=FunctionJudge(shorter), judge_ties="keep")
    with pytest.raises(PreferenceInputError, match="judge must have compare_many"):
        OnlinePreferenceLoss(DPOLoss(reduction="none"), group_size=2, judge=shorter)
    loss = OnlinePreferenceLoss(DPOLoss(reduction="none"), group_size=2, judge=FunctionJudge(shorter))
    from tensordict import TensorDict

    td = TensorDict({"next": {"reward": torch.zeros(4, 1)}, "group": torch.tensor([0, 0, 1, 1])}, [4])
    with pytest.raises(PreferenceInputError, match=r"a judge reads the rollouts' text at \('text', 'prompt'\)"):
        loss.process_rollouts(td)


def test_online_dpo_trains_on_the_judges_pairs_and_logs_the_tie_rate(prompt_file, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "online-dpo", "--dataset", str(prompt_file), "--model", "tiny", "--reward",
            "_text_rewards:digit_share", "--judge", "test_judge_training:shorter", "--steps", "4", "--threads", "1",
            "--no-progress", "--out", str(out)]
    for k, v in {"group_size": 2, "prompts_per_round": 4, "batch_size": 2, "max_new_tokens": 4,
                 "eval_prompts": 8, "lr": 3e-3}.items():
        args += ["--set", f"{k}={v}"]
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["judge"] == "test_judge_training:shorter" and summary["rounds"] == 2
    rows = [r for r in csv.DictReader((out / "metrics.csv").open()) if r.get("rollout/judge_ties")]
    assert len(rows) == 2  # one per round
    for r in rows:
        ties = float(r["rollout/judge_ties"])
        assert 0.0 <= ties <= 1.0 and float(r["rollout/groups_without_signal"]) == pytest.approx(ties)
        assert "rollout/judge_agreement" in r
    capsys.readouterr()


def test_judge_is_refused_for_grpo_in_one_line(prompt_file, capsys):
    code = main(["train", "grpo", "--dataset", str(prompt_file), "--judge", "rubric", "--steps", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "--judge picks the AI judge" in err and "'grpo' has no such choice" in err and "drop --judge" in err


def test_the_registry_lists_the_judges_and_info_describes_one(capsys):
    from offline_plugins.eval.judge import JudgeError, RubricJudge, judge_from
    from offline_plugins.plugins import load_registry

    registry = load_registry(strict=True)
    assert registry.judge("rubric").judge == "offline_plugins.eval.judge:RubricJudge"
    judge = judge_from("rubric", registry=registry)
    assert isinstance(judge, RubricJudge) and judge.name == "rubric"
    with pytest.raises(JudgeError, match="unknown judge 'rubrik'; did you mean 'rubric'"):
        judge_from("rubrik", registry=registry)
    assert main(["list"]) == 0
    listing = capsys.readouterr().out
    assert "judges (AI feedback" in listing and "\n  rubric  offline-plugins" in listing
    assert main(["info", "rubric"]) == 0
    info = capsys.readouterr().out
    assert info.startswith("rubric (judge): ") and "offline_plugins.eval.judge:RubricJudge" in info
    assert main(["list", "--json", "--all"]) == 0
    judges = json.loads(capsys.readouterr().out)["judges"]  # the built-in ones (the example plugin adds arith)
    assert [j["name"] for j in judges if j["provider"] == "offline-plugins"] == ["rubric"]


def test_a_third_party_plugin_registers_a_function_judge_by_name(tmp_path, monkeypatch):
    from offline_plugins.eval.judge import FunctionJudge, judge_from
    from offline_plugins.plugins import load_registry

    root = tmp_path / "site"
    info = root / "judge_pkg-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: judge-pkg\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[offline_plugins]\nbrevity = judge_pkg_plugin\n")
    (root / "judge_pkg_plugin.py").write_text(
        "from offline_plugins.plugins import JudgeSpec, hookimpl\n\n"
        "def brevity(prompt, first, second):\n    return float(len(first) < len(second))\n\n"
        "@hookimpl\ndef offline_plugins_register_judges(registry):\n"
        "    registry.add(JudgeSpec('brevity', 'the shorter response', 'judge_pkg_plugin:brevity'))\n")
    monkeypatch.syspath_prepend(str(root))
    registry = load_registry(strict=True)
    assert registry.judge("brevity").provider == "judge-pkg"
    judge = judge_from("brevity", registry=registry)
    assert isinstance(judge, FunctionJudge) and judge.name == "brevity"
    assert judge.compare("q", "long answer", "short").verdict == "b"
    assert judge.compare("q", "same", "same").verdict == "tie"  # 0 both ways: an order-dependent verdict
