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
from collections.abc import Iterator

from ckptool.errors import Interrupted
from ckptool.read.layouts.dirlock import held_interrupts

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
        with held_interrupts() as held:
            yield
            self.done = True
            _committed.append(self.path)
        if held:
            raise fixed(self.path)


def mark_fixed(path: str) -> None:
    """``path`` is fixed (a fix a crash cut short, finished): a Ctrl-C from
    now on in this command says so."""
    _committed.append(path)


def begin() -> None:
    """A new command: what an earlier one in this process committed is not its."""
    _committed.clear()


def late() -> Interrupted | None:
    """What a Ctrl-C that no change explained says, if this command fixed
    something in place (``fixed``); None if it did not."""
    return fixed(_committed[-1]) if _committed else None


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
