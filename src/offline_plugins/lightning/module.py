"""One thin ``LightningModule`` that trains any algorithm's TorchRL loss.

It calls the loss, sums the ``loss_*`` terms of the optimiser groups due this step,
backpropagates once and steps. Target updates, evaluation and the non-finite guard
are callbacks (:mod:`offline_plugins.lightning.callbacks`).

One ``training_step`` may take several gradient steps (``steps_per_call``), which spreads
Lightning's fixed cost per call (about 1 ms: its loop, hooks and progress tracking) over
them; the run is the same, bit for bit. A callback that must act after every gradient step
defines ``on_gradient_step(trainer, pl_module, losses)``, which the module calls inside a
call of several steps (its ``on_train_batch_end`` then sees a
:class:`~offline_plugins.lightning.data.StepBatches` and leaves it alone).
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch
from lightning.pytorch import Callback, LightningModule

from offline_plugins import __version__
from offline_plugins.algorithms.base import AlgorithmParts, OptimizerGroup, compute_terms
from offline_plugins.errors import UserError
from offline_plugins.lightning.callbacks import TargetNetworkUpdate
from offline_plugins.lightning.data import LOSS_STREAM, StepBatches, step_seed
from offline_plugins.lightning.fsdp import shard_module
from offline_plugins.lightning.optimizers import OptimizerChain, make_grouped_adam, make_shell_optimizer

__all__ = [
    "AlgorithmModule",
    "OptimizerChain",
    "make_grouped_adam",
    "make_shell_optimizer",
    "DEFAULT_STEPS_PER_CALL",
    "resolve_steps_per_call",
]

#: gradient steps per ``training_step`` when a run does not say (bench/lightning_overhead_bench.py,
#: docs/benchmarks.md "Steps per call")
DEFAULT_STEPS_PER_CALL = 8


def _hooks_batches(callback) -> bool:
    """Whether ``callback`` overrides a hook that sees each call's batch."""
    return any(
        getattr(type(callback), name, None) is not getattr(Callback, name)
        for name in ("on_train_batch_start", "on_train_batch_end")
    )


def resolve_steps_per_call(steps_per_call: Optional[int], callbacks: Sequence[Any] = ()) -> int:
    """The gradient steps per ``training_step`` of a run: ``steps_per_call``, else the default.

    The default is :data:`DEFAULT_STEPS_PER_CALL`, or 1 when one of ``callbacks`` (a user's,
    not the shell's own) overrides ``on_train_batch_start``/``on_train_batch_end``: such a
    callback expects one batch and one step per call, which a call of several steps would
    change under it. Passing ``steps_per_call`` explicitly is always honoured.

    >>> resolve_steps_per_call(3), resolve_steps_per_call(None) == DEFAULT_STEPS_PER_CALL
    (3, True)
    """
    if steps_per_call is None:
        return 1 if any(_hooks_batches(cb) for cb in callbacks) else DEFAULT_STEPS_PER_CALL
    if isinstance(steps_per_call, bool) or not isinstance(steps_per_call, int) or steps_per_call < 1:
        raise UserError(f"steps_per_call (--steps-per-call) must be a whole number >= 1, got {steps_per_call!r}; "
                        "pass None for the default, or 1 for one gradient step per Lightning call")
    return int(steps_per_call)


def compile_terms(loss):
    """:func:`~offline_plugins.algorithms.base.compute_terms` of ``loss`` through ``torch.compile``.

    Dynamo specialises on the requested terms, so TD3+BC's critic-only and full steps get a
    graph each. The compiled function shares the loss module's parameters: nothing about
    optimisers, target updates or checkpoints changes. Random draws fall back to eager's
    generators (inductor's ``fallback_random``), so a seeded run draws the same noise with
    or without compilation, and resumes exactly either way.
    """
    # TorchRL losses fill some attributes on first use (``in_keys``); filled now, they do not
    # change under the compiled graph's guards and force a recompilation
    getattr(loss, "in_keys", None)
    return torch.compile(functools.partial(compute_terms, loss), options={"fallback_random": True})


class AlgorithmModule(LightningModule):
    """Trains the loss of an :class:`~offline_plugins.algorithms.base.AlgorithmParts`.

    Manual optimisation: at step ``t`` the terms of every group due then
    (:meth:`~offline_plugins.algorithms.base.OptimizerGroup.due`)
    are summed and backpropagated once (TorchRL losses detach what a term must not
    move, as in TorchRL's own training scripts); each group's gradients are clipped
    to its ``max_grad_norm``; one optimiser (:func:`make_shell_optimizer`) steps them all.

    The loss's random draws at step ``t`` on rank ``r`` come from the default
    generators reseeded from ``(seed, r, t)``, so a resumed run repeats the
    uninterrupted one exactly.

    With ``steps_per_call=K > 1`` a ``training_step`` receives the
    :class:`~offline_plugins.lightning.data.StepBatches` of up to ``K`` steps
    (:class:`~offline_plugins.lightning.data.ReplayDataModule` makes them) and takes
    them one by one, exactly as ``K`` calls would: same batches, same seeds, the callbacks'
    ``on_gradient_step`` (target updates, the non-finite guard) and the logging after each
    step. ``trainer.global_step`` still counts gradient steps.

    It refuses to fit under a ``Trainer`` that lacks a callback in ``required_callbacks``
    (:class:`~offline_plugins.lightning.callbacks.TargetNetworkUpdate` for an algorithm with
    target networks; :func:`~offline_plugins.lightning.builder.build` adds the data kind's own),
    or fitted without the data module in ``required_datamodule`` (a data kind's own, such as the
    online rounds' :class:`~offline_plugins.kinds.rollouts.rounds.RolloutDataModule`), naming the fix. It trains offline and online methods alike, hence no "Offline" in its
    name (it was ``OfflineAlgorithmModule``; that name remains as an alias).

    Args:
        parts: what the algorithm's ``build(config, data)`` returned.

    Keyword Args:
        algorithm: algorithm name (saved in the checkpoint).
        dataset: dataset id (saved in the checkpoint).
        config: the algorithm config as a dict (saved in the checkpoint).
        seed: the run's seed.
        data_state: the dataset's normalisation and reward statistics
            (``data.state_dict()``), saved in the checkpoint for evaluation.
        run: other run settings to save (batch size, eval settings...).
        compile_loss: compute the loss terms through ``torch.compile`` (one graph per set of
            due terms; the parameters and checkpoints are the loss module's own).
        steps_per_call: gradient steps per ``training_step`` (the module also takes plain
            batches, one step each, whatever this is).
        accumulate: split each step's batch into this many micro-batches along its first
            dimension, backpropagate each (weighted by its share of the batch) and step once:
            the same gradient as the whole batch for losses that average over it, with the
            activations of one micro-batch in memory. The batch size stays the number per
            optimiser step (preference pairs, rollouts...).
    """

    def __init__(
        self,
        parts: AlgorithmParts,
        *,
        algorithm: str = "",
        dataset: str = "",
        config: Optional[dict] = None,
        seed: int = 0,
        data_state: Optional[dict] = None,
        run: Optional[dict] = None,
        compile_loss: bool = False,
        steps_per_call: int = 1,
        accumulate: int = 1,
    ) -> None:
        super().__init__()
        self.steps_per_call = resolve_steps_per_call(steps_per_call)
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise UserError(f"accumulate (--accumulate) must be a whole number >= 1, got {accumulate!r}")
        self.accumulate = int(accumulate)
        self.automatic_optimization = False
        self.save_hyperparameters(ignore=["parts", "data_state"])
        self.loss_module = parts.loss
        self.policy = parts.policy
        self.optimizer_groups: list[OptimizerGroup] = list(parts.optimizers)
        self.target_updater = parts.target_updater
        # the typed parts the shell reads (model, tokenizer, schedulers, target period); a
        # dataclass, not a Module, so nothing in it is registered twice in the state dict
        self.parts = parts
        self.extra = dict(parts.extra)
        self.data_state = data_state or {}
        self.seed = int(seed)
        self.loss_keys: tuple[str, ...] = parts.loss_keys()
        if not self.optimizer_groups:
            raise ValueError(f"algorithm {algorithm!r} declared no optimiser groups")
        self._active_cache: dict[tuple[bool, ...], tuple[list[str], list[OptimizerGroup], list[str], list[OptimizerGroup]]] = {}
        self._checked_keys = False
        self._seen_keys: set[str] = set()
        # losses that can skip terms not due (TD3+BC's actor on critic-only steps)
        self._partial_terms = hasattr(self.loss_module, "loss_terms") and any(g.every > 1 for g in self.optimizer_groups)
        self._last_terms: dict[str, torch.Tensor] = {}
        self._terms = compile_terms(self.loss_module) if compile_loss else functools.partial(compute_terms, self.loss_module)
        self._zero_weight_idle = False
        self.last_logged: dict[str, float] = {}

        # what setup() checks the Trainer has: without them the run would train something else
        # (targets that never move, a buffer never filled) without saying so
        self.required_callbacks: tuple[type, ...] = (TargetNetworkUpdate,) if parts.target_updater is not None else ()
        #: the data module the run must be fitted with (a data kind's own, e.g. the rounds of rollouts), or None
        self.required_datamodule: Optional[type] = None

    # -- training -----------------------------------------------------------------
    #: the precision FSDP2 computes in (``bf16-mixed``: its ``MixedPrecisionPolicy``); None: the Trainer's
    fsdp_precision: Optional[str] = None

    def configure_model(self) -> None:
        """Under Lightning's ``ModelParallelStrategy`` (``--strategy fsdp``), shard the loss's language
        models with FSDP2 (:func:`~offline_plugins.lightning.fsdp.shard_module`: each decoder layer,
        then the model); under any other strategy, nothing. Lightning calls it before
        ``configure_optimizers``, so the optimiser steps the sharded parameters."""
        mesh = self.device_mesh
        if mesh is None:
            return

        dims = tuple(mesh.mesh_dim_names or ())
        if "tensor_parallel" in dims and mesh["tensor_parallel"].size() > 1:
            raise UserError("offline-plugins shards with FSDP2 only: build ModelParallelStrategy with "
                            "tensor_parallel_size=1")
        shard_module(self, mesh["data_parallel"] if "data_parallel" in dims else mesh,
                     precision=self.fsdp_precision or getattr(self.trainer, "precision", None))

    def configure_optimizers(self):
        """One optimiser over every group (:func:`make_shell_optimizer`), plus the schedulers
        in ``parts.lr_schedulers``.

        Each scheduler entry is a callable ``make(optimizer) -> LRScheduler``; it is
        stepped once per gradient step and saved in checkpoints.
        """
        optimizer = make_shell_optimizer(self.optimizer_groups)
        makers = list(self.parts.lr_schedulers)
        if not makers:
            return optimizer
        return [optimizer], [{"scheduler": make(optimizer), "interval": "step"} for make in makers]

    def _active(self, step: int) -> tuple[list[str], list[OptimizerGroup], list[str], list[OptimizerGroup]]:
        """The loss keys and groups due at ``step``, and the keys and groups sitting it out."""
        due = tuple(g.due(step) for g in self.optimizer_groups)
        hit = self._active_cache.get(due)
        if hit is None:
            groups = [g for g, d in zip(self.optimizer_groups, due) if d]
            idle = [g for g, d in zip(self.optimizer_groups, due) if not d]
            keys: list[str] = []
            for g in groups:
                keys.extend(k for k in g.loss_keys if k not in keys)
            idle_keys = [k for g in idle for k in g.loss_keys if k not in keys]
            hit = self._active_cache[due] = (keys, groups, list(dict.fromkeys(idle_keys)), idle)
        return hit

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self._check_callbacks()

    def _check_callbacks(self) -> None:
        """Refuse a Trainer without a callback this algorithm needs, naming it and the fix."""
        name = self.hparams.get("algorithm") or type(self.loss_module).__name__
        wanted = self.required_datamodule
        if wanted is not None and not isinstance(getattr(self.trainer, "datamodule", None), wanted):
            line = (wanted.__doc__ or "").strip().split("\n", 1)[0].rstrip(".").replace("``", "")
            raise UserError(
                f"the Trainer fits {name} without its data module {wanted.__name__} ({line[:1].lower()}{line[1:]}); "
                "fit it with trainer.fit(parts.module, datamodule=parts.datamodule), parts = "
                "offline_plugins.lightning.build(...)")
        have = list(getattr(self.trainer, "callbacks", None) or ())
        missing = [cls for cls in self.required_callbacks if not any(isinstance(cb, cls) for cb in have)]
        if not missing:
            return
        # each callback says what it does in its docstring's first line
        def what(cls) -> str:
            line = (cls.__doc__ or "").strip().split("\n", 1)[0].rstrip(".").replace("``", "")
            return f"{cls.__name__} ({line[:1].lower()}{line[1:]})" if line else cls.__name__

        listed = "; ".join(what(cls) for cls in missing)
        raise UserError(
            f"the Trainer lacks a callback {name} needs: {listed}; build it with "
            "lightning.Trainer(callbacks=[*parts.callbacks, ...yours]), parts = offline_plugins.lightning.build(...)"
        )

    def on_fit_start(self) -> None:
        # Under DDP every parameter must take part in every backward, or the reducer needs
        # find_unused_parameters (an extra graph traversal per step, and a warning on the
        # steps where nothing is unused). So with several processes a group sitting a step
        # out still backpropagates its terms with weight 0, and its zero gradients are
        # dropped after the all-reduce: Adam then leaves it alone, as on one process.
        self._zero_weight_idle = self.trainer.world_size > 1

    def _seed_step(self, step: int) -> None:
        seed = step_seed(self.seed, self.global_rank, step, LOSS_STREAM)
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.default_generators[self.device.index or 0].manual_seed(seed)

    def _check_keys(self, out, due: list[str]) -> None:
        """Every due term must be in ``out``; checked until each group's terms were seen once."""
        present = set(out.keys())
        missing = [k for k in due if k not in present]
        if missing:
            have = sorted(k for k in present if isinstance(k, str) and (k == "loss" or k.startswith("loss_")))
            raise KeyError(
                f"the optimiser groups minimise {', '.join(missing)}, which the loss "
                f"{type(self.loss_module).__name__} does not return (it returns {', '.join(have) or 'no loss terms'})"
            )
        self._seen_keys.update(due)
        self._checked_keys = self._seen_keys.issuperset(self.loss_keys)

    def _stack_losses(self, out) -> torch.Tensor:
        """Every group's term as one detached vector (the non-finite guard's and the logs' input).

        A term the loss skipped this step (not due) holds its last computed value, or 0
        before the first; no host sync either way.
        """
        values = []
        for k in self.loss_keys:
            v = out.get(k, None)
            if v is None:
                v = self._last_terms.get(k)
                if v is None:
                    v = torch.zeros((), device=self.device)
            else:
                v = v.detach().reshape(())
                if self._partial_terms:
                    self._last_terms[k] = v
            values.append(v)
        return torch.stack(values)

    def training_step(self, batch, batch_idx: int) -> dict[str, torch.Tensor]:
        if isinstance(batch, StepBatches):
            return self._several_steps(batch)
        step = self.trainer.global_step  # 0-based index of this step
        out, losses = self._gradient_step(batch, step)
        if (step + 1) % max(1, self.trainer.log_every_n_steps) == 0:
            self._log_terms(out, losses)
        return {"losses": losses}

    def _several_steps(self, calls: StepBatches) -> dict[str, torch.Tensor]:
        """The steps of one call, each as a call of its own would take it."""
        trainer = self.trainer
        step = trainer.global_step
        if calls.start != step:
            raise RuntimeError(
                f"the batches handed to training_step start at step {calls.start}, the trainer is at step {step}: "
                "a StepBatches stream must start at the trainer's global_step (ReplayDataModule's does)"
            )
        n = len(calls)
        if trainer.max_steps is not None and trainer.max_steps > 0:
            n = min(n, trainer.max_steps - step)  # never past max_steps, whatever the stream handed out
        log_every = max(1, trainer.log_every_n_steps)
        # looked up per call (a few microseconds), so nothing depends on on_fit_start having run
        hooks = [cb.on_gradient_step for cb in trainer.callbacks if hasattr(cb, "on_gradient_step")]
        losses = None
        for i in range(n):
            out, losses = self._gradient_step(calls.batches[i], step + i)
            # as one call per step would: the step's logs, then what callbacks do after it
            if (step + i + 1) % log_every == 0:
                self._log_terms(out, losses)
            for hook in hooks:
                hook(trainer, self, losses)
        return {"losses": losses}

    def _gradient_step(self, batch, step: int):
        """One gradient step on ``batch`` as step ``step``; returns the loss output and :meth:`_stack_losses`."""
        self._seed_step(step)
        keys, groups, idle_keys, idle = self._active(step)
        zero_weight = self._zero_weight_idle and bool(idle_keys)
        opt = self.optimizers()
        opt.zero_grad(set_to_none=True)
        micro = self._micro_batches(batch)
        outs = []
        for chunk, weight in micro:
            # under DDP's zero-weight scheme every term takes part in the backward
            out = self._terms(chunk, None if zero_weight else keys)
            if not self._checked_keys:
                self._check_keys(out, keys)
            total = out.get(keys[0])
            for k in keys[1:]:
                total = total + out.get(k)
            if zero_weight:
                for k in idle_keys:
                    total = total + 0.0 * out.get(k)
            self.manual_backward(total if weight is None else total * weight)
            outs.append((out, weight))
        out = outs[0][0] if len(outs) == 1 else _weighted_outputs(outs)
        if zero_weight:
            for g in idle:
                for p in g.params:
                    p.grad = None
        for g in groups:
            if g.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(g.params, g.max_grad_norm, foreach=True)
        opt.step()
        if self._has_schedulers:
            for scheduler in self._schedulers():
                scheduler.step()
        return out, self._stack_losses(out)

    def _micro_batches(self, batch) -> list:
        """``[(batch, None)]``, or with ``accumulate = N`` the N chunks of ``batch`` with their shares."""
        if self.accumulate == 1:
            return [(batch, None)]
        n = int(batch.batch_size[0]) if hasattr(batch, "batch_size") else len(batch)
        if n < self.accumulate:
            raise UserError(f"--accumulate {self.accumulate} splits each batch into micro-batches, but a batch has "
                            f"only {n} elements; raise batch_size (--set batch_size=...) or lower --accumulate")
        return [(chunk, chunk.batch_size[0] / n) for chunk in batch.chunk(self.accumulate, dim=0)]

    @property
    def _has_schedulers(self) -> bool:
        return bool(self.parts.lr_schedulers)

    def _schedulers(self) -> list:
        found = self.lr_schedulers()
        if found is None:
            return []
        return found if isinstance(found, list) else [found]

    def _log_terms(self, out, losses: torch.Tensor) -> None:
        # Straight to the loggers rather than self.log: once a key is in Lightning's
        # ResultCollection it is processed on every step, which cost ~10% of a small
        # network's step (bench/lightning_overhead_bench.py); here the cost is one
        # host sync every log_every steps.
        names = [f"train/{k}" for k in self.loss_keys]
        values = [losses]
        if self._partial_terms and len(self._last_terms) < len(self.loss_keys):
            # a term not computed yet (the delayed actor before its first step) is not logged
            keep = [i for i, k in enumerate(self.loss_keys) if k in self._last_terms]
            names = [names[i] for i in keep]
            values = [losses[keep]]
        for key, value in out.items():
            if (
                isinstance(key, str)
                and key not in self.loss_keys
                and isinstance(value, torch.Tensor)
                and value.numel() == 1
                and value.is_floating_point()
            ):
                names.append(f"train/{key}")
                values.append(value.detach().reshape(1).to(losses.dtype))
        floats = torch.cat(values).tolist()
        metrics = dict(zip(names, floats))
        self.last_logged = metrics
        for logger in self.loggers:
            logger.log_metrics(metrics, step=self.trainer.global_step)

    # -- checkpoints --------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["offline_plugins"] = {
            "version": __version__,
            "algorithm": self.hparams.get("algorithm", ""),
            "dataset": self.hparams.get("dataset", ""),
            "config": self.hparams.get("config") or {},
            "seed": self.seed,
            "run": self.hparams.get("run") or {},
            "data_state": self.data_state,
            "target_updater": _updater_state(self.target_updater),
            # who provides the algorithm: what to install to evaluate the checkpoint elsewhere
            **getattr(self, "provenance", {}),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning files the data module's state under its class name, which was OfflineDataModule;
        # this hook runs before the data module is restored, so an older checkpoint resumes as it did
        if "OfflineDataModule" in checkpoint and "ReplayDataModule" not in checkpoint:
            checkpoint["ReplayDataModule"] = checkpoint["OfflineDataModule"]
        # an online run saved before its round moved into RolloutDataModule kept the round in the
        # RolloutRefill callback's state and the monitor's in its own: both move where they are read now
        callbacks = checkpoint.get("callbacks") or {}
        if "RolloutRefill" in callbacks and "RolloutDataModule" not in checkpoint:
            seed = (checkpoint.get("ReplayDataModule") or {}).get("seed", self.seed)
            checkpoint["RolloutDataModule"] = {**callbacks["RolloutRefill"], "seed": seed}
        evaluation = callbacks.get("RolloutEvaluation")
        if evaluation is not None and "RewardHackingMonitor" in callbacks and "monitor" not in evaluation:
            evaluation["monitor"] = callbacks["RewardHackingMonitor"]
        extra = checkpoint.get("offline_plugins", {})
        if extra.get("data_state"):
            self.data_state = extra["data_state"]
        state = extra.get("target_updater")
        if state and self.target_updater is not None and hasattr(self.target_updater, "load_state_dict"):
            self.target_updater.load_state_dict(state)


def _updater_state(updater) -> dict:
    if updater is None:
        return {}
    if hasattr(updater, "state_dict"):
        return dict(updater.state_dict())
    return {"counter": updater.counter} if hasattr(updater, "counter") else {}


def _weighted_outputs(outs: list):
    """The micro-batches' loss outputs as one: scalar entries weighted by each micro-batch's share."""
    first = outs[0][0]
    merged = first.empty()
    for key, value in first.items(include_nested=True, leaves_only=True):
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
            merged.set(key, sum(w * o.get(key).detach() for o, w in outs))
        else:
            merged.set(key, value)
    return merged


#: the earlier name (kept so code importing it keeps working); new code says ``AlgorithmModule``
OfflineAlgorithmModule = AlgorithmModule
