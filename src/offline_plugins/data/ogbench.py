"""OGBench's manipulation datasets made locally by their published recipe, and their single-task views.

OGBench (Park, Frans, Eysenbach & Levine 2025, arXiv:2410.20092) collects each manipulation
dataset with scripted oracles that the ``ogbench`` package ships, following its
``data_gen_scripts/generate_manipspace.py`` and ``commands.sh``:

- the environment ``<env>-v0`` made with ``terminate_at_goal=False, mode="data_collection"``
  and episodes of 1,001 steps; 1,000 episodes (the recipe's 100 validation episodes are not
  made here);
- ``play``: the plan oracles (``ogbench.manipspace.oracles.plan``), action noise 0.1 and
  noise smoothing 0.5;
- ``noisy``: the Markov oracles (``.markov``, minimum action norm 0.4), each episode with a
  Gaussian action noise of scale ``xi ~ U(0, 0.1)`` (``[xi, xi, xi, 3 xi, 10 xi]``) and a
  uniform random action with probability 0.1 (``puzzle-*``: 0.2);
- the oracle picks a new sub-task (``set_new_target``) each time it finishes one; cubes
  are stacked with probability 0 (``cube-single``), ``U(0, 0.25)`` (``cube-double``) or 0.5;
  a ``scene`` episode in which the cube leaves the table is made again.

OGBench's single-task offline RL (``<env>-<type>-singletask-task<k>-v0``) reads the same data
with rewards relabelled for task ``k``: at each state, the number of the task's objects in
their goal state minus their count (``0`` when the task is solved), and no bootstrapping from a
state that solves it. That is what the ids here hold:

- ``ogbench/<env>-<type>-v0``: the collected data, relabelled for the environment's default
  task (OGBench's ``-singletask-v0``: task 2, ``puzzle-3x3`` task 4), with every state's
  ``qpos``, ``qvel`` and ``button_states`` (Minari ``infos``) so that it can be relabelled;
- ``ogbench/<env>-<type>-singletask-task<k>-v0``, ``k`` in 1-5: made from it by relabelling.

Each evaluates in OGBench's single-task environment (``<env>-singletask-task<k>-v0``: it ends
when the task is solved, the reward and the success counted before the step as OGBench's
``success_timing="pre"``); the reported score is the success rate. Everything random follows
from the seed: episode ``k`` resets with ``seed * 1_000_000 + k``, and the oracles' and the
recipe's draws come from numpy's global stream (the oracles read it), seeded with ``seed``
and restored afterwards.

This module imports neither torch nor ogbench at import time.
"""

from __future__ import annotations

import json
import re
import time
import warnings
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Optional

from offline_plugins.data.errors import DatasetError
from offline_plugins.data.store import (
    build_atomically,
    check_data_format,
    is_local,
    make_dataset,
    open_minari_dataset,
    outer_store,
    read_minari_episodes,
    store_path,
)

__all__ = ["OGBENCH_ENVS", "OGBENCH_TYPES", "OGBenchEnv", "ogbench_id", "parse_ogbench_id", "explain_unknown",
           "relabel", "make_ogbench_dataset", "collect_episodes"]

NAMESPACE = "ogbench"
TASKS = (1, 2, 3, 4, 5)
_FIX = "pip install 'offline-plugins[mujoco]' (it brings ogbench and MuJoCo)"


@dataclass(frozen=True)
class OGBenchEnv:
    """One manipulation environment of OGBench and its recipe's settings."""

    env: str  #: the data-collection env (``cube-single-v0``)
    default_task: int  #: OGBench's ``-singletask-v0`` task
    noisy_random_action: float  #: ``p_random_action`` of its ``noisy`` dataset
    stack: tuple  #: the per-episode cube-stacking probability: ``(low, high)`` of a uniform draw


OGBENCH_ENVS: dict[str, OGBenchEnv] = {
    "cube-single": OGBenchEnv("cube-single-v0", 2, 0.1, (0.0, 0.0)),
    "cube-double": OGBenchEnv("cube-double-v0", 2, 0.1, (0.0, 0.25)),
    "scene": OGBenchEnv("scene-v0", 2, 0.1, (0.5, 0.5)),
    "puzzle-3x3": OGBenchEnv("puzzle-3x3-v0", 4, 0.2, (0.5, 0.5)),
}
OGBENCH_TYPES = ("play", "noisy")
EPISODES, EPISODE_STEPS = 1000, 1001
NOISE, NOISE_SMOOTHING, MIN_NORM = 0.1, 0.5, 0.4

_ID = re.compile(r"^ogbench/(?P<env>[a-z0-9-]+?)-(?P<type>play|noisy)(?:-singletask-task(?P<task>\d+))?-v0$")


def ogbench_id(env: str, kind: str, task: Optional[int] = None) -> str:
    """``ogbench_id("cube-single", "play", 3)`` -> ``"ogbench/cube-single-play-singletask-task3-v0"``."""
    return f"{NAMESPACE}/{env}-{kind}" + (f"-singletask-task{task}" if task is not None else "") + "-v0"


def parse_ogbench_id(dataset_id: str) -> Optional[tuple[str, str, Optional[int]]]:
    """``(env, type, task or None)`` of an OGBench id, or None when it is not one.

    >>> parse_ogbench_id("ogbench/puzzle-3x3-noisy-singletask-task5-v0")
    ('puzzle-3x3', 'noisy', 5)
    >>> parse_ogbench_id("ogbench/scene-play-v0")
    ('scene', 'play', None)
    """
    m = _ID.match(dataset_id)
    if m is None:
        return None
    return m["env"], m["type"], int(m["task"]) if m["task"] else None


def explain_unknown(dataset_id: str) -> Optional[str]:
    """The one line an unknown OGBench-shaped id deserves (a task outside 1-5, an env not made here).

    >>> explain_unknown("ogbench/cube-single-play-singletask-task7-v0")
    "dataset 'ogbench/cube-single-play-singletask-task7-v0': OGBench's cube-single has tasks 1-5, not 7; use ogbench/cube-single-play-singletask-task1-v0 ... -task5-v0, or ogbench/cube-single-play-v0 for its default task (2)"
    """
    parsed = parse_ogbench_id(dataset_id)
    if parsed is None:
        return None
    env, kind, task = parsed
    if env not in OGBENCH_ENVS:
        return (f"dataset {dataset_id!r}: no recipe makes OGBench's {env!r} here; the manipulation environments made "
                f"locally are {', '.join(OGBENCH_ENVS)} (ids ogbench/<env>-play-v0 and -noisy-v0)")
    if task is not None and task not in TASKS:
        return (f"dataset {dataset_id!r}: OGBench's {env} has tasks 1-5, not {task}; use "
                f"{ogbench_id(env, kind, 1)} ... -task5-v0, or {ogbench_id(env, kind)} for its default task "
                f"({OGBENCH_ENVS[env].default_task})")
    return None


def singletask_env_id(env: str, task: int) -> str:
    """OGBench's single-task evaluation env: ``singletask_env_id("scene", 3)`` -> ``"scene-singletask-task3-v0"``."""
    return f"{env}-singletask-task{task}-v0"


def _import_ogbench():
    try:
        import ogbench  # noqa: F401  (registers the environments)
        import ogbench.manipspace.oracles.markov as markov  # noqa: F401
        import ogbench.manipspace.oracles.plan as plan  # noqa: F401
    except ImportError as exc:
        raise DatasetError(f"OGBench's datasets are made with the ogbench package, which cannot be imported ({exc}); "
                           f"{_FIX}") from None

    return version("ogbench")


def _oracles(env, name: str, kind: str) -> dict:
    """The recipe's oracles for ``name``'s sub-tasks (keyed as ``info["privileged/target_task"]``)."""
    from ogbench.manipspace.oracles.markov.button_markov import ButtonMarkovOracle
    from ogbench.manipspace.oracles.markov.cube_markov import CubeMarkovOracle
    from ogbench.manipspace.oracles.markov.drawer_markov import DrawerMarkovOracle
    from ogbench.manipspace.oracles.markov.window_markov import WindowMarkovOracle
    from ogbench.manipspace.oracles.plan.button_plan import ButtonPlanOracle
    from ogbench.manipspace.oracles.plan.cube_plan import CubePlanOracle
    from ogbench.manipspace.oracles.plan.drawer_plan import DrawerPlanOracle
    from ogbench.manipspace.oracles.plan.window_plan import WindowPlanOracle

    plan = dict(env=env, noise=NOISE, noise_smoothing=NOISE_SMOOTHING)
    markov = dict(env=env, min_norm=MIN_NORM)
    if name.startswith("cube"):
        return {"cube": CubeMarkovOracle(**markov) if kind == "noisy" else CubePlanOracle(**plan)}
    if name == "scene":
        if kind == "noisy":
            return {"cube": CubeMarkovOracle(**markov, max_step=100), "button": ButtonMarkovOracle(**markov),
                    "drawer": DrawerMarkovOracle(**markov), "window": WindowMarkovOracle(**markov)}
        return {"cube": CubePlanOracle(**plan), "button": ButtonPlanOracle(**plan), "drawer": DrawerPlanOracle(**plan),
                "window": WindowPlanOracle(**plan)}
    if kind == "noisy":
        return {"button": ButtonMarkovOracle(**markov, gripper_always_closed=True)}
    return {"button": ButtonPlanOracle(**plan, gripper_always_closed=True)}


def _healthy(name: str, qpos) -> bool:
    """A ``scene`` episode is kept only if the cube stays on the table or goes into the drawer (the recipe's check)."""
    import numpy as np

    if name != "scene":
        return True
    xyz = np.asarray(qpos)[:, 14:17]
    too_right = (xyz[:, 1] >= 0.29).any()
    left_outside = ((xyz[:, 1] <= -0.3) & ((xyz[:, 2] < 0.06) | (xyz[:, 2] > 0.08))).any()
    return not (too_right or left_outside)


def collect_episodes(name: str, kind: str, *, episodes: int, steps: int, seed: int, pbar=None) -> tuple[list, dict]:
    """``episodes`` episodes of ``steps`` steps of the recipe's oracle on ``name``: a list of dicts
    (``observations [steps+1, d]``, ``actions [steps, 5]``, ``qpos``/``qvel``/``button_states`` of
    every state) and the oracle's record (``subtasks``: finished sub-tasks, ``solved``: those whose
    target was reached when the oracle finished, ``retries``: scene episodes made again)."""
    import gymnasium as gym
    import numpy as np

    _import_ogbench()
    spec = OGBENCH_ENVS[name]
    saved = np.random.get_state()
    np.random.seed(seed)
    env = gym.make(spec.env, terminate_at_goal=False, mode="data_collection", max_episode_steps=steps)
    env.action_space.seed(seed)
    agents = _oracles(env, name, kind)
    p_random = spec.noisy_random_action if kind == "noisy" else 0.0
    out, record = [], {"subtasks": 0, "solved": 0, "retries": 0}
    try:
        k = 0
        while len(out) < episodes:
            ob, info = env.reset(seed=seed * 1_000_000 + k)
            k += 1
            p_stack = float(np.random.uniform(*spec.stack)) if spec.stack[1] > spec.stack[0] else spec.stack[0]
            xi = float(np.random.uniform(0, NOISE)) if kind == "noisy" else 0.0
            agent = agents[info["privileged/target_task"]]
            agent.reset(ob, info)
            obs, acts, qpos, qvel, buttons = [ob], [], [info["qpos"]], [info["qvel"]], [info.get("button_states")]
            subtasks = solved = 0
            for _ in range(steps):
                if np.random.rand() < p_random:
                    action = env.action_space.sample()
                else:
                    action = np.asarray(agent.select_action(ob, info))
                    if kind == "noisy":
                        action = action + np.random.normal(0, [xi, xi, xi, xi * 3, xi * 10], action.shape)
                action = np.clip(action, -1, 1)
                ob, _, terminated, truncated, info = env.step(action)
                if agent.done:  # the oracle finished its sub-task: the env draws the next
                    subtasks, solved = subtasks + 1, solved + bool(info["success"])
                    agent_ob, agent_info = env.unwrapped.set_new_target(p_stack=p_stack)
                    agent = agents[agent_info["privileged/target_task"]]
                    agent.reset(agent_ob, agent_info)
                obs.append(ob)
                acts.append(action)
                qpos.append(info["qpos"])
                qvel.append(info["qvel"])
                buttons.append(info.get("button_states"))
                if pbar is not None:
                    pbar.update(1)
                if terminated or truncated:
                    break
            if not _healthy(name, qpos):
                record["retries"] += 1
                if pbar is not None:
                    pbar.update(-len(acts))
                continue
            episode = {"id": len(out), "seed": seed * 1_000_000 + k - 1, "observations": np.asarray(obs, np.float32),
                       "actions": np.asarray(acts, np.float32), "qpos": np.asarray(qpos, np.float64),
                       "qvel": np.asarray(qvel, np.float64)}
            if buttons[0] is not None:
                episode["button_states"] = np.asarray(buttons, np.int64)
            out.append(episode)
            record["subtasks"] += subtasks
            record["solved"] += solved
    finally:
        env.close()
        np.random.set_state(saved)
    return out, record


def _targets(name: str, task: int):
    """The goal state of ``name``'s task ``task`` as its single-task env sets it at reset."""
    import gymnasium as gym

    _import_ogbench()
    env = gym.make(singletask_env_id(name, task))
    env.reset(seed=0)
    u = env.unwrapped
    goal = {"num_cubes": getattr(u, "_num_cubes", 0), "num_buttons": getattr(u, "_num_buttons", 0)}
    if hasattr(u, "_cube_target_mocap_ids"):
        goal["cubes"] = u._data.mocap_pos[u._cube_target_mocap_ids].copy()
    if hasattr(u, "_target_button_states"):
        goal["buttons"] = u._target_button_states.copy()
    for part in ("drawer", "window"):
        if hasattr(u, f"_target_{part}_pos"):
            goal[part] = float(getattr(u, f"_target_{part}_pos"))
    env.close()
    return goal


def successes(name: str, goal: dict, qpos, button_states=None):
    """``[T, objects]`` bool: which of the task's objects are in their goal state at each state
    (OGBench's single-task success: a cube within 0.04 of its target, a button in its target
    state, the drawer and the window within 0.04 of their target positions)."""
    import numpy as np

    qpos = np.asarray(qpos)
    parts = []
    n = goal["num_cubes"]
    if "cubes" in goal and n:
        cubes = np.stack([qpos[:, 14 + 7 * i:17 + 7 * i] for i in range(n)], axis=1)
        parts.append(np.linalg.norm(cubes - goal["cubes"][None], axis=-1) <= 0.04)
    if "buttons" in goal:
        parts.append(np.asarray(button_states) == goal["buttons"][None])
    if "drawer" in goal:
        drawer = 14 + 7 * n + goal["num_buttons"]
        parts.append((np.abs(qpos[:, drawer] - goal["drawer"]) <= 0.04)[:, None])
        parts.append((np.abs(qpos[:, drawer + 1] - goal["window"]) <= 0.04)[:, None])
    return np.concatenate(parts, axis=-1)


def relabel(name: str, task: int, episodes: list, *, keep_states: bool = True) -> list:
    """Minari episode buffers of ``episodes`` with task ``task``'s rewards: at state ``s_t``, the
    count of objects in their goal state minus the count of objects; ``terminations[t]`` where
    ``s_t`` solves the task (no bootstrapping from it, as OGBench's ``masks``). ``keep_states``: the
    states go along as Minari ``infos`` (the collected dataset keeps them; a task's view, made from
    it, needs none)."""
    import numpy as np
    from minari.data_collector import EpisodeBuffer

    goal = _targets(name, task)
    out = []
    for ep in episodes:
        T = len(ep["actions"])
        buttons = ep["button_states"][:T] if "button_states" in ep else None
        ok = successes(name, goal, ep["qpos"][:T], buttons)
        rewards = ok.sum(-1).astype(np.float64) - ok.shape[-1]
        infos = {k: np.asarray(ep[k]) for k in ("qpos", "qvel", "button_states") if k in ep} if keep_states else None
        out.append(EpisodeBuffer(id=int(ep["id"]), seed=ep.get("seed"), observations=ep["observations"],
                                 actions=ep["actions"], rewards=rewards, terminations=ok.all(-1),
                                 truncations=np.arange(T) == T - 1, infos=infos))
    return out


def _episodes_of(dataset_id: str) -> list:
    """The stored episodes of a local OGBench dataset, with their state arrays."""
    episodes = read_minari_episodes(open_minari_dataset(dataset_id), dataset_id)
    out = []
    for ep in episodes:
        infos = ep.get("infos") or {}
        if "qpos" not in infos:
            raise DatasetError(f"dataset {dataset_id!r} holds no states (infos 'qpos'), so it cannot be relabelled "
                               f"for another task; remake it: offline-plugins data make {dataset_id} --force")
        row = {"id": ep["id"], "seed": None, "observations": ep["observations"], "actions": ep["actions"],
               **{k: infos[k] for k in ("qpos", "qvel", "button_states") if k in infos}}
        out.append(row)
    return out


def recorded_version(dataset_id: str) -> Optional[str]:
    """The ogbench version a local OGBench dataset was made with (its ``offline_plugins.json``)."""
    path = store_path() / dataset_id / "offline_plugins.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("ogbench")


def check_version(dataset_id: str) -> None:
    """Refuse an OGBench dataset made with another ogbench than the installed one: its oracles,
    goals and evaluation env may differ, so its scores would not be OGBench's."""
    made = recorded_version(dataset_id)
    try:
        installed = version("ogbench")
    except PackageNotFoundError:
        raise DatasetError(f"dataset {dataset_id!r} evaluates in OGBench's environments, and ogbench is not installed; "
                           f"{_FIX}") from None
    if made is None:
        raise DatasetError(f"dataset {dataset_id!r} does not say which ogbench made it (no offline_plugins.json); "
                           f"remake it: offline-plugins data make {dataset_id} --force")
    if made != installed:
        raise DatasetError(f"dataset {dataset_id!r} was made with ogbench {made}, and ogbench {installed} is installed: "
                           f"its oracles and tasks may differ; remake it (offline-plugins data make {dataset_id} "
                           f"--force) or install ogbench=={made}")


def make_ogbench_dataset(
    spec,
    *,
    seed: int = 0,
    progress: bool = True,
    episodes: Optional[int] = None,
    steps: Optional[int] = None,
    episode_steps: Optional[int] = None,
    data_format: Optional[str] = None,
    force: bool = False,
    save_as: Optional[str] = None,
):
    """Make OGBench dataset ``spec`` in the local Minari store (atomically, with a progress bar).

    Keyword Args:
        seed: everything random follows from it.
        progress: a tqdm bar, one tick a step.
        episodes: episodes to collect (default 1,000, the recipe's; fewer for tests).
        steps: collect whole episodes until at least this many steps (instead of ``episodes``).
        episode_steps: steps an episode (default 1,001, the recipe's).
        data_format, force, save_as: as :func:`~offline_plugins.data.build.make_recipe_dataset`.

    A ``-singletask-task<k>`` id is made from its ``ogbench/<env>-<type>-v0`` dataset (made first
    when missing, with these options) by relabelling; ``episodes``/``steps`` then size that one.
    """
    for name, value in (("episodes", episodes), ("steps", steps), ("episode_steps", episode_steps)):
        if value is not None and int(value) < 1:
            raise DatasetError(f"dataset recipe {spec.id!r}: {name}={value} must be at least 1")
    dataset_id = save_as or spec.id
    check_data_format(dataset_id, data_format)
    version = _import_ogbench()
    name, kind, task = parse_ogbench_id(spec.id)
    base = ogbench_id(name, kind)
    stored = None
    if task is not None:
        with outer_store():  # the collected data lives in the store this one goes to, not in a build's own
            if not is_local(base):
                make_dataset(base, seed=seed, progress=progress, episodes=episodes, steps=steps,
                             episode_steps=episode_steps, data_format=data_format, exist_ok=True)
            check_version(base)
            stored = _episodes_of(base)

    def build():
        started = time.monotonic()
        if task is None:
            from tqdm.auto import tqdm

            length = int(episode_steps or EPISODE_STEPS)
            n = int(episodes) if episodes is not None else -(-int(steps) // length) if steps is not None else EPISODES
            with tqdm(total=n * length, desc=dataset_id, unit="step", disable=not progress, leave=False) as pbar:
                collected, record = collect_episodes(name, kind, episodes=n, steps=length, seed=seed, pbar=pbar)
            buffers = relabel(name, OGBENCH_ENVS[name].default_task, collected)
            record.update(episodes=n, steps=length)
        else:
            buffers = relabel(name, task, stored, keep_states=False)
            record = {"from": base}
        record["build_s"] = round(time.monotonic() - started, 1)
        return _write(spec, dataset_id, buffers, name, kind, task, seed, version, record, data_format)

    return build_atomically(dataset_id, build, force=force)


def _write(spec, dataset_id, buffers, name, kind, task, seed, version, record, data_format):
    import minari
    from minari.storage import get_dataset_path

    eval_task = task if task is not None else OGBENCH_ENVS[name].default_task
    eval_env = singletask_env_id(name, eval_task)
    oracle = "plan oracles, action noise 0.1, smoothing 0.5" if kind == "play" else (
        f"Markov oracles with per-episode Gaussian action noise and random actions with probability "
        f"{OGBENCH_ENVS[name].noisy_random_action}")
    made = (f"{len(buffers)} episodes of {len(buffers[0].actions)} steps of ogbench {version}'s {oracle}"
            if task is None else f"{record['from']} relabelled")
    description = (f"OGBench's {name}-{kind} data made locally by offline-plugins recipe {spec.id!r} (seed {seed}): "
                   f"{made}; rewards of single-task task {eval_task} (objects in their goal state minus their count; "
                   f"terminations where the task is solved), evaluated in {eval_env}; the score is the success rate.")
    extra = {"data_format": data_format} if data_format else {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*author_email.*")
        warnings.filterwarnings("ignore", message=".*precision lowered.*")
        dataset = minari.create_dataset_from_buffers(
            dataset_id=dataset_id, buffer=buffers, env=eval_env, eval_env=eval_env,
            algorithm_name=f"ogbench {kind} oracles (generate_manipspace.py)", author="offline-plugins",
            code_permalink="offline_plugins.data.ogbench:make_ogbench_dataset", description=description,
            requirements=[f"ogbench=={version}"], **extra)
    note = {"recipe": spec.id, "seed": seed, "ogbench": version, "task": eval_task, "eval_env": eval_env, **record}
    path = get_dataset_path(dataset_id) / "offline_plugins.json"
    path.write_text(json.dumps(note, indent=1) + "\n")
    return dataset
