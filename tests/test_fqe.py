"""Fitted Q evaluation (``eval CKPT --ope fqe``): the regression against a hand computation, the
value clip, a value known in closed form recovered and two policies ranked, the held-out split,
``--keep-checkpoints``, and the CLI's line and errors."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from offline_plugins.cli import main
from offline_plugins.data.offline import DataStatistics
from offline_plugins.eval.fqe import FQELoss, OPEError, _episode_split, fitted_q_evaluation
from offline_plugins.modules.networks import make_qvalue

torch.set_num_threads(1)


def _constant_policy(c: float):
    return TensorDictModule(lambda obs: torch.full(obs.shape[:-1] + (1,), c), ["observation"], ["action"])


def _linear_q(w_obs: float, w_act: float, b: float):
    q = make_qvalue(1, 1, ())  # one Linear(2, 1): Q = w_obs * s + w_act * a + b
    linear = [m for m in q.modules() if isinstance(m, torch.nn.Linear)][0]
    with torch.no_grad():
        linear.weight.copy_(torch.tensor([[w_obs, w_act]]))
        linear.bias.fill_(b)
    return q


def test_the_regression_against_a_hand_computation():
    loss = FQELoss(_linear_q(1.0, 2.0, 0.5), _constant_policy(0.25), gamma=0.5)
    batch = TensorDict({"observation": torch.tensor([[1.0], [0.0]]), "action": torch.tensor([[1.0], [-1.0]]),
                        ("next", "observation"): torch.tensor([[2.0], [3.0]]),
                        ("next", "reward"): torch.tensor([[1.0], [-1.0]]),
                        ("next", "terminated"): torch.tensor([[False], [True]])}, [2])
    out = loss(batch)
    # Q(s, a): 1 + 2 + .5 = 3.5 and 0 - 2 + .5 = -1.5
    # targets: 1 + .5 * Q(2, .25) = 1 + .5 * (2 + .5 + .5) = 2.5; the terminated row: -1
    assert out["q_mean"].item() == pytest.approx((3.5 - 1.5) / 2)
    assert out["target_mean"].item() == pytest.approx((2.5 - 1.0) / 2)
    assert out["loss_qvalue"].item() == pytest.approx(((3.5 - 2.5) ** 2 + (-1.5 + 1.0) ** 2) / 2)
    out["loss_qvalue"].backward()
    # the target network's copy gets no gradient; the online one does
    assert all(p.grad is None for p in loss.target_qvalue_network_params.values(True, True))


def test_bootstrapped_values_are_clipped_into_the_range_of_returns():
    loss = FQELoss(_linear_q(0.0, 0.0, 100.0), _constant_policy(0.0), gamma=0.5, value_range=(-4.0, 2.0))
    batch = TensorDict({"observation": torch.zeros(1, 1), "action": torch.zeros(1, 1),
                        ("next", "observation"): torch.zeros(1, 1), ("next", "reward"): torch.ones(1, 1),
                        ("next", "terminated"): torch.zeros(1, 1, dtype=torch.bool)}, [1])
    assert loss(batch)["target_mean"].item() == pytest.approx(1.0 + 0.5 * 2.0)
    with pytest.raises(OPEError, match=r"gamma must lie in \[0, 1\), got 1.0"):
        FQELoss(_linear_q(0, 0, 0), _constant_policy(0.0), gamma=1.0)


def _action_cost_data(episodes: int = 24, length: int = 20, seed: int = 0):
    """Reward -a^2 for the action taken, random states and uniform actions in [-1, 1], never terminated:
    a policy always acting c is worth -c^2 / (1 - gamma) from every state."""
    g = torch.Generator().manual_seed(seed)
    n = episodes * length
    obs = torch.randn(n + episodes, 1, generator=g)
    action = torch.rand(n, 1, generator=g) * 2 - 1
    episode = torch.arange(n) // length
    last = (torch.arange(n) % length == length - 1).unsqueeze(-1)
    td = TensorDict({"observation": obs[:n], "action": action, "episode": episode,
                     ("next", "observation"): obs[1:n + 1], ("next", "reward"): -action ** 2,
                     ("next", "done"): last, ("next", "terminated"): torch.zeros(n, 1, dtype=torch.bool),
                     ("next", "truncated"): last}, [n])
    stats = DataStatistics(obs_loc=torch.zeros(1), obs_scale=torch.ones(1))
    return SimpleNamespace(td=td, stats=stats, dataset_id="toy/action-cost-v0",
                           normalized_score=stats.normalized_score)


def test_a_value_known_in_closed_form_is_recovered_and_two_policies_ranked():
    data = _action_cost_data()
    kw = dict(gamma=0.8, steps=1500, hidden=(32, 32), batch_size=128, held_out=0.25)
    still = fitted_q_evaluation(_constant_policy(0.0), data, **kw)
    pushing = fitted_q_evaluation(_constant_policy(0.9), data, **kw)
    # -0.81 / (1 - 0.8) = -4.05; the resting policy is worth 0
    assert pushing["value"] == pytest.approx(-4.05, abs=0.6)
    assert abs(still["value"]) < 0.6
    assert still["held_out_episodes"] == 6 and still["fit_episodes"] == 18
    # the held-out episodes' own returns, summed here from their rewards
    _, out = _episode_split(data.td["episode"], 0.25, seed=0)
    held = data.td[out]
    sums = [float(held["next", "reward"][held["episode"] == e].sum()) for e in held["episode"].unique()]
    assert still["data_return"] == pytest.approx(sum(sums) / len(sums), rel=1e-5)
    assert still["normalized_score_estimate"] is None  # no reference scores in this data
    assert math.isfinite(still["return_estimate"])


def test_the_split_holds_whole_episodes_out_and_needs_two():
    episode = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3])
    fit, out = _episode_split(episode, 0.5, seed=0)
    assert (fit ^ out).all()
    held = set(episode[out].tolist())
    assert len(held) == 2 and not held & set(episode[fit].tolist())
    with pytest.raises(OPEError, match=r"needs at least 2 episodes.*has 1"):
        _episode_split(torch.zeros(5, dtype=torch.long), 0.2, seed=0)


@pytest.fixture
def store(minari_store, monkeypatch):
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(minari_store))
    return minari_store


def test_kept_checkpoints_are_estimated_from_the_cli_without_an_environment(store, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert main(["train", "bc", "--dataset", "pendulum/medium-replay-v0", "--steps", "20", "--checkpoint-every", "10",
                 "--keep-checkpoints", "--eval-episodes", "1", "--set", "hidden=[16]", "--out", str(out),
                 "--no-progress"]) == 0
    kept = sorted(p.name for p in (out / "checkpoints").glob("step=*.ckpt"))
    assert kept == ["step=10.ckpt", "step=20.ckpt"]
    capsys.readouterr()

    # no environment may be made: an estimate that reached for one would fail here
    import offline_plugins.data.offline as offline

    def no_env(*a, **k):
        raise AssertionError("FQE made an environment")

    monkeypatch.setattr(offline.OfflineData, "make_env", no_env)
    assert main(["eval", str(out / "checkpoints" / "step=10.ckpt"), "--ope", "fqe", "--ope-steps", "20"]) == 0
    line = capsys.readouterr().out
    assert "bc on offline-plugins/pendulum/medium-replay-v0, step 10, by FQE (20 steps): estimated normalised" in line
    assert "no environment was run" in line
    assert main(["eval", str(out / "checkpoints" / "last.ckpt"), "--ope", "mc"]) != 0
    err = capsys.readouterr().err
    assert "unknown --ope method 'mc'; the one there is: fqe" in err and "Traceback" not in err
