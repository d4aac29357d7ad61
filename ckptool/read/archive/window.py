"""One member of an archive as a read-only, seekable binary file: bytes
[``start``, ``start + size``) of the archive file, read at absolute
offsets (``os.pread`` of a local archive, ``pread`` of a remote one), so
that two members open at once never share a position.

It reads as ``ckptool.read.remote.rfile.RemoteFile`` does (``read``,
``readinto``, ``seek``, ``tell``, ``readall``, ``pread``, ``size`` and
``url``) and, like it, has no descriptor of its own: the readers that copy
from a descriptor take the ``pread`` path (``ckptool.write.layout.source_of``).
"""

from __future__ import annotations

import io
import os
from typing import Any

from ckptool.errors import CorruptCheckpointError


class Window(io.RawIOBase):
    def __init__(self, raw: Any, start: int, size: int, url: str) -> None:
        super().__init__()
        self._raw = raw  # the archive file, open (closed with this window)
        self._fd = raw.fileno() if getattr(raw, "url", None) is None else None
        self.start, self.size, self.url = start, size, url
        self._pos = 0

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
                data = self.pread(self._pos, n)
                view[:len(data)] = data
                n = len(data)
            self._pos += n
            return n

    def readall(self) -> bytes:
        data = self.pread(self._pos, max(0, self.size - self._pos))
        self._pos += len(data)
        return data

    def fileno(self) -> int:
        raise io.UnsupportedOperation(f"{self.url} is a member of an archive: it has no "
                                      "descriptor of its own")

    def pread(self, offset: int, n: int) -> bytes:
        """``n`` bytes from ``offset`` of the member (fewer only at its end)."""
        n = max(0, min(n, self.size - offset))
        if n == 0:
            return b""
        at = self.start + offset
        if self._fd is None:
            data = bytes(self._raw.pread(at, n))
        else:
            data = os.pread(self._fd, n, at)
            while len(data) < n:  # (a short read of a local file: rare, go on)
                more = os.pread(self._fd, n - len(data), at + len(data))
                if not more:
                    break
                data += more
        if len(data) != n:
            raise CorruptCheckpointError(
                f"{self.url}: the archive ends inside this member (it changed, or was cut "
                "short, since its index was read)", "copy the archive again")
        return data

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()
