"""Environments that are not text: the in-context RL task families of Algorithm Distillation
(:mod:`~offline_plugins.envs.icl`) and the maze (:mod:`~offline_plugins.envs.maze`), and the Gymnasium
registration of the ids this package defines (:func:`register_gymnasium`; the text environments are in
:mod:`offline_plugins.text.envs`).

Importing this package imports gymnasium, not torch.
"""

from __future__ import annotations

import gymnasium

__all__ = ["GYM_IDS", "register_gymnasium"]

#: Gymnasium ids this package registers, with their entry points
GYM_IDS: dict[str, str] = {
    "offline_plugins/TextArithmetic-v0": "offline_plugins.text.envs.gym_text:TextTaskGymEnv",
}


def register_gymnasium() -> None:
    """Register :data:`GYM_IDS` with Gymnasium (idempotent).

    Also usable as a ``gymnasium.envs`` entry point, so ``gym.make`` finds the ids
    without importing this package first.
    """
    for env_id, entry_point in GYM_IDS.items():
        if env_id not in gymnasium.registry:
            gymnasium.register(id=env_id, entry_point=entry_point)
