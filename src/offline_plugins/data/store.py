"""The local Minari store: find a dataset id, make it from a recipe, or explain why not.

Every failure is a :class:`~offline_plugins.data.errors.DatasetError` naming the
dataset, the problem and the fix.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Optional

from offline_plugins.data.errors import DatasetError

__all__ = [
    "store_path",
    "local_dataset_ids",
    "is_local",
    "resolve_dataset_id",
    "make_dataset",
    "open_minari_dataset",
    "dataset_size_bytes",
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
    from offline_plugins.plugins import load_registry

    return load_registry()


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
    import socket

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


def make_dataset(dataset_id: str, registry=None, *, seed: int = 0, progress: bool = True, force: bool = False, **options):
    """Make a recipe's dataset in the local store; returns the ``minari.MinariDataset``."""
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
    return recipe.load_make()(recipe, seed=seed, progress=progress, force=force, **options)


def _extra_available(extra: str) -> bool:
    import importlib.util

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
