"""Built-in dataset recipes: D4RL's five tiers for each env with a shipped behaviour policy.

Ids are ``offline-plugins/<env>/<tier>-v0``. The ``offline-plugins/`` namespace keeps
them apart from Minari's remote ids (``mujoco/hopper/medium-v0`` is Farama's, made
with other policies); :func:`offline_plugins.data.load_offline_data` also accepts the
short form ``pendulum/medium-v0``.

An env's recipes are registered only when its policy file is installed, so every
listed recipe can be made. This module imports no torch (``offline-plugins list``
stays fast).

>>> from offline_plugins.plugins.registry import Registry
>>> registry = Registry()
>>> offline_plugins_register_datasets(registry.scoped("offline-plugins", "0", "datasets"))
>>> registry.dataset("offline-plugins/pendulum/medium-v0").env_id
'Pendulum-v1'
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from offline_plugins.data.histories import HISTORY_RECIPES
from offline_plugins.data.maze import MAZE_RECIPES
from offline_plugins.data.ogbench import OGBENCH_ENVS, OGBENCH_TYPES, TASKS, ogbench_id, singletask_env_id
from offline_plugins.plugins.hookspecs import hookimpl
from offline_plugins.plugins.registry import DatasetSpec

__all__ = ["NAMESPACE", "ENVS", "TIER_SUMMARIES", "recipe_id", "offline_plugins_register_datasets"]

NAMESPACE = "offline-plugins"

# short name -> (Gymnasium id, action space, steps per tier, extras needed)
ENVS: dict[str, tuple[str, str, int, tuple[str, ...]]] = {
    "pendulum": ("Pendulum-v1", "continuous", 50_000, ()),
    "cartpole": ("CartPole-v1", "discrete", 50_000, ()),
    "hopper": ("Hopper-v5", "continuous", 50_000, ("mujoco",)),
    "halfcheetah": ("HalfCheetah-v5", "continuous", 50_000, ("mujoco",)),
    "walker2d": ("Walker2d-v5", "continuous", 50_000, ("mujoco",)),
}

TIER_SUMMARIES: dict[str, str] = {
    "random": "uniform random actions",
    "medium": "a policy stopped at about a third of the way from random to expert return",
    "medium-replay": "the training buffer up to the medium policy",
    "expert": "the best policy of the training run",
    "medium-expert": "half medium, half expert episodes",
}


def recipe_id(env: str, tier: str, version: int = 0) -> str:
    """``recipe_id("hopper", "medium")`` -> ``"offline-plugins/hopper/medium-v0"``."""
    return f"{NAMESPACE}/{env}/{tier}-v{version}"


def _policy_installed(env_id: str) -> bool:
    folder = Path(str(resources.files("offline_plugins.data") / "policies"))
    stem = env_id.lower()
    return (folder / f"{stem}.pt").is_file() and (folder / f"{stem}.json").is_file()


@hookimpl
def offline_plugins_register_datasets(registry):
    """Register the five tiers of every env whose behaviour policy is installed."""
    for short, (env_id, action_space, steps, requires) in ENVS.items():
        if not _policy_installed(env_id):
            continue
        for tier, summary in TIER_SUMMARIES.items():
            registry.add(
                DatasetSpec(
                    id=recipe_id(short, tier),
                    summary=f"{env_id}, {tier}: {summary}.",
                    env_id=env_id,
                    make="offline_plugins.data.build:make_recipe_dataset",
                    tier=tier,
                    action_space=action_space,
                    requires=requires,
                    options=(("steps", steps),),
                )
            )
    # Algorithm Distillation's learning histories (offline_plugins.data.histories)

    for short, options in HISTORY_RECIPES.items():
        env, learner = dict(options)["env"], dict(options)["learner"]
        registry.add(
            DatasetSpec(
                id=recipe_id(short, "histories"),
                summary=f"{env} learning histories of {learner} on training tasks (held-out tasks to evaluate).",
                env_id=f"offline_plugins/{env}-v0",
                make="offline_plugins.data.histories:make_history_dataset",
                tier="histories",
                action_space="discrete",
                options=options,
            )
        )
    # a point mass in a maze, D4RL maze2d's waypoint-controller data (offline_plugins.data.maze)

    for short, options in MAZE_RECIPES.items():
        maze = dict(options)["maze"]
        registry.add(
            DatasetSpec(
                id=recipe_id(short, maze.lower()),
                summary=f"a point mass in gymnasium-robotics' {maze}, D4RL maze2d's noisy waypoint controller to "
                        "random goal cells; sparse reward at a fixed goal.",
                env_id=f"offline_plugins/PointMaze{maze}Goal-v0",
                make="offline_plugins.data.maze:make_maze_dataset",
                tier=maze.lower(),
                action_space="continuous",
                requires=("mujoco",),
                options=options,
            )
        )
    # OGBench's manipulation datasets by their own recipe, and their single-task views (offline_plugins.data.ogbench)

    for env, settings in OGBENCH_ENVS.items():
        for kind in OGBENCH_TYPES:
            for task in (None, *TASKS):
                which = (f"task {task}" if task is not None else f"the default task ({settings.default_task})")
                registry.add(
                    DatasetSpec(
                        id=ogbench_id(env, kind, task),
                        summary=f"OGBench {env}-{kind} made by its recipe (the {'plan' if kind == 'play' else 'Markov'} "
                                f"oracles), rewards of {which}; success rate in "
                                f"{singletask_env_id(env, task or settings.default_task)}.",
                        env_id=singletask_env_id(env, task or settings.default_task),
                        make="offline_plugins.data.ogbench:make_ogbench_dataset",
                        tier=kind if task is None else f"{kind}-task{task}",
                        action_space="continuous",
                        requires=("mujoco",),
                    )
                )

