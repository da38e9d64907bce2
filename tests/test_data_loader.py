"""Loading Minari datasets into TED TensorDicts and TorchRL replay buffers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

minari = pytest.importorskip("minari")

from offline_plugins.data import DataStatistics, load_offline_data  # noqa: E402
from offline_plugins.data.store import make_dataset  # noqa: E402

MEDIUM = "offline-plugins/pendulum/medium-v0"


@pytest.fixture(scope="module")
def pendulum(minari_store):
    """Tiny Pendulum datasets (3 episodes of 200 steps) in both Minari formats."""
    make_dataset(MEDIUM, episodes=3, progress=False, force=True)
    make_dataset("offline-plugins/pendulum/random-v0", episodes=3, progress=False, force=True, data_format="arrow")
    return minari_store


@pytest.mark.parametrize("dataset_id", [MEDIUM, "offline-plugins/pendulum/random-v0"], ids=["hdf5", "arrow"])
def test_values_equal_minari_step_for_step(pendulum, dataset_id):
    data = load_offline_data(dataset_id, progress=False)
    ds = minari.load_dataset(dataset_id)
    assert ds.storage.metadata["data_format"] == ("hdf5" if dataset_id == MEDIUM else "arrow")
    start = 0
    for ep in ds.iterate_episodes():
        T = len(ep.rewards)
        rows = data.td[start : start + T]
        np.testing.assert_array_equal(rows["observation"].numpy(), ep.observations[:-1])
        np.testing.assert_array_equal(rows["next", "observation"].numpy(), ep.observations[1:])
        np.testing.assert_array_equal(rows["action"].numpy(), ep.actions)
        np.testing.assert_array_equal(rows["next", "reward"].squeeze(-1).numpy(), ep.rewards.astype(np.float32))
        np.testing.assert_array_equal(rows["next", "terminated"].squeeze(-1).numpy(), ep.terminations)
        np.testing.assert_array_equal(rows["next", "truncated"].squeeze(-1).numpy(), ep.truncations)
        assert (rows["episode"] == ep.id).all()
        start += T
    assert start == len(data) == ds.total_steps
    # torchrl 0.14.1's MinariExperienceReplay returns zeros from local data; ours must not
    assert data.td["observation"].abs().sum() > 0


def test_ted_layout_specs_and_scores(pendulum):
    data = load_offline_data(MEDIUM, progress=False)
    td = data.td
    N = len(data)
    assert td.batch_size == torch.Size([N]) and N == 600
    assert td["next", "reward"].shape == (N, 1) and td["return_to_go"].shape == (N, 1)
    for key in ("done", "terminated", "truncated"):
        assert td["next", key].dtype == torch.bool and td["next", key].shape == (N, 1)
    assert td["episode"].dtype == torch.int64
    assert data.action_space == "continuous" and data.env_id == "Pendulum-v1"
    assert data.observation_spec.shape == (3,) and data.action_spec.shape == (1,)
    assert data.action_spec.is_in(td["action"][:5]).all()
    assert float(data.action_spec.space.high) == 2.0
    # reference scores come from the behaviour-policy card
    assert data.ref_min_score < data.ref_max_score
    expected = 100 * (data.episode_returns - data.ref_min_score) / (data.ref_max_score - data.ref_min_score)
    torch.testing.assert_close(data.normalized_score(data.episode_returns), expected)
    assert data.num_episodes == 3 and int(data.episode_lengths.sum()) == N


def test_return_to_go_and_reward_scaling(pendulum):
    raw = load_offline_data(MEDIUM, progress=False)
    scaled = load_offline_data(MEDIUM, progress=False, reward_scale="iql", reward_shift=-1.0)
    spread = float(raw.episode_returns.max() - raw.episode_returns.min())
    k = 1000.0 / spread
    torch.testing.assert_close(scaled.td["next", "reward"], raw.td["next", "reward"] * k - 1.0)
    assert scaled.reward_scale == pytest.approx(k) and scaled.reward_shift == -1.0
    # return_to_go: undiscounted sum of the training rewards to the episode's end
    r = scaled.td["next", "reward"].squeeze(-1).double()
    ep = scaled.td["episode"]
    for e in ep.unique():
        rows = ep == e
        expected = r[rows].flip(0).cumsum(0).flip(0)
        torch.testing.assert_close(scaled.td["return_to_go"][rows].squeeze(-1).double(), expected, rtol=1e-5, atol=1e-3)
    const = load_offline_data(MEDIUM, progress=False, reward_scale=0.1)
    torch.testing.assert_close(const.td["next", "reward"], raw.td["next", "reward"] * 0.1)


def test_observation_normalisation_and_state_dict(pendulum):
    raw = load_offline_data(MEDIUM, progress=False)
    assert (raw.obs_loc == 0).all() and (raw.obs_scale == 1).all()
    norm = load_offline_data(MEDIUM, progress=False, normalize_observations=True)
    obs = raw.td["observation"]
    torch.testing.assert_close(norm.obs_loc, obs.double().mean(0).float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norm.td["observation"], norm.normalize(obs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norm.td["next", "observation"], norm.normalize(raw.td["next", "observation"]), rtol=1e-5, atol=1e-5)
    # a checkpoint restores evaluation exactly, without the dataset
    state = norm.state_dict()
    path_like = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}
    restored = DataStatistics.from_state_dict(path_like)
    torch.testing.assert_close(restored.normalize(obs), norm.normalize(obs))
    assert restored.normalized_score(torch.tensor([restored.ref_max_score])).item() == pytest.approx(100.0)
    raw.load_state_dict(state)
    torch.testing.assert_close(raw.normalize(obs), norm.normalize(obs))


def test_random_buffer_is_reproducible_and_shares_storage(pendulum):
    data = load_offline_data(MEDIUM, progress=False)
    a = data.replay_buffer(32, seed=3).sample()
    b = data.replay_buffer(32, seed=3).sample()
    c = data.replay_buffer(32, seed=4).sample()
    assert a.batch_size == torch.Size([32])
    assert torch.equal(a["observation"], b["observation"]) and not torch.equal(a["observation"], c["observation"])
    rb_random = data.replay_buffer(32)
    rb_slice = data.replay_buffer(32, sampler="slice", slice_len=8)
    ptr = data.td["observation"].data_ptr()
    assert rb_random.storage._storage["observation"].data_ptr() == ptr
    assert rb_slice.storage._storage["observation"].data_ptr() == ptr
    assert len(rb_random) == len(data)


def test_slice_sampler_windows(pendulum):
    data = load_offline_data(MEDIUM, progress=False)
    batch = data.replay_buffer(40, sampler="slice", slice_len=10, seed=0).sample()
    windows = batch.reshape(4, 10)
    for w in windows.unbind(0):
        assert (w["episode"] == w["episode"][0]).all()
        # consecutive steps: each next observation is the following observation
        torch.testing.assert_close(w["next", "observation"][:-1], w["observation"][1:])
    assert "return_to_go" in batch.keys()


def test_slice_sampler_bad_arguments(pendulum):
    data = load_offline_data(MEDIUM, progress=False)
    with pytest.raises(minari_error(), match="multiple of slice_len"):
        data.replay_buffer(30, sampler="slice", slice_len=8)
    with pytest.raises(minari_error(), match="no episode has 500 steps"):
        data.replay_buffer(500, sampler="slice", slice_len=500)
    with pytest.raises(minari_error(), match="sampler must be"):
        data.replay_buffer(8, sampler="prioritized")


def test_make_env_recovers_the_evaluation_env(pendulum):
    data = load_offline_data(MEDIUM, progress=False)
    env = data.make_env()
    obs, _ = env.reset(seed=0)
    assert env.spec.id == "Pendulum-v1" and obs.shape == (3,)
    env.close()


def test_short_ids_and_device(pendulum):
    data = load_offline_data("pendulum/medium-v0", device="cpu", progress=False)
    assert data.dataset_id == MEDIUM and data.td.device == torch.device("cpu")


def minari_error():
    from offline_plugins.data.errors import DatasetError

    return DatasetError


@pytest.mark.gpu
def test_cuda_storage_and_batches(pendulum):
    data = load_offline_data(MEDIUM, device="cuda", normalize_observations=True, progress=False)
    assert data.td.device.type == "cuda" and data.obs_loc.device.type == "cuda"
    for rb in (data.replay_buffer(32, seed=0), data.replay_buffer(32, sampler="slice", slice_len=8, seed=0)):
        batch = rb.sample()
        assert batch["observation"].device.type == "cuda"
    cpu_data = load_offline_data(MEDIUM, progress=False)
    assert cpu_data.replay_buffer(16, device="cuda").sample()["action"].device.type == "cuda"
