"""Build the learning-history datasets of Algorithm Distillation (Laskin et al. 2022, arXiv:2210.14215).

Each Minari episode is one task's whole learning history: a source learner (UCB1 on
bandits, tabular Q-learning in dark room, :mod:`offline_plugins.envs.icl`) starts from
scratch on training task ``seed * 1_000_000 + k`` and plays its in-context episodes in
order, so a window of the history spans several episodes of its learning. The
dataset's evaluation env is the same family on held-out tasks (``split="test"``).
"""

from __future__ import annotations

import warnings
from typing import Optional

from offline_plugins.data.errors import DatasetError
from offline_plugins.data.store import build_atomically, check_data_format

__all__ = ["HISTORY_RECIPES", "REFERENCE_TASKS", "make_history_dataset", "reference_returns"]

#: recipe name -> its options: the env class name, its kwargs, the learner (``ucb1`` or ``q-learning``), tasks
HISTORY_RECIPES: dict[str, tuple] = {
    "bandit": (("env", "Bandit"), ("env_kwargs", (("arms", 5), ("episodes", 100))), ("learner", "ucb1"), ("tasks", 200)),
    "darkroom": (("env", "DarkRoom"), ("env_kwargs", (("size", 9), ("episode_len", 20), ("episodes", 60))),
                 ("learner", "q-learning"), ("tasks", 60)),
}


#: held-out tasks (reset seeds 0..N-1, those ``offline-plugins eval`` starts with) the reference returns average
REFERENCE_TASKS = 50


def reference_returns(spec, tasks: int = REFERENCE_TASKS) -> tuple[float, float]:
    """``(random, oracle)`` mean history returns over tasks ``0..tasks-1`` of env ``spec``: uniform
    random actions (seeded Monte Carlo) and the expected return of a policy that knows each task."""
    import gymnasium as gym
    import numpy as np

    from offline_plugins.envs.icl import UniformActions, learning_history

    env, rng = gym.make(spec), np.random.default_rng(0)
    random, oracle = [], []
    for k in range(tasks):
        random.append(learning_history(env, UniformActions(int(env.action_space.n)), rng, seed=k)["rewards"].sum())
        oracle.append(env.unwrapped.oracle_return())
    env.close()
    return float(np.mean(random)), float(np.mean(oracle))


def _learner(name: str, env):
    from offline_plugins.envs.icl import UCB1, QLearning

    return UCB1(env.unwrapped.arms) if name == "ucb1" else QLearning(env.unwrapped.size)


def make_history_dataset(
    spec,
    *,
    seed: int = 0,
    progress: bool = True,
    episodes: Optional[int] = None,
    steps: Optional[int] = None,
    data_format: Optional[str] = None,
    force: bool = False,
    save_as: Optional[str] = None,
):
    """Make the learning-history dataset of recipe ``spec`` in the local Minari store.

    Keyword Args:
        seed: training tasks and the learner's exploration follow from it.
        progress: show a tqdm progress bar (one tick per history).
        episodes: histories (tasks) to record (default: the recipe's ``tasks`` option).
        steps: not used (a history's length is fixed by the env); refused when given.
        data_format, force, save_as: as :func:`~offline_plugins.data.build.make_recipe_dataset`.
    """
    dataset_id = save_as or spec.id
    if steps is not None:
        raise DatasetError(f"dataset recipe {spec.id!r} records whole learning histories: drop --steps and set how "
                           "many tasks with --episodes")
    if episodes is not None and int(episodes) < 1:
        raise DatasetError(f"dataset recipe {spec.id!r}: episodes={episodes} must be at least 1 (one history per task)")
    check_data_format(dataset_id, data_format)

    def build():
        return _build(spec, dataset_id, seed=seed, progress=progress, tasks=episodes, data_format=data_format)

    return build_atomically(dataset_id, build, force=force)


def _build(spec, dataset_id: str, *, seed: int, progress: bool, tasks: Optional[int], data_format):
    import gymnasium as gym
    import minari
    import numpy as np
    from minari.data_collector import EpisodeBuffer
    from tqdm.auto import tqdm

    from offline_plugins.envs.icl import env_spec, learning_history

    options = dict(spec.options)
    env_name, kwargs, learner = options["env"], dict(options["env_kwargs"]), options["learner"]
    tasks = int(tasks if tasks is not None else options["tasks"])
    train_spec = env_spec(env_name, **kwargs, split="train")
    env = gym.make(train_spec)
    rng = np.random.default_rng(seed)
    buffers = []
    for k in tqdm(range(tasks), desc=dataset_id, unit="history", disable=not progress, leave=False):
        task_seed = seed * 1_000_000 + k
        h = learning_history(env, _learner(learner, env), rng, seed=task_seed)
        buffers.append(EpisodeBuffer(id=k, seed=task_seed, observations=h["observations"], actions=h["actions"],
                                     rewards=h["rewards"], terminations=h["terminations"].astype(bool),
                                     truncations=h["truncations"].astype(bool)))
    env.close()
    ref_min, ref_max = reference_returns(env_spec(env_name, **kwargs, split="test"))
    description = (f"{spec.summary} Made by offline-plugins recipe {spec.id!r} (seed {seed}): {tasks} learning "
                   f"histories of {learner}, one Minari episode per training task; the evaluation env draws "
                   f"held-out tasks. Reference returns over held-out tasks 0-{REFERENCE_TASKS - 1}: uniform random "
                   "actions (min) and a policy that knows the task (max).")
    extra = {"data_format": data_format} if data_format else {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*author_email.*")
        return minari.create_dataset_from_buffers(
            dataset_id=dataset_id,
            buffer=buffers,
            env=train_spec,
            eval_env=env_spec(env_name, **kwargs, split="test"),
            algorithm_name=f"offline-plugins/{learner} learning histories",
            author="offline-plugins",
            code_permalink="offline_plugins.data.histories:make_history_dataset",
            description=description,
            ref_min_score=ref_min,
            ref_max_score=ref_max,
            **extra,
        )
