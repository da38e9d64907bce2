"""Files written whole or not at all, and the one-line error a full disk gives.

A run rewrites its checkpoint, metrics, summary, plot and exported model many times; a
dataset build writes its folder once. Each is written beside its target and renamed over
it (``os.replace``; a folder: a sibling folder, then a swap), after an ``fsync`` (on a
delayed-allocation file system a full disk is often reported only there), so a failure
leaves the previous file as it was. A write that fails because the disk is full, a quota
or file-size limit is reached, the file system is read-only or the device fails
(:data:`WRITE_ERRNOS`) becomes a :class:`WriteError`: one line naming the file, the cause
and that nothing earlier was touched. Other errors propagate unchanged.

>>> import errno, tempfile
>>> from pathlib import Path
>>> folder = Path(tempfile.mkdtemp())
>>> atomic_write_text(folder / "a.txt", "old")
>>> def full(fh):
...     fh.write(b"new, partly")
...     raise OSError(errno.ENOSPC, "No space left on device")
>>> atomic_write(folder / "a.txt", full)
Traceback (most recent call last):
...
offline_plugins.data.files.WriteError: could not write ...a.txt: no space left on device (ENOSPC); the previous ...
>>> (folder / "a.txt").read_text(), sorted(p.name for p in folder.iterdir())
('old', ['a.txt'])
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

from offline_plugins.errors import UserError

__all__ = [
    "WRITE_ERRNOS",
    "WriteError",
    "is_write_error",
    "write_error",
    "atomic_path",
    "atomic_write",
    "atomic_write_text",
    "atomic_write_bytes",
    "atomic_folder",
]

#: the errors of a write the user fixes on the machine, not in the command
WRITE_ERRNOS = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EFBIG, errno.EROFS, errno.EIO,
                                     errno.EACCES, errno.EPERM) if e is not None)

_CAUSES = {
    errno.ENOSPC: "no space left on device",
    getattr(errno, "EDQUOT", -1): "disk quota exceeded",
    errno.EFBIG: "file too large for this file system or process limit",
    errno.EROFS: "the file system is read-only",
    errno.EIO: "input/output error of the device",
    errno.EACCES: "permission denied (the folder or file is not writable by this user)",
    errno.EPERM: "operation not permitted",
}

_DEFAULT_FIX = "free some space (or fix the file system) and run again"


class WriteError(UserError):
    """A file could not be written (disk full, quota, file size limit, read-only, I/O error);
    the previous version of the file is intact. ``path`` and ``errno`` say which and why."""

    def __init__(self, message: str, *, path: Union[str, os.PathLike, None] = None,
                 errno: Optional[int] = None) -> None:
        super().__init__(message)
        self.path = None if path is None else Path(path)
        self.errno = errno


def is_write_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is an ``OSError`` of :data:`WRITE_ERRNOS`."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, WriteError) or (isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def _os_error(exc: BaseException) -> Optional[OSError]:
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS:
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def write_error(path: Union[str, os.PathLike], exc: BaseException, *, fix: str = _DEFAULT_FIX,
                what: Optional[str] = None) -> WriteError:
    """The :class:`WriteError` for ``exc`` raised while writing ``path``: one line with the file, the
    cause, ``what`` was left intact (default: "the previous NAME is intact") and ``fix``."""
    if isinstance(exc, WriteError):
        return exc
    os_error = _os_error(exc)
    code = os_error.errno if os_error is not None else None
    cause = _CAUSES.get(code) if code is not None else None
    if cause is None:
        first = (str(exc).splitlines() or [""])[0][:200]
        cause = (os_error.strerror if os_error is not None else None) or f"{type(exc).__name__}: {first}"
    name = errno.errorcode.get(code, "") if code is not None else ""
    cause = f"{cause} ({name})" if name else cause
    what = what or f"the previous {Path(path).name} is intact"
    return WriteError(f"could not write {path}: {cause}; {what} (nothing was replaced); {fix}",
                      path=path, errno=code)


def _sibling(path: Path, tag: str) -> Path:
    # hidden, beside the target (same file system, so the rename is atomic), unique per writer
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _fsync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a folder be opened or synced
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(path: Union[str, os.PathLike], *, fix: str = _DEFAULT_FIX) -> Iterator[Path]:
    """Yield a path beside ``path`` to write (by any writer that takes a path); when the block ends
    without error the file is synced and renamed over ``path``. On any failure the partial file is
    removed and ``path`` is left as it was; a failure of :data:`WRITE_ERRNOS` is raised as a
    :class:`WriteError` (``fix`` says what to do), others as they are."""
    path = Path(path)
    partial = _sibling(path, "partial")
    try:
        yield partial
        fd = os.open(partial, os.O_RDONLY)
        try:
            os.fsync(fd)  # a delayed-allocation file system reports a full disk here
        finally:
            os.close(fd)
        os.replace(partial, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            partial.unlink()
        if is_write_error(exc):
            raise write_error(path, exc, fix=fix) from None
        raise
    _fsync_folder(path.parent)


def atomic_write(path: Union[str, os.PathLike], write: Callable, *, fix: str = _DEFAULT_FIX,
                 mode: str = "wb") -> Path:
    """Write ``path`` whole or not at all: ``write(fh)`` fills a file beside it (opened with ``mode``;
    text as UTF-8), which :func:`atomic_path` renames over ``path``."""
    with atomic_path(path, fix=fix) as partial:
        encoding = None if "b" in mode else "utf-8"
        with open(partial, mode, encoding=encoding, newline="" if encoding else None) as fh:
            write(fh)
    return Path(path)


def atomic_write_text(path: Union[str, os.PathLike], text: str, *, fix: str = _DEFAULT_FIX) -> None:
    """:func:`atomic_write` of a text (UTF-8)."""
    atomic_write(path, lambda fh: fh.write(text), fix=fix, mode="w")


def atomic_write_bytes(path: Union[str, os.PathLike], data: bytes, *, fix: str = _DEFAULT_FIX) -> None:
    """:func:`atomic_write` of bytes."""
    atomic_write(path, lambda fh: fh.write(data), fix=fix, mode="wb")


@contextlib.contextmanager
def atomic_folder(path: Union[str, os.PathLike], *, fix: str = _DEFAULT_FIX) -> Iterator[Path]:
    """Yield a fresh folder beside ``path`` to fill; when the block ends without error it takes
    ``path``'s place (the old folder, if any, is moved aside, then removed), else it is removed and
    ``path`` is left as it was. A failure of :data:`WRITE_ERRNOS` is raised as a :class:`WriteError`.

    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> with atomic_folder(root / "model") as tmp:
    ...     _ = (tmp / "weights.bin").write_bytes(b"1")
    >>> sorted(p.name for p in root.iterdir()), (root / "model" / "weights.bin").read_bytes()
    (['model'], b'1')
    """
    path = Path(path)
    building = _sibling(path, "partial")
    try:
        building.mkdir(parents=True)
        yield building
        for dirpath, _, files in os.walk(building):  # everything on the disk before the swap
            for name in files:
                with contextlib.suppress(OSError):
                    fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
        old = _sibling(path, "old") if path.exists() or path.is_symlink() else None
        if old is not None:
            os.rename(path, old)
        try:
            os.rename(building, path)
        except BaseException:
            if old is not None:
                os.rename(old, path)
            raise
    except BaseException as exc:
        shutil.rmtree(building, ignore_errors=True)
        if is_write_error(exc):
            raise write_error(path, exc, fix=fix, what=f"the previous {path.name} folder is intact") from None
        raise
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                old.unlink()
    _fsync_folder(path.parent)

