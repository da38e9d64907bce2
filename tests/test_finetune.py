"""Offline-to-online fine-tuning (``train --online-steps``): the offline phase is the offline run,
rounds collected online are the dataset's layout (normalised, reward-scaled, in order), batches
mix the two at the configured ratio with the loss's columns on both parts, a resume in the online
phase is exact, and what cannot run is refused by name."""

from __future__ import annotations

import pytest
import torch
from torchrl.envs.utils import ExplorationType, set_exploration_type

from offline_plugins.cli import main
from offline_plugins.lightning import build
from offline_plugins.lightning.data import ReplayBufferStream
from offline_plugins.kinds.environment.finetune import FineTuneDataModule, OnlineError, exploration_policy
from offline_plugins.lightning.run import load_checkpoint, train_algorithm

torch.set_num_threads(1)
DATA = "pendulum/medium-replay-v0"
SMALL = {"hidden": [16, 16], "batch_size": 32, "online_frames_per_round": 50, "online_updates_per_round": 10}


@pytest.fixture
def store(minari_store, monkeypatch):
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(minari_store))
    return minari_store


def _parts(algorithm="iql", online_steps=30, offline_steps=5, **config):
    parts = build(algorithm, DATA, config={**SMALL, **config}, online_steps=online_steps,
                  offline_steps=offline_steps, seed=1)
    parts.datamodule.setup("fit")
    return parts


def _pendulum_reward(obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    # gymnasium's Pendulum-v1: -(angle^2 + 0.1 thdot^2 + 0.001 u^2) of the state before the step
    theta = torch.atan2(obs[:, 1], obs[:, 0])
    u = action.clamp(-2.0, 2.0).reshape(-1)
    return -(theta ** 2 + 0.1 * obs[:, 2] ** 2 + 0.001 * u ** 2)


def test_a_round_is_written_in_the_datasets_layout(store):
    parts = _parts()
    dm, data = parts.datamodule, parts.plan.data
    batch = dm.batch_of(5)  # the first online step: round 0 is collected first
    assert dm.collected == 1 and len(dm.buffer) == 50
    rows = dm.buffer.storage.get(range(50))
    stats = data.stats
    # observations normalised as the data layer did: the raw ones give Pendulum's own reward, scaled
    raw = rows["observation"] * stats.obs_scale + stats.obs_loc
    expected = _pendulum_reward(raw.double(), rows["action"].double()) * stats.reward_scale + stats.reward_shift
    torch.testing.assert_close(rows["next", "reward"].reshape(-1).double(), expected, atol=1e-4, rtol=1e-4)
    # in order: each step's next observation is the following step's observation
    torch.testing.assert_close(rows["next", "observation"][:-1], rows["observation"][1:])
    # the round's end cuts the episode (Pendulum's episodes last 200 steps); its id follows the dataset's
    assert rows["next", "truncated"].reshape(-1).tolist() == [False] * 49 + [True]
    assert rows["next", "done"][-1] and not rows["next", "terminated"].any()
    assert set(rows["episode"].tolist()) == {int(data.td["episode"].max()) + 1}
    # return_to_go: the undiscounted sum of the rewards to the round's end
    r = rows["next", "reward"].reshape(-1)
    torch.testing.assert_close(rows["return_to_go"].reshape(-1), r.flip(0).cumsum(0).flip(0))
    # a batch holds round(32 * 0.5) online rows (their episode ids are past the dataset's)
    assert batch.batch_size == torch.Size([32])
    assert int((batch["episode"] > data.td["episode"].max()).sum()) == 16
    assert "index" not in batch.keys()


def test_the_offline_phase_draws_the_offline_runs_batches(store):
    parts = _parts(online_steps=10, offline_steps=3)
    dm = parts.datamodule
    plain = ReplayBufferStream(parts.plan.data.replay_buffer(32, seed=1), seed=1)
    for step in range(3):
        torch.testing.assert_close(dm.batch_of(step)["action"], plain._sample(step)["action"])
    assert dm.collected == 0 and dm.round_of(2) is None and dm.round_of(3) == 0 and dm.round_of(13) == 1
    assert dm.next_boundary(0) == 3 and dm.next_boundary(3) == 13


def test_the_ratio_sets_the_online_share_and_columns_fill_both_parts(store):
    parts = _parts("cal-ql", online_ratio=0.25, gamma=0.5)
    dm, data = parts.datamodule, parts.plan.data
    batch = dm.batch_of(5)
    online = batch["episode"] > data.td["episode"].max()
    assert int(online.sum()) == 8  # round(32 * 0.25)
    # Cal-QL's bound on online rows: the discounted return to the round's end, by hand from its rewards
    rows = dm.buffer.storage.get(range(50))
    torch.testing.assert_close(rows["mc_return"].reshape(-1), _discounted_by_hand(rows, 0.5))
    assert torch.isfinite(batch["mc_return"]).all()
    terms = parts.module.parts.loss(batch)
    assert torch.isfinite(terms["loss_cql"]).all()


def _discounted_by_hand(rows, gamma: float) -> torch.Tensor:
    """The discounted return to the end of the rows (one round), from their rewards."""
    g, expected = 0.0, []
    for reward in reversed(rows["next", "reward"].reshape(-1).tolist()):
        g = reward + gamma * g
        expected.append(g)
    return torch.tensor(expected[::-1])


def test_online_rows_carry_the_monte_carlo_return_the_diagnostics_read(store):
    # IQL's q_data_minus_mc reads mc_return, the return discounted at the loss's gamma: the online
    # rows get it from the loss's columns too, and the mixed batch reports the pair
    parts = _parts("iql", gamma=0.5)
    dm = parts.datamodule
    batch = dm.batch_of(5)
    rows = dm.buffer.storage.get(range(50))
    torch.testing.assert_close(rows["mc_return"].reshape(-1), _discounted_by_hand(rows, 0.5))
    out = parts.module.parts.loss(batch)
    torch.testing.assert_close(out["mc_return_mean"], batch["mc_return"].mean())
    torch.testing.assert_close(out["q_data_minus_mc"], out["q_data_mean"] - out["mc_return_mean"])


def test_a_deterministic_actor_explores_with_gaussian_noise_in_units_of_half_the_range(store):
    parts = _parts("rebrac", exploration_noise=0.1)
    policy = exploration_policy(parts.module.parts, parts.plan.data, 0.1)
    from tensordict import TensorDict

    td = TensorDict({"observation": torch.zeros(20000, 3)}, [20000])
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        mean = policy(td.clone())["action"]
    torch.manual_seed(0)
    with set_exploration_type(ExplorationType.RANDOM):
        noisy = policy(td.clone())["action"]
    # Pendulum's actions lie in [-2, 2]: half the range is 2, so the std is 0.2 (away from the bounds)
    inside = (mean.abs() < 1.0).reshape(-1)
    assert inside.all()
    assert (noisy - mean).std().item() == pytest.approx(0.2, rel=0.05)
    assert noisy.abs().max() <= 2.0


def test_a_run_resumed_in_the_online_phase_ends_as_the_uninterrupted_one(store, tmp_path):
    kw = dict(seed=2, eval_every=0, eval_episodes=1, progress=False, threads=1, overrides=SMALL)
    train_algorithm("iql", DATA, steps=10, online_steps=15, out_dir=tmp_path / "cut", **kw)
    resumed = train_algorithm("iql", DATA, steps=10, online_steps=30, out_dir=tmp_path / "cut", resume=True, **kw)
    straight = train_algorithm("iql", DATA, steps=10, online_steps=30, out_dir=tmp_path / "straight", **kw)
    a, b = load_checkpoint(resumed["checkpoint"]), load_checkpoint(straight["checkpoint"])
    assert a["global_step"] == b["global_step"] == 40
    for k in b["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k
    assert [h["round"] for h in resumed["online_history"]] == [0, 1, 2]
    assert resumed["online_history"] == straight["online_history"]
    assert straight["offline_steps"] == 10 and straight["online_steps"] == 30
    # every transition collected is in the checkpoint
    online = a["FineTuneDataModule"]["online"]
    assert online["observation"].shape[0] == 150



def test_a_run_resumed_in_the_offline_phase_or_after_it_goes_on_online_as_a_straight_run(store, tmp_path):
    kw = dict(seed=3, eval_every=0, eval_episodes=1, progress=False, threads=1, overrides=SMALL)
    straight = train_algorithm("iql", DATA, steps=10, online_steps=20, out_dir=tmp_path / "straight", **kw)
    # stopped in the offline phase (a plain offline run of 6 steps), resumed with the whole plan
    train_algorithm("iql", DATA, steps=6, out_dir=tmp_path / "offline", **kw)
    resumed = train_algorithm("iql", DATA, steps=10, online_steps=20, out_dir=tmp_path / "offline", resume=True, **kw)
    a, b = load_checkpoint(resumed["checkpoint"]), load_checkpoint(straight["checkpoint"])
    assert a["global_step"] == b["global_step"] == 30
    for k in b["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k
    assert resumed["online_history"] == straight["online_history"]

def test_what_cannot_fine_tune_online_is_refused_by_name(store, tmp_path, capsys):
    with pytest.raises(OnlineError, match=r"'bc' has no online phase; fine-tune online with one of awac, cal-ql, iql, rebrac \("):
        build("bc", DATA, online_steps=10, offline_steps=5)
    assert main(["train", "td3-bc", "--dataset", DATA, "--steps", "5", "--online-steps", "5", "--out",
                 str(tmp_path / "x"), "--no-progress"]) != 0
    err = capsys.readouterr().err
    assert "'td3-bc' has no online phase" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_several_processes_are_refused_when_the_data_module_is_set_up(store):
    from types import SimpleNamespace

    parts = build("iql", DATA, config=SMALL, online_steps=10, offline_steps=5)
    dm = parts.datamodule
    dm.trainer = SimpleNamespace(world_size=2, global_rank=0)
    with pytest.raises(OnlineError, match=r"one environment in one process, and this run has 2 processes"):
        FineTuneDataModule.setup(dm, "fit")



@pytest.mark.gpu
def test_fine_tuning_runs_on_cuda_with_the_environment_on_the_cpu(store, tmp_path):
    # the collector steps the Gymnasium env on the CPU and the policy on the GPU; rounds are stored there
    summary = train_algorithm("iql", DATA, steps=5, online_steps=20, out_dir=tmp_path / "cuda", seed=0, eval_every=0,
                              eval_episodes=1, progress=False, accelerator="gpu", devices=1, overrides=SMALL)
    assert summary["steps"] == 25 and len(summary["online_history"]) == 2
    state = load_checkpoint(summary["checkpoint"])
    assert state["FineTuneDataModule"]["online"]["observation"].shape[0] == 100
