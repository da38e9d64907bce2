"""The local Minari store: find a dataset id, make it from a recipe, or explain why not.

Every failure is a :class:`~offline_plugins.data.errors.DatasetError` naming the
dataset, the problem and the fix.

Datasets are made by :func:`build_atomically`: under a per-dataset lock file
(``STORE/.locks/ID.lock``, ``fcntl.flock``), a build writes into a private Minari root
``STORE/.building/ID+PID-RANDOM/store`` and its finished folder is renamed into place,
so a killed or failed build never leaves a partial dataset and a rebuild never loses
the old one. Hidden (``.``) folders are skipped by Minari and by :func:`local_dataset_ids`.

A recipe's size is estimated before it runs (:func:`estimated_dataset_bytes`) and a make is
refused when the store's free space (or the process's file-size limit) is below it; a
write that fails anyway (disk full, quota, file too large, read-only, I/O error) ends in one
line, with the partial build removed, instead of HDF5's tracebacks.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Callable, Iterator, Optional
from urllib.parse import quote, unquote

try:  # POSIX: without them, builds of one id are not serialised and no file-size limit is checked
    import fcntl
    import resource
except ImportError:  # pragma: no cover - Windows
    fcntl = resource = None

import errno
import gc
import importlib.util
import inspect
import re
import socket

from offline_plugins.data.errors import DatasetError
from offline_plugins.data.files import WRITE_ERRNOS, is_write_error
from offline_plugins.plugins import shared_registry

__all__ = [
    "read_minari_episodes",
    "store_path",
    "local_dataset_ids",
    "is_local",
    "resolve_dataset_id",
    "make_dataset",
    "build_atomically",
    "check_data_format",
    "open_minari_dataset",
    "dataset_size_bytes",
    "estimated_dataset_bytes",
]


def store_path() -> Path:
    """The Minari datasets folder (``MINARI_DATASETS_PATH``, else ``~/.minari/datasets``)."""
    env = os.environ.get("MINARI_DATASETS_PATH")
    return Path(env) if env else Path.home() / ".minari" / "datasets"


def local_dataset_ids() -> list[str]:
    """Ids of the datasets in the local store, found from their ``data/`` folders.

    Unlike ``minari.list_local_datasets`` this reads no metadata, so a damaged dataset
    is still listed (and reported when loaded).
    """
    root = store_path()
    found: list[str] = []
    if not root.is_dir():
        return found

    def walk(folder: Path, prefix: str) -> None:
        for child in sorted(folder.iterdir()):
            if not child.is_dir() or child.name.startswith("."):
                continue
            ident = f"{prefix}{child.name}"
            if (child / "data").is_dir():
                found.append(ident)
            else:
                walk(child, ident + "/")

    walk(root, "")
    return found


def is_local(dataset_id: str) -> bool:
    """Whether ``dataset_id`` has a folder in the local store."""
    return (store_path() / dataset_id / "data").is_dir()


def dataset_size_bytes(dataset_id: str) -> int:
    """Bytes on disk of a local dataset."""
    total = 0
    for dirpath, _, files in os.walk(store_path() / dataset_id):
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    return total


def _registry(registry):
    if registry is not None:
        return registry

    return shared_registry()


def resolve_dataset_id(dataset_id: str, registry=None, *, allow_download: bool = True) -> tuple[str, Optional[object]]:
    """``(minari_id, recipe_or_None)`` for a user's id.

    Accepts a local id, a recipe id, a recipe id without its ``offline-plugins/``
    namespace, or (where there is a network) a remote Minari id, which is downloaded.
    """
    if not isinstance(dataset_id, str) or not dataset_id.strip():
        raise DatasetError(f"dataset id must be a non-empty string like 'offline-plugins/pendulum/medium-v0', got {dataset_id!r}")
    dataset_id = dataset_id.strip()
    reg = _registry(registry)
    for candidate in (dataset_id, f"offline-plugins/{dataset_id}"):
        recipe = reg.datasets.get(candidate)
        if is_local(candidate) or recipe is not None:
            return candidate, recipe
    from offline_plugins.data.ogbench import explain_unknown

    ogbench = explain_unknown(dataset_id)
    if ogbench is not None:
        raise DatasetError(ogbench)
    known = sorted(set(local_dataset_ids()) | set(reg.datasets))
    close = difflib.get_close_matches(dataset_id, known, n=3, cutoff=0.6)
    close += [k for k in known if k.endswith("/" + dataset_id) and k not in close]
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    remote = ""
    ours = {k.split("/")[1] for k in reg.datasets if k.startswith("offline-plugins/")} | {"offline-plugins"}
    if allow_download and _looks_like_minari_id(dataset_id) and dataset_id.split("/")[0] not in ours:
        problem = _try_download(dataset_id)
        if problem is None:
            return dataset_id, None
        remote = f" It is not on Minari's remote server either, or that server cannot be reached ({problem})."
    raise DatasetError(
        f"unknown dataset {dataset_id!r}: it is not in the local Minari store ({store_path()}) and no recipe "
        f"makes it.{remote}{hint} See 'offline-plugins data list' for recipes and local datasets; "
        "a remote id needs a network once: 'minari download ID'."
    )


def _looks_like_minari_id(dataset_id: str) -> bool:
    from minari.dataset.minari_dataset import DATASET_ID_RE

    return bool(DATASET_ID_RE.fullmatch(dataset_id)) and "/" in dataset_id


def _try_download(dataset_id: str) -> Optional[str]:
    """None when ``dataset_id`` was downloaded, else a short reason."""
    if os.environ.get("OFFLINE_PLUGINS_OFFLINE") or os.environ.get("HF_HUB_OFFLINE"):
        return "offline mode is set (OFFLINE_PLUGINS_OFFLINE or HF_HUB_OFFLINE)"

    try:  # Minari's client retries for ~20 s when offline; one quick connection says it first
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
    except OSError as exc:
        return f"no network: {exc}"
    import minari

    try:
        minari.download_dataset(dataset_id)
    except Exception as exc:  # network errors come in many types; the reason is what matters
        text = f"{type(exc).__name__}: {exc}".splitlines()[0]
        return text[:200]
    return None if is_local(dataset_id) else "the download left no dataset"


def make_dataset(
    dataset_id: str,
    registry=None,
    *,
    seed: int = 0,
    progress: bool = True,
    force: bool = False,
    exist_ok: bool = False,
    **options,
):
    """Make a recipe's dataset in the local store; returns the ``minari.MinariDataset``.

    The recipe runs inside :func:`build_atomically`: concurrent makes of one id wait for
    each other, and the dataset appears only when complete.

    Keyword Args:
        seed, progress, **options: passed to the recipe's ``make``.
        force: replace the dataset if it exists (the old one stays until the new one is done).
        exist_ok: return the existing dataset instead of raising when it exists (also
            when another process made it while this one waited for the lock).
    """

    minari_id, recipe = resolve_dataset_id(dataset_id, registry, allow_download=False)
    if recipe is None:
        raise DatasetError(
            f"dataset {dataset_id!r} has no recipe, so it cannot be made here; recipes are listed by "
            "'offline-plugins data list'"
        )
    missing = [extra for extra in recipe.requires if not _extra_available(extra)]
    if missing:
        raise DatasetError(
            f"dataset recipe {minari_id!r} needs the {', '.join(missing)} extra; "
            f"install it with: pip install 'offline-plugins[{','.join(missing)}]'"
        )
    make = recipe.load_make()
    kwargs = dict(seed=seed, progress=progress, force=force, **options)
    try:  # a typo in an option is reported before waiting for a lock or finding the dataset exists
        params = inspect.signature(make).parameters
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        params = {}
    if params and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(kwargs) - set(params))
        if unknown:
            known = list(params)[1:]  # the first is the recipe's spec
            raise DatasetError(
                f"dataset recipe {minari_id!r}: unknown option(s) {', '.join(unknown)}; known: {', '.join(known)}"
            )
    target = options.get("save_as") or minari_id
    if not (exist_ok and is_local(target)):
        _check_room(target, estimated_dataset_bytes(recipe, steps=options.get("steps"),
                                                    episodes=options.get("episodes")))
    return build_atomically(target, lambda: make(recipe, **kwargs), force=force, exist_ok=exist_ok)


#: bytes a Minari HDF5 file takes per value stored, measured on the recipes (pendulum: about 4x the
#: raw float32 payload, with Minari's per-episode groups and HDF5 chunk overhead); and a floor
_BYTES_PER_VALUE = 16
_BYTES_PER_STEP = 24
_MIN_ESTIMATE = 1 << 20


def estimated_dataset_bytes(recipe, *, steps: Optional[int] = None, episodes: Optional[int] = None) -> Optional[int]:
    """About how many bytes the dataset of ``recipe`` takes on disk (an upper estimate: the flat sizes
    of its environment's observation and action spaces per step, at HDF5's measured overhead), or None
    when it cannot be told (an environment that cannot be made here: the build says why)."""
    try:
        import gymnasium as gym

        env = gym.make(recipe.env_id)
        try:
            per_step = gym.spaces.flatdim(env.observation_space) * 2 + gym.spaces.flatdim(env.action_space)
            limit = getattr(env.spec, "max_episode_steps", None) if env.spec is not None else None
        finally:
            env.close()
    except Exception:
        return None
    options = dict(getattr(recipe, "options", ()) or ())
    n = int(steps if steps is not None else options.get("steps", 100_000))
    if recipe.tier == "medium-replay":  # the size of the training buffer it replays, not --steps
        try:
            from offline_plugins.data.behaviour import load_policy_file

            n = sum(int(seg["steps"]) for seg in load_policy_file(recipe.env_id).payload["replay"])
        except Exception:
            pass
    if episodes is not None and limit:
        n = min(n, int(episodes) * int(limit))
    return max(_MIN_ESTIMATE, n * (per_step * _BYTES_PER_VALUE + _BYTES_PER_STEP))


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def _check_room(dataset_id: str, needed: Optional[int]) -> None:
    """Refuse a make that cannot fit: the store's free space, or this process's file-size limit
    (``ulimit -f``), below the estimate ``needed``."""
    if needed is None:
        return
    root = store_path()
    probe = root
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    fix = ("free some space, or set MINARI_DATASETS_PATH to a folder on a disk with room, then run "
           f"'offline-plugins data make {dataset_id}' again (fewer --steps make a smaller dataset)")
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        free = None
    if free is not None and free < needed:
        raise DatasetError(f"dataset {dataset_id!r} needs about {_human(needed)} in {root}, which has {_human(free)} "
                           f"free; nothing was written; {fix}")
    if resource is None:  # pragma: no cover - not POSIX
        return
    try:
        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (OSError, ValueError, AttributeError):  # pragma: no cover - no such limit here
        return
    if soft != resource.RLIM_INFINITY and soft < needed:
        raise DatasetError(f"dataset {dataset_id!r} needs a file of about {_human(needed)}, but this process may write "
                           f"files of at most {_human(soft)} (ulimit -f); nothing was written; raise the limit "
                           "(ulimit -f unlimited) or make a smaller dataset with fewer --steps")


def _write_errno(exc: BaseException) -> Optional[int]:
    """The errno of a write that failed for lack of room or a broken file system, also when HDF5
    reports it only in its message (``errno = 28``); None for other errors."""

    seen = 0
    while exc is not None and seen < 8:
        if is_write_error(exc) and isinstance(exc, OSError):
            return exc.errno
        found = re.search(r"errno = (\d+)", str(exc))
        if found and int(found.group(1)) in WRITE_ERRNOS:
            return int(found.group(1))
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


@contextlib.contextmanager
def _quiet_unraisable() -> Iterator[list]:
    """Collect the errors raised in destructors meanwhile (h5py prints one per object it cannot
    close once a write failed), and show them when the block ends as Python would; a build that
    failed on a full disk clears them first (its one line says it)."""
    caught: list = []
    previous = sys.unraisablehook
    sys.unraisablehook = caught.append
    try:
        yield caught
    finally:
        sys.unraisablehook = previous
        for unraisable in caught:
            previous(unraisable)


_BUILDING = ".building"
_LOCKS = ".locks"
_BUILD_NOTE = "build.json"


def _key(dataset_id: str) -> str:
    """``dataset_id`` as one file name ('/' and '+' escaped, so '+' can separate fields)."""
    return quote(dataset_id, safe="")


def _build_owner(folder: Path) -> Optional[str]:
    """The dataset id a build folder ``STORE/.building/ID+PID-RANDOM`` belongs to, or None."""
    try:
        return json.loads((folder / _BUILD_NOTE).read_text())["dataset_id"]
    except (OSError, ValueError, KeyError, TypeError):
        key = folder.name.split("+", 1)[0]
        return unquote(key) if "+" in folder.name else None


def _inside_build(dataset_id: str) -> bool:
    """Whether the current Minari root is the private root of a build of ``dataset_id``."""
    root = store_path()
    return root.name == "store" and root.parent.parent.name == _BUILDING and _build_owner(root.parent) == dataset_id


@contextlib.contextmanager
def outer_store() -> Iterator[Path]:
    """Inside a build, make the store it will move its dataset into the current one (yielded), so a
    recipe made from another dataset (a relabelled view) can read or make that one; outside a
    build, the store as it is."""
    root = store_path()
    inside = root.name == "store" and root.parent.parent.name == _BUILDING
    if not inside:
        yield root
        return
    outer = root.parent.parent.parent
    os.environ["MINARI_DATASETS_PATH"] = str(outer)
    try:
        yield outer
    finally:
        os.environ["MINARI_DATASETS_PATH"] = str(root)


@contextlib.contextmanager
def _dataset_lock(root: Path, dataset_id: str, *, wait: bool = True) -> Iterator[bool]:
    """Hold the inter-process lock of ``dataset_id`` in store ``root``; yields whether it is held.

    With ``wait=False`` it yields False at once when another process holds it. Without
    ``fcntl`` (not POSIX) there is no lock and it yields True.
    """
    if fcntl is None:  # pragma: no cover - Windows: builds of one id are not serialised
        yield True
        return
    path = root / _LOCKS / f"{_key(dataset_id)}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            print(
                f"offline-plugins: waiting for another process building dataset {dataset_id!r} (lock {path})",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield True  # the kernel drops the lock when the process dies, so a killed build never blocks
    finally:
        os.close(fd)


def _discard_build(root: Path, folder: Path, dataset_id: Optional[str]) -> None:
    """Remove a build folder, first putting back a dataset it had moved aside and not replaced."""
    if dataset_id is not None:
        previous = folder / "previous" / dataset_id
        target = root / dataset_id
        if previous.is_dir() and not target.exists():
            try:
                os.rename(previous, target)
            except OSError:
                pass
    shutil.rmtree(folder, ignore_errors=True)


def _sweep_stale_builds(root: Path, dataset_id: str) -> None:
    """Remove the build folders of killed processes (called holding ``dataset_id``'s lock).

    A build folder is stale when nobody holds its dataset's lock: the lock dies with its
    process, so this needs no pid check (and is not fooled by a reused pid).
    """
    if fcntl is None:  # pragma: no cover - without locks a live build cannot be told from a dead one
        return
    building = root / _BUILDING
    if not building.is_dir():
        return
    for folder in sorted(building.iterdir()):
        owner = _build_owner(folder)
        if owner == dataset_id:
            _discard_build(root, folder, owner)
        elif owner is not None:
            with _dataset_lock(root, owner, wait=False) as free:
                if free:
                    _discard_build(root, folder, owner)


def _exists_error(dataset_id: str, root: Path) -> DatasetError:
    return DatasetError(f"dataset {dataset_id!r} already exists in {root}; pass force=True (CLI: --force) to rebuild it")


def check_data_format(dataset_id: str, data_format: Optional[str]) -> None:
    """Refuse a ``data_format`` Minari cannot write (None: Minari's default)."""
    if data_format not in (None, "hdf5", "arrow"):
        raise DatasetError(f"dataset {dataset_id!r}: data_format must be 'hdf5' or 'arrow', got {data_format!r}")


def build_atomically(dataset_id: str, build: Callable[[], object], *, force: bool = False, exist_ok: bool = False):
    """Run ``build()``, which writes ``dataset_id`` with Minari, so that the dataset appears whole or not at all.

    Holding ``dataset_id``'s lock, ``build`` runs with ``MINARI_DATASETS_PATH`` set to a
    private root inside the store (restored afterwards); the finished folder is then
    renamed into place, and an old dataset (``force``) is deleted only after that. On
    any failure (also ``KeyboardInterrupt``) the old dataset stays and the build folder
    is removed. Inside a build of ``dataset_id`` (a recipe calling this again) it just
    runs ``build``.

    Returns the dataset, opened at its final place.

    Raises:
        DatasetError: the dataset exists and neither ``force`` nor ``exist_ok`` is set,
            or ``build`` wrote no dataset.
    """
    if _inside_build(dataset_id):
        return build()
    root = store_path()
    if is_local(dataset_id) and not force:
        if exist_ok:
            return open_minari_dataset(dataset_id)
        raise _exists_error(dataset_id, root)
    with _dataset_lock(root, dataset_id):
        _sweep_stale_builds(root, dataset_id)
        if is_local(dataset_id) and not force:  # another process made it while this one waited
            if exist_ok:
                return open_minari_dataset(dataset_id)
            raise _exists_error(dataset_id, root)
        folder = root / _BUILDING / f"{_key(dataset_id)}+{os.getpid()}-{uuid.uuid4().hex[:8]}"
        private = folder / "store"
        target = root / dataset_id
        previous = folder / "previous" / dataset_id
        private.mkdir(parents=True)
        try:
            (folder / _BUILD_NOTE).write_text(json.dumps({"dataset_id": dataset_id, "pid": os.getpid()}))
            saved = os.environ.get("MINARI_DATASETS_PATH")
            os.environ["MINARI_DATASETS_PATH"] = str(private)
            try:
                with _quiet_unraisable() as caught:
                    try:
                        build()
                    except BaseException as exc:
                        code = _write_errno(exc)
                        if code is None:
                            raise
                        # drop the failed HDF5 objects now, while destructor errors are still collected

                        exc.__traceback__ = None
                        del exc
                        gc.collect()
                        caught.clear()  # HDF5's complaints about the full disk: the one line below says it
                        raise _build_write_error(dataset_id, root, code) from None
            finally:
                if saved is None:
                    os.environ.pop("MINARI_DATASETS_PATH", None)
                else:
                    os.environ["MINARI_DATASETS_PATH"] = saved
            built = private / dataset_id
            if not (built / "data" / "metadata.json").is_file():
                raise DatasetError(
                    f"dataset {dataset_id!r}: its recipe finished without writing the dataset (no "
                    f"{built / 'data' / 'metadata.json'}); the recipe's make must write it with Minari under this id"
                )
            _copy_namespaces(private, root, dataset_id)
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                previous.parent.mkdir(parents=True, exist_ok=True)
                os.rename(target, previous)
            os.rename(built, target)
        except BaseException:
            _discard_build(root, folder, dataset_id)
            raise
        shutil.rmtree(folder, ignore_errors=True)
    return open_minari_dataset(dataset_id)


def _build_write_error(dataset_id: str, root: Path, code: int) -> DatasetError:
    cause = {errno.ENOSPC: "no space left on device", errno.EFBIG: "a file grew past the file-size limit",
             errno.EROFS: "the file system is read-only", errno.EIO: "an input/output error of the device",
             getattr(errno, "EDQUOT", -1): "disk quota exceeded"}.get(code, os.strerror(code))
    return DatasetError(
        f"could not make dataset {dataset_id!r} in {root}: {cause} ({errno.errorcode.get(code, code)}) while "
        "writing it; "
        "the partial build was removed and the store is as it was (an earlier copy of the dataset is intact); "
        "free some space, or set MINARI_DATASETS_PATH to a folder on a disk with room, and make it again"
    )


def _copy_namespaces(private: Path, root: Path, dataset_id: str) -> None:
    """Give ``root`` the Minari namespace metadata files the build wrote and ``root`` lacks."""
    from minari.namespace import NAMESPACE_METADATA_FILENAME

    parts = dataset_id.split("/")[:-1]
    for depth in range(1, len(parts) + 1):
        namespace = "/".join(parts[:depth])
        source = private / namespace / NAMESPACE_METADATA_FILENAME
        dest = root / namespace / NAMESPACE_METADATA_FILENAME
        if source.is_file() and not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            partial = dest.with_name(f".{dest.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
            shutil.copyfile(source, partial)
            os.replace(partial, dest)  # whole or absent, also when two builds write it at once


def _extra_available(extra: str) -> bool:
    module = {"mujoco": "mujoco"}.get(extra, extra)
    return importlib.util.find_spec(module) is not None


def open_minari_dataset(dataset_id: str):
    """``minari.load_dataset`` of a local id, with every failure turned into a DatasetError."""
    import minari

    data_dir = store_path() / dataset_id / "data"
    fix = f"rebuild it ('offline-plugins data make {dataset_id} --force' for a recipe, 'minari download {dataset_id} --force' for a remote one)"
    if not (data_dir / "metadata.json").is_file():
        raise DatasetError(f"dataset {dataset_id!r}: {data_dir / 'metadata.json'} is missing; {fix}")
    try:
        meta = json.loads((data_dir / "metadata.json").read_text())
    except (OSError, ValueError) as exc:
        raise DatasetError(f"dataset {dataset_id!r}: {data_dir / 'metadata.json'} is not valid JSON ({exc}); {fix}") from None
    if meta.get("data_format", "hdf5") == "hdf5" and not (data_dir / "main_data.hdf5").is_file():
        raise DatasetError(f"dataset {dataset_id!r}: data file {data_dir / 'main_data.hdf5'} is missing; {fix}")
    try:
        dataset = minari.load_dataset(dataset_id)
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        raise DatasetError(f"dataset {dataset_id!r} in {data_dir} cannot be opened ({reason}); {fix}") from None
    return dataset


def read_minari_episodes(dataset, dataset_id: str) -> list[dict]:
    """Minari's episodes as dicts, every read failure turned into a DatasetError."""
    fix = f"rebuild it ('offline-plugins data make {dataset_id} --force', or 'minari download {dataset_id} --force')"
    indices = list(dataset.episode_indices)
    if not indices:
        raise DatasetError(f"dataset {dataset_id!r} is empty (0 episodes); {fix}")
    try:
        episodes = list(dataset.storage.get_episodes(indices))
    except KeyError as exc:
        raise DatasetError(f"dataset {dataset_id!r}: a data file lacks the key {exc}; {fix}") from None
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        raise DatasetError(f"dataset {dataset_id!r}: its data files cannot be read ({reason}); {fix}") from None
    for ep in episodes:
        for key in ("observations", "actions", "rewards", "terminations", "truncations"):
            if ep.get(key) is None:
                raise DatasetError(f"dataset {dataset_id!r}: episode {ep.get('id')} has no {key!r}; {fix}")
    return episodes
