"""Check written bytes while the rest of the file is still being written.

A writer hands each finished range (offset, size, expected CRC) to a
``ByteChecker``: a background thread reads it back from the output file
(``fastcrc``: mmap windows, libdeflate where present) and compares the CRC.
For an output that must be durable it also asks the kernel to start writing
the range to disk (``sync_file_range``, asynchronous), so that the final
``fsync`` has little left to do. Reading back and copying overlap instead of
running one after the other; every byte is still re-read after it was
written.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from collections.abc import Callable
from types import TracebackType

from ckptool.write.fastcrc import Observe, crc_file_ranges

_SYNC_FILE_RANGE_WRITE = 2


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


Check = tuple[str, int, int, int]  # (name, offset, size, expected CRC)


class ByteChecker:
    """``check(name, offset, size, crc)`` or ``check_many([...])`` as ranges
    are written; ``finish()`` returns the names whose bytes did not match.

    Use as a context manager: leaving the block by an exception cancels
    what is still queued (a failed run must not re-read the rest of the
    file first) and ends the thread."""

    def __init__(self, fd: int, durable: bool = False,
                 observe: Observe | None = None) -> None:
        self.fd = fd
        self.observe = observe  # shown the bytes re-read, in order (a streaming hash)
        self.failed: list[str] = []
        self.problem: str | None = None  # why a range could not be read, if one could not
        self.checked = 0
        self._cancelled = False
        self._queue: queue.Queue[list[Check] | None] = queue.Queue()
        # writing back early only pays when an fsync will wait for it; else it
        # makes this run wait for the disk, which cp and torch.save never do
        self._writeback = _writeback_starter() if durable else None
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

    def check(self, name: str, offset: int, size: int, crc: int) -> None:
        self._queue.put([(name, offset, size, crc)])

    def check_many(self, checks: list[Check]) -> None:
        """Ranges re-read together (in file order: one mapping for neighbours,
        few GIL round trips)."""
        if checks:
            self._queue.put(sorted(checks, key=lambda c: c[1]))

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            if self._cancelled:
                continue  # drained, unread
            try:
                crcs = crc_file_ranges(self.fd, [(offset, size) for _, offset, size, _ in batch],
                                       self.observe)
                self.failed += [name for (name, _, _, crc), got in zip(batch, crcs, strict=True)
                                if got != crc]
                if self._writeback is not None:
                    start = batch[0][1]
                    self._writeback(self.fd, start, batch[-1][1] + batch[-1][2] - start)
            except Exception as exc:
                # unreadable counts as not matching; and no exception may end
                # this thread, or later checks would pass unread
                self.problem = self.problem or f"{type(exc).__name__}: {exc}"
                self.failed += [name for name, *_ in batch]
            self.checked += len(batch)

    def finish(self) -> list[str]:
        """Wait for every queued check; the names that failed."""
        self._queue.put(None)
        self._thread.join()
        return self.failed

    def cancel(self) -> None:
        """Drop what is queued and end the thread (a run that failed)."""
        self._cancelled = True
        self.finish()
