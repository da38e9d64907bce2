"""What the sequence-model glue modules share inside ``build``: window checks and derived columns.

The columns are computed once from the loaded data and added to ``data.td`` itself,
which the replay buffers wrap without copying, so every window sampled from the
same storage carries them:

- ``step_count`` int64 ``[N, 1]``: the step's index in its episode (TorchRL's
  ``StepCounter`` key), for Decision Transformer's timestep embedding;
- ``discounted_return_to_go`` ``[N, 1]``: ``sum_k gamma^k r_{t+k}`` to the episode's
  end, the value the Trajectory Transformer and Diffuser's return model learn.

>>> import torch
>>> episode = torch.tensor([0, 0, 0, 1, 1])
>>> step_counts(episode).squeeze(-1).tolist()
[0, 1, 2, 0, 1]
>>> r = torch.ones(5, 1)
>>> discounted_returns(episode, r, 0.5).squeeze(-1).tolist()
[1.75, 1.5, 1.0, 1.5, 1.0]
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from offline_plugins.config import ConfigError
from offline_plugins.objectives.sequence.common import ContextLengthError

__all__ = ["step_counts", "discounted_returns", "check_window", "check_batch_windows", "add_step_count", "add_discounted_return"]


def _episode_starts(episode: torch.Tensor) -> torch.Tensor:
    n = episode.shape[0]
    idx = torch.arange(n, device=episode.device)
    new = torch.ones(n, dtype=torch.bool, device=episode.device)
    new[1:] = episode[1:] != episode[:-1]
    return torch.where(new, idx, torch.zeros_like(idx)).cummax(0).values


def step_counts(episode: torch.Tensor) -> torch.Tensor:
    """Index of each step in its episode, for contiguous episodes: ``[N] -> [N, 1]``."""
    episode = episode.reshape(-1)
    return (torch.arange(episode.shape[0], device=episode.device) - _episode_starts(episode)).unsqueeze(-1)


def discounted_returns(episode: torch.Tensor, reward: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma G_{t+1}`` within each contiguous episode: ``[N] , [N, 1] -> [N, 1]``.

    Computed as ``gamma^-t * (reverse cumulative sum of gamma^t r_t)`` in float64, one
    pass with no Python loop over steps.
    """
    episode = episode.reshape(-1)
    t = step_counts(episode).squeeze(-1).to(torch.float64)
    g = torch.as_tensor(gamma, dtype=torch.float64)
    w = g.pow(t) * reward.reshape(-1).to(torch.float64)
    csum = w.flip(0).cumsum(0).flip(0)  # sum of w[k] for k >= i over the whole dataset
    n = episode.shape[0]
    idx = torch.arange(n, device=episode.device)
    last = torch.ones_like(episode, dtype=torch.bool)
    last[:-1] = episode[1:] != episode[:-1]
    # the last step of each step's episode; what csum holds beyond it belongs to later episodes
    end = torch.where(last, idx, torch.full_like(idx, n)).flip(0).cummin(0).values.flip(0)
    after = torch.cat([csum, csum.new_zeros(1)])[end + 1]
    return ((csum - after) / g.pow(t)).to(reward.dtype).unsqueeze(-1)


def check_window(data: Any, algorithm: str, window: int, what: str, drop_short_episodes: bool) -> None:
    """Raise :class:`ContextLengthError` when ``window`` is longer than an episode of ``data``.

    ``SliceSampler`` skips episodes shorter than the window, so they would silently
    leave training; with ``drop_short_episodes`` that is allowed (and reported).
    """
    lengths = torch.as_tensor(data.episode_lengths)
    if window < 1:
        raise ContextLengthError(f"{algorithm}: {what}={window} must be at least 1")
    shortest, longest = int(lengths.min()), int(lengths.max())
    if window > longest:
        raise ContextLengthError(
            f"{algorithm}: {what}={window} is longer than every episode of {getattr(data, 'dataset_id', 'the dataset')!r} "
            f"(longest: {longest} steps); set --set {what}={min(longest, 20)} or shorter"
        )
    if window > shortest:
        short = lengths < window
        frac = float(lengths[short].sum()) / float(lengths.sum())
        msg = (
            f"{algorithm}: {what}={window} is longer than the dataset's shortest episode ({shortest} steps); "
            f"{int(short.sum())} of {lengths.numel()} episodes ({100 * frac:.1f}% of the steps) are shorter and "
            "cannot give a window"
        )
        if not drop_short_episodes:
            raise ContextLengthError(
                f"{msg}. Set --set {what}={shortest} to use every episode, or --set drop_short_episodes=true "
                "to train on the longer ones only"
            )
        warnings.warn(msg + "; they are left out (drop_short_episodes=true)", stacklevel=3)


def check_batch_windows(config: Any, data: Any, algorithm: str, window: int, what: str, example: int, note: str = "") -> None:
    """:func:`check_window` (``config.drop_short_episodes``), then a ``ConfigError`` unless
    ``config.batch_size`` (steps) is a whole number of windows; the fix suggests ``example`` windows."""
    check_window(data, algorithm, window, what, config.drop_short_episodes)
    if config.batch_size % window:
        raise ConfigError(
            f"{algorithm}: batch_size={config.batch_size} must be a multiple of {what}={window}{note}; "
            f"e.g. --set batch_size={example * window}"
        )


def add_step_count(data: Any) -> None:
    """Add ``step_count`` to ``data.td`` (once)."""
    if data.td.get("step_count", None) is None:
        data.td.set("step_count", step_counts(data.td.get("episode")))


def add_discounted_return(data: Any, gamma: float, termination_penalty: float = 0.0) -> None:
    """Add ``discounted_return_to_go`` to ``data.td`` for this ``gamma`` (recomputed if it changed).

    ``termination_penalty`` is added to the reward of terminal steps first (the
    Trajectory Transformer and Diffuser references use -100 for locomotion).
    """
    key = (float(gamma), float(termination_penalty))
    if getattr(data, "_discounted_return_key", None) == key and data.td.get("discounted_return_to_go", None) is not None:
        return
    reward = data.td.get(("next", "reward"))
    if termination_penalty:
        reward = reward + termination_penalty * data.td.get(("next", "terminated")).to(reward.dtype)
    data.td.set("discounted_return_to_go", discounted_returns(data.td.get("episode"), reward, gamma))
    try:
        data._discounted_return_key = key
    except AttributeError:  # a slotted data object: recompute next time
        pass
