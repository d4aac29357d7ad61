"""Copy scattered ranges of one file into another at other offsets, with a
read-ahead thread.

``convert`` packs tensors from a torch zip (each record behind its local
header) into a safetensors file (no gaps allowed), so every destination
offset is shifted against its source modulo the page size. The kernel's
``copy_file_range`` copies such ranges slowly: each page of the output is
written in two pieces (0.73 to 0.78 s for 2 GB here). Reading into a user
buffer and writing it out costs two memory copies instead of one, but the
read needs no lock on the output, so a second thread can read the next
buffer while this one writes: 0.45 to 0.47 s for the same 2 GB. Buffers are
few and small (4 x 2 MiB), so memory stays flat whatever the file size.

Every piece's CRC is taken from the buffer, the bytes then written: the
copy is checked as it is written, and nothing is read back.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ckptool.write.fastcrc import crc_buffer

BUFFER = 2 << 20  # fits a core's cache: larger buffers measured slower
BUFFERS = 4
FAR = 64 << 10  # source ranges further apart than this are read separately
MAX_PARTS = 512  # below IOV_MAX (1024 on Linux): what one pwritev takes

# called with a piece's index once it is written, and the CRC of its bytes
Done = Callable[[int, int], None]
# shown each run of bytes as it is written: (destination offset, the bytes)
Wrote = Callable[[int, memoryview], None]


@dataclass
class _Batch:
    src_start: int  # source bytes [src_start, src_end) go to one buffer
    src_end: int
    # (source offset, size, destination offset, piece index, last part of it)
    parts: list[tuple[int, int, int, int, bool]]


def copy_pieces(src_fd: int, dst_fd: int, pieces: list[tuple[int, int, int]],
                done: Done | None = None, wrote: Wrote | None = None) -> None:
    """Copy each (source offset, size, destination offset) piece; destination
    offsets ascending. ``done(i, crc)`` follows piece ``i``'s last byte out,
    with the CRC-32 of its bytes (computed on the read-ahead thread, from the
    buffer written); ``wrote`` is shown the bytes of each write, in order,
    before the buffer is reused. Raises EOFError when the source ends early."""
    batches = list(_batches(pieces))
    running: dict[int, int] = {}  # piece index -> CRC so far
    if not batches:
        return
    free: queue.Queue[bytearray] = queue.Queue()
    full: queue.Queue[tuple[_Batch, bytearray] | BaseException | None] = queue.Queue()
    for _ in range(min(BUFFERS, len(batches))):
        free.put(bytearray(BUFFER))
    stop = threading.Event()

    def read_ahead() -> None:
        try:
            for batch in batches:
                buf = free.get()
                if stop.is_set():
                    return
                size = batch.src_end - batch.src_start
                got = os.preadv(src_fd, [memoryview(buf)[:size]], batch.src_start)
                if got < size:
                    raise EOFError(f"the input ends {size - got} bytes early")
                for s, n, _, index, _ in batch.parts:
                    at = s - batch.src_start
                    running[index] = crc_buffer(buf, at, at + n, running.get(index, 0))
                full.put((batch, buf))
            full.put(None)
        except BaseException as exc:  # handed to the writing thread
            full.put(exc)

    reader = threading.Thread(target=read_ahead, name="ckptool-read", daemon=True)
    reader.start()
    try:
        while (item := full.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            batch, buf = item
            _write(dst_fd, batch, buf)
            if wrote is not None:
                with memoryview(buf) as view:
                    for s, n, at, *_ in batch.parts:
                        wrote(at, view[s - batch.src_start:s - batch.src_start + n])
            free.put(buf)
            for *_, index, last in batch.parts:
                if last:
                    crc = running.pop(index, 0)
                    if done is not None:
                        done(index, crc)
    finally:
        stop.set()
        free.put(bytearray(0))  # wakes a reader waiting for a buffer
        reader.join()


def _write(dst_fd: int, batch: _Batch, buf: bytearray) -> None:
    view = memoryview(buf)
    at = batch.parts[0][2]
    parts = [view[s - batch.src_start:s - batch.src_start + n] for s, n, *_ in batch.parts]
    want = sum(len(p) for p in parts)
    written = os.pwritev(dst_fd, parts, at) if hasattr(os, "pwritev") else 0
    if written < want:  # short write, or no pwritev: the rest in one go
        rest = bytes(b"".join(parts))[written:]
        while rest:
            n = os.pwrite(dst_fd, rest, at + written)
            written += n
            rest = rest[n:]


def _batches(pieces: list[tuple[int, int, int]]) -> list[_Batch]:
    """Group pieces into buffer-sized reads: neighbours in both files share a
    buffer (the few bytes between them in the source are read too), a piece
    longer than a buffer is read in buffer-sized parts."""
    batches: list[_Batch] = []
    for index, (src, size, dst) in enumerate(pieces):
        if size == 0:
            batches.append(_Batch(src, src, [(src, 0, dst, index, True)]))
            continue
        at = 0
        while at < size:
            n = min(size - at, BUFFER)
            part = (src + at, n, dst + at, index, at + n == size)
            last = batches[-1] if batches else None
            if (last is not None and last.parts[-1][1] > 0 and len(last.parts) < MAX_PARTS
                    and last.parts[-1][2] + last.parts[-1][1] == part[2]
                    and last.src_end <= part[0] <= last.src_end + FAR
                    and part[0] + n - last.src_start <= BUFFER):
                last.parts.append(part)
                last.src_end = part[0] + n
            else:
                batches.append(_Batch(part[0], part[0] + n, [part]))
            at += n
    return batches
