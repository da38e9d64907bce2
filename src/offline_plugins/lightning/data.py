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
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Union

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import IterableDataset

__all__ = ["step_seed", "ReplayBufferStream", "OfflineDataModule", "SAMPLE_STREAM", "LOSS_STREAM"]

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


class ReplayBufferStream(IterableDataset):
    """Endless batches from a TorchRL replay buffer, batch ``t`` seeded by ``(seed, rank, t)``.

    Args:
        buffer: a TorchRL ``ReplayBuffer`` with its batch size set.

    Keyword Args:
        seed: the run's seed.
        rank: this process's global rank.
        start_step: first step to draw, or a callable returning it when iteration
            starts (the trainer's ``global_step``, so a resumed run picks up there).
        stop_step: stop before this step (None: never).
    """

    def __init__(
        self,
        buffer,
        *,
        seed: int,
        rank: int = 0,
        start_step: Union[int, Callable[[], int]] = 0,
        stop_step: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.buffer = buffer
        self.seed = int(seed)
        self.rank = int(rank)
        self.start_step = start_step
        self.stop_step = stop_step
        self.generator = torch.Generator(device=_buffer_device(buffer))
        buffer.set_rng(self.generator)

    def __iter__(self) -> Iterator[Any]:
        step = self.start_step() if callable(self.start_step) else int(self.start_step)
        while self.stop_step is None or step < self.stop_step:
            self.generator.manual_seed(step_seed(self.seed, self.rank, step, SAMPLE_STREAM))
            yield self.buffer.sample()
            step += 1


class OfflineDataModule(LightningDataModule):
    """A ``LightningDataModule`` that streams batches from an offline dataset's replay buffer.

    The buffer is built in ``setup`` on the trainer's device, so batches are sampled
    where they are used and no DataLoader worker sits between buffer and step.

    Args:
        data: an ``OfflineData`` (anything with ``replay_buffer(batch_size, *, sampler,
            slice_len, seed, device)``).

    Keyword Args:
        batch_size: transitions per batch (trajectory windows: ``num_slices * slice_len``).
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
            from offline_plugins.errors import UserError

            raise UserError(
                f"the checkpoint was trained with seed {state_dict['seed']}, this run uses seed {self.seed}; "
                "resume with the same --seed"
            )
