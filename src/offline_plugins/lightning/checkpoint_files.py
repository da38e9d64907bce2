"""Reading and checking checkpoint files, in one place: :func:`read_checkpoint` (``torch.load(weights_only=True)``
only, a distributed checkpoint folder's shards too), :func:`check_checkpoint` (the metadata validated before
use), :func:`load_checkpoint` (both), :func:`resume_path`, :func:`check_resume` (a resume that does not fit the
run says what differs, also when the data file it was trained on changed since: :func:`data_fingerprint`),
:func:`algorithm_of_checkpoint` and :func:`state_dict_mismatch`.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from offline_plugins.data.store import is_local, store_path
from offline_plugins.lightning.guards import RunError
from offline_plugins.plugins.registry import UnknownNameError

__all__ = ["SHARDED_META", "is_sharded_checkpoint", "read_checkpoint", "check_checkpoint", "load_checkpoint",
           "resume_path", "algorithm_of_checkpoint", "state_dict_mismatch", "check_resume", "data_fingerprint"]

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
    try:
        if real:
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



def load_checkpoint(path: Union[str, os.PathLike], *, for_resume: bool = False) -> dict[str, Any]:
    """Read a checkpoint written by :func:`~offline_plugins.lightning.run.train` (a Lightning
    checkpoint with our extras).

    Opened with ``torch.load(weights_only=True)``: a file carrying pickled code is refused
    (:class:`RunError`) and nothing in it runs. Its metadata is checked before use.
    """
    ckpt = read_checkpoint(path, tensors=not for_resume)
    check_checkpoint(ckpt, path, for_resume=for_resume)
    return ckpt


def resume_path(resume, out: Path) -> Optional[Path]:
    """The checkpoint ``resume`` names (``True``: ``out/checkpoints/last.ckpt``; a path), or None
    when not resuming; a ``RunError`` when it does not exist."""
    if resume in (None, False, ""):
        return None
    path = out / "checkpoints" / "last.ckpt" if resume is True else Path(resume)
    if not (path.is_file() or is_sharded_checkpoint(path)):
        raise RunError(f"cannot resume: checkpoint {str(path)!r} does not exist; train without --resume first")
    return path
