"""Check a copy's bytes as they are written, on a thread of its own.

The writer (``ckptool.write.copy``) hands each piece of a span to a
``ByteChecker`` before it writes it (``take``): a piece of a mapping of the
input, which the checker reads to take the CRC of each range the piece
ends, while the writer writes the piece before it, and which the writer
then writes, as it is, once the checker is done with it. Each range's CRC
is compared with the CRC it must have, where the input says (a zip record's
directory entry), or recorded (a span with none: its CRC goes into the zip
directory written after it). Nothing is read back from the output: every
byte is read once and written once. (The copy checks that its input did
not change meanwhile.)

The checker also shows every byte written, in file order, to an observer
(a streaming hash, for a manifest); a writer that checks bytes itself
(``gather``) reports their CRCs (``check``) and hands their bytes over for
the observer (``wrote``). For an output that must be durable, writeback is
started as the bytes are written (``sync_file_range``, asynchronous), so
that the final ``fsync`` has little left to do.
"""

from __future__ import annotations

import ctypes
import mmap
import queue
import threading
from collections.abc import Callable
from types import TracebackType

from ckptool.write.fastcrc import Observe, crc_buffer

_SYNC_FILE_RANGE_WRITE = 2
WRITEBACK = 64 << 20  # bytes written between two starts of writeback

Buffer = mmap.mmap | bytearray | bytes  # bytes written, for the observer
Source = mmap.mmap | bytearray  # a piece of a span: a mapping of the input, or a buffer read
# a range to check: (name, output offset, size, the CRC it must have or None)
Part = tuple[str, int, int, int | None]


def _writeback_starter() -> Callable[[int, int, int], None] | None:
    """libc's sync_file_range (Linux), to start writeback early; else None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]

    def start(fd: int, offset: int, size: int) -> None:
        fn(fd, offset, size, _SYNC_FILE_RANGE_WRITE)  # advisory: errors change nothing

    return start


class Ranges:
    """The checked ranges of one run of output bytes (a span), sorted, back
    to back or with unchecked bytes between them, and their CRCs so far."""

    def __init__(self, parts: list[Part]) -> None:
        self.parts = parts
        self.crcs: list[int] = []  # of the ranges done, in order
        self._running = 0

    def take(self, buffer: Source, start: int, at: int, size: int) -> list[tuple[str, int, int]]:
        """Output bytes [at, at + size), at ``start`` in ``buffer``, into the
        CRCs; returns (name, CRC, expected) of the checked ranges that end there."""
        ended = []
        while len(self.crcs) < len(self.parts):
            name, lo, n, expected = self.parts[len(self.crcs)]
            a, b = max(lo, at), min(lo + n, at + size)
            if a < b:
                self._running = crc_buffer(buffer, start + a - at, start + b - at, self._running)
            if lo + n > at + size:
                break
            self.crcs.append(self._running)
            if expected is not None:
                ended.append((name, self._running, expected))
            self._running = 0
        return ended


# (output offset, the bytes, where they start in them, how many, the ranges
# they take part in, set once taken)
_Item = tuple[int, Buffer, int, int, Ranges | None, threading.Event | None]


class ByteChecker:
    """``take(at, buffer, start, size, ranges)`` for each piece of a span
    before it is written (wait for the event it returns), ``wrote(at,
    buffer, start, size)`` for other bytes written, ``written(at, size)``
    after every write; ``finish()`` returns the names whose bytes did not
    match.

    Use as a context manager: leaving the block by an exception drops what
    is still queued and ends the thread."""

    def __init__(self, fd: int, durable: bool = False,
                 observe: Observe | None = None) -> None:
        self.fd = fd
        self.observe = observe  # shown the bytes written, in order (a streaming hash)
        self.failed: list[str] = []
        self.problem: str | None = None  # why bytes could not be checked, if they could not
        self.checked = 0
        self._cancelled = False
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        # writing back early only pays when an fsync will wait for it; else it
        # makes this run wait for the disk, which cp and torch.save never do
        self._writeback = _writeback_starter() if durable else None
        self._unsynced: tuple[int, int] | None = None  # written, writeback not started
        self._thread = threading.Thread(target=self._run, name="ckptool-check", daemon=True)
        self._thread.start()

    def __enter__(self) -> ByteChecker:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is not None:
            self.cancel()
        else:
            self.finish()

    def take(self, at: int, buffer: Source, start: int, size: int,
             ranges: Ranges) -> threading.Event:
        """Check ``buffer[start:start + size]``, the bytes about to be
        written at ``at``, as part of ``ranges``; the event is set once
        they are (or dropped). The buffer must not change until written (a
        mapping of the input, a buffer not used again)."""
        done = threading.Event()
        self._queue.put((at, buffer, start, size, ranges, done))
        return done

    def wrote(self, at: int, buffer: Buffer, start: int, size: int) -> None:
        """Bytes written that ``take`` did not see, for the observer, in
        their turn (the buffer must not change: bytes, a buffer not used
        again)."""
        if self.observe is not None:
            self._queue.put((at, buffer, start, size, None, None))

    def check(self, name: str, crc: int, expected: int) -> None:
        """A CRC the writer took itself, against the one it must have."""
        self.checked += 1
        if crc != expected:
            self.failed.append(name)

    def written(self, at: int, size: int) -> None:
        """Bytes [at, at + size) are in the file: start their writeback, a
        batch at a time, where the output must be durable."""
        if self._writeback is None or not size:
            return
        lo, hi = self._unsynced or (at, at)
        lo, hi = min(lo, at), max(hi, at + size)
        if hi - lo >= WRITEBACK:
            self._writeback(self.fd, lo, hi - lo)
            self._unsynced = None
        else:
            self._unsynced = (lo, hi)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            at, buffer, start, size, ranges, done = item
            try:
                if not self._cancelled:  # else drained, unchecked
                    self._see(at, buffer, start, size, ranges)
            except Exception as exc:
                # a failure counts as not matching; and no exception may end
                # this thread, or later checks would pass unchecked
                self.problem = self.problem or f"{type(exc).__name__}: {exc}"
                self.failed += [name for name, *_ in ranges.parts] if ranges else ["bytes"]
            finally:
                if done is not None:
                    done.set()

    def _see(self, at: int, buffer: Buffer, start: int, size: int,
             ranges: Ranges | None) -> None:
        if ranges is not None:
            assert not isinstance(buffer, bytes), "a span's piece is a mapping or a buffer"
            for name, crc, expected in ranges.take(buffer, start, at, size):
                self.check(name, crc, expected)
        if self.observe is not None:
            with memoryview(buffer) as view:
                self.observe(at, view[start:start + size])

    def finish(self) -> list[str]:
        """Wait until everything handed over is checked; the names that failed."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._writeback is not None and self._unsynced is not None and not self._cancelled:
            lo, hi = self._unsynced
            self._writeback(self.fd, lo, hi - lo)
        self._unsynced = None
        return self.failed

    def cancel(self) -> None:
        """Drop what is queued and end the thread (a run that failed)."""
        self._cancelled = True
        self.finish()
