"""One thin ``LightningModule`` that trains any algorithm's TorchRL loss.

It calls the loss, sums the ``loss_*`` terms of the optimiser groups due this step,
backpropagates once and steps. Target updates, evaluation and the non-finite guard
are callbacks (:mod:`offline_plugins.lightning.callbacks`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from lightning.pytorch import LightningModule

from offline_plugins.algorithms.base import AlgorithmParts, OptimizerGroup
from offline_plugins.lightning.data import LOSS_STREAM, step_seed

__all__ = ["OfflineAlgorithmModule", "make_grouped_adam"]


def make_grouped_adam(groups: Sequence[OptimizerGroup]) -> torch.optim.Adam:
    """One Adam whose parameter groups are the algorithm's optimiser groups.

    One optimiser (not one per group) keeps Lightning's ``global_step`` equal to the
    number of gradient steps. It is equivalent to one Adam per group: Adam's state
    is per parameter, and a group that sits a step out (``every > 1``) has no
    gradient, so Adam leaves its parameters and moments alone.
    """
    param_groups = []
    all_params = []
    for g in groups:
        params = [p for p in g.params if p.requires_grad]
        if not params:
            raise ValueError(f"optimiser group {g.name!r} has no trainable parameters")
        param_groups.append({"params": params, "lr": g.lr, "weight_decay": g.weight_decay, "name": g.name})
        all_params.extend(params)
    # fused Adam (one kernel for every tensor; on CPU too since torch 2.4) when the parameters
    # are floating point on one device type, as OptimizerGroup.make_optimizer does; else foreach
    devices = {p.device.type for p in all_params}
    fused = len(devices) == 1 and devices <= {"cuda", "cpu"} and all(p.is_floating_point() for p in all_params)
    return torch.optim.Adam(param_groups, **({"fused": True} if fused else {"foreach": True}))


class OfflineAlgorithmModule(LightningModule):
    """Trains the loss of an :class:`~offline_plugins.algorithms.base.AlgorithmParts`.

    Manual optimisation: at step ``t`` the terms of every group with ``t % every == 0``
    are summed and backpropagated once (TorchRL losses detach what a term must not
    move, as in TorchRL's own training scripts); each group's gradients are clipped
    to its ``max_grad_norm``; one Adam steps them all.

    The loss's random draws at step ``t`` on rank ``r`` come from the default
    generators reseeded from ``(seed, r, t)``, so a resumed run repeats the
    uninterrupted one exactly.

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
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.save_hyperparameters(ignore=["parts", "data_state"])
        self.loss_module = parts.loss
        self.policy = parts.policy
        self.optimizer_groups: list[OptimizerGroup] = list(parts.optimizers)
        self.target_updater = parts.target_updater
        self.extra = dict(parts.extra)
        self.data_state = data_state or {}
        self.seed = int(seed)
        self.loss_keys: tuple[str, ...] = parts.loss_keys()
        if not self.optimizer_groups:
            raise ValueError(f"algorithm {algorithm!r} declared no optimiser groups")
        self._active_cache: dict[tuple[bool, ...], tuple[list[str], list[OptimizerGroup]]] = {}
        self._checked_keys = False
        self.last_logged: dict[str, float] = {}

    # -- training -----------------------------------------------------------------
    def configure_optimizers(self):
        """One Adam over every group, plus the schedulers in ``parts.extra["lr_schedulers"]``.

        Each scheduler entry is a callable ``make(optimizer) -> LRScheduler``; it is
        stepped once per gradient step and saved in checkpoints.
        """
        optimizer = make_grouped_adam(self.optimizer_groups)
        makers = list(self.extra.get("lr_schedulers", ()) or ())
        if not makers:
            return optimizer
        return [optimizer], [{"scheduler": make(optimizer), "interval": "step"} for make in makers]

    def _active(self, step: int) -> tuple[list[str], list[OptimizerGroup]]:
        due = tuple(step % g.every == 0 for g in self.optimizer_groups)
        hit = self._active_cache.get(due)
        if hit is None:
            groups = [g for g, d in zip(self.optimizer_groups, due) if d]
            keys: list[str] = []
            for g in groups:
                keys.extend(k for k in g.loss_keys if k not in keys)
            hit = self._active_cache[due] = (keys, groups)
        return hit

    def _seed_step(self, step: int) -> None:
        seed = step_seed(self.seed, self.global_rank, step, LOSS_STREAM)
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.default_generators[self.device.index or 0].manual_seed(seed)

    def _check_keys(self, out) -> None:
        missing = [k for k in self.loss_keys if k not in out.keys()]
        if missing:
            have = sorted(k for k in out.keys() if isinstance(k, str) and k.startswith("loss_"))
            raise KeyError(
                f"the optimiser groups minimise {', '.join(missing)}, which the loss "
                f"{type(self.loss_module).__name__} does not return (it returns {', '.join(have) or 'no loss_* terms'})"
            )
        self._checked_keys = True

    def training_step(self, batch, batch_idx: int) -> dict[str, torch.Tensor]:
        step = self.trainer.global_step  # 0-based index of this step
        self._seed_step(step)
        out = self.loss_module(batch)
        if not self._checked_keys:
            self._check_keys(out)
        keys, groups = self._active(step)
        total = out.get(keys[0])
        for k in keys[1:]:
            total = total + out.get(k)
        opt = self.optimizers()
        opt.zero_grad(set_to_none=True)
        self.manual_backward(total)
        for g in groups:
            if g.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(g.params, g.max_grad_norm, foreach=True)
        opt.step()
        if self._has_schedulers:
            for scheduler in self._schedulers():
                scheduler.step()
        losses = torch.stack([out.get(k).detach().reshape(()) for k in self.loss_keys])
        if (step + 1) % max(1, self.trainer.log_every_n_steps) == 0:
            self._log_terms(out, losses)
        return {"losses": losses}

    @property
    def _has_schedulers(self) -> bool:
        return bool(self.extra.get("lr_schedulers"))

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
        from offline_plugins import __version__

        checkpoint["offline_plugins"] = {
            "version": __version__,
            "algorithm": self.hparams.get("algorithm", ""),
            "dataset": self.hparams.get("dataset", ""),
            "config": self.hparams.get("config") or {},
            "seed": self.seed,
            "run": self.hparams.get("run") or {},
            "data_state": self.data_state,
            "target_updater": _updater_state(self.target_updater),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
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
