"""What an algorithm's ``build(config, data)`` returns: the parts a trainer needs.

An :class:`AlgorithmParts` holds the TorchRL loss, the evaluation policy, the
optimiser groups (which parameters, which learning rate, which ``loss_*`` terms
they minimise) and the target-network updater. The Lightning shell trains any of
them; a plain TorchRL loop can use the same parts (``examples/compose_in_torchrl.py``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from tensordict.nn import TensorDictModuleBase
from torchrl.objectives import LossModule

from offline_plugins.errors import UserError

__all__ = ["OptimizerGroup", "RolloutPlan", "AlgorithmParts", "adam_kernel", "compute_terms", "target_update_period"]


@dataclass
class OptimizerGroup:
    """One optimiser: its parameters, learning rate and the loss terms it minimises.

    Attributes:
        name: ``actor``, ``critic``, ``value``, ``alpha``... (used in logs and checkpoints).
        params: the parameters it steps.
        lr: learning rate.
        loss_keys: the ``loss_*`` entries of the loss output whose sum it minimises.
        every: step it every ``every`` gradient steps (TD3+BC's delayed actor); see :meth:`due`.
        weight_decay: weight decay; decoupled from the gradient (AdamW's, Loshchilov & Hutter
            2019) when ``decoupled_weight_decay``, else Adam's L2 term added to the gradient.
        max_grad_norm: clip gradients of ``params`` to this norm first (None: no clipping).
        betas: Adam's moment decay rates (GPT-style models: ``(0.9, 0.95)``).
        decoupled_weight_decay: AdamW's decay (what the transformer references use) instead of L2.
    """

    name: str
    params: Sequence[torch.nn.Parameter]
    lr: float
    loss_keys: tuple[str, ...]
    every: int = 1
    weight_decay: float = 0.0
    max_grad_norm: Optional[float] = None
    betas: tuple[float, float] = (0.9, 0.999)
    decoupled_weight_decay: bool = False

    def due(self, step: int) -> bool:
        """Whether the group steps at the 0-based gradient step ``step``: on every
        ``every``-th step, the first at ``step = every - 1``, as TD3's delayed actor
        (``total_it += 1; if total_it % policy_freq == 0``).

        >>> [OptimizerGroup("actor", [], 1e-3, ("loss_actor",), every=2).due(t) for t in range(4)]
        [False, True, False, True]
        """
        return (step + 1) % self.every == 0

    def trainable(self) -> list[torch.nn.Parameter]:
        """The parameters that require gradients; raises when there are none."""
        params = [p for p in self.params if p.requires_grad]
        if not params:
            raise ValueError(f"optimiser group {self.name!r} has no trainable parameters")
        return params

    def make_optimizer(self) -> torch.optim.Optimizer:
        """This group's optimiser: Adam with the group's learning rate and weight decay.

        A subclass may return another optimiser; the Lightning shell then steps the
        groups' own optimisers (:class:`~offline_plugins.lightning.optimizers.OptimizerChain`)
        instead of one grouped Adam.
        """
        params = self.trainable()
        return torch.optim.Adam(params, lr=self.lr, weight_decay=self.weight_decay, betas=tuple(self.betas),
                                decoupled_weight_decay=self.decoupled_weight_decay, **adam_kernel(params))


def adam_kernel(params: Sequence[torch.nn.Parameter]) -> dict[str, bool]:
    """``{"fused": True}`` when Adam's fused kernel applies to ``params``, else ``{"foreach": True}``.

    The fused kernel (one kernel for every tensor) runs on CUDA and, since torch 2.4, on
    CPU, where it measured 3.6x faster than foreach for 2x256 MLPs
    (bench/offline_bench.py); it needs floating-point parameters all on one device type.
    """
    devices = {p.device.type for p in params}
    fused = len(devices) == 1 and devices <= {"cuda", "cpu"} and all(p.is_floating_point() for p in params)
    return {"fused": True} if fused else {"foreach": True}


def compute_terms(loss: LossModule, batch, keys: Optional[Sequence[str]] = None):
    """``loss(batch)``; with ``keys``, ``loss.loss_terms(batch, keys)`` where the loss offers it.

    ``loss_terms`` is an optional method of a loss whose terms are stepped at different
    rates: it computes the ``loss_*`` terms in ``keys`` (and may skip the rest), e.g.
    TD3+BC's critic-only steps without the actor's forward.
    """
    terms = getattr(loss, "loss_terms", None) if keys is not None else None
    return loss(batch) if terms is None else terms(batch, keys)


def target_update_period(every: Optional[int], groups: Sequence[OptimizerGroup]) -> int:
    """Gradient steps between target-network updates: ``every`` (``AlgorithmParts.target_update_every``)
    if the algorithm set it, else the slowest group's ``every`` (TD3+BC moves its targets with the
    delayed actor).

    >>> target_update_period(None, [OptimizerGroup("critic", [], 1e-3, ("loss_qvalue",)),
    ...                             OptimizerGroup("actor", [], 1e-3, ("loss_actor",), every=2)])
    2
    """
    if isinstance(every, dict):  # the old call, with the parts' extra dict
        every = every.get("target_update_every")
    if every is not None:
        return int(every)
    return max(g.every for g in groups)


@dataclass
class RolloutPlan:
    """What a round of rollouts needs from an online algorithm (``AlgorithmParts.rollout``).

    ``build(config, data)`` returns it and leaves the data as it was loaded; the
    ``text-rollouts`` kind's data module
    (:class:`~offline_plugins.kinds.rollouts.rounds.RolloutDataModule`) runs the rounds from it.

    Attributes:
        process: ``process(rollouts) -> rollouts`` with ``"advantage"`` (and ``"has_signal"``)
            written: the loss's ``process_rollouts``.
        dynamic_sampling: replace groups whose rewards are all equal by newly sampled ones (DAPO).
        min_group_size: the smallest ``group_size`` the loss accepts (group methods 2, PPO 1).
        epochs: passes over a round's training rows.
        epochs_field: the config field ``epochs`` came from, for error messages.
        training_rows: None (train on the rollout rows) or ``rows(rollouts) -> rows``: what a
            round trains on instead (e.g. one preference pair per prompt); it must return
            ``rows_per_round`` rows whatever the rollouts hold.
        rows_per_round: with ``training_rows``, how many rows it returns.
        rows_what: what those rows are, for error messages.
        source: the prompt source a round samples from and evaluation scores on, when the
            algorithm transforms the prompts (text-DT's return conditioning); None: the data's.
        reference: the model whose log-probs are the rollouts' reference, when it is not the
            data's (LoRA: the policy with its adapters off; text-DT: the reference with the
            reward tokens' embeddings); None: the data's.
        tokenizer: the tokenizer of the policy, when it is not the data's (text-DT adds tokens).
        generator: what samples the rounds when it is not the policy's own ``generate``: an
            engine with the same ``generate`` contract and a ``before_round(model, step)`` that
            loads the policy's weights into it (``--generator vllm``:
            :class:`~offline_plugins.text.backends.vllm_engine.VLLMGenerator`); None: ``generate``.
        sync_check: a :class:`~offline_plugins.text.collectors.sync_check.SyncCheck` the data module runs after
            the rounds it is due on (the sampler's log-probs against the trainer's); None: none.
        max_staleness: sample each round beside the training of the one before
            (``--set async_rollouts=true``), from weights at most this many optimiser steps older than
            the policy that trains on it (:class:`~offline_plugins.text.collectors.async_sampler.AsyncSampler`);
            None: rounds are sampled, then trained on, in turn.
    """

    process: Callable[[Any], Any]
    dynamic_sampling: bool = False
    min_group_size: int = 2
    epochs: int = 1
    epochs_field: str = "ppo_epochs"
    training_rows: Optional[Callable[[Any], Any]] = None
    rows_per_round: Optional[int] = None
    rows_what: str = "training rows"
    source: Optional[Any] = None
    reference: Optional[torch.nn.Module] = None
    tokenizer: Optional[Any] = None
    generator: Optional[Any] = None
    sync_check: Optional[Any] = None
    max_staleness: Optional[int] = None

    def __post_init__(self) -> None:
        if isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 1:
            raise UserError(f"{self.epochs_field} must be a whole number >= 1, got {self.epochs!r}; fix it with "
                            f"--set {self.epochs_field}=1")
        if (self.training_rows is None) != (self.rows_per_round is None):
            raise ValueError("RolloutPlan: training_rows and rows_per_round go together (give both or neither)")

    @classmethod
    def of(cls, loss: Any, **fields: Any) -> "RolloutPlan":
        """The plan of a rollout loss: its ``process_rollouts``, ``dynamic_sampling`` and
        ``min_group_size``, and ``fields``."""
        fields.setdefault("dynamic_sampling", bool(getattr(loss, "dynamic_sampling", False)))
        fields.setdefault("min_group_size", int(getattr(loss, "min_group_size", 2)))
        return cls(process=loss.process_rollouts, **fields)


#: ``extra`` keys that were read by the shell before they became typed fields of :class:`AlgorithmParts`
_TYPED_EXTRA = ("target_update_every", "lr_schedulers", "model", "tokenizer")


@dataclass
class AlgorithmParts:
    """Everything built for one algorithm on one dataset.

    Attributes:
        loss: the TorchRL ``LossModule``; ``loss(batch)`` returns ``loss_*`` terms and
            detached diagnostics.
        policy: deterministic evaluation policy reading ``"observation"`` (normalised as
            in training) and writing ``"action"``; for language models, the module that
            scores responses (``CausalLMLogProbs``, or a reward model's ``CausalLMReward``).
        optimizers: the optimiser groups, in the order they are stepped.
        target_updater: TorchRL ``SoftUpdate``/``HardUpdate`` bound to ``loss``, or None.
        target_update_every: gradient steps between target updates (None: the slowest
            optimiser group's ``every``; see :func:`target_update_period`).
        lr_schedulers: callables ``make(optimizer) -> LRScheduler``; the shell steps each
            once per gradient step and saves it in checkpoints.
        model: the ``transformers`` causal LM the policy generates with: used for the KL to
            the reference and generation in evaluation, exported with ``save_pretrained``.
            None when the policy is no language model (a reward model's score head).
        tokenizer: the tokenizer exported with ``model``.
        rollout: online algorithms: the :class:`RolloutPlan` of their rounds of rollouts
            (None for algorithms trained on a fixed dataset).
        extra: anything else the algorithm wants to keep (the shell reads none of it).
        reference: the frozen reference model ``model`` is compared with (the KL to the reference, the
            "before" scores), when it is not the data's own: with LoRA, the policy with its adapters off.
    """

    loss: LossModule
    policy: TensorDictModuleBase
    optimizers: list[OptimizerGroup]
    target_updater: Optional[Any] = None
    target_update_every: Optional[int] = None
    lr_schedulers: Sequence[Callable[[torch.optim.Optimizer], Any]] = ()
    model: Optional[torch.nn.Module] = None
    tokenizer: Optional[Any] = None
    rollout: Optional[RolloutPlan] = None
    extra: dict[str, Any] = field(default_factory=dict)
    reference: Optional[torch.nn.Module] = None

    def __post_init__(self) -> None:
        moved = [k for k in _TYPED_EXTRA if k in self.extra]
        if moved:
            warnings.warn(
                f"AlgorithmParts(extra={{{', '.join(repr(k) for k in moved)}: ...}}) is deprecated: pass "
                f"{', '.join(f'{k}=...' for k in moved)} as fields",
                DeprecationWarning,
                stacklevel=3,
            )
            for key in moved:
                value = self.extra.pop(key)
                if getattr(self, key) in (None, ()):
                    setattr(self, key, value)
        self.lr_schedulers = tuple(self.lr_schedulers or ())
        if self.target_update_every is not None and int(self.target_update_every) < 1:
            raise ValueError(f"target_update_every must be at least 1, got {self.target_update_every}")

    def target_period(self) -> int:
        """Gradient steps between target-network updates (see :func:`target_update_period`)."""
        return target_update_period(self.target_update_every, self.optimizers)

    def loss_keys(self) -> tuple[str, ...]:
        keys: list[str] = []
        for group in self.optimizers:
            keys.extend(k for k in group.loss_keys if k not in keys)
        return tuple(keys)
