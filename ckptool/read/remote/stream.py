"""A remote file read whole, once, in large ranges: what ``verify --full``
and a manifest's sha256 read (``ckptool.check.verify.remotebytes``).

``blocks(url)`` yields the file's bytes ``BLOCK`` at a time, each one
range request of the version first listed (``rfile.RemoteFile.fetch``:
pinned, counted, retried, a short answer an error naming the URL), none
of them kept: memory is one block per file read; ``exact`` is one small
range, exactly (a zip's local headers). ``listed_sha256(url)``
is the store's own sha256 of the file where its listing gives one (the
Hub's, for an LFS file), with no request beyond the listing.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from typing import IO

from ckptool.read.remote import tree, urls
from ckptool.read.remote.rfile import RemoteFile

BLOCK = 16 << 20  # bytes a request


def _entry(url: str) -> tuple[str, tree.Entry]:
    scheme = urls.scheme_of(url)
    assert scheme is not None
    entry = tree.tree(scheme).entry(url)
    if entry is None or entry.directory:
        raise FileNotFoundError(errno.ENOENT, "not found", urls.shown(url))
    return scheme, entry


def listed_sha256(url: str) -> str | None:
    """The sha256 (hex) the store lists for the file at ``url``, or None."""
    return _entry(url)[1].sha256


def exact(f: IO[bytes], offset: int, n: int) -> bytes:
    """Bytes [offset, offset + n) of the remote file ``f`` (a ``RemoteFile``,
    fewer at its end): one request of exactly that range, kept by no one (a
    zip's local headers, without the tensor bytes around them)."""
    if not isinstance(f, RemoteFile):  # a member of an archive (``read.archive``): in place
        return bytes(f.pread(offset, n))  # type: ignore[attr-defined]
    end = min(f.size, offset + n)
    return f.fetch(offset, end) if end > offset else b""


def blocks(url: str, block: int = BLOCK) -> Iterator[tuple[int, bytes]]:
    """``(offset, bytes)`` of the whole file at ``url``, ``block`` bytes a
    request, first to last."""
    scheme, entry = _entry(url)
    f = RemoteFile(scheme, entry)
    for start in range(0, entry.size, block):
        yield start, f.fetch(start, min(entry.size, start + block))
