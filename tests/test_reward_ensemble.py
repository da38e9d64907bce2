"""Reward-model ensembles: K heads, each on its own bootstrap; mean, min or mean - k std for RL."""

from __future__ import annotations

import json

import pytest
import torch
from tensordict import TensorDict

from offline_plugins.cli import main
from offline_plugins.modules.causal_lm import CausalLMReward, aggregate_rewards
from offline_plugins.modules.tiny_lm import load_causal_lm
from offline_plugins.objectives.llm import BradleyTerryLoss

torch.set_num_threads(1)


def _pairs(n: int = 6, length: int = 8, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, 40, (n, 2, length), generator=g)
    attn = torch.ones(n, 2, length, dtype=torch.bool)
    attn[:, 1, -2:] = False  # rejected rows are shorter: the last real token is found from the mask
    return TensorDict({"tokens": {"full": tokens}, "masks": {"all_attention_mask": attn}}, [n, 2])


def test_aggregates_against_hand_computation():
    heads = torch.tensor([[0.0, 2.0, 4.0], [1.0, 1.0, 1.0]])
    # mean 2, population std sqrt(8/3); the second row agrees, so every aggregate is 1
    assert aggregate_rewards(heads, "mean").tolist() == [2.0, 1.0]
    assert aggregate_rewards(heads, "min").tolist() == [0.0, 1.0]
    lcb = aggregate_rewards(heads, "lcb", k=0.5)
    assert lcb[0].item() == pytest.approx(2.0 - 0.5 * (8 / 3) ** 0.5) and lcb[1].item() == 1.0
    with pytest.raises(ValueError, match="aggregate must be one of mean, min, lcb"):
        aggregate_rewards(heads, "max")


def test_heads_share_the_backbone_and_the_reward_is_their_aggregate():
    torch.manual_seed(0)
    net = CausalLMReward(load_causal_lm("tiny", seed=0)[0], heads=3, aggregate="min")
    td = net(_pairs())
    heads = td["reward_heads"]
    assert heads.shape == (6, 2, 3) and not torch.allclose(heads[..., 0], heads[..., 1])  # heads start apart
    assert torch.equal(td["reward"], heads.amin(-1))
    assert torch.equal(net.rewards(td["tokens", "full"], td["masks", "all_attention_mask"]), heads.amin(-1))
    single = CausalLMReward(load_causal_lm("tiny", seed=0)[0])
    assert single.head.weight.shape[0] == 1 and "reward_heads" not in single(_pairs()).keys()


def test_each_head_minimises_its_own_bootstrap_weighted_loss():
    torch.manual_seed(0)
    net = CausalLMReward(load_causal_lm("tiny", seed=0)[0], heads=4)
    loss = BradleyTerryLoss(net)
    batch = _pairs()
    torch.manual_seed(7)
    out = loss(batch)
    # by hand: the same Poisson(1) weights, drawn from the same seed, per pair and head
    with torch.no_grad():
        heads = net.head_rewards(batch["tokens", "full"], batch["masks", "all_attention_mask"])
    per = -torch.nn.functional.logsigmoid(heads[:, 0] - heads[:, 1])
    torch.manual_seed(7)
    w = torch.poisson(torch.ones_like(per))
    expected = ((w * per).sum(0) / w.sum(0).clamp_min(1.0)).mean()
    assert out["loss_reward"].item() == pytest.approx(expected.item(), rel=1e-5)
    assert out["ensemble_std"].item() == pytest.approx(heads.std(-1, correction=0).mean().item(), rel=1e-5)
    plain = BradleyTerryLoss(net, bootstrap=False)(batch)["loss_reward"]
    assert plain.item() == pytest.approx(per.mean().item(), rel=1e-5)
    # every head gets its own gradient
    out["loss_reward"].backward()
    assert (net.head.weight.grad.abs().sum(-1) > 0).all()


def test_cli_trains_an_ensemble_and_refuses_bad_settings(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OFFLINE_PLUGINS_CACHE", str(tmp_path / "cache"))
    rows = [{"prompt": f"q{i}=", "chosen": "good", "rejected": "bad" * (1 + i % 3)} for i in range(240)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "rm"
    code = main(["train", "reward-model", "--dataset", str(data), "--model", "tiny", "--steps", "30",
                 "--set", "ensemble=3", "--set", "aggregate=lcb", "--log-every", "10", "--out", str(out), "--no-progress",
                 "--threads", "1"])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["ensemble"] == 3 and summary["preference_accuracy"] > 0.9
    assert "train/ensemble_std" in summary["losses"]
    capsys.readouterr()
    assert main(["eval", str(out / "checkpoints" / "last.ckpt"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["preference_accuracy"] == summary["preference_accuracy"]
    for bad, says in (("ensemble=0", "ensemble must be a whole number >= 1"), ("aggregate=max", "aggregate must be")):
        code = main(["train", "reward-model", "--dataset", str(data), "--model", "tiny", "--steps", "2",
                     "--set", bad, "--out", str(tmp_path / "bad"), "--no-progress"])
        err = capsys.readouterr().err
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err

