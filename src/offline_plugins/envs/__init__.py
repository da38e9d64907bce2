"""Text environments (prompt = state, response = action), the built-in verifiable tasks (arithmetic,
word problems, step chains, tool tasks), tools and their sandboxes, and the maze environment.

Importing this package imports neither torch nor gymnasium; :class:`TextEnv` (the TorchRL
environment the rollout collector steps every round) lives in :mod:`offline_plugins.envs.text`; the
tasks in :mod:`~offline_plugins.envs.arithmetic`, :mod:`~offline_plugins.envs.word_problems`,
:mod:`~offline_plugins.envs.steps` and :mod:`~offline_plugins.envs.multiturn` (what they share in
:mod:`~offline_plugins.envs.task_base`, the catalog ``make_task`` in :mod:`offline_plugins.envs.tasks`);
tools and sandboxes in :mod:`~offline_plugins.envs.tools` and :mod:`~offline_plugins.envs.sandbox`;
their Gymnasium view in :mod:`offline_plugins.envs.gym_text`.
"""

from __future__ import annotations

__all__ = ["GYM_IDS", "register_gymnasium"]

#: Gymnasium ids this package registers, with their entry points
GYM_IDS: dict[str, str] = {
    "offline_plugins/TextArithmetic-v0": "offline_plugins.envs.gym_text:TextTaskGymEnv",
}


def register_gymnasium() -> None:
    """Register :data:`GYM_IDS` with Gymnasium (idempotent).

    Also usable as a ``gymnasium.envs`` entry point, so ``gym.make`` finds the ids
    without importing this package first.
    """
    import gymnasium

    for env_id, entry_point in GYM_IDS.items():
        if env_id not in gymnasium.registry:
            gymnasium.register(id=env_id, entry_point=entry_point)
