"""A full disk, a quota or a refused write while a checkpoint or an export is written: one line naming
the folder, the free space there and that nothing was lost (the partial temp folder is removed, never
renamed into place, so the previous checkpoint or export stays what a resume or a user finds)."""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from pretrain.runtime.guard import RunStopped

#: errno values that mean "this folder cannot take the write" (not a bug of the writer)
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EFBIG})
#: what an export's failed write leaves as it was
EXPORT_KEPT = ("the checkpoints and any earlier export are untouched (free space, then rerun with --resume to write "
               "the export)")


class StorageError(RunStopped):
    """A checkpoint or an export could not be written for lack of space or permission (the message is
    one line; the CLI prints it and exits 1)."""


def storage_oserror(exc: BaseException | None, _seen: set | None = None) -> OSError | None:
    """The ``OSError`` with a :data:`STORAGE_ERRNOS` errno behind ``exc``: itself, its cause or context,
    or (DCP's ``CheckpointException``) one of the per-rank failures it wraps; None if there is none."""
    seen = _seen if _seen is not None else set()
    if exc is None or id(exc) in seen:
        return None
    seen.add(id(exc))
    if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
        return exc
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint's CheckpointException
    if isinstance(failures, dict):
        for failure in failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException) and (found := storage_oserror(inner, seen)):
                return found
    return storage_oserror(exc.__cause__, seen) or storage_oserror(exc.__context__, seen)


def free_space(path: str | Path) -> str:
    """Free space on the disk holding ``path`` (its nearest existing folder), e.g. ``"12.0 MiB"``."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return "unknown space"
    if free < 1024:
        return f"{free} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        free /= 1024
        if free < 1024 or unit == "TiB":
            return f"{free:.1f} {unit}"


@contextmanager
def guarded_write(what: str, final: Path, tmp: Path, kept: str):
    """Run the block that writes ``tmp`` (later renamed to ``final``); a storage ``OSError`` inside it
    (see :func:`storage_oserror`) removes ``tmp`` and becomes a :class:`StorageError` naming ``what``,
    the folder, the error, the free space and ``kept`` (what stays as it was)."""
    try:
        yield
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        err = storage_oserror(e)
        if err is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        reason = os.strerror(err.errno) if err.errno else str(err)
        raise StorageError(f"{what} {final} not written: {reason} ({free_space(final.parent)} free in "
                           f"{final.parent}); nothing was lost: the partial {tmp.name} was removed, never renamed, "
                           f"and {kept}") from e
