"""The requests and bytes a command made to remote stores.

Counted where ckptool asks for something (a listing, a file's details, a
range of bytes): one call, one request. A library may make more beneath
(a token refresh, a retry after throttling); the tests count at the
server as well. Counters are per process and thread-safe: shard headers
are read on a pool of threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class Counts:
    requests: int = 0
    bytes: int = 0
    listings: int = 0

    def as_json(self) -> dict[str, int]:
        return {"requests": self.requests, "bytes": self.bytes, "listings": self.listings}


_lock = threading.Lock()
_counts = Counts()


def request(nbytes: int = 0, listing: bool = False) -> None:
    with _lock:
        _counts.requests += 1
        _counts.bytes += nbytes
        _counts.listings += listing


def snapshot() -> Counts:
    with _lock:
        return Counts(_counts.requests, _counts.bytes, _counts.listings)


def reset() -> None:
    with _lock:
        _counts.requests = _counts.bytes = _counts.listings = 0
