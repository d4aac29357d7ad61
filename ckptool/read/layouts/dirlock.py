"""Who may change a directory of shards in place, and Ctrl-C while one does.

An in-place fix of a directory (``ckptool.write.fix.shards``) holds an
exclusive ``flock`` on the directory itself from before it changes anything
until its journal is gone; a command that finds a journal takes the same
lock before it finishes or rolls back the fix the journal names
(``ckptool.read.layouts.journal``), and a reader of its index and shards
holds it shared (``shared``). So two fixes of one directory never
interleave, and a reader never races a live writer: it waits for it
(``WAIT`` seconds at most, then says who holds the directory), and looks at
the journal again once it has the lock. A lock is the process's: it goes
when the process dies, however it dies. A filesystem that cannot lock (some
NFS mounts) is used without one (``locked`` yields False), and the journal's
process id then tells a live writer from a dead one.

``held_interrupts`` keeps a Ctrl-C from cutting a change of the directory
short: it is recorded, and acted on once the change is made.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ckptool.errors import InputError

WAIT = 5.0  # seconds a command waits for another process's change of a directory
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN)
_held: dict[tuple[int, str], bool] = {}  # (thread, directory) -> really locked


@contextlib.contextmanager
def locked(directory: str, holder: Callable[[], str]) -> Iterator[bool]:
    """Hold the directory's lock (again, within a thread that holds it).
    Yields whether the filesystem locks it. Waits ``WAIT`` seconds for
    another process's, then raises an ``InputError`` naming ``holder()``
    (what that process is, as far as the caller knows)."""
    with _flock(directory, holder, exclusive=True) as held:
        yield held


@contextlib.contextmanager
def shared(directory: str, holder: Callable[[], str]) -> Iterator[bool]:
    """Around a read of the directory (its index and its shards' headers):
    a shared lock, so that it never reads while a fix commits (it waits for
    one as ``locked`` does). Within a thread that holds the directory's
    lock already (a fix reading what it fixes, a nested read) it takes
    none: a second ``flock`` of the process's own would wait for itself.
    Yields whether the filesystem locks it."""
    with _flock(directory, holder, exclusive=False) as held:
        yield held


@contextlib.contextmanager
def _flock(directory: str, holder: Callable[[], str], exclusive: bool) -> Iterator[bool]:
    key = (threading.get_ident(), os.path.realpath(directory))
    if key in _held:
        yield _held[key]
        return
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
    try:
        _held[key] = _lock(fd, directory, holder, exclusive=exclusive)
        try:
            yield _held[key]
        finally:
            del _held[key]
    finally:
        os.close(fd)  # (which releases the lock)


def is_held(directory: str) -> bool:
    """Whether this thread holds the directory's lock (shared or not)."""
    return (threading.get_ident(), os.path.realpath(directory)) in _held


def _lock(fd: int, directory: str, holder: Callable[[], str], exclusive: bool = True) -> bool:
    try:
        import fcntl
    except ImportError:  # a system without flock
        return False
    deadline = time.monotonic() + WAIT
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in _BUSY:
                return False  # no locks on this filesystem (ENOLCK, EBADF on NFS...)
        if time.monotonic() >= deadline:
            from ckptool.describe import shell_word

            raise InputError(f"{directory} is being fixed in place by {holder()}",
                             "wait for it to finish, then run this command again (ckptool "
                             f"inspect {shell_word(directory)} says what it holds then)")
        time.sleep(0.05)


@contextlib.contextmanager
def held_interrupts() -> Iterator[list[int]]:
    """Around a change that must not be cut short: a Ctrl-C is recorded in
    the list yielded, not raised (in the main thread: others get none)."""
    held: list[int] = []
    previous = _hold(held)
    try:
        yield held
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _hold(held: list[int]) -> Any:
    """Install a SIGINT handler that only records; returns the one it replaced
    (None where none can be installed: not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGINT)
    if previous is None:  # installed outside Python: cannot be put back
        return None
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    return previous
