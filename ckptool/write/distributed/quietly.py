"""What a rank says, and holds back, while it connects to the others: torch's
c10d logs each failed try with its C++ stack on fd 2 (``stderr_held``
keeps it, and writes it back only if connecting succeeded), and a rank
left waiting says so (``saying_waiting``)."""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def stderr_held() -> Iterator[Callable[[str], None]]:
    """fd 2 into a temporary file while torch connects: written back once it
    succeeded, dropped when it failed (the error says it in one line). What
    ckptool says meanwhile (the function yielded) goes to stderr at once."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr at all: nothing to hold, nobody to tell
        yield lambda line: None
        return
    try:
        with tempfile.TemporaryFile() as kept:
            os.dup2(kept.fileno(), 2)
            failed = True
            try:
                yield lambda line: _write_all(saved, f"{line}\n".encode())
                failed = False
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                if not failed:
                    kept.seek(0)
                    _write_all(2, kept.read())
    finally:
        os.close(saved)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


@contextmanager
def saying_waiting(say: Callable[[str], None], line: str, after: float,
                   every: float) -> Iterator[None]:
    """``line`` said after ``after`` seconds, then every ``every``, until
    the block ends; nothing if it ends before."""
    done = threading.Event()

    def run() -> None:
        delay = after
        while not done.wait(delay):
            say(line)
            delay = every

    thread = threading.Thread(target=run, name="ckptool-join-waiting", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
