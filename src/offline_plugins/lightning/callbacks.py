"""What happens around training, as Lightning callbacks any algorithm reuses.

- :class:`TargetNetworkUpdate` steps the algorithm's TorchRL ``SoftUpdate`` /
  ``HardUpdate`` after the optimiser step (required where the algorithm has target networks).
- :class:`NonFiniteGuard` stops the run at the first NaN/inf loss term, naming the
  step and the term, without a host sync on every step.
- :class:`ScheduledEvaluation` is the base of a data kind's evaluation: every ``every`` steps and at
  the end, its history kept in checkpoints (each kind's own lives with it:
  ``kinds/environment/evaluation.py``, ``kinds/preference/evaluation.py``, ...).
- :class:`InterruptCheckpoint` saves ``last.ckpt`` where SIGINT/SIGTERM stops a run.
- :class:`StepProgressBar` is Lightning's tqdm bar counting gradient steps.

When one ``training_step`` takes several gradient steps (the module's ``steps_per_call``),
the callbacks that act after every step do so from ``on_gradient_step``, which the module
calls after each of them; those that act every ``n`` steps declare ``step_periods``, and
calls end on their multiples (:func:`~offline_plugins.lightning.data.schedule_periods`).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.utilities.exceptions import SIGTERMException

from offline_plugins.errors import UserError
from offline_plugins.lightning.data import StepBatches
from offline_plugins.lightning.fsdp import is_sharded

__all__ = [
    "NonFiniteLossError",
    "TargetNetworkUpdate",
    "NonFiniteGuard",
    "TokenThroughput",
    "ScheduledEvaluation",
    "StepProgressBar",
    "FinalCheckpoint",
    "InterruptCheckpoint",
]


class NonFiniteLossError(UserError):
    """A loss term became NaN or infinite; the message names the step and the term."""


class TargetNetworkUpdate(Callback):
    """Moves the algorithm's target networks after its gradient steps.

    It steps ``pl_module.target_updater`` (TorchRL's ``SoftUpdate``/``HardUpdate``) after
    every ``every``-th gradient step. ``every`` defaults to the algorithm's
    ``AlgorithmParts.target_update_every``, else to the slowest optimiser group's period
    (TD3+BC moves its targets with the delayed actor, on the same steps: the every-th,
    2 every-th...). A module whose algorithm has target networks refuses to fit without it.
    The updater's own progress (``HardUpdate``'s counter) is saved by the module. Inside a
    call of several steps the module calls :meth:`on_gradient_step` after each, so targets
    move after the same steps as with one step per call.
    """

    def __init__(self, every: Optional[int] = None) -> None:
        self.every = every

    def _period(self, pl_module) -> int:
        if self.every is not None:
            return int(self.every)
        return pl_module.parts.target_period()

    def on_gradient_step(self, trainer, pl_module, losses) -> None:
        updater = getattr(pl_module, "target_updater", None)
        if updater is None:
            return
        # global_step already counts this step; the step just taken is global_step - 1
        if trainer.global_step % self._period(pl_module) == 0:
            updater.step()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not isinstance(batch, StepBatches):  # a call of several steps updated after each
            self.on_gradient_step(trainer, pl_module, None)


class NonFiniteGuard(Callback):
    """Stop at the first non-finite loss term, naming the step and the term.

    Each step's loss terms are copied into a row of a device ring buffer of
    ``check_every`` rows (one copy per step, no host sync); every ``check_every``
    steps and at the end the buffer is read once, and the earliest non-finite entry
    names the step and the term. Rows of earlier windows passed their check, so a bad
    entry is always from the window just ended.

    Raises:
        NonFiniteLossError: on every rank, once any rank saw a bad term.
    """

    def __init__(self, check_every: int = 100) -> None:
        self.check_every = max(1, int(check_every))
        self._ring: Optional[torch.Tensor] = None
        self._step = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if isinstance(batch, StepBatches):  # a call of several steps recorded each
            return
        losses = outputs.get("losses") if isinstance(outputs, dict) else None
        if losses is None:
            return
        self.on_gradient_step(trainer, pl_module, losses)

    def on_gradient_step(self, trainer, pl_module, losses) -> None:
        step = trainer.global_step  # 1-based number of the step just taken
        ring = self._ring
        if ring is None or ring.device != losses.device or ring.shape[1:] != losses.shape:
            ring = self._ring = torch.zeros((self.check_every, *losses.shape), dtype=losses.dtype, device=losses.device)
        ring[(step - 1) % self.check_every].copy_(losses)
        self._step = step
        if step % self.check_every == 0:
            self.check(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.check(trainer, pl_module)

    def check(self, trainer, pl_module) -> None:
        """Raise if a term went non-finite since the last check (syncs once)."""
        if self._ring is None:
            return
        bad = ~torch.isfinite(self._ring.reshape(self.check_every, -1))
        found_here = bool(bad.any())
        found = trainer.strategy.reduce_boolean_decision(found_here, all=False)
        if not found:
            return
        keys = list(getattr(pl_module, "loss_keys", ()))
        if found_here:
            bad = bad.cpu()
            now, n = self._step, self.check_every
            # row r holds the latest step s <= now with (s - 1) % n == r
            rows = torch.arange(n)
            steps = now - (now - 1 - rows) % n
            steps = torch.where(bad.any(1), steps, torch.full_like(steps, 2**62))
            r = int(steps.argmin())
            i = int(bad[r].nonzero()[0])
            value = float(self._ring.reshape(n, -1)[r, i].cpu())
            term = keys[i] if i < len(keys) else f"term {i}"
            where = f" on rank {trainer.global_rank}" if trainer.world_size > 1 else ""
            msg = (
                f"non-finite loss at step {int(steps[r])}{where}: {term} = {value}; "
                "lower the learning rate (--set ...lr=), clip gradients, or check the data for NaN/inf"
            )
        else:
            msg = "non-finite loss on another rank; see that rank's message"
        raise NonFiniteLossError(msg)


class TokenThroughput(Callback):
    """Counts the real tokens the training steps read, for ``tokens_per_s`` in ``summary.json``.

    A token is a ``True`` of a batch leaf named ``all_attention_mask`` (TorchRL's LLM layout:
    prompt and response tokens; both sides of a preference pair; KTO's mismatched rows too);
    a batch without one (offline RL) counts nothing and, after the first, costs one check
    per step. The count is kept as a device tensor (no host sync per step) and read once
    at the end by :meth:`run_summary`.
    """

    def __init__(self) -> None:
        self._keys: Optional[list] = None
        self._count: Optional[torch.Tensor] = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for b in (batch.batches if isinstance(batch, StepBatches) else [batch]):
            if self._keys is None:
                keys = getattr(b, "keys", None)
                self._keys = [] if keys is None else [
                    k for k in b.keys(include_nested=True, leaves_only=True)
                    if (k[-1] if isinstance(k, tuple) else k) == "all_attention_mask"]
            if not self._keys:
                return
            n = sum(b.get(k).sum() for k in self._keys)
            self._count = n if self._count is None else self._count + n

    def run_summary(self, seconds: float, world_size: int = 1) -> dict[str, Any]:
        """``{}`` for batches without tokens; else ``tokens_trained`` (this rank), ``tokens_per_s`` over
        ``seconds`` (the fit's, as ``steps_per_s``) and ``tokens_per_s_all_ranks`` (times the world
        size: ranks read batches of one size)."""
        if self._count is None:
            return {}
        tokens = int(self._count)
        rate = tokens / max(seconds, 1e-9)
        return {"tokens_trained": tokens, "tokens_per_s": round(rate, 1),
                "tokens_per_s_all_ranks": round(rate * world_size, 1)}


class ScheduledEvaluation(Callback):
    """Evaluate every ``every`` gradient steps (0: only at the end) and when training ends, on
    global rank 0; keep the records in ``history`` (saved in checkpoints, so a resumed run's
    learning curve continues). Subclasses define ``_score(trainer, pl_module)``, returning
    ``(record fields, logged metrics)`` of an evaluation now.

    The base of every data kind's evaluation (:meth:`offline_plugins.kinds.DataKind.evaluation`);
    a plugin's new kind subclasses it too."""

    every: int
    history: list

    @property
    def step_periods(self) -> tuple[int, ...]:
        """A call of several steps ends on multiples of ``every`` (so evaluations keep their steps)."""
        return (int(self.every),) if self.every else ()

    def evaluate(self, trainer, pl_module) -> Optional[dict]:
        """Evaluate now; returns the logged record on rank 0, None elsewhere.

        A model sharded with FSDP (``--strategy fsdp``) gathers its parameters from every rank in
        each forward, so there every rank scores (the same held-out rows, with the same weights)
        and rank 0 alone records and logs."""
        step = int(trainer.global_step)
        if self.history and self.history[-1]["step"] == step:
            return self.history[-1]
        if getattr(self, "_scored_step", None) == step:
            return None

        if trainer.global_rank != 0 and not is_sharded(pl_module):
            return None
        self._scored_step = step
        t0 = time.perf_counter()
        fields, metrics = self._score(trainer, pl_module)
        if trainer.global_rank != 0:
            return None
        record = {"step": step, **fields, "eval_s": round(time.perf_counter() - t0, 3)}
        self.history.append(record)
        # Lightning writes the 0-based index of the last step in the "step" column
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step - 1)
        return record

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every and trainer.global_step % self.every == 0:
            self.evaluate(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.evaluate(trainer, pl_module)

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))


class FinalCheckpoint(Callback):
    """Save a checkpoint to ``path`` when training ends (``ModelCheckpoint`` saves every N steps only)."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def on_train_end(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(self.path, weights_only=False)


class InterruptCheckpoint(Callback):
    """Save ``last.ckpt`` at the step boundary where SIGINT/SIGTERM stops a run.

    Lightning stops after the step in which ``trainer.received_sigterm`` became true
    (SIGTERM, or SIGINT through :class:`~offline_plugins.lightning.guards.GracefulInterrupt`);
    this saves the checkpoint in that step's ``on_train_batch_end``, where
    ``ModelCheckpoint`` saves its periodic ones, so ``--resume`` continues exactly. A
    signal that lands after that hook is saved from ``on_exception``. Single-process
    runs only (under DDP a save here could wait on ranks that did not see the signal).
    """

    def __init__(self, path) -> None:
        self.path = str(path)
        self.saved_at: Optional[int] = None

    def _save(self, trainer) -> None:
        if trainer.world_size == 1 and self.saved_at != trainer.global_step:
            trainer.save_checkpoint(self.path, weights_only=False)
            self.saved_at = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.received_sigterm:
            self._save(trainer)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException) and trainer.global_step > 0:
            self._save(trainer)


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, titled ``title`` (``train``), counting gradient steps up to ``max_steps``."""

    def __init__(self, *args, title: str = "train", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.title = title

    def on_train_epoch_start(self, trainer, *args) -> None:
        super().on_train_epoch_start(trainer, *args)
        bar = self.train_progress_bar
        bar.set_description(self.title)
        if trainer.max_steps and trainer.max_steps > 0:
            # a resumed run shows the steps already done rather than starting at 0
            bar.total = trainer.max_steps
            bar.initial = bar.n = trainer.global_step
            if not bar.disable:
                bar.refresh()

    def get_metrics(self, trainer, pl_module) -> dict:
        """The summed loss terms at the last logging step, and Lightning's own entries."""
        metrics = dict(super().get_metrics(trainer, pl_module))
        metrics.pop("v_num", None)
        last = getattr(pl_module, "last_logged", None)
        keys = getattr(pl_module, "loss_keys", ())
        if last and all(f"train/{k}" in last for k in keys):
            metrics["loss"] = f"{sum(last[f'train/{k}'] for k in keys):.4g}"
        return metrics

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        n = trainer.global_step
        bar = self.train_progress_bar
        # a call of several steps can jump over a multiple of refresh_rate: refresh once it is passed
        if bar is not None and not bar.disable and (n // self.refresh_rate > bar.n // self.refresh_rate or n == bar.total):
            bar.n = n
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            bar.refresh()
