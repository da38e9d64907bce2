"""The run-level guards of :func:`~offline_plugins.lightning.run.train`.

Everything here either refuses a run before it starts (with a
:class:`~offline_plugins.errors.UserError` naming the input and the fix) or keeps a
started run from leaving something broken behind:

- :func:`check_devices`: ``--devices``/``--accelerator`` against what the machine has,
  before a single DDP rank is spawned.
- :func:`check_out_dir`: ``--out`` must be (or be creatable as) a folder we can write.
- :class:`RunFolderLock`: one run per output folder at a time (an ``flock`` on
  ``OUT/.run.lock``, released by the kernel if the process dies).
- checkpoints are read and checked in :mod:`offline_plugins.lightning.checkpoint_files`.
- :class:`GracefulInterrupt`: SIGINT/SIGTERM stop training at the next step boundary,
  save ``last.ckpt`` there and let ``train`` write a partial summary.
- :func:`quiet_lightning`: Lightning's banner lines at warning level unless ``verbose``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import sys
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any, Iterator, Optional, Union

try:  # POSIX: without fcntl a run folder is not locked
    import fcntl
    import resource
except ImportError:  # pragma: no cover - Windows
    fcntl = resource = None

import numpy as np
import torch

from offline_plugins.errors import UserError

__all__ = [
    "restored_process_state",
    "RUN_ENV_VARS",
    "RunError",
    "RunInterrupted",
    "check_devices",
    "check_out_dir",
    "check_precision",
    "check_strategy",
    "peak_memory_mb",
    "held_state_mb",
    "RunFolderLock",
    "GracefulInterrupt",
    "quiet_lightning",
]


class RunError(UserError):
    """A run that cannot start as asked (output folder in use, bad step counts, bad checkpoint)."""


class RunInterrupted(UserError):
    """Training was stopped by SIGINT/SIGTERM; ``last.ckpt`` and a partial summary were saved."""

    exit_code = 130


_ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def check_devices(devices: Union[int, str, list, None], accelerator: str = "auto", num_nodes: int = 1) -> None:
    """Refuse ``devices``/``accelerator`` this machine cannot give, before anything is spawned.

    ``--devices N`` above the CPU cores (CPU training: one DDP process per device) or
    the visible GPUs, and ``--accelerator gpu`` without CUDA, are one-line errors.

    >>> check_devices(1, "cpu")
    >>> check_devices(10_000, "cpu")
    Traceback (most recent call last):
    ...
    offline_plugins.lightning.guards.RunError: --devices 10000 asks for 10000 CPU processes, ...
    """
    acc = str(accelerator or "auto").lower()
    if acc not in _ACCELERATORS:
        raise RunError(f"--accelerator {accelerator!r} is not one this package trains on; use one of "
                       f"{', '.join(_ACCELERATORS)}")
    if int(num_nodes) < 1:
        raise RunError(f"--num-nodes must be at least 1, got {num_nodes}")
    cuda = torch.cuda.is_available()
    if acc in ("gpu", "cuda") and not cuda:
        raise RunError(
            f"--accelerator {accelerator} asks for a CUDA GPU, but none is visible here "
            f"(torch {torch.__version__}: torch.cuda.is_available() is False); use --accelerator cpu or auto"
        )
    if acc == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise RunError("--accelerator mps asks for Apple's Metal backend, which this machine lacks; "
                       "use --accelerator cpu or auto")
    if isinstance(devices, str):
        if devices == "auto":
            return
        if not devices.strip().isdigit():
            raise RunError(f"--devices expects a whole number or 'auto', got {devices!r}")
        devices = int(devices)
    if isinstance(devices, (list, tuple)):
        wanted = len(devices)
    elif isinstance(devices, int):
        wanted = devices
    else:
        return
    if wanted < 1:
        raise RunError(f"--devices must be at least 1, got {wanted}")
    if acc in ("gpu", "cuda") or (acc == "auto" and cuda):
        have, what = torch.cuda.device_count(), "CUDA GPUs"
    elif acc == "mps":
        have, what = 1, "MPS devices"
    else:
        have, what = _cpu_count(), "CPU processes"
    if wanted > have:
        where = "GPUs are visible" if what == "CUDA GPUs" else ("CPU cores are available" if what == "CPU processes"
                                                                 else "MPS device is available")
        raise RunError(
            f"--devices {wanted} asks for {wanted} {what}, but only {have} {where} to this process; "
            f"pass --devices {have} or fewer"
        )


#: Lightning precisions a run accepts, and those that need CUDA
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "64-true", "16-mixed", "16-true")
_CUDA_ONLY = ("16-mixed", "16-true")
_ALIASES = {"32": "32-true", "64": "64-true", "bf16": "bf16-mixed", "16": "16-mixed"}


def check_precision(precision: Union[str, int], accelerator: str = "auto") -> str:
    """The canonical precision for Lightning's ``Trainer``; an unknown or unsupported one is a ``RunError``.

    >>> check_precision("32"), check_precision("bf16-mixed")
    ('32-true', 'bf16-mixed')
    """
    text = _ALIASES.get(str(precision), str(precision))
    return _check_choice("--precision", precision, text, PRECISIONS, _CUDA_ONLY, accelerator, " (or 32, 64, bf16, 16)",
                         "a CUDA GPU (float16 autocast on a CPU is not supported); use --precision bf16-mixed on a CPU")


def _check_choice(flag: str, given: Any, value: str, choices: tuple, cuda_only: tuple, accelerator: str,
                  also: str, needs: str) -> str:
    """``value`` when it is one of ``choices`` and, if it is in ``cuda_only``, CUDA is here; else a RunError."""
    if value not in choices:
        raise RunError(f"{flag} {given!r} is not one of {', '.join(choices)}{also}")
    if value in cuda_only:
        if accelerator == "cpu" or not torch.cuda.is_available():
            raise RunError(f"{flag} {value} needs {needs}")
    return value


#: the strategies ``train`` passes to Lightning by name, and those that need CUDA
STRATEGIES = ("auto", "ddp", "ddp_spawn", "fsdp", "deepspeed")
_CUDA_STRATEGIES = ("deepspeed",)


def check_strategy(strategy: Optional[str], accelerator: str = "auto") -> Optional[str]:
    """``strategy`` if this machine can run it; a ``RunError`` naming what is missing otherwise.

    >>> check_strategy(None), check_strategy("ddp")
    (None, 'ddp')
    """
    if strategy is None or not isinstance(strategy, str):
        return strategy
    return _check_choice("--strategy", strategy, strategy, STRATEGIES, _CUDA_STRATEGIES, accelerator, "",
                         "CUDA GPUs (Lightning runs it on GPUs only); on a CPU use --strategy ddp or fsdp with --devices N")


def peak_memory_mb(device=None) -> dict[str, float]:
    """Peak memory of this process: resident set on the host, and allocated on the CUDA device."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    out = {"host_max_rss": round(rss / (1024 * 1024 if sys.platform == "darwin" else 1024), 1)}
    if device is not None and getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available():
        out["cuda_max_allocated"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return out


def held_state_mb(module, optimizers=()) -> dict[str, float]:
    """What this rank holds of the model and its optimiser, in MB: ``parameters`` (trainable and
    frozen, buffers excluded) and ``optimizer`` (its per-parameter state, e.g. Adam's two moments).
    A sharded parameter (FSDP2's ``DTensor``) counts its local shard only.

    >>> import torch
    >>> net = torch.nn.Linear(1000, 250)
    >>> opt = torch.optim.Adam(net.parameters())
    >>> net(torch.ones(1, 1000)).sum().backward(); opt.step()
    >>> held_state_mb(net, [opt])
    {'parameters': 0.95, 'optimizer': 1.91}
    """
    def nbytes(t) -> int:
        t = getattr(t, "_local_tensor", t)
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    params = sum(nbytes(p) for p in module.parameters())
    state = 0
    for opt in optimizers:
        for per_param in getattr(opt, "state", {}).values():
            state += sum(nbytes(v) for v in per_param.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"parameters": round(params / 2**20, 2), "optimizer": round(state / 2**20, 2)}


def check_out_dir(out_dir: Union[str, os.PathLike]) -> Path:
    """``out_dir`` as a Path, refused if it is a file or cannot be created and written.

    Writes nothing that stays: a probe file in the nearest existing folder is removed at once.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise RunError(f"--out {str(out)!r} is an existing file, not a folder; choose a folder path for the run")
    probe = out
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise RunError(f"--out {str(out)!r}: {str(probe)!r} is a file, so no folder can be made under it; "
                       "choose another --out")
    try:  # os.access says yes to root on a read-only mount; a real file says the truth
        fd, name = tempfile.mkstemp(prefix=".offline-plugins-probe-", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise RunError(f"--out {str(out)!r}: cannot write in {str(probe)!r} ({reason}); choose a folder you can "
                       "write (or fix its permissions)") from None
    return out


class RunFolderLock:
    """An exclusive lock on one run folder, held for the whole run.

    ``acquire`` creates ``folder`` (if needed) and takes a non-blocking ``flock`` on
    ``folder/.run.lock``; a second process asking for the same folder is refused with a
    :class:`RunError` naming the holder's pid. The kernel drops the lock when the holder
    dies, so a killed run never blocks the next one. Where ``fcntl`` is missing (Windows)
    the lock is a no-op.
    """

    NAME = ".run.lock"
    #: the locks this process holds (a forked child closes its copies: :meth:`close_inherited`)
    _held: "weakref.WeakSet[RunFolderLock]" = weakref.WeakSet()

    def __init__(self, folder: Union[str, os.PathLike]) -> None:
        self.folder = Path(folder)
        self._fh = None
        self.created = False

    @classmethod
    def close_inherited(cls) -> None:
        """In a forked child: close the descriptors of the locks it inherited, without unlocking. An
        ``flock`` lasts while any descriptor of it is open, so a child (a sampler process) that kept
        them would hold its run's folder after the run was killed, and refuse the ``--resume``."""
        for lock in list(cls._held):
            if lock._fh is not None:
                with contextlib.suppress(OSError):
                    os.close(lock._fh.fileno())
                lock._fh = None
        cls._held = weakref.WeakSet()

    def acquire(self) -> "RunFolderLock":
        if fcntl is None:  # pragma: no cover - not POSIX
            self.folder.mkdir(parents=True, exist_ok=True)
            return self
        self.created = not self.folder.exists()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fh = open(self.folder / self.NAME, "a+")
        except OSError as exc:
            raise RunError(f"--out {str(self.folder)!r} cannot be created ({exc.strerror or exc}); choose another "
                           "--out") from None
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            holder = fh.read().strip() or "unknown"
            fh.close()
            raise RunError(
                f"output folder {str(self.folder)!r} is in use by another run (pid {holder}); wait for it to end, "
                "or choose another --out"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        self._fh = fh
        RunFolderLock._held.add(self)
        return self

    def release(self, *, remove_if_unused: bool = False) -> None:
        """Drop the lock; with ``remove_if_unused`` also remove a folder this lock created and nothing else used."""
        if self._fh is None:
            return
        fh, self._fh = self._fh, None
        RunFolderLock._held.discard(self)
        if remove_if_unused and self.created:
            others = [p for p in self.folder.iterdir() if p.name != self.NAME]
            if not others:
                with contextlib.suppress(OSError):
                    (self.folder / self.NAME).unlink()
                    self.folder.rmdir()
        fh.close()

    def __enter__(self) -> "RunFolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# -- interruption -----------------------------------------------------------------
class GracefulInterrupt:
    """Turn the first SIGINT (Ctrl-C) into a stop at the next step boundary.

    Lightning already stops on SIGTERM that way (``trainer.received_sigterm``, then a
    ``SIGTERMException`` after the step); this gives SIGINT the same path, and
    :class:`~offline_plugins.lightning.callbacks.InterruptCheckpoint` saves ``last.ckpt``
    on it. A second Ctrl-C interrupts at once. Single-process runs only: under DDP the
    handler is not installed and Lightning's own handling applies.
    """

    def __init__(self) -> None:
        self.signal: Optional[str] = None
        self.trainer = None
        self._previous = None

    def _handler(self, signum, frame) -> None:
        if self.signal is not None:  # the second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name
        if self.trainer is not None:
            self.trainer._signal_connector.received_sigterm = True

    def note_sigterm(self) -> None:
        if self.signal is None:
            self.signal = "SIGTERM"

    @contextlib.contextmanager
    def installed(self, trainer) -> Iterator["GracefulInterrupt"]:
        self.trainer = trainer
        main = threading.current_thread() is threading.main_thread()
        if main and trainer.world_size == 1:
            self._previous = signal.signal(signal.SIGINT, self._handler)
        try:
            yield self
        finally:
            if main and self._previous is not None:
                signal.signal(signal.SIGINT, self._previous)
                self._previous = None


# -- terminal output --------------------------------------------------------------
# TorchRL logs each replay buffer's storage allocation at info level, to stdout
_LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning", "torchrl")


#: environment variables a run sets for itself and its DDP ranks
RUN_ENV_VARS = ("OMP_NUM_THREADS", "OFFLINE_PLUGINS_RUN_DIR", "PL_GLOBAL_SEED", "PL_SEED_WORKERS")


@contextlib.contextmanager
def restored_process_state() -> Iterator[None]:
    """Restore what a run changes process-wide when it ends, however it ends.

    A run sets torch's CPU threads (``--threads``) and the variables in
    :data:`RUN_ENV_VARS` once, and reseeds the global RNGs (Lightning's
    ``seed_everything``, and each step's seed from ``(seed, rank, step)``); called as a
    library function, ``train`` gives the caller back its threads, environment and the
    states of torch's (CPU and initialised CUDA), numpy's and Python's global RNGs.

    >>> import os, random
    >>> state = random.getstate()
    >>> with restored_process_state():
    ...     os.environ["OFFLINE_PLUGINS_RUN_DIR"] = "runs/x"
    ...     _ = random.random()
    >>> "OFFLINE_PLUGINS_RUN_DIR" in os.environ, random.getstate() == state
    (False, True)
    """
    env = {k: os.environ.get(k) for k in RUN_ENV_VARS}
    threads = torch.get_num_threads()
    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state_all(cuda_state)


@contextlib.contextmanager
def quiet_lightning(verbose: bool = False) -> Iterator[None]:
    """Lightning's and TorchRL's info lines (accelerator banner, logging tips, "fit stopped",
    storage allocations) at warning level.

    The user's terminal keeps our progress bar and result lines; Lightning's warnings
    still show. ``verbose=True`` changes nothing. Levels are restored afterwards.
    """
    if verbose:
        yield
        return
    loggers = [logging.getLogger(name) for name in _LIGHTNING_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(lg.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
