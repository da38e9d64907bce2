"""Load any Minari dataset into TorchRL's TED layout and replay buffers.

Episodes are read through Minari's own storage API (hdf5 or arrow) rather than
TorchRL's ``MinariExperienceReplay``: in torchrl 0.14.1 its ``load_from_local_minari``
path returns all-zero tensors without an error. ``tests/test_data_loader.py`` checks
our values against Minari's step for step.

>>> import torch
>>> stats = DataStatistics(obs_loc=torch.tensor([1.0]), obs_scale=torch.tensor([2.0]),
...                        ref_min_score=-1000.0, ref_max_score=-200.0)
>>> stats.normalize(torch.tensor([[3.0]]))
tensor([[1.]])
>>> stats.normalized_score(torch.tensor([-600.0]))
tensor([50.])
>>> DataStatistics.from_state_dict(stats.state_dict()).ref_max_score
-200.0
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces
from tensordict import TensorDict
from torchrl.data import (
    Bounded,
    Categorical,
    OneHot,
    RandomSampler,
    SliceSampler,
    TensorDictReplayBuffer,
    TensorStorage,
    Unbounded,
)
from torchrl.data.replay_buffers.writers import ImmutableDatasetWriter

from offline_plugins.data.errors import DatasetError
from offline_plugins.data.ogbench import check_version
from offline_plugins.data.store import (
    dataset_size_bytes,
    is_local,
    make_dataset,
    open_minari_dataset,
    read_minari_episodes,  # here before the store held it
    resolve_dataset_id,
)

__all__ = ["DataStatistics", "OfflineData", "load_offline_data", "read_minari_episodes", "dataset_info"]

_OBS_STD_EPS = 1e-3  # TD3+BC / IQL reference implementations add this to the std


@dataclass
class DataStatistics:
    """Everything needed to evaluate a policy exactly as it was trained: keep it in checkpoints.

    Attributes:
        obs_loc, obs_scale: observations are fed to the policy as ``(obs - loc) / scale``
            (0 and 1 when normalisation is off).
        reward_scale, reward_shift: training rewards are ``reward * scale + shift``.
        ref_min_score, ref_max_score: the dataset's random and expert returns (D4RL).
        dataset_id, env_id: where the statistics came from.
    """

    obs_loc: torch.Tensor
    obs_scale: torch.Tensor
    reward_scale: float = 1.0
    reward_shift: float = 0.0
    ref_min_score: Optional[float] = None
    ref_max_score: Optional[float] = None
    dataset_id: str = ""
    env_id: Optional[str] = None

    def normalize(self, obs: torch.Tensor) -> torch.Tensor:
        """``(obs - obs_loc) / obs_scale``, on ``obs``'s device."""
        return (obs - self.obs_loc.to(obs.device)) / self.obs_scale.to(obs.device)

    def normalized_score(self, returns: Union[torch.Tensor, np.ndarray, float]) -> torch.Tensor:
        """D4RL's normalised score ``100 * (R - ref_min) / (ref_max - ref_min)`` of raw returns."""
        if self.ref_min_score is None or self.ref_max_score is None:
            raise DatasetError(
                f"dataset {self.dataset_id!r} has no ref_min_score/ref_max_score in its Minari metadata, so "
                "returns cannot be normalised; remake it with reference scores "
                "(minari.create_dataset_from_buffers(..., ref_min_score=..., ref_max_score=...))"
            )
        r = torch.as_tensor(returns)
        if not r.is_floating_point():
            r = r.to(torch.float32)
        return 100.0 * (r - self.ref_min_score) / (self.ref_max_score - self.ref_min_score)

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and numbers (``torch.save``-able, ``weights_only``-loadable)."""
        return {
            "obs_loc": self.obs_loc.detach().cpu().clone(),
            "obs_scale": self.obs_scale.detach().cpu().clone(),
            "reward_scale": float(self.reward_scale),
            "reward_shift": float(self.reward_shift),
            "ref_min_score": self.ref_min_score,
            "ref_max_score": self.ref_max_score,
            "dataset_id": self.dataset_id,
            "env_id": self.env_id,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        missing = {"obs_loc", "obs_scale", "reward_scale", "reward_shift"} - set(state)
        if missing:
            raise DatasetError(
                f"data statistics state is missing {', '.join(sorted(missing))}; pass what "
                "OfflineData.state_dict() returned"
            )
        self.obs_loc = torch.as_tensor(state["obs_loc"], dtype=torch.float32)
        self.obs_scale = torch.as_tensor(state["obs_scale"], dtype=torch.float32)
        self.reward_scale = float(state["reward_scale"])
        self.reward_shift = float(state["reward_shift"])
        self.ref_min_score = state.get("ref_min_score")
        self.ref_max_score = state.get("ref_max_score")
        self.dataset_id = state.get("dataset_id", self.dataset_id)
        self.env_id = state.get("env_id", self.env_id)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "DataStatistics":
        """A new instance from :meth:`state_dict` (no dataset needed)."""
        stats = cls(obs_loc=torch.zeros(0), obs_scale=torch.ones(0))
        stats.load_state_dict(state)
        return stats


@dataclass
class OfflineData:
    """A whole offline dataset in TorchRL's TED layout, with its specs and statistics.

    Attributes:
        td: batch ``[N]`` TensorDict: ``observation``, ``action``, ``("next", "observation")``,
            ``("next", "reward")`` ``[N, 1]`` (scaled and shifted),
            ``("next", "done"|"terminated"|"truncated")`` bool ``[N, 1]``, ``episode``
            int64 ``[N]`` (Minari's episode id), ``return_to_go`` ``[N, 1]`` (undiscounted
            sum of the training rewards from this step to the episode's end).
            Discrete actions are int64 ``[N]`` indices (``Categorical``), or one-hot
            ``[N, n]`` (``OneHot``) with ``discrete_actions="one_hot"``.
        observation_spec, action_spec: TorchRL specs of one step.
        action_space: ``"continuous"`` or ``"discrete"``.
        dataset_id, env_id: the Minari id; the Gymnasium id (None if the metadata has none).
        stats: the :class:`DataStatistics` (normalisation, reward scaling, reference scores).
        episode_returns, episode_lengths: raw (unscaled) return and length of each episode.
        device: where ``td`` lives.
        dropped: what loading left out on request: ``empty_episodes`` (``drop_empty_episodes``),
            ``nonfinite_episodes`` and their ``nonfinite_steps`` (``drop_nonfinite``).
    """

    td: TensorDict
    observation_spec: Any
    action_spec: Any
    action_space: str
    dataset_id: str
    env_id: Optional[str]
    stats: DataStatistics
    episode_returns: torch.Tensor
    episode_lengths: torch.Tensor
    device: torch.device = torch.device("cpu")
    dict_observation_keys: Optional[list] = None
    dropped: dict = field(default_factory=lambda: {"empty_episodes": 0, "nonfinite_episodes": 0, "nonfinite_steps": 0})
    _storages: dict = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return self.td.shape[0]

    @property
    def num_episodes(self) -> int:
        return self.episode_returns.shape[0]

    @property
    def obs_loc(self) -> torch.Tensor:
        return self.stats.obs_loc

    @property
    def obs_scale(self) -> torch.Tensor:
        return self.stats.obs_scale

    @property
    def reward_scale(self) -> float:
        return self.stats.reward_scale

    @property
    def reward_shift(self) -> float:
        return self.stats.reward_shift

    @property
    def ref_min_score(self) -> Optional[float]:
        return self.stats.ref_min_score

    @property
    def ref_max_score(self) -> Optional[float]:
        return self.stats.ref_max_score

    def normalize(self, obs: torch.Tensor) -> torch.Tensor:
        """Apply the observation normalisation used for ``td`` to raw env observations."""
        return self.stats.normalize(obs)

    def normalized_score(self, returns) -> torch.Tensor:
        """D4RL normalised score of raw returns: ``100 * (R - min) / (max - min)``."""
        return self.stats.normalized_score(returns)

    def state_dict(self) -> dict[str, Any]:
        """Normalisation, reward scaling and reference scores (see :class:`DataStatistics`)."""
        return self.stats.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore statistics saved with a checkpoint (``td`` itself is not changed)."""
        self.stats.load_state_dict(state)

    def _storage_td(self, device: torch.device) -> TensorDict:
        # one copy per device, shared by every buffer made on that device
        key = str(device)
        if key not in self._storages:
            self._storages[key] = self.td if device == self.td.device else self.td.to(device)
        return self._storages[key]

    def replay_buffer(
        self,
        batch_size: int,
        *,
        sampler: str = "random",
        slice_len: Optional[int] = None,
        seed: Optional[int] = None,
        device=None,
        prefetch: Optional[int] = None,
        strict_length: bool = True,
    ):
        """A read-only ``TensorDictReplayBuffer`` over the whole dataset.

        Args:
            batch_size: transitions per sample (``sampler="slice"``: total steps, a
                multiple of ``slice_len``).

        Keyword Args:
            sampler: ``"random"`` (TorchRL ``RandomSampler``, uniform with replacement) or
                ``"slice"`` (``SliceSampler(slice_len=..., traj_key="episode")``: windows of
                ``slice_len`` consecutive steps of one episode, ``batch_size // slice_len``
                windows per sample, flattened to ``[batch_size]``).
            slice_len: window length for ``"slice"``.
            seed: seeds the buffer's own generator, so the samples are reproducible.
            device: where the storage lives (default: this data's device). Buffers on one
                device share one storage; no copy is made per buffer.
            prefetch: batches prepared ahead in a background thread.
            strict_length: ``"slice"`` only: skip episodes shorter than ``slice_len``.
        """
        device = torch.device(device) if device is not None else self.device
        if sampler == "random":
            samp = RandomSampler()
        elif sampler == "slice":
            if not slice_len or slice_len < 1:
                raise DatasetError(f"dataset {self.dataset_id!r}: sampler='slice' needs slice_len >= 1, got {slice_len!r}")
            if batch_size % slice_len:
                raise DatasetError(
                    f"dataset {self.dataset_id!r}: batch_size {batch_size} is not a multiple of slice_len "
                    f"{slice_len}; use batch_size = windows * slice_len, e.g. {slice_len * max(1, batch_size // slice_len)}"
                )
            if strict_length and not bool((self.episode_lengths >= slice_len).any()):
                raise DatasetError(
                    f"dataset {self.dataset_id!r}: no episode has {slice_len} steps (longest: "
                    f"{int(self.episode_lengths.max())}); use a shorter slice_len or strict_length=False"
                )
            samp = SliceSampler(
                slice_len=slice_len,
                traj_key="episode",
                cache_values=True,
                strict_length=strict_length,
                truncated_key=None,
            )
        else:
            raise DatasetError(f"dataset {self.dataset_id!r}: sampler must be 'random' or 'slice', got {sampler!r}")
        # the sampler draws its indices where the storage is, with this generator: it must live there too
        generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        return TensorDictReplayBuffer(
            storage=TensorStorage(self._storage_td(device), max_size=len(self), device=device),
            sampler=samp,
            writer=ImmutableDatasetWriter(),
            batch_size=batch_size,
            prefetch=prefetch,
            generator=generator,
        )

    def make_env(self, env_id: Optional[str] = None, **kwargs):
        """The Gymnasium evaluation env (Minari's ``recover_environment(eval_env=True)``).

        Pass ``env_id`` to use another env (needed when the metadata records none).
        Dict observations are flattened as in ``td`` (``FlattenObservation``).
        """
        if env_id is not None:
            env = gym.make(env_id, **kwargs)
        else:
            dataset = open_minari_dataset(self.dataset_id)
            if dataset.spec.env_spec is None and getattr(dataset, "_eval_env_spec", None) is None:
                raise DatasetError(
                    f"dataset {self.dataset_id!r} records no environment in its Minari metadata "
                    "(env_spec is None), so the evaluation env cannot be recovered; in Python pass one: "
                    "data.make_env(env_id='Pendulum-v1'); the CLI has no env option, so to train or evaluate "
                    "there remake the dataset with its env (minari.create_dataset_from_buffers(..., env=ENV_ID))"
                )
            try:
                env = dataset.recover_environment(eval_env=True, **kwargs)
            except Exception as exc:
                raise DatasetError(
                    f"dataset {self.dataset_id!r}: its evaluation env cannot be made ({type(exc).__name__}: {exc}); "
                    "install what it needs (e.g. pip install 'offline-plugins[mujoco]') or pass env_id=..."
                ) from None
        if self.dict_observation_keys is not None:
            env = gym.wrappers.FlattenObservation(env)
        return env


def _flatten_observations(dataset_id: str, space, obs) -> tuple[np.ndarray, Optional[list]]:
    """``[T+1, obs_dim]`` float32, and the leaf keys when a Dict/Tuple was flattened."""
    if isinstance(space, spaces.Box):
        arr = np.asarray(obs)
        return arr.reshape(arr.shape[0], -1).astype(np.float32, copy=False), None
    if isinstance(space, (spaces.Dict, spaces.Tuple)):
        leaves, keys = [], []
        items = space.spaces.items() if isinstance(space, spaces.Dict) else enumerate(space.spaces)
        for key, sub in items:
            if not isinstance(sub, spaces.Box):
                break
            arr = np.asarray(obs[key])
            leaves.append(arr.reshape(arr.shape[0], -1).astype(np.float32, copy=False))
            keys.append(key)
        else:
            return np.concatenate(leaves, axis=-1), keys
    raise DatasetError(
        f"dataset {dataset_id!r}: observation space {space} is not supported; supported are Box, and "
        "Dict or Tuple spaces of Box (flattened in space order, as gymnasium's FlattenObservation does)"
    )


def load_offline_data(
    dataset_id: str,
    *,
    device="cpu",
    make_if_missing: bool = True,
    normalize_observations: bool = False,
    reward_scale: Union[None, float, str] = None,
    reward_shift: float = 0.0,
    drop_nonfinite: bool = False,
    drop_empty_episodes: bool = False,
    discrete_actions: str = "categorical",
    progress: bool = True,
    registry=None,
) -> OfflineData:
    """Load a Minari dataset (ours, a user's, or a remote one) as an :class:`OfflineData`.

    Args:
        dataset_id: a Minari id; recipe ids may drop their ``offline-plugins/`` namespace.

    Keyword Args:
        device: where ``td`` (and by default the replay buffers' storage) lives.
        make_if_missing: make a recipe's dataset when it is not in the local store.
        normalize_observations: store ``(obs - mean) / (std + 1e-3)`` in ``td`` (as TD3+BC
            and IQL do); the statistics are in ``stats`` either way.
        reward_scale: None (1.0), a number, or ``"iql"``: ``1000 / (max return - min return)``
            over episodes, as IQL/CORL do for locomotion.
        reward_shift: added after scaling (e.g. ``-1.0`` as IQL does for AntMaze).
        drop_nonfinite: drop episodes with NaN/inf values instead of raising.
        drop_empty_episodes: drop zero-step episodes instead of raising.
        discrete_actions: ``"categorical"`` (int64 index, ``Categorical`` spec) or
            ``"one_hot"`` (``OneHot`` spec, as TorchRL's DQN losses expect by default).
        progress: show a progress bar when a recipe is made.
        registry: a plugin registry (default: the installed plugins).
    """
    if discrete_actions not in ("categorical", "one_hot"):
        raise DatasetError(f"discrete_actions must be 'categorical' or 'one_hot', got {discrete_actions!r}")
    minari_id, recipe = resolve_dataset_id(dataset_id, registry)
    if not is_local(minari_id):
        if not make_if_missing:
            raise DatasetError(
                f"dataset {minari_id!r} is not in the local Minari store; make it with "
                f"'offline-plugins data make {minari_id}' or pass make_if_missing=True"
            )
        # exist_ok: another process may make it while this one waits for the dataset's lock
        make_dataset(minari_id, registry, progress=progress, exist_ok=True)
    if minari_id.startswith("ogbench/"):  # scored in OGBench's environments: the same ogbench must run them

        check_version(minari_id)
    dataset = open_minari_dataset(minari_id)
    episodes = read_minari_episodes(dataset, minari_id)
    return _to_offline_data(
        dataset,
        episodes,
        minari_id,
        device=torch.device(device),
        normalize_observations=normalize_observations,
        reward_scale=reward_scale,
        reward_shift=reward_shift,
        drop_nonfinite=drop_nonfinite,
        drop_empty_episodes=drop_empty_episodes,
        discrete_actions=discrete_actions,
    )


def _to_offline_data(
    dataset,
    episodes: list[dict],
    dataset_id: str,
    *,
    device: torch.device,
    normalize_observations: bool,
    reward_scale,
    reward_shift: float,
    drop_nonfinite: bool,
    drop_empty_episodes: bool,
    discrete_actions: str,
) -> OfflineData:
    obs_space, act_space = dataset.observation_space, dataset.action_space
    if isinstance(act_space, spaces.Box):
        action_space = "continuous"
    elif isinstance(act_space, spaces.Discrete):
        action_space = "discrete"
    else:
        raise DatasetError(
            f"dataset {dataset_id!r}: action space {act_space} is not supported; supported are Box "
            "(continuous) and Discrete"
        )

    empty = [ep["id"] for ep in episodes if len(ep["rewards"]) == 0]
    dropped = {"empty_episodes": 0, "nonfinite_episodes": 0, "nonfinite_steps": 0}
    if empty:
        if not drop_empty_episodes:
            raise DatasetError(
                f"dataset {dataset_id!r} has {len(empty)} zero-length episode(s) (first: episode {empty[0]}); "
                "pass drop_empty_episodes=True (CLI: --drop-empty on 'train' and 'data info') to skip them"
            )
        dropped["empty_episodes"] = len(empty)
        warnings.warn(f"dataset {dataset_id!r}: dropped {len(empty)} zero-length episode(s)", stacklevel=3)
        episodes = [ep for ep in episodes if len(ep["rewards"]) > 0]
        if not episodes:
            raise DatasetError(f"dataset {dataset_id!r} has only zero-length episodes; nothing to load")

    obs_list, act_list, rew_list, term_list, trunc_list, ids = [], [], [], [], [], []
    dict_keys = None
    bad: list[tuple[int, int]] = []  # (episode id, non-finite steps)
    for ep in episodes:
        obs, dict_keys = _flatten_observations(dataset_id, obs_space, ep["observations"])
        T = len(ep["rewards"])
        if obs.shape[0] != T + 1 or len(ep["actions"]) != T:
            raise DatasetError(
                f"dataset {dataset_id!r}: episode {ep['id']} has {obs.shape[0]} observations, "
                f"{len(ep['actions'])} actions and {T} rewards (expected T+1, T, T); rebuild the dataset"
            )
        actions = np.asarray(ep["actions"])
        rewards = np.asarray(ep["rewards"], dtype=np.float64).reshape(T)
        if action_space == "continuous":
            actions = actions.reshape(T, -1).astype(np.float32, copy=False)
        finite = np.isfinite(obs).all(-1)
        step_ok = finite[:-1] & finite[1:] & np.isfinite(rewards)
        if action_space == "continuous":
            step_ok &= np.isfinite(actions).all(-1)
        if not step_ok.all():
            bad.append((int(ep["id"]), int((~step_ok).sum())))
            continue
        term = np.asarray(ep["terminations"], dtype=bool).reshape(T).copy()
        trunc = np.asarray(ep["truncations"], dtype=bool).reshape(T).copy()
        if not (term[-1] or trunc[-1]):  # collection stopped mid-episode: the data ends there
            trunc[-1] = True
        obs_list.append(obs)
        act_list.append(actions)
        rew_list.append(rewards)
        term_list.append(term)
        trunc_list.append(trunc)
        ids.append(int(ep["id"]))
    if bad:
        steps = sum(n for _, n in bad)
        if not drop_nonfinite:
            raise DatasetError(
                f"dataset {dataset_id!r} has NaN or infinite observations, actions or rewards in {steps} step(s) "
                f"of {len(bad)} episode(s) (first: episode {bad[0][0]}); pass drop_nonfinite=True "
                "(CLI: --drop-nonfinite on 'train' and 'data info') to drop those episodes, or rebuild the dataset"
            )
        dropped.update(nonfinite_episodes=len(bad), nonfinite_steps=steps)
        warnings.warn(
            f"dataset {dataset_id!r}: dropped {len(bad)} episode(s) with non-finite values "
            f"(first: episode {bad[0][0]})",
            stacklevel=3,
        )
        if not obs_list:
            raise DatasetError(f"dataset {dataset_id!r}: every episode has non-finite values; nothing to load")

    lengths = np.array([len(r) for r in rew_list], dtype=np.int64)
    raw_returns = np.array([r.sum() for r in rew_list], dtype=np.float64)
    obs_all = np.concatenate([o[:-1] for o in obs_list])
    next_obs_all = np.concatenate([o[1:] for o in obs_list])
    rewards = np.concatenate(rew_list)
    episode = np.repeat(np.array(ids, dtype=np.int64), lengths)

    # statistics over the states the data visits (next observations add only the last states)
    mean = obs_all.mean(0, dtype=np.float64)
    std = obs_all.std(0, dtype=np.float64) + _OBS_STD_EPS
    obs_dim = obs_all.shape[-1]
    if normalize_observations:
        loc, scale = torch.as_tensor(mean, dtype=torch.float32), torch.as_tensor(std, dtype=torch.float32)
        obs_all = ((obs_all - mean) / std).astype(np.float32)
        next_obs_all = ((next_obs_all - mean) / std).astype(np.float32)
    else:
        loc, scale = torch.zeros(obs_dim), torch.ones(obs_dim)

    if reward_scale is None:
        scale_value = 1.0
    elif isinstance(reward_scale, str):
        if reward_scale != "iql":
            raise DatasetError(f"dataset {dataset_id!r}: reward_scale must be None, a number or 'iql', got {reward_scale!r}")
        spread = float(raw_returns.max() - raw_returns.min())
        if spread <= 0:
            raise DatasetError(
                f"dataset {dataset_id!r}: reward_scale='iql' divides by max - min episode return, which is 0 "
                "here; pass a number instead"
            )
        scale_value = 1000.0 / spread
    else:
        scale_value = float(reward_scale)
    train_rewards = rewards * scale_value + float(reward_shift)

    # undiscounted reward-to-go within each episode, from one global cumulative sum
    csum = np.cumsum(train_rewards)
    ends = np.cumsum(lengths) - 1
    rtg = csum[np.repeat(ends, lengths)] - csum + train_rewards

    if action_space == "continuous":
        act_all = np.concatenate(act_list).astype(np.float32)
        action = torch.from_numpy(act_all)
        action_spec = Bounded(
            torch.as_tensor(act_space.low, dtype=torch.float32).reshape(-1),
            torch.as_tensor(act_space.high, dtype=torch.float32).reshape(-1),
            shape=(act_all.shape[-1],),
        )
    else:
        idx = torch.from_numpy(np.concatenate(act_list).astype(np.int64).reshape(-1))
        n = int(act_space.n)
        if discrete_actions == "one_hot":
            action = torch.nn.functional.one_hot(idx, n).to(torch.int64)
            action_spec = OneHot(n)
        else:
            action = idx
            action_spec = Categorical(n)
    if isinstance(obs_space, spaces.Box) and np.isfinite(obs_space.low).all() and np.isfinite(obs_space.high).all() and not normalize_observations:
        observation_spec = Bounded(
            torch.as_tensor(obs_space.low, dtype=torch.float32).reshape(-1),
            torch.as_tensor(obs_space.high, dtype=torch.float32).reshape(-1),
            shape=(obs_dim,),
        )
    else:
        observation_spec = Unbounded(shape=(obs_dim,), dtype=torch.float32)

    term = torch.from_numpy(np.concatenate(term_list)).unsqueeze(-1)
    trunc = torch.from_numpy(np.concatenate(trunc_list)).unsqueeze(-1)
    N = obs_all.shape[0]
    td = TensorDict(
        {
            "observation": torch.from_numpy(np.ascontiguousarray(obs_all, dtype=np.float32)),
            "action": action,
            "episode": torch.from_numpy(episode),
            "return_to_go": torch.from_numpy(rtg.astype(np.float32)).unsqueeze(-1),
            "next": {
                "observation": torch.from_numpy(np.ascontiguousarray(next_obs_all, dtype=np.float32)),
                "reward": torch.from_numpy(train_rewards.astype(np.float32)).unsqueeze(-1),
                "done": term | trunc,
                "terminated": term,
                "truncated": trunc,
            },
        },
        batch_size=[N],
    ).to(device)

    env_spec = getattr(dataset, "_eval_env_spec", None) or dataset.spec.env_spec
    stats = DataStatistics(
        obs_loc=loc.to(device),
        obs_scale=scale.to(device),
        reward_scale=scale_value,
        reward_shift=float(reward_shift),
        ref_min_score=_maybe_float(dataset.storage.metadata.get("ref_min_score")),
        ref_max_score=_maybe_float(dataset.storage.metadata.get("ref_max_score")),
        dataset_id=dataset_id,
        env_id=env_spec.id if env_spec is not None else None,
    )
    return OfflineData(
        td=td,
        observation_spec=observation_spec.to(device),
        action_spec=action_spec.to(device),
        action_space=action_space,
        dataset_id=dataset_id,
        env_id=stats.env_id,
        stats=stats,
        episode_returns=torch.from_numpy(raw_returns),
        episode_lengths=torch.from_numpy(lengths),
        device=device,
        dict_observation_keys=dict_keys,
        dropped=dropped,
    )


def _maybe_float(value) -> Optional[float]:
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def dataset_info(dataset_id: str, registry=None, *, drop_nonfinite: bool = False, drop_empty: bool = False) -> dict:
    """Episodes, steps, returns, reference scores, spaces and size of a local dataset (what ``data info`` prints)."""
    data = load_offline_data(
        dataset_id,
        make_if_missing=False,
        drop_nonfinite=drop_nonfinite,
        drop_empty_episodes=drop_empty,
        progress=False,
        registry=registry,
    )
    minari_dataset = open_minari_dataset(data.dataset_id)
    returns = data.episode_returns
    info = {
        "id": data.dataset_id,
        "env_id": data.env_id,
        "episodes": data.num_episodes,
        "steps": len(data),
        "return_min": float(returns.min()),
        "return_mean": float(returns.mean()),
        "return_max": float(returns.max()),
        "ref_min_score": data.ref_min_score,
        "ref_max_score": data.ref_max_score,
        "normalized_score_mean": (
            float(data.normalized_score(returns).mean()) if data.ref_min_score is not None and data.ref_max_score is not None else None
        ),
        "observation_space": str(minari_dataset.observation_space),
        "action_space": str(minari_dataset.action_space),
        "action_kind": data.action_space,
        "data_format": minari_dataset.storage.metadata.get("data_format", "hdf5"),
        "size_bytes": dataset_size_bytes(data.dataset_id),
        "algorithm": minari_dataset.storage.metadata.get("algorithm_name"),
        "dropped": dict(data.dropped),
    }
    return info
