"""The sha256 of an output file, and of each tensor's bytes in it, taken
from the bytes as they are written (``ByteChecker`` shows them, on its own
thread): a manifest of the output without reading it again.

The checker is shown the bytes in file order (``copy.Copier`` writes a
layout's segments in order); a range that comes
early all the same is kept aside until the bytes before it have come (up to
``KEEP`` bytes; beyond that, or with a gap or an overlap, the hash is given
up and the caller reads the file instead). ``result(size)`` is the file's
hash and the tensors', or None when the bytes did not come whole and in
order.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping

KEEP = 256 << 20  # bytes held while waiting for the ones before them


class StreamHash:
    """Fed ``(offset, bytes)`` by the checker's thread; ``ranges``: the
    tensors to digest, by name: (start, size) in the file."""

    def __init__(self, ranges: Mapping[str, tuple[int, int]]) -> None:
        self._file = hashlib.sha256()
        self._next = 0
        self._early: dict[int, bytes] = {}
        self._early_bytes = 0
        self._broken = False
        self._lock = threading.Lock()
        self._ranges = sorted((start, start + size, name) for name, (start, size) in
                              ranges.items())
        self._digests = {name: hashlib.sha256() for name in ranges}
        self._first = 0  # the first range that may still take bytes

    def feed(self, offset: int, data: memoryview) -> None:
        with self._lock:
            if self._broken:
                return
            if offset != self._next:
                if offset < self._next or self._early_bytes + len(data) > KEEP:
                    self._broken = True  # bytes again, or too many out of turn
                    return
                self._early[offset] = bytes(data)
                self._early_bytes += len(data)
                return
            self._take(offset, data)
            while self._next in self._early:
                held = self._early.pop(self._next)
                self._early_bytes -= len(held)
                self._take(self._next, memoryview(held))

    def _take(self, offset: int, data: memoryview) -> None:
        end = offset + len(data)
        self._file.update(data)
        while self._first < len(self._ranges) and self._ranges[self._first][1] <= offset:
            self._first += 1
        i = self._first
        while i < len(self._ranges) and self._ranges[i][0] < end:
            start, stop, name = self._ranges[i]
            lo, hi = max(start, offset), min(stop, end)
            if lo < hi:
                self._digests[name].update(data[lo - offset:hi - offset])
            i += 1
        self._next = end

    def result(self, size: int) -> tuple[str, dict[tuple[int, int], str]] | None:
        """(the file's sha256, each tensor's ``sha256:`` digest by its
        (start, size)) once the file's ``size`` bytes came whole and in
        order; else None."""
        with self._lock:
            if self._broken or self._early or self._next != size:
                return None
            return self._file.hexdigest(), {
                (start, stop - start): f"sha256:{self._digests[name].hexdigest()}"
                for start, stop, name in self._ranges}


# each file's hashes taken as it is written (``--manifest``), by its final
# path: (the hash, the file's size, -1 for the size it has once written)
Streams = dict[str, tuple[StreamHash, int]]
