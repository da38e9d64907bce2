"""Bad datasets meet a DatasetError naming the dataset, the problem and the fix."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

minari = pytest.importorskip("minari")
gym = pytest.importorskip("gymnasium")
h5py = pytest.importorskip("h5py")

from minari.data_collector import EpisodeBuffer  # noqa: E402

from offline_plugins.data import DatasetError, load_offline_data  # noqa: E402
from offline_plugins.data.store import make_dataset, store_path  # noqa: E402
from offline_plugins.errors import UserError  # noqa: E402

BOX_OBS = gym.spaces.Box(-10, 10, (2,), np.float32)
BOX_ACT = gym.spaces.Box(-1, 1, (1,), np.float32)


def _episode(k, T=5, obs_dim=2, rewards=None, obs=None):
    rng = np.random.default_rng(k)
    return EpisodeBuffer(
        id=k,
        observations=obs if obs is not None else rng.normal(size=(T + 1, obs_dim)).astype(np.float32),
        actions=rng.uniform(-1, 1, size=(T, 1)).astype(np.float32),
        rewards=rewards if rewards is not None else rng.normal(size=T),
        terminations=np.zeros(T, bool),
        truncations=np.r_[np.zeros(T - 1, bool), True],
    )


def _user_dataset(dataset_id, episodes, obs_space=BOX_OBS, act_space=BOX_ACT, **kwargs):
    if dataset_id in minari.list_local_datasets():
        minari.delete_dataset(dataset_id)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return minari.create_dataset_from_buffers(
            dataset_id, episodes, observation_space=obs_space, action_space=act_space, **kwargs
        )


@pytest.fixture()
def offline(monkeypatch, minari_store):
    monkeypatch.setenv("OFFLINE_PLUGINS_OFFLINE", "1")
    return minari_store


def test_dataset_error_is_a_user_error():
    assert issubclass(DatasetError, UserError)


def test_unknown_id_suggests_close_matches(offline):
    with pytest.raises(DatasetError, match=r"unknown dataset 'pendulum/medum-v0'.*Did you mean 'offline-plugins/pendulum/medium-v0'") as e:
        load_offline_data("pendulum/medum-v0", progress=False)
    assert "data list" in str(e.value)


def test_remote_id_offline_says_so(offline):
    with pytest.raises(DatasetError, match=r"mujoco/hopper/expert-v9.*offline mode is set.*minari download"):
        load_offline_data("mujoco/hopper/expert-v9", progress=False)


def test_not_made_and_make_if_missing_false(offline):
    with pytest.raises(DatasetError, match=r"not in the local Minari store; make it with 'offline-plugins data make"):
        load_offline_data("offline-plugins/pendulum/medium-replay-v0", make_if_missing=False, progress=False)


def test_missing_data_file(offline):
    _user_dataset("user/missing-v0", [_episode(0)])
    (store_path() / "user/missing-v0/data/main_data.hdf5").unlink()
    with pytest.raises(DatasetError, match=r"'user/missing-v0'.*main_data.hdf5.*(missing|cannot be opened).*rebuild"):
        load_offline_data("user/missing-v0", progress=False)


def test_corrupt_data_file(offline):
    _user_dataset("user/corrupt-v0", [_episode(0)])
    (store_path() / "user/corrupt-v0/data/main_data.hdf5").write_bytes(b"not an hdf5 file")
    with pytest.raises(DatasetError, match=r"'user/corrupt-v0'.*cannot be (opened|read).*rebuild"):
        load_offline_data("user/corrupt-v0", progress=False)


def test_missing_key(offline):
    _user_dataset("user/nokey-v0", [_episode(0), _episode(1)])
    with h5py.File(store_path() / "user/nokey-v0/data/main_data.hdf5", "a") as f:
        del f["episode_1"]["rewards"]
    with pytest.raises(DatasetError, match=r"'user/nokey-v0'.*rewards"):
        load_offline_data("user/nokey-v0", progress=False)


def test_nonfinite_values_count_and_first_episode(offline):
    bad_rewards = np.array([0.0, np.nan, 1.0, np.inf, 0.0])
    bad_obs = np.zeros((6, 2), np.float32)
    bad_obs[2, 0] = np.nan
    _user_dataset("user/nan-v0", [_episode(0), _episode(1, rewards=bad_rewards), _episode(2), _episode(3, obs=bad_obs)])
    with pytest.raises(DatasetError, match=r"'user/nan-v0' has NaN or infinite.* 4 step\(s\) of 2 episode\(s\) \(first: episode 1\).*drop_nonfinite=True"):
        load_offline_data("user/nan-v0", progress=False)
    with pytest.warns(UserWarning, match="dropped 2 episode"):
        data = load_offline_data("user/nan-v0", drop_nonfinite=True, progress=False)
    assert sorted(data.td["episode"].unique().tolist()) == [0, 2]
    assert data.td["observation"].isfinite().all() and data.td["next", "reward"].isfinite().all()


def test_empty_dataset(offline):
    _user_dataset("user/empty-v0", [])
    with pytest.raises(DatasetError, match=r"'user/empty-v0' is empty \(0 episodes\)"):
        load_offline_data("user/empty-v0", progress=False)


def test_zero_length_episode(offline):
    _user_dataset("user/zero-v0", [_episode(0), _episode(1)])
    # Minari's writer refuses empty episodes, but other tools can write them
    with h5py.File(store_path() / "user/zero-v0/data/main_data.hdf5", "a") as f:
        g = f["episode_1"]
        for key, shape, dtype in [
            ("observations", (1, 2), np.float32),
            ("actions", (0, 1), np.float32),
            ("rewards", (0,), np.float64),
            ("terminations", (0,), bool),
            ("truncations", (0,), bool),
        ]:
            del g[key]
            g.create_dataset(key, data=np.zeros(shape, dtype))
    with pytest.raises(DatasetError, match=r"'user/zero-v0' has 1 zero-length episode\(s\) \(first: episode 1\).*drop_empty_episodes=True"):
        load_offline_data("user/zero-v0", progress=False)
    with pytest.warns(UserWarning, match="zero-length"):
        data = load_offline_data("user/zero-v0", drop_empty_episodes=True, progress=False)
    assert data.num_episodes == 1 and len(data) == 5


def test_dict_observations_are_flattened(offline):
    space = gym.spaces.Dict({"pos": gym.spaces.Box(-1, 1, (2,), np.float32), "vel": gym.spaces.Box(-1, 1, (3,), np.float32)})
    eps = []
    for k in range(2):
        obs = {"pos": np.full((4, 2), k, np.float32), "vel": np.arange(12, dtype=np.float32).reshape(4, 3)}
        eps.append(
            EpisodeBuffer(id=k, observations=obs, actions=np.zeros((3, 1), np.float32), rewards=np.ones(3),
                          terminations=np.array([0, 0, 1], bool), truncations=np.zeros(3, bool))
        )
    _user_dataset("user/dict-v0", eps, obs_space=space)
    data = load_offline_data("user/dict-v0", progress=False)
    assert data.observation_spec.shape == (5,) and data.dict_observation_keys == ["pos", "vel"]
    np.testing.assert_array_equal(data.td["observation"][0].numpy(), [0, 0, 0, 1, 2])
    np.testing.assert_array_equal(data.td["next", "observation"][3].numpy(), [1, 1, 3, 4, 5])


def test_unsupported_dict_leaf(offline):
    space = gym.spaces.Dict({"pos": gym.spaces.Box(-1, 1, (2,), np.float32), "mode": gym.spaces.Discrete(3)})
    obs = {"pos": np.zeros((3, 2), np.float32), "mode": np.zeros(3, np.int64)}
    ep = EpisodeBuffer(id=0, observations=obs, actions=np.zeros((2, 1), np.float32), rewards=np.ones(2),
                       terminations=np.array([0, 1], bool), truncations=np.zeros(2, bool))
    _user_dataset("user/dictbad-v0", [ep], obs_space=space)
    with pytest.raises(DatasetError, match=r"'user/dictbad-v0': observation space Dict.*not supported; supported are Box, and Dict or Tuple spaces of Box"):
        load_offline_data("user/dictbad-v0", progress=False)


def test_discrete_actions_categorical_and_one_hot(offline):
    act = gym.spaces.Discrete(3)
    ep = EpisodeBuffer(id=0, observations=np.zeros((4, 2), np.float32), actions=np.array([0, 2, 1]), rewards=np.ones(3),
                       terminations=np.array([0, 0, 1], bool), truncations=np.zeros(3, bool))
    _user_dataset("user/discrete-v0", [ep], act_space=act)
    data = load_offline_data("user/discrete-v0", progress=False)
    assert data.action_space == "discrete" and data.td["action"].tolist() == [0, 2, 1]
    assert type(data.action_spec).__name__ == "Categorical" and data.action_spec.n == 3
    hot = load_offline_data("user/discrete-v0", discrete_actions="one_hot", progress=False)
    assert hot.td["action"].tolist() == [[1, 0, 0], [0, 0, 1], [0, 1, 0]]
    assert type(hot.action_spec).__name__ == "OneHot"


def test_no_env_in_metadata(offline):
    _user_dataset("user/noenv-v0", [_episode(0)])
    data = load_offline_data("user/noenv-v0", progress=False)
    assert data.env_id is None
    with pytest.raises(DatasetError, match=r"'user/noenv-v0' records no environment.*make_env\(env_id="):
        data.make_env()
    env = data.make_env(env_id="Pendulum-v1")
    assert env.spec.id == "Pendulum-v1"
    with pytest.raises(DatasetError, match="no ref_min_score"):
        data.normalized_score(np.array([1.0]))


def test_recipe_option_errors(offline):
    with pytest.raises(DatasetError, match=r"unknown option\(s\) episods"):
        make_dataset("offline-plugins/pendulum/random-v0", episods=2, progress=False)
    make_dataset("offline-plugins/pendulum/random-v0", episodes=1, progress=False, force=True)
    with pytest.raises(DatasetError, match=r"already exists.*--force"):
        make_dataset("offline-plugins/pendulum/random-v0", episodes=1, progress=False)
    with pytest.raises(DatasetError, match="has no recipe"):
        make_dataset("user/noenv-v0", progress=False)


def test_recipe_needing_a_missing_extra(offline, monkeypatch):
    from offline_plugins.data import store

    monkeypatch.setattr(store, "_extra_available", lambda extra: False)
    with pytest.raises(DatasetError, match=r"needs the mujoco extra; install it with: pip install 'offline-plugins\[mujoco\]'"):
        make_dataset("offline-plugins/hopper/medium-v0", progress=False)
