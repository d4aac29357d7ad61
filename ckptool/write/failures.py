"""A write the system refuses, said as ckptool says errors: which output,
why, and what to do (``cannot write /x/out.safetensors: no space left on
device`` / ``free space on that filesystem, or write elsewhere``).

A full disk (or quota) says how much the filesystem has left and, where
the writer said so (``needing``), how much the output needs: ``cannot write
/x/out.safetensors: no space left on device (needs 1.2 GB, 310.4 MB free on
/x)``.

``naming(target, *paths)`` turns an ``OSError`` that is the output's into an
``OutputError`` naming ``target``: one whose errno only a write raises (disk
full, quota, file too large, read-only filesystem), or one that names
``target`` or a path of its (its temporary file or directory). An error of
another file (the input, read while the output is written) is left as it is.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from contextvars import ContextVar

from ckptool.describe import human_bytes
from ckptool.errors import OutputError

# what the output being written needs, in bytes, where its writer said
NEEDED: ContextVar[int | None] = ContextVar("ckptool_output_needs", default=None)

# errnos only a write raises: whatever the OSError names, the output failed
_WRITES = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
_CLEAN = "nothing was left half-written"
_HINTS = {
    errno.ENOSPC: "free space on that filesystem, or write elsewhere",
    errno.EDQUOT: "free space within your quota on that filesystem, or write elsewhere",
    errno.EFBIG: "the filesystem (or `ulimit -f`) caps the size of a file: write elsewhere",
    errno.EROFS: "the filesystem is mounted read-only: write elsewhere",
    errno.ENAMETOOLONG: "choose a shorter output name",
    errno.EACCES: "check the permissions of the output's directory, or write elsewhere",
    errno.EPERM: "check the permissions of the output's directory, or write elsewhere",
}


def output_error(target: str | os.PathLike[str], exc: OSError,
                 clean: bool = True) -> OutputError:
    """``exc`` as the error of writing ``target`` (``clean``: the writer
    removed what it had written, and the hint says so)."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    hint = _HINTS.get(exc.errno or 0, "check the output's path and its filesystem")
    if clean:
        hint += f" ({_CLEAN})"
    message = f"cannot write {os.fspath(target)}: {reason[:1].lower()}{reason[1:]}"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        message += _space(os.fspath(target))
    return OutputError(message, hint)


@contextlib.contextmanager
def needing(nbytes: int) -> Iterator[None]:
    """Inside this block, the output being written needs ``nbytes``."""
    token = NEEDED.set(nbytes)
    try:
        yield
    finally:
        NEEDED.reset(token)


def _space(target: str) -> str:
    """`` (needs X, Y free on MOUNT)`` for the filesystem ``target`` is on."""
    where = os.path.dirname(os.path.abspath(target))
    while not os.path.isdir(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    try:
        fs = os.statvfs(where)
    except OSError:
        return ""
    free = fs.f_bavail * fs.f_frsize
    mount = where
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    if fs.f_files and not fs.f_favail:  # bytes to spare, but no file can be made
        return f" (no inode left on {mount}: it holds as many files as it can)"
    needed = NEEDED.get()
    needs = f"needs {human_bytes(needed)}, " if needed else ""
    return f" ({needs}{human_bytes(free)} free on {mount})"


def is_output_error(exc: OSError, paths: tuple[str | os.PathLike[str], ...]) -> bool:
    """Whether ``exc`` is the failure of writing one of ``paths`` (or a path
    inside one of them), rather than of reading another file."""
    if exc.errno in _WRITES:
        return True
    mine = [os.fsdecode(p) for p in paths]
    for name in (exc.filename, exc.filename2):
        if isinstance(name, (str, bytes, os.PathLike)):
            said = os.fsdecode(name)
            if any(said == p or said.startswith(p.rstrip(os.sep) + os.sep) for p in mine):
                return True
    return False


@contextlib.contextmanager
def naming(target: str | os.PathLike[str], *paths: str | os.PathLike[str],
           clean: bool = True) -> Iterator[None]:
    """Inside this block, an ``OSError`` of writing ``target`` (or one of
    ``paths``, its temporary files) is an ``OutputError`` naming ``target``."""
    try:
        yield
    except OSError as exc:
        if not is_output_error(exc, (target, *paths)):
            raise
        raise output_error(target, exc, clean) from exc
