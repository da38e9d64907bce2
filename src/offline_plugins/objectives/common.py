"""Helpers the offline-RL losses share: input checks, diagnostics and TD(0) estimator wiring.

>>> import torch
>>> from tensordict import TensorDict
>>> batch = TensorDict({"observation": torch.zeros(2, 3)}, [2])
>>> check_batch_keys(batch, ["observation", ("next", "reward")], "IQLLoss")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
offline_plugins.objectives.common.MissingBatchKeyError: IQLLoss: the batch has no key ('next', 'reward');...
>>> q = torch.tensor([[2.0], [4.0]])
>>> rtg = torch.tensor([[1.0], [1.0]])
>>> d = data_q_diagnostics(q, TensorDict({"return_to_go": rtg}, [2]), "return_to_go")
>>> [(k, float(v)) for k, v in sorted(d.items())]
[('mc_return_mean', 1.0), ('q_data_mean', 3.0), ('q_data_minus_mc', 2.0)]
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

from offline_plugins.errors import OfflineLossError

__all__ = [
    "OfflineLossError",
    "MissingBatchKeyError",
    "ActionSpaceError",
    "HyperparameterError",
    "check_batch_keys",
    "check_range",
    "data_q_diagnostics",
    "advantage_diagnostics",
    "transition_keys",
    "td0_value_estimator_keys",
    "make_td0_value_estimator",
]


class MissingBatchKeyError(OfflineLossError, KeyError):
    """The batch lacks a key the loss reads."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0] if self.args else ""


class ActionSpaceError(OfflineLossError):
    """An algorithm was given an action space it does not support."""


class HyperparameterError(OfflineLossError):
    """A hyperparameter outside its valid range."""


def check_batch_keys(tensordict: TensorDictBase, keys: Iterable[NestedKey], owner: str) -> None:
    """Raise :class:`MissingBatchKeyError` naming the first key of ``keys`` the batch lacks."""
    for key in keys:
        if tensordict.get(key, None) is None:
            raise MissingBatchKeyError(
                f"{owner}: the batch has no key {key!r}; it expects TorchRL's TED layout "
                "(observation, action, ('next', 'observation'|'reward'|'done'|'terminated')). "
                f"Sample from an OfflineData replay buffer, or rename your keys with loss.set_keys(...)"
            )


def check_range(
    owner: str,
    name: str,
    value: float,
    low: Optional[float] = None,
    high: Optional[float] = None,
    *,
    low_inclusive: bool = False,
    high_inclusive: bool = False,
) -> float:
    """Return ``float(value)`` or raise :class:`HyperparameterError` naming ``name`` and the range."""
    value = float(value)
    ok = True
    if low is not None:
        ok &= value >= low if low_inclusive else value > low
    if high is not None:
        ok &= value <= high if high_inclusive else value < high
    if not ok:
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        left = "[" if low_inclusive else "("
        right = "]" if high_inclusive else ")"
        raise HyperparameterError(
            f"{owner}: {name}={value:g} is outside {left}{lo}, {hi}{right}; set {name} to a value in that range"
        )
    return value


def data_q_diagnostics(q_data: torch.Tensor, tensordict: TensorDictBase, return_key: NestedKey) -> dict:
    """Mean Q on the dataset's actions, and its gap to the data's Monte-Carlo return.

    ``q_data_minus_mc`` > 0 that grows during training is the over-estimation
    that extrapolation error causes (Fujimoto et al. 2019); it is only reported
    when the batch carries the discounted return-to-go (``return_key``).
    """
    q_data = q_data.detach()
    out = {"q_data_mean": q_data.mean()}
    rtg = tensordict.get(return_key, None)
    if rtg is not None:
        rtg = rtg.to(q_data.dtype)
        out["mc_return_mean"] = rtg.mean()
        out["q_data_minus_mc"] = (q_data.reshape(rtg.shape) - rtg).mean()
    return out


def advantage_diagnostics(value: torch.Tensor, advantage: torch.Tensor, weight: torch.Tensor, max_weight) -> dict:
    """``value_mean``, ``advantage_mean``/``_std`` and the advantage weights' mean and clipped fraction."""
    return {
        "value_mean": value.mean(),
        "advantage_mean": advantage.mean(),
        "advantage_std": advantage.std(),
        "advantage_weight_mean": weight.mean(),
        "advantage_weight_clipped_frac": (weight >= max_weight).float().mean(),
    }


def transition_keys(obs_keys: Iterable[NestedKey], keys) -> list:
    """The keys a transition batch needs: observation(s), action, next reward/done/terminated, next observation(s)."""
    obs_keys = list(obs_keys)
    return [
        *obs_keys,
        keys.action,
        ("next", keys.reward),
        ("next", keys.done),
        ("next", keys.terminated),
        *[("next", k) for k in obs_keys],
    ]


def _td0_tensor_keys(loss, value_key: NestedKey) -> dict:
    keys = loss.tensor_keys
    return {"value": value_key, "reward": keys.reward, "done": keys.done, "terminated": keys.terminated}


def td0_value_estimator_keys(loss, value_key: NestedKey) -> None:
    """Forward ``loss``'s (possibly renamed) keys to its value estimator, if it has one."""
    if loss._value_estimator is not None:
        loss._value_estimator.set_keys(**_td0_tensor_keys(loss, value_key))


def make_td0_value_estimator(loss, value_type, value_key: NestedKey, **hyperparams) -> None:
    """Give ``loss`` a TD(0) estimator that reads the next-state value the loss writes at ``value_key``."""
    from torchrl.objectives.utils import ValueEstimators, dispatch_value_estimator  # lazy: _glue imports this module

    if value_type is None:
        value_type = loss.default_value_estimator
    dispatch_value_estimator(
        loss,
        value_type,
        supported=(ValueEstimators.TD0,),
        tensor_keys=_td0_tensor_keys(loss, value_key),
        value_network=None,
        **hyperparams,
    )
