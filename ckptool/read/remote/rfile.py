"""A remote file as a seekable binary file, read by range requests.

The readers of ``ckptool.read`` read a few small pieces of a file (a
safetensors header, a zip's end records and directory, a pickle) and,
when a command needs them, its tensors. Each read that misses what was
fetched before is one range request:

- a small read (under ``SPECULATIVE`` bytes) fetches ``SPECULATIVE``
  bytes from where it starts, or the file's last ``SPECULATIVE`` bytes
  when it starts within them: a safetensors header and its length come in
  one request, a zip's end records and most directories in one more;
- a larger read (a pickle, a tensor) fetches exactly what it asks for.

Fetches under ``LARGE`` bytes are kept, shared by every open of the file
(at most ``KEPT`` bytes a file, the oldest dropped first); larger ones are
not: a tensor is read once. Every range is read from the version of the
file first listed (``tree.Entry.version``): an S3 version id or ETag, a GCS
generation, an HTTP server's strong ETag (``If-Match``); a Hub file at the
commit its revision named. A response of another length than asked, or a
version that changed, is an error naming the URL, never bytes of two
versions mixed.
"""

from __future__ import annotations

import bisect
import io
import threading
from typing import Any

from ckptool.errors import CorruptCheckpointError
from ckptool.read.remote import counts, httprange, hubrepo, paths, stores, urls
from ckptool.read.remote.tree import Entry

SPECULATIVE = 64 << 10
KEPT = 16 << 20  # bytes kept of one file
LARGE = 4 << 20  # a piece this large is a tensor's bytes: used once, never kept


class RemoteFile(io.RawIOBase):
    def __init__(self, scheme: str, entry: Entry) -> None:
        super().__init__()
        self.scheme = scheme
        self.url = entry.url
        self.size = entry.size
        self.entry = entry
        self._path = paths.of(scheme, entry.url)
        self._pos = 0
        self._pieces = _pieces_of(entry)

    # -- io.RawIOBase -------------------------------------------------------

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR:
            offset += self._pos
        elif whence == io.SEEK_END:
            offset += self.size
        if offset < 0:
            raise OSError(22, "negative seek position")
        self._pos = offset
        return offset

    def readinto(self, buffer: Any) -> int:
        with memoryview(buffer) as view:
            n = min(len(view), max(0, self.size - self._pos))
            if n:
                view[:n] = self.pread(self._pos, n)
            self._pos += n
            return n

    def readall(self) -> bytes:
        data = self.pread(self._pos, max(0, self.size - self._pos))
        self._pos += len(data)
        return data

    def fileno(self) -> int:
        raise io.UnsupportedOperation(f"{urls.shown(self.url)} is remote: it has no descriptor")

    # -- ranges -------------------------------------------------------------

    def pread(self, offset: int, n: int) -> bytes:
        """``n`` bytes from ``offset`` (fewer only at the file's end): what
        was fetched before, and one request for each gap (``SPECULATIVE``
        bytes at least where the read is small)."""
        n = max(0, min(n, self.size - offset))
        if n == 0:
            return b""
        end = offset + n
        have, gaps = self._pieces.covering(offset, end)
        if gaps and n >= LARGE:  # a tensor's bytes: one request, kept by no one
            return self.fetch(offset, end)
        for gap_start, gap_end in gaps:
            if gap_end - gap_start < SPECULATIVE:  # small: fetch around it
                gap_start, gap_end = self._around(gap_start, gap_end, offset, end)
            piece = self.fetch(gap_start, gap_end)
            self._pieces.keep(gap_start, piece)
            have.append((gap_start, piece))
        # (from the pieces in hand: another thread may drop kept ones meanwhile)
        return _assemble(have, offset, end)

    def _around(self, start: int, end: int, need_start: int, need_end: int) -> tuple[int, int]:
        """A small gap widened to ``SPECULATIVE`` bytes where the reads
        will likely go next: back towards the file's start when what follows
        it is fetched or is the file's end (a zip's directory is read
        backwards from its end records), else forward (a header's fields)."""
        behind = end == self.size or not self._pieces.gaps(end, min(self.size, end + 1))
        if behind:
            start = max(0, end - SPECULATIVE)
        else:
            before = self._pieces.end_before(start)  # a hole after what was fetched: filled
            if before is not None and start - before <= SPECULATIVE:
                start = before
            end = min(self.size, max(end, start + SPECULATIVE))
            start = max(0, min(start, end - SPECULATIVE))
        return self._pieces.trim(start, end, need_start, need_end)

    def fetch(self, start: int, end: int) -> bytes:
        """Bytes [start, end) of the version first listed: one request."""
        counts.request(end - start)
        with stores.failures(self.url):
            data = stores.retrying(lambda: self._get(start, end), self.url)
        if len(data) != end - start:
            raise CorruptCheckpointError(
                f"{urls.shown(self.url)}: asked for bytes {start}-{end - 1}, "
                f"got {len(data)} bytes",
                "the remote file changed or the response was cut short; run the command again")
        return bytes(data)

    def _get(self, start: int, end: int) -> bytes:
        """One range request, for the version first listed where the store
        can be asked for it: S3's version id, or its ETag (``IfMatch``);
        an HTTP server's strong ETag (``If-Match``); a Hub file is read at
        the commit its revision named when it was listed."""
        fs = stores.filesystem(self.scheme)
        family = urls.SCHEMES[self.scheme]
        version = self.entry.version
        etag = version.get("ETag") or version.get("etag")
        if family == "s3":
            return _s3_range(fs, self._path, start, end, version.get("VersionId"), etag)
        if family == "http":  # (fsspec's cat_file checks neither status nor Content-Range)
            return httprange.get(fs, self._path, start, end, self.size, etag)
        if family == "gcs" and version.get("generation"):
            return _gcs_range(fs, self._path, start, end, version["generation"])
        if family == "hf":  # at the pinned commit, exactly the range, checked
            return hubrepo.range_get(self._path, start, end, self.size)
        return bytes(fs.cat_file(self._path, start=start, end=end))


def _s3_range(fs: Any, path: str, start: int, end: int, version_id: str | None,
              etag: str | None) -> bytes:
    """Bytes [start, end) of an S3 object, of that version or that ETag
    (s3fs's ``cat_file`` takes a version id, not an ETag)."""
    from fsspec.asyn import sync

    bucket, key, listed_version = fs.split_path(path)
    pin = ({"VersionId": version_id or listed_version} if version_id or listed_version
           else {"IfMatch": etag} if etag else {})

    async def get() -> bytes:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key,
                                 Range=f"bytes={start}-{end - 1}", **pin)
        try:
            return bytes(await resp["Body"].read())
        finally:
            resp["Body"].close()

    return bytes(sync(fs.loop, get))


def _gcs_range(fs: Any, path: str, start: int, end: int, generation: str) -> bytes:
    """Bytes [start, end) of a GCS object while it is still that generation
    (a 412 otherwise: gcsfs's ``cat_file`` takes no precondition)."""
    from fsspec.asyn import sync

    async def get() -> bytes:
        _, data = await fs._call("GET", fs.url(path), headers={"Range": f"bytes={start}-{end - 1}"},
                                 ifGenerationMatch=generation)
        return bytes(data)

    return bytes(sync(fs.loop, get))


class _Pieces:
    """The bytes of one file fetched so far: pieces that do not overlap,
    by where they start. Shared by every ``RemoteFile`` of the file (a
    command opens a file several times: to sniff it, then to read it)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.pieces: list[bytes] = []
        self.order: list[int] = []  # where the pieces kept start, oldest first
        self.kept = 0
        self.lock = threading.Lock()

    def covering(self, start: int, end: int) -> tuple[list[tuple[int, bytes]],
                                                      list[tuple[int, int]]]:
        """The pieces kept that overlap [start, end) (start, bytes), and the
        ranges of it not fetched yet."""
        have: list[tuple[int, bytes]] = []
        out = []
        pos = start
        with self.lock:
            i = max(0, bisect.bisect_right(self.starts, start) - 1)
            while pos < end and i < len(self.starts):
                p_start, piece = self.starts[i], self.pieces[i]
                p_end = p_start + len(piece)
                if p_end <= pos:
                    i += 1
                    continue
                if p_start >= end:
                    break
                if p_start > pos:
                    out.append((pos, p_start))
                have.append((p_start, piece))
                pos = max(pos, p_end)
                i += 1
        if pos < end:
            out.append((pos, end))
        return have, out

    def gaps(self, start: int, end: int) -> list[tuple[int, int]]:
        """The ranges of [start, end) not fetched yet."""
        return self.covering(start, end)[1]

    def trim(self, start: int, end: int, need_start: int, need_end: int) -> tuple[int, int]:
        """[start, end) less what is fetched on either side of the needed range."""
        with self.lock:
            for p_start, piece in zip(self.starts, self.pieces, strict=True):
                p_end = p_start + len(piece)
                if p_end <= need_start and p_end > start:
                    start = p_end
                if p_start >= need_end and p_start < end:
                    end = p_start
        return start, end

    def end_before(self, offset: int) -> int | None:
        """Where the last piece starting before ``offset`` ends, if before it."""
        with self.lock:
            i = bisect.bisect_left(self.starts, offset) - 1
            if i < 0:
                return None
            end = self.starts[i] + len(self.pieces[i])
            return end if end <= offset else None

    def keep(self, start: int, piece: bytes) -> bool:
        """Keep a piece fetched (False: too large to keep). Over the file's
        share (``KEPT``), the pieces kept longest go first: a pickle read
        a few bytes at a time slides through the file, and the end records
        and directory read first are needed again only at the start."""
        if len(piece) >= LARGE:
            return False
        with self.lock:
            while self.order and self.kept + len(piece) > KEPT:
                oldest = self.order.pop(0)
                i = bisect.bisect_left(self.starts, oldest)
                if i < len(self.starts) and self.starts[i] == oldest:
                    self.kept -= len(self.pieces[i])
                    del self.starts[i], self.pieces[i]
            i = bisect.bisect_left(self.starts, start)
            self.starts.insert(i, start)
            self.pieces.insert(i, piece)
            self.order.append(start)
            self.kept += len(piece)
        return True


def _assemble(pieces: list[tuple[int, bytes]], start: int, end: int) -> bytes:
    """Bytes [start, end) from pieces (start, bytes) that cover them."""
    out = bytearray()
    pos = start
    for p_start, piece in sorted(pieces, key=lambda p: p[0]):
        p_end = p_start + len(piece)
        if p_start <= pos < p_end:
            stop = min(end, p_end)
            out += piece[pos - p_start:stop - p_start]
            pos = stop
        if pos >= end:
            break
    if pos < end:
        raise AssertionError(f"bytes {pos}-{end} of a read were neither kept nor fetched")
    return bytes(out)


_files: dict[tuple[str, str], _Pieces] = {}
_files_lock = threading.Lock()


def _pieces_of(entry: Entry) -> _Pieces:
    key = (entry.url, repr(sorted(entry.version.items())))
    with _files_lock:
        if key not in _files:
            _files[key] = _Pieces()
        return _files[key]


def forget() -> None:
    """Drop every piece kept (a test, or a new command, starts afresh)."""
    with _files_lock:
        _files.clear()
