"""One writer at a time of an output path, whichever way it writes.

A conversion into OUT, on one process or many (``convert``, ``fix -o``,
``convert`` under torchrun), holds an exclusive ``flock`` on
``.OUT.ckptool.lock`` beside it from before it checks OUT until it has
committed or given up; another one refused the lock says who holds it. So
a plain convert and a distributed one never both believe they wrote OUT.

Taken again by the thread that holds it (a conversion whose directory
writer locks too), it is held once more, not refused.

The lock file is removed by its holder on release, success or failure. A
process that opened the file just before it was removed would lock a file
no longer there: after taking the lock, the holder checks that the path
still names the file it locked, and tries again if not. ``kill -9`` leaves
the file behind, unlocked: the next writer takes it and removes it. A lock
file is empty and has one name: anything else at its path (the input
itself, a link, a FIFO) is refused, never taken, never removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import threading
from pathlib import Path
from types import TracebackType

from ckptool.errors import UsageError
from ckptool.write.failures import naming, output_error

_HELD: dict[tuple[int, str], int] = {}  # (thread, lock file) -> times taken
_HELD_LOCK = threading.Lock()


def lock_path(target: str | os.PathLike[str]) -> Path:
    """The lock file of output ``target``."""
    path = Path(os.fspath(target).rstrip("/") or os.fspath(target))
    return path.parent / f".{path.name}.ckptool.lock"


class OutputLock:
    """``with OutputLock(target):`` this process alone writes ``target``;
    a ``UsageError`` if another holds it. Where the output's directory does
    not exist nothing is locked (the writer says why it cannot write)."""

    def __init__(self, target: str | os.PathLike[str]) -> None:
        self.target = os.fspath(target)
        # beside what the name leads to: a link to OUT and OUT share one lock
        self.path = lock_path(os.path.realpath(target))
        self._fd: int | None = None
        self._again = False  # this thread held it already

    def acquire(self) -> None:
        if not self.path.parent.is_dir():
            return
        key = (threading.get_ident(), os.path.abspath(self.path))
        with _HELD_LOCK:
            if key in _HELD:
                _HELD[key] += 1
                self._again = True
                return
        self._take()
        with _HELD_LOCK:
            _HELD[key] = 1

    def _take(self) -> None:
        for _ in range(100):  # another holder removing the file each time: give up
            with naming(self.target):
                try:  # never through a link, never blocking on a FIFO
                    fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
                                 | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
                except OSError as exc:
                    if exc.errno == errno.ELOOP:
                        raise self._in_the_way() from exc
                    raise output_error(self.target, exc) from exc
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size or st.st_nlink != 1:
                os.close(fd)  # not a lock file: someone's file, which release would remove
                raise self._in_the_way()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                raise UsageError(f"another ckptool is writing {self.target} (it holds "
                                 f"{self.path})", "wait for it to end, or name another "
                                 "output") from exc
            if _same_file(fd, self.path):
                self._fd = fd
                return
            os.close(fd)  # locked a file its holder has just removed
        raise UsageError(f"cannot lock {self.target}: {self.path} keeps being replaced",
                         "wait for the other writers to end, then run again")

    def _in_the_way(self) -> UsageError:
        return UsageError(f"{self.path} is in the way of the output's lock: it is no lock "
                          "file of ckptool's", "move it away, then run again")

    def release(self) -> None:
        key = (threading.get_ident(), os.path.abspath(self.path))
        if self._again:
            with _HELD_LOCK:
                _HELD[key] -= 1
            self._again = False
            return
        if self._fd is None:
            return
        with _HELD_LOCK:
            _HELD.pop(key, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # while still held: a waiter re-checks the path
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)
