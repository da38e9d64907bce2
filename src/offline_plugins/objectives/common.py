"""Helpers the offline-RL losses share: input checks, diagnostics, TorchRL's key contract and TD(0) wiring.

>>> import torch
>>> from tensordict import TensorDict
>>> batch = TensorDict({"observation": torch.zeros(2, 3)}, [2])
>>> check_batch_keys(batch, ["observation", ("next", "reward")], "IQLLoss")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
offline_plugins.objectives.common.MissingBatchKeyError: IQLLoss: the batch has no key ('next', 'reward');...
>>> q = torch.tensor([[2.0], [4.0]])
>>> mc = torch.tensor([[1.0], [1.0]])
>>> d = data_q_diagnostics(q, TensorDict({"mc_return": mc}, [2]), "mc_return")
>>> [(k, float(v)) for k, v in sorted(d.items())]
[('mc_return_mean', 1.0), ('q_data_mean', 3.0), ('q_data_minus_mc', 2.0)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase, dispatch
from tensordict.utils import NestedKey
from torchrl.data import Bounded
from torchrl.objectives.utils import ValueEstimators, dispatch_value_estimator

from offline_plugins.errors import OfflineLossError
from offline_plugins.modules import networks

__all__ = [
    "OfflineLossError",
    "MissingBatchKeyError",
    "ActionSpaceError",
    "HyperparameterError",
    "check_batch_keys",
    "check_range",
    "MC_DIAGNOSTIC_KEYS",
    "DiagnosticsContract",
    "data_q_diagnostics",
    "advantage_diagnostics",
    "MCReturnKey",
    "ColumnsInput",
    "transition_keys",
    "td0_value_estimator_keys",
    "make_td0_value_estimator",
    "TransitionKeys",
    "TD0TransitionLoss",
    "random_transitions",
    "toy_actor_critic",
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


#: the Monte-Carlo pair: read the batch's ``mc_return`` (the data's Monte-Carlo return discounted at
#: the loss's gamma), so they are switched on separately
MC_DIAGNOSTIC_KEYS = ("mc_return_mean", "q_data_minus_mc")

#: how a loss gets ``mc_return``, for the errors that name it
_MC_RETURN_HOW = (
    "the data's Monte-Carlo return discounted at the loss's gamma, sum_k gamma^k r_(t+k) to the episode's end "
    "(not the data layer's undiscounted return_to_go); pass columns=DatasetColumns.of(data.td, {'mc_return': "
    "functools.partial(discounted_returns, gamma=gamma)}) to the loss (offline_plugins.objectives.columns; it "
    "fills batches by their replay-buffer 'index'), add it to the batch yourself, rename yours with "
    "loss.set_keys(mc_return=...)"
)


class ColumnsInput:
    """What a loss that takes ``columns=`` shares: per-transition columns the data layer does not
    store (:class:`~offline_plugins.objectives.columns.DatasetColumns`: the discounted
    ``mc_return``, ReBRAC's ``("next", "action")``) filled into each batch, by its storage
    ``index``, before the loss checks the batch's keys. A batch that carries a column keeps its own.

    A class calls :meth:`_set_columns` after ``nn.Module.__init__`` (a module can be assigned only
    then) and :meth:`_fill_columns` first thing in ``forward``; the columns are a submodule, so
    they follow ``.to()``, and their non-persistent buffers stay out of ``state_dict``.
    """

    def _set_columns(self, columns) -> None:
        self.columns = columns

    def _fill_columns(self, tensordict: TensorDictBase) -> TensorDictBase:
        columns = getattr(self, "columns", None)
        return tensordict if columns is None else columns.fill(tensordict)


class DiagnosticsContract(ColumnsInput):
    """TorchRL's ``out_keys``/``in_keys`` contract, plus detached diagnostics on request.

    The one rule for our subclasses of TorchRL's losses: with ``diagnostics=False`` (the
    default) ``out_keys``, ``in_keys`` and what a keyword call returns are TorchRL's. With
    ``diagnostics=True`` the class's diagnostics are listed in ``out_keys`` after TorchRL's
    keys and returned. With ``mc_diagnostics=True`` as well, ``mc_return`` (the data's
    Monte-Carlo return discounted at the loss's gamma, :class:`MCReturnKey`) joins
    ``in_keys``, ``mc_return_mean``/``q_data_minus_mc`` are listed last and always
    returned, and a batch without ``mc_return`` raises :class:`MissingBatchKeyError`.
    Every setting is fixed at construction, so ``out_keys`` never depends on the data.

    The loss's ``columns`` (:class:`ColumnsInput`; a
    :class:`~offline_plugins.objectives.columns.DatasetColumns`, e.g. ``mc_return`` from
    :func:`~offline_plugins.objectives.columns.discounted_returns`) are filled into the batch by
    :meth:`_check_batch`, before any key is checked.

    A class lists this base before TorchRL's and provides ``_torchrl_out_keys()`` and
    ``_diagnostic_keys()`` (its own diagnostics, the Monte-Carlo pair excluded); it calls
    :meth:`_init_diagnostics` before TorchRL's ``__init__``, :meth:`_set_out_keys` and
    :meth:`_set_columns` after it, and :meth:`_check_batch` at the start of ``forward``, or
    has ``forward`` return :meth:`_diagnosed_forward` (TorchRL's ``forward`` and
    ``_diagnose()``'s entries).
    """

    # TorchRL declares most losses' ``out_keys`` as a class-level list, which
    # ``TensorDictModuleBase.__new__`` turns into a property only on the class being
    # instantiated: a subclass inherits the raw list, and ``select_out_keys`` fails unless
    # TorchRL's own class was built first. Declaring the property here makes it hold for
    # our classes and their subclasses from the start (and replaces ``CQLLoss``'s own
    # property, whose setter leaves the ``_out_keys_apparent`` that selections use unset).
    out_keys = TensorDictModuleBase.out_keys

    #: whether TorchRL's output is shaped like the batch under ``reduction="none"`` (IQL,
    #: CQL): it then has no room for batch statistics, as it has none for TorchRL's scalars
    _unreduced_output_is_batched = True

    def _init_diagnostics(self, diagnostics: bool, mc_diagnostics: bool = False) -> None:
        if mc_diagnostics and not diagnostics:
            raise HyperparameterError(
                f"{type(self).__name__}: mc_diagnostics=True adds to the diagnostics, which are off; "
                "pass diagnostics=True as well, or mc_diagnostics=False"
            )
        self.diagnostics = bool(diagnostics)
        self.mc_diagnostics = bool(mc_diagnostics)

    def _diagnostic_keys(self) -> list:
        return []

    def _emits_diagnostics(self) -> bool:
        return self.diagnostics and not (self._unreduced_output_is_batched and self.reduction == "none")

    def _emits_mc(self) -> bool:
        return self.mc_diagnostics and self._emits_diagnostics()

    def _set_out_keys(self) -> None:
        """``out_keys``: TorchRL's, then the diagnostics, then the Monte-Carlo pair."""
        keys = list(self._torchrl_out_keys())
        if self._emits_diagnostics():
            keys += self._diagnostic_keys()
        if self._emits_mc():
            keys += MC_DIAGNOSTIC_KEYS
        self.out_keys = keys

    @property
    def in_keys(self) -> list:
        keys = list(super().in_keys)
        if self._emits_mc() and self.tensor_keys.mc_return not in keys:
            # so a keyword call takes ``mc_return=``
            keys.append(self.tensor_keys.mc_return)
        return keys

    @in_keys.setter
    def in_keys(self, values) -> None:
        self._in_keys = values  # as TorchRL's setters (CQLLoss has none: it computes its keys)

    def _observation_keys(self) -> list:
        """The observation keys of a transition (the actor's ``in_keys``)."""
        return self.actor_network.in_keys

    def _check_batch(self, tensordict: TensorDictBase) -> None:
        """Fill the loss's ``columns`` into the batch, then raise :class:`MissingBatchKeyError`
        for a batch without a transition's keys (:func:`transition_keys`) or the ``mc_return``
        the diagnostics read."""
        self._fill_columns(tensordict)
        check_batch_keys(tensordict, transition_keys(self._observation_keys(), self.tensor_keys), type(self).__name__)
        self._check_diagnostic_keys(tensordict)

    def _diagnosed_forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """TorchRL's ``forward`` on a checked batch, then, when the diagnostics are on, the
        entries of the class's ``_diagnose(tensordict)`` (computed without gradients)."""
        self._check_batch(tensordict)
        out = super().forward(tensordict)
        if self._emits_diagnostics():
            with torch.no_grad():
                out.update(self._diagnose(tensordict))
        return out

    def _check_diagnostic_keys(self, tensordict: TensorDictBase) -> None:
        key = self.tensor_keys.mc_return if self._emits_mc() else None
        if key is not None and tensordict.get(key, None) is None:
            raise MissingBatchKeyError(
                f"{type(self).__name__}: the batch has no key {key!r}, which mc_diagnostics=True reads for "
                f"{' and '.join(MC_DIAGNOSTIC_KEYS)}: {_MC_RETURN_HOW}, or pass mc_diagnostics=False"
            )

    def _counted_positions(self, tensordict: TensorDictBase, like: torch.Tensor) -> Optional[torch.Tensor]:
        """The positions the loss's reduction counts (TorchRL's loss masks), shaped like ``like``; None: all."""
        valid = None
        mask_keys = getattr(self, "_loss_mask_keys", None)  # TorchRL >= 0.12
        for mask_key in mask_keys() if mask_keys is not None else ():
            mask = tensordict.get(mask_key, None)
            if mask is not None:
                mask = self._expand_loss_mask(mask, like)
                valid = mask if valid is None else valid & mask
        return valid

    def _mc_diagnostics(self, q_data: torch.Tensor, tensordict: TensorDictBase, valid) -> dict:
        """The Monte-Carlo pair for ``q_data`` (already restricted to ``valid``); empty when off."""
        if not self._emits_mc():
            return {}
        mc = tensordict.get(self.tensor_keys.mc_return).to(q_data.dtype)
        mc = mc.reshape(valid.shape if valid is not None else q_data.shape)
        if valid is not None:
            mc = mc[valid]
        return {"mc_return_mean": mc.mean(), "q_data_minus_mc": (q_data.detach() - mc).mean()}


def data_q_diagnostics(q_data: torch.Tensor, tensordict: TensorDictBase, return_key: NestedKey) -> dict:
    """Mean Q on the dataset's actions, and its gap to the data's Monte-Carlo return.

    ``q_data_minus_mc`` > 0 that grows during training is the over-estimation
    that extrapolation error causes (Fujimoto et al. 2019); it is only reported
    when the batch carries the Monte-Carlo return (``return_key``, ``mc_return``: discounted
    at the loss's gamma, as Q is; :func:`~offline_plugins.objectives.columns.discounted_returns`).
    """
    q_data = q_data.detach()
    out = {"q_data_mean": q_data.mean()}
    mc = tensordict.get(return_key, None)
    if mc is not None:
        mc = mc.to(q_data.dtype)
        out["mc_return_mean"] = mc.mean()
        out["q_data_minus_mc"] = (q_data.reshape(mc.shape) - mc).mean()
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


def random_transitions(action: torch.Tensor, obs_dim: int, **entries: torch.Tensor) -> TensorDict:
    """A batch of random transitions in TorchRL's TED layout, for examples and tests.

    ``action`` ``[B, ...]`` is the batch's action; ``observation`` and ``("next", "observation")``
    ``[B, obs_dim]`` and ``("next", "reward")`` ``[B, 1]`` are standard normal, and
    ``("next", "done")``/``("next", "terminated")`` False. ``entries``: further keys
    (``mc_return=...``).

    >>> batch = random_transitions(torch.randint(4, (5,)), obs_dim=3)
    >>> batch.batch_size, batch["next", "observation"].shape, batch["next", "terminated"].any().item()
    (torch.Size([5]), torch.Size([5, 3]), False)
    """
    n = action.shape[0]
    return TensorDict(
        {
            "observation": torch.randn(n, obs_dim),
            "action": action,
            ("next", "observation"): torch.randn(n, obs_dim),
            ("next", "reward"): torch.randn(n, 1),
            ("next", "done"): torch.zeros(n, 1, dtype=torch.bool),
            ("next", "terminated"): torch.zeros(n, 1, dtype=torch.bool),
            **entries,
        },
        [n],
    )


_TOY_ACTORS = {"tanh-gaussian": networks.make_tanh_gaussian_actor, "deterministic": networks.make_deterministic_actor}


def toy_actor_critic(actor: str = "tanh-gaussian", *, layer_norm: bool = False, **entries: torch.Tensor):
    """An actor, a critic, their action spec and a batch: the small problem of the losses' examples.

    The observation has 3 dimensions and the action 2 in ``[-1, 1]``; the networks are
    :mod:`offline_plugins.modules.networks`' with one hidden layer of 8 units: ``actor``
    ``"tanh-gaussian"`` (``make_tanh_gaussian_actor``) or ``"deterministic"``
    (``make_deterministic_actor``), the critic ``make_qvalue`` (``make_layer_norm_qvalue`` with
    ``layer_norm=True``). The batch is :func:`random_transitions` of 4 actions drawn from the spec,
    with ``entries``. Returns ``(actor, qvalue, spec, batch)``.

    >>> actor, qvalue, spec, batch = toy_actor_critic("deterministic")
    >>> actor(batch.select("observation"))["action"].shape, spec.shape
    (torch.Size([4, 2]), torch.Size([2]))
    """
    if actor not in _TOY_ACTORS:
        raise ValueError(f"toy_actor_critic: unknown actor {actor!r}; expected one of {sorted(_TOY_ACTORS)}")
    spec = Bounded(-torch.ones(2), torch.ones(2), (2,))
    make_qvalue = networks.make_layer_norm_qvalue if layer_norm else networks.make_qvalue
    batch = random_transitions(spec.rand((4,)), obs_dim=3, **entries)
    return _TOY_ACTORS[actor](3, spec, (8,)), make_qvalue(3, 2, (8,)), spec, batch


def _td0_tensor_keys(loss, value_key: NestedKey) -> dict:
    keys = loss.tensor_keys
    return {"value": value_key, "reward": keys.reward, "done": keys.done, "terminated": keys.terminated}


def td0_value_estimator_keys(loss, value_key: NestedKey) -> None:
    """Forward ``loss``'s (possibly renamed) keys to its value estimator, if it has one."""
    if loss._value_estimator is not None:
        loss._value_estimator.set_keys(**_td0_tensor_keys(loss, value_key))


def make_td0_value_estimator(loss, value_type, value_key: NestedKey, **hyperparams) -> None:
    """Give ``loss`` a TD(0) estimator that reads the next-state value the loss writes at ``value_key``."""
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


@dataclass
class MCReturnKey:
    """The key our diagnostics add to the ``_AcceptedKeys`` of TorchRL's losses (CQL, IQL, TD3+BC,
    SAC): mixed in first, ``class _AcceptedKeys(MCReturnKey, TorchRLLoss._AcceptedKeys)``, so it
    comes after TorchRL's keys.

    Attributes:
        mc_return (NestedKey): the data's Monte-Carlo return from the state, discounted at the
            loss's gamma (:func:`~offline_plugins.objectives.columns.discounted_returns`; the
            data layer's ``return_to_go`` is undiscounted and is not it), ``[*B, 1]``, read only
            with ``mc_diagnostics=True``. Defaults to ``"mc_return"``.
    """

    mc_return: NestedKey = "mc_return"


@dataclass
class TransitionKeys:
    """The keys every :class:`TD0TransitionLoss` reads and writes; a loss's ``_AcceptedKeys`` adds its own.

    Attributes:
        action (NestedKey): the dataset's action. Defaults to ``"action"``.
        reward, done, terminated (NestedKey): under ``"next"``. Default to their names.
        priority (NestedKey): where the TD error is written. Defaults to ``"td_error"``.
        mc_return (NestedKey): the data's Monte-Carlo return discounted at the loss's gamma
            (:class:`MCReturnKey`), read only for diagnostics when present. Defaults to
            ``"mc_return"``.
    """

    action: NestedKey = "action"
    reward: NestedKey = "reward"
    done: NestedKey = "done"
    terminated: NestedKey = "terminated"
    priority: NestedKey = "td_error"
    mc_return: NestedKey = "mc_return"


class TD0TransitionLoss(ColumnsInput):
    """What our own transition losses with a TD(0) critic (AWAC, BCQ, discrete BCQ; TorchRL has
    none of them) share: the keys they read, the estimator wiring, the target and ``forward``.

    A class lists this base before TorchRL's ``LossModule``; its ``_AcceptedKeys`` extends
    :class:`TransitionKeys`, ``_next_value_key`` names the key field of the next-state value
    the loss computes and the TD(0) estimator reads, and it provides
    ``_loss_terms(batch) -> (losses, td_error, q_data, diagnostics)`` (and
    ``_observation_keys()`` unless it reads ``tensor_keys.observation``), and calls
    :meth:`_set_columns` in its ``__init__``. ``forward`` fills the loss's ``columns`` into the
    batch (:class:`ColumnsInput`), checks the batch's keys (:attr:`in_keys`), flattens it to
    ``[batch]``, writes ``td_error`` at ``priority`` and returns the losses, then, with
    ``diagnostics``, :func:`data_q_diagnostics` of ``q_data`` (the Monte-Carlo pair when the
    batch carries ``mc_return``) and the loss's own diagnostics.
    """

    _next_value_key = "state_action_value"

    def _observation_keys(self) -> list:
        return [self.tensor_keys.observation]

    def _forward_value_estimator_keys(self, **kwargs) -> None:
        td0_value_estimator_keys(self, getattr(self.tensor_keys, self._next_value_key))

    def make_value_estimator(self, value_type=None, **hyperparams) -> None:
        # the next-state value is computed by the loss and read from the batch
        make_td0_value_estimator(self, value_type, getattr(self.tensor_keys, self._next_value_key), **hyperparams)

    @property
    def in_keys(self) -> list:
        keys, obs = self.tensor_keys, list(self._observation_keys())
        return [*obs, keys.action, *[("next", k) for k in obs], ("next", keys.reward), ("next", keys.done),
                ("next", keys.terminated)]

    def _td0_target(self, tensordict: TensorDictBase, next_value: torch.Tensor) -> torch.Tensor:
        """The value estimator's target for ``next_value`` (the next-state value, shaped ``[*batch, 1]``)."""
        keys = self.tensor_keys
        td = tensordict.select(("next", keys.reward), ("next", keys.done), ("next", keys.terminated))
        td.set(("next", getattr(keys, self._next_value_key)), next_value)
        return self.value_estimator.value_estimate(td).squeeze(-1)

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        self._fill_columns(tensordict)
        check_batch_keys(tensordict, self.in_keys, type(self).__name__)
        if tensordict.ndim != 1:
            tensordict = tensordict.reshape(-1)
        losses, td_error, q_data, diagnostics = self._loss_terms(tensordict)
        tensordict.set(self.tensor_keys.priority, td_error)
        out = TensorDict(losses)
        if self.diagnostics:
            out.update(data_q_diagnostics(q_data, tensordict, self.tensor_keys.mc_return))
            out.update(diagnostics)
        return out
