"""Batches for the training shell: an endless stream over a TorchRL replay buffer.

Batch ``t`` on rank ``r`` is drawn with the buffer's generator reseeded from
``(seed, r, t)`` (JAX's ``fold_in`` idea). That makes a run's batches a function
of the step alone: a resumed run draws exactly the batches the uninterrupted run
would have drawn, whatever Lightning prefetched before the interruption, and the
ranks of a DDP run draw different batches without sharing any state.

>>> import torch
>>> from tensordict import TensorDict
>>> from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
>>> rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100), batch_size=4)
>>> _ = rb.extend(TensorDict({"x": torch.arange(100)}, [100]))
>>> a = [b["x"].tolist() for b in ReplayBufferStream(rb, seed=0, start_step=0, stop_step=3)]
>>> b = [b["x"].tolist() for b in ReplayBufferStream(rb, seed=0, start_step=2, stop_step=3)]
>>> a[2] == b[0], a[0] != a[1]
(True, True)

With ``steps_per_call=K`` the stream hands out the batches of several steps at once, as a
:class:`StepBatches` (one ``training_step`` then takes them all, see
:class:`~offline_plugins.lightning.module.AlgorithmModule`). Each batch is still
drawn from its own step's seed, so the batches are those of ``K=1``. A call ends at the
next multiple of ``K``, of every period in ``periods`` and at ``stop_step``, so callbacks
that act at multiples of a period see the model at exactly those steps.

>>> calls = list(ReplayBufferStream(rb, seed=0, start_step=0, stop_step=7, steps_per_call=4, periods=(3,)))
>>> [(c.start, len(c)) for c in calls]
[(0, 3), (3, 1), (4, 2), (6, 1)]
>>> [b["x"].tolist() for c in calls for b in c.batches][:3] == a
True
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import IterableDataset

from offline_plugins.errors import UserError

__all__ = ["step_seed", "StepBatches", "StepStream", "ReplayBufferStream", "ReplayDataModule", "schedule_periods",
           "SAMPLE_STREAM", "LOSS_STREAM"]

SAMPLE_STREAM = 1
LOSS_STREAM = 2
_MASK64 = (1 << 64) - 1


def step_seed(seed: int, rank: int, step: int, stream: int) -> int:
    """A 63-bit seed mixed from ``(seed, rank, step, stream)`` with splitmix64.

    >>> step_seed(0, 0, 1, 1) != step_seed(0, 1, 1, 1) != step_seed(0, 0, 2, 1)
    True
    """
    x = 0
    for part in (seed, rank, step, stream):
        x = (x ^ (int(part) & _MASK64)) & _MASK64
        x = (x + 0x9E3779B97F4A7C15) & _MASK64
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        x = z ^ (z >> 31)
    return x >> 1


def _buffer_device(buffer) -> torch.device:
    storage = getattr(buffer, "_storage", None)
    device = getattr(storage, "device", None)
    if device is None or str(device) == "auto":
        return torch.device("cpu")
    return torch.device(device)


class StepBatches:
    """The batches of steps ``start``, ``start + 1``, ... that one ``training_step`` takes.

    Moved between devices as a whole; ``device`` is the batches' device.
    """

    __slots__ = ("start", "batches")

    def __init__(self, start: int, batches: list) -> None:
        self.start = int(start)
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __repr__(self) -> str:
        return f"StepBatches(start={self.start}, steps={len(self.batches)})"

    @property
    def device(self) -> Optional[torch.device]:
        return getattr(self.batches[0], "device", None) if self.batches else None

    def to(self, device, non_blocking: bool = False) -> "StepBatches":
        return StepBatches(self.start, [b.to(device, non_blocking=non_blocking) for b in self.batches])


class StepStream(IterableDataset):
    """Endless step items, item ``t`` made by ``draw(t)``: one per step, or a :class:`StepBatches`
    of a call's steps.

    Args:
        draw: ``draw(step)`` makes step ``step``'s item (a batch; or the step number itself, for a
            data module that makes the batch right before the step).

    Keyword Args:
        start_step: first step to draw, or a callable returning it when iteration
            starts (the trainer's ``global_step``, so a resumed run picks up there).
        stop_step: stop before this step (None: never).
        steps_per_call: 1 yields one item per step; ``K > 1`` yields a :class:`StepBatches`
            of up to ``K`` steps, ending at the next multiple of ``K``.
        periods: with ``K > 1``, a :class:`StepBatches` also ends at every multiple of these.
        phases: with ``K > 1``, ``(period, offset)`` pairs: a :class:`StepBatches` also ends at every
            step ``offset + n * period``.
    """

    def __init__(self, draw: Callable[[int], Any], *, start_step: Union[int, Callable[[], int]] = 0,
                 stop_step: Optional[int] = None, steps_per_call: int = 1, periods: Sequence[int] = (),
                 phases: Sequence[tuple[int, int]] = ()) -> None:
        super().__init__()
        self._draw = draw
        self.start_step = start_step
        self.stop_step = stop_step
        self.steps_per_call = int(steps_per_call)
        self.periods = tuple(int(p) for p in periods if p and int(p) > 0)
        self.phases = tuple((int(p), int(o) % int(p)) for p, o in phases if p and int(p) > 0)

    def _call_end(self, step: int) -> int:
        """Where the call starting at ``step`` ends: the first multiple of ``K`` or of a period after it,
        or the first step of a phase after it."""
        end = (step // self.steps_per_call + 1) * self.steps_per_call
        for p in self.periods:
            end = min(end, (step // p + 1) * p)
        for p, o in self.phases:
            end = min(end, ((step - o) // p + 1) * p + o)
        return end if self.stop_step is None else min(end, self.stop_step)

    def configure(self, trainer, extra_periods: Sequence[int] = (), extra_phases: Sequence[tuple[int, int]] = ()
                  ) -> None:
        """Take the trained module's ``steps_per_call``; with several, calls end where the trainer's
        callbacks act (:func:`schedule_periods`), at ``extra_periods``, at ``extra_phases`` and at ``max_steps``."""
        module = getattr(trainer, "lightning_module", None) if trainer is not None else None
        k = int(getattr(module, "steps_per_call", 1) or 1)
        self.steps_per_call = k
        if k > 1:
            self.periods = tuple(sorted({*schedule_periods(trainer), *(int(p) for p in extra_periods if p)}))
            self.phases = tuple((int(p), int(o) % int(p)) for p, o in extra_phases if p and int(p) > 0)
            self.stop_step = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None

    def __iter__(self) -> Iterator[Any]:
        step = self.start_step() if callable(self.start_step) else int(self.start_step)
        if self.steps_per_call == 1:
            while self.stop_step is None or step < self.stop_step:
                yield self._draw(step)
                step += 1
            return
        while self.stop_step is None or step < self.stop_step:
            end = self._call_end(step)
            yield StepBatches(step, [self._draw(t) for t in range(step, end)])
            step = end


class ReplayBufferStream(StepStream):
    """Endless batches from a TorchRL replay buffer, batch ``t`` seeded by ``(seed, rank, t)``.

    Args:
        buffer: a TorchRL ``ReplayBuffer`` with its batch size set.

    Keyword Args:
        seed: the run's seed.
        rank: this process's global rank.
        start_step, stop_step, steps_per_call, periods: as :class:`StepStream`.
    """

    def __init__(self, buffer, *, seed: int, rank: int = 0, **steps: Any) -> None:
        super().__init__(self._sample, **steps)
        self.buffer = buffer
        self.seed = int(seed)
        self.rank = int(rank)
        self.generator = torch.Generator(device=_buffer_device(buffer))
        buffer.set_rng(self.generator)

    def _sample(self, step: int):
        self.generator.manual_seed(step_seed(self.seed, self.rank, step, SAMPLE_STREAM))
        return self.buffer.sample()


def schedule_periods(trainer) -> tuple[int, ...]:
    """The step periods at which the trainer's callbacks act on the model between calls.

    Every ``ModelCheckpoint``'s ``every_n_train_steps``, and the ``step_periods`` a callback
    declares (:class:`~offline_plugins.lightning.callbacks.ScheduledEvaluation` declares its
    ``every``). A call of several steps ends on each multiple of these, so such a callback
    acts at the same steps as with one step per call.
    """
    periods: set[int] = set()
    for cb in getattr(trainer, "callbacks", None) or ():
        if isinstance(cb, ModelCheckpoint):
            periods.add(int(getattr(cb, "_every_n_train_steps", 0) or 0))
        periods.update(int(p) for p in getattr(cb, "step_periods", ()) or ())
    return tuple(sorted(p for p in periods if p > 0))


class ReplayDataModule(LightningDataModule):
    """A ``LightningDataModule`` that streams batches from a dataset's replay buffer.

    The buffer is built in ``setup`` on the trainer's device, so batches are sampled
    where they are used and no DataLoader worker sits between buffer and step. When the
    trained module takes several steps per call (its ``steps_per_call``), the stream hands
    out :class:`StepBatches` ending at the multiples of :func:`schedule_periods` and at the
    trainer's ``max_steps``.

    Named for what it streams from, a replay buffer, not for the kind of data: offline
    transitions, trajectory windows, preference pairs and online rollouts alike (it was
    ``OfflineDataModule``; that name remains as an alias, and checkpoints saved under it resume).

    Args:
        data: the loaded dataset (``OfflineData``, ``PreferenceData``, ``RolloutData``...: anything
            with ``replay_buffer(batch_size, *, sampler, slice_len, seed, device)``).

    Keyword Args:
        batch_size: elements per batch (trajectory windows: ``num_slices * slice_len``).
        seed: the run's seed; each rank derives its own stream from it.
        sampler: ``"random"`` for transitions, ``"slice"`` for trajectory windows.
        slice_len: window length for ``sampler="slice"``.
    """

    def __init__(
        self,
        data,
        *,
        batch_size: int = 256,
        seed: int = 0,
        sampler: str = "random",
        slice_len: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.data = data
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.sampler = sampler
        self.slice_len = slice_len
        self.stream: Optional[ReplayBufferStream] = None

    def setup(self, stage: str) -> None:
        if self.stream is not None:
            return
        trainer = self.trainer
        device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
        rank = trainer.global_rank if trainer is not None else 0
        buffer = self.data.replay_buffer(
            self.batch_size, sampler=self.sampler, slice_len=self.slice_len, seed=self.seed, device=device
        )
        self.stream = ReplayBufferStream(buffer, seed=self.seed, rank=rank, start_step=self._current_step)

    def _current_step(self) -> int:
        return int(self.trainer.global_step) if self.trainer is not None else 0

    def train_dataloader(self) -> ReplayBufferStream:
        # the stream itself, not a DataLoader: a DataLoader would draw its base seed
        # from the global RNG on every iter() and add a collate per step
        assert self.stream is not None, "setup() must run before train_dataloader()"
        self.stream.configure(self.trainer)
        return self.stream

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        # batches are sampled on the device already; Lightning's generic transfer
        # would walk the TensorDict key by key on every step
        if getattr(batch, "device", None) == device:
            return batch
        if hasattr(batch, "to"):
            return batch.to(device, non_blocking=True)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "batch_size": self.batch_size, "sampler": self.sampler, "slice_len": self.slice_len}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # the stream position is the trainer's restored global_step; the seed must match
        if int(state_dict.get("seed", self.seed)) != self.seed:
            raise UserError(
                f"the checkpoint was trained with seed {state_dict['seed']}, this run uses seed {self.seed}; "
                "resume with the same --seed"
            )


#: the earlier name (kept so code importing it keeps working); new code says ``ReplayDataModule``
OfflineDataModule = ReplayDataModule
