"""The bytes of a remote input fetched ahead of the copy that writes them.

A conversion from a URL writes each tensor from one range request
(``layout.input_segment``). One request at a time, the copy would wait out
every round trip; here the requests for the next segments are made on a
few threads while the copy writes the one before, within a budget of bytes
held (``AHEAD_BYTES``: memory stays bounded whatever the checkpoint's
size), in the order the copy takes them. Segments under ``SMALL`` bytes
are not fetched ahead: the file's own read-ahead (``RemoteFile``: 64 KiB
around a small read, kept) serves them, and two threads would fetch the
same range twice.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

AHEAD_BYTES = 32 << 20  # bytes fetched and not yet written, at most
WORKERS = 4  # requests in flight at once
SMALL = 64 << 10


class ReadAhead:
    """The ranges of one remote input, in the order the copy writes them."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self._ranges: list[tuple[int, int]] = []
        self._futures: dict[int, Future[bytes]] = {}
        self._held = 0  # bytes of the futures started and not yet taken
        self._next = 0  # the first range not started yet
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def add(self, src: int, size: int) -> int:
        """Register a range the copy will take; returns its number."""
        with self._lock:
            self._ranges.append((src, size))
            return len(self._ranges) - 1

    def take(self, i: int) -> bytes:
        """The bytes of range ``i`` (started now if they were not)."""
        src, size = self._ranges[i]
        if size < SMALL:
            return bytes(self.source.pread(src, size))
        with self._lock:
            self._start(i)
            future = self._futures.pop(i, None)
        if future is None:  # taken out of order: fetched now
            return bytes(self.source.pread(src, size))
        try:
            return future.result()
        finally:
            with self._lock:
                self._held -= size
                self._start(i + 1)

    def _start(self, first: int) -> None:
        """Start the ranges from ``first`` on while the budget allows (the
        first of them always)."""
        i = max(first, self._next)
        if first < self._next and first not in self._futures:
            i = self._next
        while i < len(self._ranges):
            src, size = self._ranges[i]
            if size < SMALL:
                i += 1
                continue
            if self._held and self._held + size > AHEAD_BYTES:
                break
            if self._pool is None:
                self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="ckptool-fetch")
                weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
            self._futures[i] = self._pool.submit(self.source.pread, src, size)
            self._held += size
            i += 1
        self._next = max(self._next, i)


_ahead: weakref.WeakKeyDictionary[Any, ReadAhead] = weakref.WeakKeyDictionary()
_ahead_lock = threading.Lock()


def of(source: Any) -> ReadAhead:
    """The read-ahead of a remote input (one per open file)."""
    with _ahead_lock:
        found = _ahead.get(source)
        if found is None:
            found = _ahead[source] = ReadAhead(source)
        return found
