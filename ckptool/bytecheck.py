"""Check written bytes while the rest of the file is still being written.

A writer hands each finished range (offset, size, expected CRC) to a
``ByteChecker``: a background thread reads it back from the output file,
compares the CRC, and asks the kernel to start writing it to disk
(``sync_file_range``, asynchronous), so that the final ``fsync`` has little
left to do. Reading back, copying and writeback overlap instead of running
one after the other; every byte is still re-read after it was written.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from collections.abc import Callable

from ckptool.zipwriter import crc_range

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


class ByteChecker:
    """``check(name, offset, size, crc)`` as ranges are written; ``finish()``
    returns the names whose bytes did not match."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.failed: list[str] = []
        self.checked = 0
        self._queue: queue.Queue[tuple[str, int, int, int] | None] = queue.Queue()
        self._writeback = _writeback_starter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def check(self, name: str, offset: int, size: int, crc: int) -> None:
        self._queue.put((name, offset, size, crc))

    def _run(self) -> None:
        buf = bytearray(16 << 20)
        while (item := self._queue.get()) is not None:
            name, offset, size, crc = item
            try:
                if crc_range(self.fd, offset, size, buf) != crc:
                    self.failed.append(name)
                if self._writeback is not None:
                    self._writeback(self.fd, offset, size)
            except OSError:  # unreadable counts as not matching
                self.failed.append(name)
            self.checked += 1

    def finish(self) -> list[str]:
        self._queue.put(None)
        self._thread.join()
        return self.failed
