"""The run-level guards of :func:`~offline_plugins.lightning.run.train`.

Everything here either refuses a run before it starts (with a
:class:`~offline_plugins.errors.UserError` naming the input and the fix) or keeps a
started run from leaving something broken behind:

- :func:`check_devices`: ``--devices``/``--accelerator`` against what the machine has,
  before a single DDP rank is spawned.
- :func:`check_out_dir`: ``--out`` must be (or be creatable as) a folder we can write.
- :class:`RunFolderLock`: one run per output folder at a time (an ``flock`` on
  ``OUT/.run.lock``, released by the kernel if the process dies).
- :func:`read_checkpoint` / :func:`check_resume`: checkpoints open with
  ``torch.load(weights_only=True)`` only, their metadata is validated before use, and a
  resume that does not fit the run says what differs, also when the data file it was
  trained on changed since (:func:`data_fingerprint`).
- :class:`GracefulInterrupt`: SIGINT/SIGTERM stop training at the next step boundary,
  save ``last.ckpt`` there and let ``train`` write a partial summary.
- :func:`quiet_lightning`: Lightning's banner lines at warning level unless ``verbose``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any, Iterator, Optional, Union

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
    "read_checkpoint",
    "is_sharded_checkpoint",
    "check_checkpoint",
    "check_resume",
    "data_fingerprint",
    "state_dict_mismatch",
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
    import torch

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
        import torch

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
    import resource
    import sys

    import torch

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
    import torch

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
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
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


# -- checkpoints ------------------------------------------------------------------
_LIGHTNING_KEYS = ("state_dict", "global_step", "epoch", "loops", "optimizer_states", "pytorch-lightning_version")
_OUR_KEYS = ("algorithm", "dataset", "config", "seed")


#: the file of a distributed checkpoint folder (``--strategy fsdp``) with everything but the sharded tensors
SHARDED_META = "meta.pt"


def is_sharded_checkpoint(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is a distributed checkpoint folder (``--strategy fsdp``: one shard file per rank,
    ``.metadata`` and ``meta.pt``)."""
    p = Path(path)
    return p.is_dir() and (p / SHARDED_META).is_file() and (p / ".metadata").is_file()


def read_checkpoint(path: Union[str, os.PathLike], *, tensors: bool = True) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)``: tensors and plain containers, never code.

    A file carrying pickled callables or classes is refused with a :class:`RunError`
    naming what it tried to load; nothing in it runs.

    A distributed checkpoint folder (``--strategy fsdp``) reads as the same dict: its ``meta.pt``
    (``weights_only=True``) and its shards gathered into full tensors by
    ``torch.distributed.checkpoint`` (the whole checkpoint in CPU memory); with ``tensors=False``
    the tensors are meta-device placeholders of their saved shapes (what a resume's checks need,
    without reading the shards: Lightning loads those into the sharded model itself).
    """
    p = Path(path)
    if p.is_dir() and is_sharded_checkpoint(p):
        ckpt = _torch_load(p / SHARDED_META, shown=p)
        if isinstance(ckpt, dict):
            ckpt.update(_sharded_tensors(p, real=tensors))
        return ckpt
    if not p.is_file():
        raise RunError(f"checkpoint {str(p)!r} does not exist; runs keep theirs in OUT/checkpoints/last.ckpt")
    return _torch_load(p, shown=p)


def _sharded_tensors(folder: Path, *, real: bool) -> dict[str, Any]:
    """``{"state_dict": ..., "optimizer_0": ...}`` of a distributed checkpoint folder: gathered from its
    shards (``real``), or meta-device tensors of the shapes its ``.metadata`` records."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        if real:
            from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
            from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

            out: dict[str, Any] = {}
            _load_state_dict(out, storage_reader=FileSystemReader(folder), planner=_EmptyStateDictLoadPlanner(),
                             no_dist=True)
            optimizers = sorted((k for k in out if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
            out["optimizer_states"] = [out.pop(k) for k in optimizers]
            return out
        metadata = FileSystemReader(folder).read_metadata()
    except Exception as exc:
        first = (str(exc).splitlines() or [""])[0][:300]
        raise RunError(f"checkpoint {str(folder)!r} could not be read ({type(exc).__name__}: {first}); a shard "
                       "may be missing or truncated") from None
    state: dict[str, Any] = {}
    optimizers: set[str] = set()
    for key, item in metadata.state_dict_metadata.items():
        where = (metadata.planner_data or {}).get(key, tuple(key.split(".", 1)))
        if where and where[0] == "state_dict" and isinstance(item, TensorStorageMetadata):
            state[".".join(str(w) for w in where[1:])] = torch.empty(tuple(item.size), device="meta")
        elif where and str(where[0]).startswith("optimizer_"):
            optimizers.add(str(where[0]))
    # the optimisers' states stay in the shards (Lightning loads them): named, not read
    return {"state_dict": state, "optimizer_states": [{"sharded": k} for k in sorted(optimizers)]}


def _torch_load(p: Path, *, shown: Path) -> Any:
    import pickle

    import torch

    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if "Unsupported global" not in text and "was not an allowed global" not in text:
            # not a pickle of code: random bytes, a truncated or foreign file
            detail = next((line.strip() for line in text.splitlines() if line.strip().startswith("Unsupported")),
                          text.splitlines()[0][:200])
            raise RunError(f"checkpoint {str(shown)!r} could not be read (UnpicklingError: {detail}); it may be "
                           "truncated or not a checkpoint") from None
        import re

        found = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"([\w.]+) was not an allowed global", text)
        what = f" ({found.group(1)})" if found else ""
        raise RunError(
            f"checkpoint {str(shown)!r} holds pickled Python objects{what} that loading would run; offline-plugins "
            "opens checkpoints with weights_only=True and refused it, nothing in it ran. Use a checkpoint "
            "written by 'offline-plugins train' (OUT/checkpoints/last.ckpt) from a source you trust"
        ) from None
    except Exception as exc:
        first = (str(exc).splitlines() or [""])[0][:300]
        raise RunError(f"checkpoint {str(shown)!r} could not be read ({type(exc).__name__}: {first}); it may be "
                       "truncated or not a checkpoint") from None


def check_checkpoint(ckpt: Any, path: Union[str, os.PathLike], *, for_resume: bool = False) -> dict[str, Any]:
    """Validate a loaded checkpoint's own metadata; returns its ``offline_plugins`` entry.

    Evaluation needs ``state_dict`` and our entry (``algorithm``, ``dataset``,
    ``config``, ``seed``); resuming also needs Lightning's loop and optimiser state.
    """
    where = f"checkpoint {str(path)!r}"
    if not isinstance(ckpt, dict) or "offline_plugins" not in ckpt:
        raise RunError(f"{where} is not an offline-plugins training checkpoint (no 'offline_plugins' entry); "
                       "use OUT/checkpoints/last.ckpt of a run of 'offline-plugins train'")
    info = ckpt["offline_plugins"]
    if not isinstance(info, dict):
        raise RunError(f"{where}: its 'offline_plugins' entry is a {type(info).__name__}, not a mapping; the file "
                       "was edited or damaged: use the run's own last.ckpt")
    missing = [f"offline_plugins.{k}" for k in _OUR_KEYS if k not in info]
    needed = _LIGHTNING_KEYS if for_resume else ("state_dict",)
    missing += [k for k in needed if k not in ckpt]
    if missing:
        use = "resume from" if for_resume else "evaluate"
        raise RunError(
            f"{where} lacks {', '.join(repr(m) for m in missing)}, which offline-plugins needs to {use} it; the "
            "file was edited by hand or written by another tool: use OUT/checkpoints/last.ckpt of the run"
        )
    bad = [(k, t) for k, t in (("algorithm", str), ("dataset", str), ("config", dict), ("seed", int))
           if not isinstance(info[k], t) or (t is str and not info[k])]
    if not isinstance(ckpt["state_dict"], dict):
        bad.append(("state_dict", dict))
    if for_resume and not isinstance(ckpt["global_step"], int):
        bad.append(("global_step", int))
    if bad:
        text = ", ".join(f"{k!r} should be a {'non-empty ' if t is str else ''}{t.__name__}" for k, t in bad)
        raise RunError(f"{where} has malformed metadata ({text}); the file was edited or damaged: use the run's "
                       "own last.ckpt")
    return info


def algorithm_of_checkpoint(info: dict, registry, path) -> Any:
    """The installed spec of a checkpoint's algorithm, or an error naming the package to install."""
    from offline_plugins.plugins.registry import UnknownNameError

    name = info["algorithm"]
    try:
        return registry.algorithm(name)
    except UnknownNameError:
        provider = info.get("provider")
        if provider and provider != "offline-plugins":
            version = info.get("provider_version")
            pin = f"=={version}" if version else ""
            raise RunError(
                f"checkpoint {str(path)!r} was trained with algorithm {name!r} from the package {provider!r}"
                f"{f' {version}' if version else ''}, which is not installed here (or failed to load: "
                f"'offline-plugins list'); install it: pip install '{provider}{pin}'"
            ) from None
        disabled = sorted(getattr(registry, "disabled", ()) or ())
        off = f"; plugins switched off now: {', '.join(disabled)}" if disabled else ""
        raise RunError(
            f"checkpoint {str(path)!r} was trained with algorithm {name!r}, which no installed plugin provides"
            f"{off}; install the package that registers {name!r} ('offline-plugins list' shows what is installed)"
        ) from None


def _config_differences(old: dict, new: dict) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [f"{k} (checkpoint {old.get(k, '<unset>')!r}, now {new.get(k, '<unset>')!r})"
            for k in keys if old.get(k) != new.get(k)]


def state_dict_mismatch(saved: dict, own: dict) -> Optional[str]:
    """The first way the tensors ``saved`` (a checkpoint's) do not fit ``own`` (the networks built now),
    as a phrase, or None when they fit: a shape (``name is (48,) in the checkpoint, (16, 3) here``),
    then missing and unexpected names.

    >>> import torch
    >>> state_dict_mismatch({"w": torch.zeros(48)}, {"w": torch.zeros(16, 3)})
    'w is (48,) in the checkpoint, (16, 3) here'
    >>> state_dict_mismatch({"w": torch.zeros(2)}, {"w": torch.zeros(2), "b": torch.zeros(1)})
    '1 tensor(s) missing (first: b), 0 unexpected'
    """
    for key, tensor in own.items():
        if key in saved and hasattr(saved[key], "shape") and hasattr(tensor, "shape") \
                and tuple(saved[key].shape) != tuple(tensor.shape):
            return f"{key} is {tuple(saved[key].shape)} in the checkpoint, {tuple(tensor.shape)} here"
    missing = [k for k in own if k not in saved]
    extra = [k for k in saved if k not in own]
    if missing or extra:
        first = f" (first: {(missing or extra)[0]})"
        return f"{len(missing)} tensor(s) missing{first if missing else ''}, {len(extra)} unexpected" \
               f"{first if extra and not missing else ''}"
    return None


def check_resume(ckpt: dict, path, *, algorithm: str, dataset: str, config: dict, module,
                 data_fingerprint: Optional[dict] = None, check_data: bool = True) -> None:
    """Refuse a resume whose checkpoint belongs to another run, naming the run and what differs;
    ``data_fingerprint`` (:func:`data_fingerprint` of the data now) must match the one the run saved
    (``check_data=False``: not compared, as on the ranks a launcher started after rank 0 checked it)."""
    info = ckpt["offline_plugins"]
    run = f"{info['algorithm']} on {info['dataset']}, step {ckpt.get('global_step', '?')}"
    if info["algorithm"] != algorithm:
        raise RunError(
            f"cannot resume: checkpoint {str(path)!r} is a run of {info['algorithm']!r} ({run}), not of "
            f"{algorithm!r}; resume with 'offline-plugins train {info['algorithm']} --dataset {info['dataset']} "
            "--resume ...', or start a new run without --resume"
        )
    if info["dataset"] != dataset:
        raise RunError(
            f"cannot resume: checkpoint {str(path)!r} was trained on dataset {info['dataset']!r} ({run}), this run "
            f"reads {dataset!r}; pass --dataset {info['dataset']}, or start a new run without --resume"
        )
    changed = _fingerprint_difference((info.get("run") or {}).get("data_fingerprint"), data_fingerprint) \
        if check_data else None
    if changed:
        raise RunError(
            f"cannot resume: the data of checkpoint {str(path)!r} ({run}) changed since it was saved: {changed}; "
            "restore the data the run was trained on, or start a new run on the new data without --resume"
        )
    first = state_dict_mismatch(ckpt["state_dict"], module.state_dict())
    if first:
        diffs = _config_differences(info.get("config") or {}, config)
        differ = f"; config differs in {', '.join(diffs[:6])}" if diffs else ""
        first = first.replace(" in the checkpoint, ", " there, ")
        raise RunError(
            f"cannot resume: checkpoint {str(path)!r} ({run}) does not fit this run's networks ({first}){differ}; "
            "resume with the run's own --config/--set, or start a new run without --resume"
        )


#: files up to this size are hashed whole; larger ones by size, modification time and their first and last MiB
_HASH_WHOLE_BYTES = 32 * 2**20
_EDGE_BYTES = 2**20


def _file_fingerprint(path: Path) -> dict[str, Any]:
    import hashlib

    stat = path.stat()
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        if stat.st_size <= _HASH_WHOLE_BYTES:
            for block in iter(lambda: fh.read(2**20), b""):
                digest.update(block)
            return {"size": stat.st_size, "sha256": digest.hexdigest()}
        digest.update(fh.read(_EDGE_BYTES))
        fh.seek(-_EDGE_BYTES, os.SEEK_END)
        digest.update(fh.read(_EDGE_BYTES))
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256_first_last_mib": digest.hexdigest()}


def data_fingerprint(dataset_id: str) -> Optional[dict[str, Any]]:
    """What identifies the data a run reads, to tell on ``--resume`` whether it changed: for a dataset
    that is a file or folder (a ``.jsonl`` path, a Minari dataset in the local store), each file's size
    and SHA-256 (files over 32 MiB: size, modification time and a hash of their first and last MiB); None
    for a built-in or remote id, which its id and version already name.

    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> _ = (Path(folder) / "pairs.jsonl").write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\\n')
    >>> fp = data_fingerprint(str(Path(folder) / "pairs.jsonl"))
    >>> sorted(fp), sorted(fp["files"][""])
    (['files', 'path'], ['sha256', 'size'])
    >>> data_fingerprint("offline-plugins/arithmetic/v0") is None
    True
    """
    if not isinstance(dataset_id, str) or not dataset_id or dataset_id.startswith("hf:"):
        return None
    path = Path(dataset_id).expanduser()
    if not path.exists():
        from offline_plugins.data.store import is_local, store_path

        if not is_local(dataset_id):
            return None
        path = store_path() / dataset_id / "data"
    path = path.resolve()
    if path.is_file():
        files = {"": _file_fingerprint(path)}
    else:
        files = {}
        for dirpath, dirnames, names in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(names):
                if not name.startswith("."):
                    full = Path(dirpath) / name
                    files[str(full.relative_to(path))] = _file_fingerprint(full)
    return {"path": str(path), "files": files}


def _fingerprint_difference(saved: Optional[dict], now: Optional[dict]) -> Optional[str]:
    """How the data changed between the fingerprints ``saved`` and ``now``, or None (also when the
    checkpoint recorded none: it was written before fingerprints were)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("files"), dict):
        return None
    if now is None:
        return f"{saved.get('path', '?')} is gone"
    root = now.get("path") or saved.get("path", "?")  # where it is read now (a moved copy of the same data is fine)
    named = lambda rel: str(Path(root) / rel) if rel else root  # noqa: E731
    for rel, was in saved["files"].items():
        found = now["files"].get(rel)
        if found is None:
            return f"{named(rel)} is missing"
        if found != was:
            if found.get("size") != was.get("size"):
                return f"{named(rel)} is {found.get('size')} bytes now, {was.get('size')} when the run started"
            return f"{named(rel)} has changed since the run started (same size, {was.get('size')} bytes)"
    for rel in now["files"]:
        if rel not in saved["files"]:
            return f"{named(rel)} is new"
    return None


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
    import random

    import numpy as np
    import torch

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
