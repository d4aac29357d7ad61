"""What a Ctrl-C says when it stops an in-place change: the state it left.

An in-place writer runs inside ``changing(path)``. Its commit, the one
step that turns the old checkpoint into the new one, runs inside
``change.committing()``, which is never cut short: a Ctrl-C during it is
held until it is done. So a Ctrl-C leaves ``path`` either as it was (the
writer removes what it wrote beside it on the way out) or fixed, and it is
raised as ``Interrupted`` saying which: ``interrupted: PATH is unchanged``
or ``interrupted after PATH was fixed``. ``reported`` does the same for a
Ctrl-C outside any change (while the input is read, or the report printed).

A Ctrl-C reaches Python's main thread only; holding it is done there (a
change on another thread, in the TUI, has no Ctrl-C to hold).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from ckptool.errors import Interrupted

_committed: list[str] = []  # what the changes of this command committed (``reported``)


def unchanged(path: str) -> Interrupted:
    return Interrupted(f"interrupted: {path} is unchanged",
                       "nothing was fixed; run the command again to fix it")


def fixed(path: str) -> Interrupted:
    return Interrupted(f"interrupted after {path} was fixed",
                       "the fix is complete; only its report was cut short")


class Change:
    """One in-place change of ``path``, as ``changing`` yields it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.done = False

    @contextlib.contextmanager
    def committing(self) -> Iterator[None]:
        """The commit: a Ctrl-C during it is held, then raised once it is done."""
        held: list[int] = []
        previous = _hold(held)
        try:
            yield
            self.done = True
            _committed.append(self.path)
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        if held:
            raise fixed(self.path)


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


@contextlib.contextmanager
def changing(path: str) -> Iterator[Change]:
    """Around an in-place change of ``path``: a Ctrl-C says what it left."""
    change = Change(path)
    try:
        yield change
    except Interrupted:
        raise
    except KeyboardInterrupt:
        raise (fixed(path) if change.done else unchanged(path)) from None


@contextlib.contextmanager
def reported(path: str | None) -> Iterator[None]:
    """Around a command that may change ``path`` in place (None: it does not):
    a Ctrl-C no change explained says whether ``path`` was changed."""
    _committed.clear()
    try:
        yield
    except Interrupted:
        raise
    except KeyboardInterrupt:
        if path is None:
            raise
        raise (fixed(path) if _committed else unchanged(path)) from None
