"""Helpers the offline-RL glue modules share inside their ``build`` functions.

Imported lazily (from inside ``build``), so it may import torch.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional

from offline_plugins.algorithms.base import AlgorithmParts, OptimizerGroup
from offline_plugins.config import ConfigError
from offline_plugins.errors import UserError
from offline_plugins.objectives.columns import DatasetColumns, discounted_returns
from offline_plugins.objectives.common import ActionSpaceError, check_range
from offline_plugins.objectives.target import FusedSoftUpdate
from offline_plugins.text.data.rollouts import RolloutData

__all__ = [
    "check_inputs",
    "check_data",
    "check_common",
    "obs_dim",
    "action_dim",
    "num_actions",
    "mc_columns",
    "params",
    "soft_updater",
    "group",
    "actor_critic_groups",
    "transition_parts",
]


def check_data(data: Any, algorithm: str, action_space: str) -> None:
    """Raise :class:`ActionSpaceError` unless ``data`` has the specs and ``action_space`` the algorithm needs."""
    for attr in ("observation_spec", "action_spec", "action_space"):
        if not hasattr(data, attr):
            raise ActionSpaceError(
                f"{algorithm}: the data object has no {attr!r}; build(config, data) expects an OfflineData "
                "(or any object with observation_spec, action_spec and action_space)"
            )
    if data.action_space != action_space:
        twin = {"continuous": "discrete", "discrete": "continuous"}.get(action_space, "")
        other = algorithm[: -len("-discrete")] if algorithm.endswith("-discrete") else f"{algorithm}-discrete"
        fix = f"use '{other}'" if twin == data.action_space else "use a dataset with that action space"
        raise ActionSpaceError(
            f"{algorithm}: the dataset has {data.action_space!r} actions but {algorithm} needs {action_space!r} "
            f"actions; {fix}"
        )


def check_common(config: Any, algorithm: str) -> None:
    """Validate the fields every offline-RL config has (those it has)."""
    for name in ("gamma", "tau"):
        if hasattr(config, name):
            check_range(algorithm, name, getattr(config, name), 0.0, 1.0, high_inclusive=True)
    for name in dir(config):
        if name == "lr" or name.endswith("_lr"):
            check_range(algorithm, name, getattr(config, name), 0.0, None)
    if hasattr(config, "batch_size"):
        check_range(algorithm, "batch_size", config.batch_size, 1, None, low_inclusive=True)
    if hasattr(config, "hidden"):
        widths = tuple(config.hidden)
        if not widths or any(int(w) < 1 for w in widths):
            raise ConfigError(f"{algorithm}: hidden={widths!r} must be positive layer widths, e.g. [256, 256]")


def check_inputs(config: Any, data: Any, algorithm: str, action_space: str) -> None:
    """:func:`check_data` then :func:`check_common`: the checks every ``build`` starts with."""
    check_data(data, algorithm, action_space)
    check_common(config, algorithm)


def obs_dim(data: Any) -> int:
    shape = tuple(data.observation_spec.shape)
    if len(shape) != 1:
        raise ActionSpaceError(
            f"observation_spec has shape {shape}; the MLP networks need flat observations of shape [obs_dim] "
            "(flatten them in the data layer)"
        )
    return int(shape[0])


def action_dim(data: Any) -> int:
    return int(data.action_spec.shape[-1])


def num_actions(data: Any) -> int:
    spec = data.action_spec
    n = getattr(spec, "n", None)
    if n is None:
        n = getattr(getattr(spec, "space", None), "n", None)
    if n is None:
        raise ActionSpaceError(
            f"a discrete action_spec must be torchrl.data.Categorical(n), got {type(spec).__name__}"
        )
    return int(n)


def mc_columns(data: Any, gamma: float, extra: Optional[Mapping[Any, Callable]] = None):
    """The :class:`~offline_plugins.objectives.columns.DatasetColumns` a loss's ``columns=`` takes:
    ``mc_return``, the data's Monte-Carlo return discounted at ``gamma`` (the loss's, so that
    ``q_data_minus_mc`` compares Q with the return it estimates;
    :func:`~offline_plugins.objectives.columns.discounted_returns`), and the columns ``extra``
    makes (``{key: make(td)}``, e.g. ReBRAC's ``("next", "action")``), computed from the stored
    episodes ``data.td`` and filled into batches by their replay-buffer ``index``. The makers are
    kept, so the online phase of fine-tuning computes the columns for its new transitions.

    None for data without stored episodes (no ``td``): a loss then runs without its Monte-Carlo
    diagnostics (``mc_diagnostics=columns is not None``)."""
    td = getattr(data, "td", None)
    if td is None:
        return None

    makers = {"mc_return": functools.partial(discounted_returns, gamma=float(gamma)), **dict(extra or {})}
    return DatasetColumns.of(td, makers)


def params(*modules) -> list:
    """The trainable parameters of ``modules`` (TensorDictParams or nn.Modules), deduplicated."""
    seen, out = set(), []
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                out.append(p)
    return out


def soft_updater(loss, tau: float):
    """TorchRL's Polyak ``SoftUpdate`` bound to ``loss``: ``target <- (1 - tau) target + tau online``,
    stepped in one fused call (:class:`~offline_plugins.objectives.target.FusedSoftUpdate`)."""
    return FusedSoftUpdate(loss, tau=tau)


def group(name: str, module, lr: float, *loss_keys: str, **kwargs):
    """An :class:`~offline_plugins.algorithms.base.OptimizerGroup` stepping ``module``'s trainable
    parameters (:func:`params`; a list is taken as the parameters themselves) on the sum of
    ``loss_keys``; ``kwargs``: its other fields."""
    return OptimizerGroup(name, module if isinstance(module, list) else params(module), lr, tuple(loss_keys), **kwargs)


def actor_critic_groups(loss, config: Any, *critic_keys: str, actor_every: int = 1) -> list:
    """The ``critic`` group (``loss.qvalue_network_params`` on ``critic_keys``, default
    ``loss_qvalue``, at ``config.critic_lr``), then the ``actor`` group
    (``loss.actor_network_params`` on ``loss_actor``, at ``config.actor_lr``, every
    ``actor_every`` steps)."""
    return [
        group("critic", loss.qvalue_network_params, config.critic_lr, *(critic_keys or ("loss_qvalue",))),
        group("actor", loss.actor_network_params, config.actor_lr, "loss_actor", every=actor_every),
    ]


def transition_parts(loss, policy, config: Any, optimizers: list, **kwargs):
    """The parts of a TD(0) offline-RL algorithm: ``loss`` gets its value estimator with
    ``config.gamma``, and its targets a Polyak updater with ``config.tau`` (:func:`soft_updater`);
    ``kwargs``: further :class:`~offline_plugins.algorithms.base.AlgorithmParts` fields."""
    loss.make_value_estimator(gamma=config.gamma)
    return AlgorithmParts(
        loss=loss, policy=policy, optimizers=optimizers, target_updater=soft_updater(loss, config.tau), **kwargs
    )


def require_rollouts(data: Any, algorithm: str) -> None:
    """Refuse data that is not a :class:`~offline_plugins.text.data.rollouts.RolloutData` (what the
    text-rollouts kind loads), naming what was given and how to load the right one."""
    if not isinstance(data, RolloutData):
        raise UserError(f"{algorithm} trains on its own rollouts: give it a RolloutData "
                        f"(offline_plugins.text.data.rollouts.load_rollout_data), not a {type(data).__name__}")
