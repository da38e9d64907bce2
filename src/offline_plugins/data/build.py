"""Build a recipe's Minari dataset: roll out a behaviour policy, write it with Minari.

Episodes are written with :func:`minari.create_dataset_from_buffers`, which needs no
jax (``minari.DataCollector`` does). Every episode ``k`` of a tier resets the env
with ``seed * 1_000_000 + k`` and draws actions from one :class:`torch.Generator`
seeded with ``seed``, so a dataset is a pure function of (recipe, seed).
"""

from __future__ import annotations

import json
import os
import warnings
from importlib.metadata import version
from typing import Optional

import gymnasium as gym
import minari
import numpy as np
import torch
from minari.data_collector import EpisodeBuffer
from minari.storage import get_dataset_path
from tqdm.auto import tqdm

from offline_plugins.data.behaviour import load_policy_file
from offline_plugins.data.errors import DatasetError
from offline_plugins.data.store import build_atomically, check_data_format

__all__ = ["TIERS", "make_recipe_dataset", "rollout_episodes"]

TIERS: tuple[str, ...] = ("random", "medium", "medium-replay", "expert", "medium-expert")


def rollout_episodes(
    make_env,
    policy,
    generator,
    *,
    seed: int,
    steps: Optional[int] = None,
    episodes: Optional[int] = None,
    first_episode: int = 0,
    num_envs: int = 8,
    pbar=None,
) -> list:
    """Whole episodes of ``policy``, ``num_envs`` envs stepped in lockstep with one batched forward.

    Like one env run until ``steps`` steps (whole episodes; the last one may overshoot) or
    ``episodes`` episodes. Episode ``k``
    resets with ``seed * 1_000_000 + k``; the result is ordered by ``k`` and depends only
    on the arguments. Returns a list of ``minari.data_collector.EpisodeBuffer``.
    """
    if steps is None and episodes is None:
        raise ValueError("rollout_episodes needs steps or episodes")
    envs = [make_env() for _ in range(num_envs)]
    slots: list = [None] * num_envs  # per env: (episode id, lists) or None when idle
    finished: dict = {}
    started = 0
    counted = 0  # steps finished or running

    max_len = getattr(envs[0].spec, "max_episode_steps", None) or 1000

    def may_start() -> bool:
        # start only if the running episodes, at their longest, leave room: the last
        # episodes then run one at a time and the total overshoots by one episode at most
        running = sum(slot is not None for slot in slots)
        room = steps is None or counted + running * max_len < steps
        return room and (episodes is None or started < episodes)

    def start(i: int) -> None:
        nonlocal started
        k = first_episode + started
        obs, _ = envs[i].reset(seed=seed * 1_000_000 + k)
        slots[i] = (k, {"obs": [obs], "act": [], "rew": [], "term": [], "trunc": []})
        started += 1

    for i in range(num_envs):
        if may_start():
            start(i)
    while any(slot is not None for slot in slots):
        live = [i for i, slot in enumerate(slots) if slot is not None]
        obs = torch.as_tensor(np.stack([slots[i][1]["obs"][-1] for i in live]))
        actions = policy.act(obs, generator).numpy()
        for j, i in enumerate(live):
            k, ep = slots[i]
            o, r, term, trunc, _ = envs[i].step(actions[j])
            ep["obs"].append(o)
            ep["act"].append(actions[j])
            ep["rew"].append(r)
            ep["term"].append(term)
            ep["trunc"].append(trunc)
            counted += 1
            if pbar is not None:
                pbar.update(1)
            if term or trunc:
                finished[k] = EpisodeBuffer(
                    id=k,
                    seed=seed * 1_000_000 + k,
                    observations=np.stack(ep["obs"]),
                    actions=np.stack(ep["act"]),
                    rewards=np.asarray(ep["rew"], dtype=np.float64),
                    terminations=np.asarray(ep["term"], dtype=bool),
                    truncations=np.asarray(ep["trunc"], dtype=bool),
                )
                slots[i] = None
                if may_start():
                    start(i)
    for env in envs:
        env.close()
    return [finished[k] for k in sorted(finished)]


def make_recipe_dataset(
    spec,
    *,
    seed: int = 0,
    progress: bool = True,
    steps: Optional[int] = None,
    episodes: Optional[int] = None,
    data_format: Optional[str] = None,
    force: bool = False,
    save_as: Optional[str] = None,
):
    """Make the Minari dataset of recipe ``spec`` in the local Minari store.

    The dataset is built beside the store and renamed into place when complete (see
    :func:`~offline_plugins.data.store.build_atomically`): an interrupted build leaves
    nothing, and ``force`` keeps the old dataset until the new one is done.

    Args:
        spec: the :class:`~offline_plugins.plugins.registry.DatasetSpec`.

    Keyword Args:
        seed: everything random (env resets, action noise) follows from it.
        progress: show a tqdm progress bar.
        steps: collect whole episodes until at least this many steps (default: the
            recipe's; ignored by ``medium-replay``, whose size is the training buffer's).
        episodes: stop after this many episodes (small datasets for tests).
        data_format: ``"hdf5"`` or ``"arrow"`` (default: Minari's).
        force: replace an existing dataset with the same id.
        save_as: write under another Minari id (default: ``spec.id``).

    Returns:
        the new ``minari.MinariDataset``.
    """
    dataset_id = save_as or spec.id
    if spec.tier not in TIERS:
        raise DatasetError(f"dataset recipe {spec.id!r}: tier {spec.tier!r} is not one of {', '.join(TIERS)}")
    check_data_format(dataset_id, data_format)
    def build():
        return _build(spec, dataset_id, seed=seed, progress=progress, steps=steps, episodes=episodes, data_format=data_format)

    return build_atomically(dataset_id, build, force=force)


def _build(spec, dataset_id: str, *, seed: int, progress: bool, steps, episodes, data_format):
    """Roll out the recipe and write ``dataset_id`` into the current Minari store (which lacks it)."""
    options = dict(spec.options)
    tier = spec.tier
    try:
        gym.make(spec.env_id).close()
    except (ImportError, gym.error.DependencyNotInstalled, ModuleNotFoundError) as exc:
        extra = f"pip install 'offline-plugins[{spec.requires[0]}]'" if spec.requires else "install its dependencies"
        raise DatasetError(f"dataset recipe {spec.id!r} needs env {spec.env_id!r}, which cannot be made ({exc}); {extra}") from None
    policies = load_policy_file(spec.env_id)
    steps = int(steps if steps is not None else options.get("steps", 100_000))
    generator = torch.Generator().manual_seed(seed)

    if tier == "medium-replay":
        plan = [(n, pol) for n, pol in policies.replay_segments()]
    elif tier == "medium-expert":
        plan = [(steps // 2, policies.policy("medium")), (steps - steps // 2, policies.policy("expert"))]
    elif tier == "random":
        plan = [(steps, policies.random_policy())]
    else:
        plan = [(steps, policies.policy(tier))]
    total = sum(n for n, _ in plan)
    buffers: list = []
    with tqdm(total=total, desc=dataset_id, unit="step", disable=not progress, leave=False) as pbar:
        for i, (n, policy) in enumerate(plan):
            if episodes is None:
                left = None
            elif tier == "medium-expert":  # an episode limit is shared half and half, like the steps
                left = episodes // 2 if i == 0 else episodes - episodes // 2
            else:
                left = episodes - len(buffers)
            if left is not None and left <= 0:
                continue
            buffers += rollout_episodes(
                lambda: gym.make(spec.env_id),
                policy,
                generator,
                seed=seed,
                steps=n,
                episodes=left,
                first_episode=len(buffers),
                pbar=pbar,
            )
    description = (
        f"{spec.summary} Made by offline-plugins recipe {spec.id!r} (tier {tier}, seed {seed}) with the "
        f"behaviour policy {policies.path.name} ({policies.card.get('algorithm', '')}; "
        f"{policies.card.get('script', '')})."
    )
    kwargs = {"data_format": data_format} if data_format else {}
    with warnings.catch_warnings():
        # Minari asks for an author e-mail; a recipe has none to give
        warnings.filterwarnings("ignore", message=".*author_email.*")
        dataset = _create(minari, dataset_id, buffers, spec, tier, policies, description, kwargs)
    _write_recipe_note(dataset_id, spec, seed)
    return dataset


def _create(minari, dataset_id, buffers, spec, tier, policies, description, kwargs):
    return minari.create_dataset_from_buffers(
        dataset_id=dataset_id,
        buffer=buffers,
        env=spec.env_id,
        eval_env=spec.env_id,
        algorithm_name=f"offline-plugins/{tier} ({policies.card.get('algorithm', 'random')})",
        author="offline-plugins",
        code_permalink="offline_plugins.data.build:make_recipe_dataset",
        ref_min_score=policies.ref_min_score,
        ref_max_score=policies.ref_max_score,
        description=description,
        requirements=[f"mujoco>={_mujoco_version()}"] if "mujoco" in spec.requires and _mujoco_version() else None,
        **kwargs,
    )


def _mujoco_version() -> Optional[str]:
    try:
        return version("mujoco")
    except Exception:
        return None


def _write_recipe_note(dataset_id: str, spec, seed: int) -> None:
    """Record which recipe and seed made the dataset, next to Minari's own metadata."""
    path = os.path.join(str(get_dataset_path(dataset_id)), "offline_plugins.json")
    with open(path, "w") as f:
        json.dump({"recipe": spec.id, "tier": spec.tier, "seed": seed, "env_id": spec.env_id}, f)
