"""Copy a torch zip's storage records into a new archive, page-congruent, on
a background thread.

The kernel copies a file range about twice as fast when source and
destination offsets agree modulo the page size: it moves whole page-cache
pages instead of pieces of two (on a 2 GB checkpoint, 0.46 to 0.58 s against
0.75 to 0.86 s). So a rewritten archive puts its storage records first.
Each run of kept records that lie back to back in the source is copied as
one span, their local headers and data descriptors included, to an offset
congruent with its source offset. The first record of a run gets a local
header of its own, padded to land there. ``data.pkl`` and the small records
follow the storages, written by the caller once the pickle is ready. The
central directory keeps the source's order, so ``data.pkl`` is still the
first entry, where torch takes the archive's root folder from; zip readers
find records through the directory, not by their position.

The layout depends only on which records are kept, so ``Copier`` can copy
on its own thread (the kernel copy releases the GIL) while the caller reads
and re-pickles, handing each finished record to a ``ByteChecker``.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.read.ziparchive import Member, ZipArchive, ZipError
from ckptool.write.bytecheck import ByteChecker, Check
from ckptool.write.zipwriter import ALIGNMENT, descriptor, local_header

Progress = Callable[[int, int], None]  # (bytes done, bytes total)
# bytes per kernel copy call: the copier takes the GIL between calls, and a
# busy main thread can make it wait for it each time
SPAN_CHUNK = 256 << 20
TAIL_CHUNK = 16 << 20
CONGRUENT_MIN = 1 << 20  # smaller runs keep torch's 64-byte alignment, no page padding
CastBytes = Callable[[str], bytes]  # storage key -> its bytes, cast


@dataclass
class Piece:
    """One storage record of the output."""

    key: str  # the storage key: the record is <root>/data/<key>
    name: str
    header: int  # output offset of its local header
    data: int  # output offset of its first byte
    size: int
    crc: int  # what its bytes must check to (a cast's: set once written)
    flags: int  # for the central directory, as its local header has them





@dataclass
class Run:
    """Records written in one go: a span of the source, or one cast record."""

    header: bytes  # the first record's local header, ours
    pieces: list[Piece] = field(default_factory=list)
    src_start: int = 0  # source offset of the first record's bytes
    src_end: int = 0  # source offset just after the last record's bytes
    cast: bool = False
    # every byte the run writes, in output order: headers, the gaps copied
    # between records (descriptor + local header), records, the last descriptor
    checks: list[Check] = field(default_factory=list)

    @property
    def trailer_at(self) -> int:
        """Where the last record's data descriptor goes."""
        return self.pieces[-1].data + self.pieces[-1].size

    @property
    def trailer(self) -> bytes:
        last = self.pieces[-1]
        return descriptor(last.crc, last.size)


@dataclass
class Layout:
    runs: list[Run]
    end: int  # where the records after the storages start
    total: int  # bytes the copier writes

    def pieces(self) -> list[Piece]:
        return [p for run in self.runs for p in run.pieces]


def storage_members(archive: ZipArchive, prefix: str) -> dict[str, Member]:
    """The archive's storage records, by storage key."""
    folder = f"{prefix}data/"
    return {name[len(folder):]: m for name, m in archive.members.items()
            if name.startswith(folder) and len(name) > len(folder)}


def plan_layout(fd: int, archive: ZipArchive, members: dict[str, Member],
                casts: dict[str, int]) -> Layout:
    """Where each kept record goes: ``members`` (by storage key) in their source
    order; ``casts`` gives the output size of the records written cast."""
    groups = _group(fd, archive, members, casts)
    runs: list[Run] = []
    pos = 0
    for group in groups:
        (key, member, src, _), *rest = group
        cast = key in casts
        end = rest[-1][2] + rest[-1][1].size if rest else src + member.size
        # padding to the page pays only on a large copy
        congruent = src if (not cast and src % ALIGNMENT == 0
                            and end - src >= CONGRUENT_MIN) else None
        header = local_header(member.name.encode(), pos, congruent)
        size = casts[key] if cast else member.size
        first = Piece(key, member.name, pos, pos + len(header), size, member.crc, 0x0808)
        run = Run(header, [first], src, src + member.size, cast)
        run.checks.append((f"storage {key}'s local header", pos, len(header),
                           zlib.crc32(header)))
        delta = first.data - src
        for key, member, src, gap in rest:
            # the bytes between two records (a descriptor, then the next local
            # header) are copied as they are, and re-read like the rest
            run.checks += [(f"storage {run.pieces[-1].key}", run.pieces[-1].data,
                            run.pieces[-1].size, run.pieces[-1].crc),
                           (f"storage {key}'s local header", run.src_end + delta, len(gap),
                            zlib.crc32(gap))]
            run.pieces.append(Piece(key, member.name, member.header_offset + delta, src + delta,
                                    member.size, member.crc, member.flags))
            run.src_end = src + member.size
        if not cast:
            last = run.pieces[-1]
            run.checks.append((f"storage {last.key}", last.data, last.size, last.crc))
        runs.append(run)
        pos = _close(run)
    total = sum(r.pieces[0].size if r.cast else r.src_end - r.src_start for r in runs)
    return Layout(runs, pos, total)


Group = list[tuple[str, Member, int, bytes]]  # (key, member, source data offset, gap before)


def _group(fd: int, archive: ZipArchive, members: dict[str, Member],
           casts: dict[str, int]) -> list[Group]:
    """Kept records in source order, in groups written in one go: a cast
    record alone, or records that follow each other in the source."""
    groups: list[Group] = []
    for key, member in sorted(members.items(), key=lambda item: item[1].header_offset):
        if member.flags & 0x1 or member.method != 0:
            raise UnsupportedCheckpointError(
                f"storage record {member.name} is compressed or encrypted "
                "(torch.save stores records uncompressed)",
                "load and re-save it with torch.save")
        try:
            src = archive.data_offset(member)
        except ZipError as exc:
            raise CorruptCheckpointError(f"cannot locate {member.name}: {exc}") from exc
        last = groups[-1] if groups else None
        gap = None
        if last is not None and key not in casts and last[0][0] not in casts:
            gap = _gap_after(fd, last[-1][1], last[-1][2], member, src)
        if last is not None and gap is not None:
            last.append((key, member, src, gap))
        else:
            groups.append([(key, member, src, b"")])
    return groups


def _close(run: Run) -> int:
    """Ends a run with its last descriptor (a cast's CRC is filled in when it
    is written); returns the offset after it."""
    if not run.cast:
        trailer = run.trailer
        run.checks.append((f"storage {run.pieces[-1].key}'s data descriptor", run.trailer_at,
                           len(trailer), zlib.crc32(trailer)))
    return run.trailer_at + len(run.trailer)


def _gap_after(fd: int, prev: Member, prev_src: int, member: Member, src: int) -> bytes | None:
    """The source bytes between ``prev``'s data and ``member``'s when ``member``
    can follow it in one copy: right after it, separated only by ``prev``'s
    data descriptor (either size form) and ``member``'s local header."""
    if not member.flags & 0x08:
        return None
    if not (member.flags & 0x800 or member.name.isascii()):
        return None  # the central directory writes names as UTF-8
    prev_end = prev_src + prev.size
    if src - prev_end > 1 << 18:
        return None
    # torch writes the 8-byte-size (ZIP64) form for every record past 4 GiB
    forms = {descriptor(prev.crc, prev.size),
             struct.pack("<IIQQ", 0x08074B50, prev.crc, prev.size, prev.size)}
    for desc in forms:
        if member.header_offset == prev_end + len(desc):
            gap = os.pread(fd, src - prev_end, prev_end)
            if gap[:len(desc)] == desc:
                return gap
    return None


class Copier:
    """Writes a layout's storage records on a thread of its own.

    ``start()``, then ``finish()`` (re-raises what went wrong in the thread);
    ``cancel()`` stops it after the chunk it is copying and writes nothing
    more. Each byte range goes to ``checker`` as soon as it is in the output."""

    def __init__(self, src_fd: int, dst_fd: int, layout: Layout, checker: ByteChecker,
                 progress: Progress | None = None, cast: CastBytes | None = None) -> None:
        self.src_fd, self.dst_fd = src_fd, dst_fd
        self.layout = layout
        self.checker = checker
        self.progress = progress
        self.cast = cast
        self.done = 0
        self._kernel = hasattr(os, "copy_file_range")
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptool-copy", daemon=True)

    def start(self) -> Copier:
        self._thread.start()
        return self

    def cancel(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def finish(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            for run in self.layout.runs:
                if self._stop.is_set():
                    return
                self._write(run.header, run.pieces[0].header)
                if run.cast:
                    self._write_cast(run)
                pending = deque(run.checks)
                if not run.cast:
                    self._copy_span(run, pending)
                if self._stop.is_set():
                    return  # cancelled mid-span: nothing more is written or checked
                self._write(run.trailer, run.trailer_at)
                self.checker.check_many(list(pending))  # the last descriptor, a cast's checks
        except BaseException as exc:  # re-raised on the caller's thread by finish()
            self._error = exc

    def _write(self, data: bytes, at: int) -> None:
        done = 0
        while done < len(data):
            done += os.pwrite(self.dst_fd, memoryview(data)[done:], at + done)

    def _write_cast(self, run: Run) -> None:
        assert self.cast is not None, "a cast record needs a cast function"
        piece = run.pieces[0]
        data = self.cast(piece.key)
        if len(data) != piece.size:
            raise CorruptCheckpointError(
                f"storage {piece.key} cast to {len(data)} bytes, {piece.size} planned",
                "report this as a bug; nothing was written")
        piece.crc = zlib.crc32(data)
        self._write(data, piece.data)
        self._advance(piece.size)
        trailer = run.trailer
        run.checks += [(f"storage {piece.key}", piece.data, piece.size, piece.crc),
                       (f"storage {piece.key}'s data descriptor", run.trailer_at, len(trailer),
                        zlib.crc32(trailer))]

    def _copy_span(self, run: Run, pending: deque[Check]) -> None:
        delta = run.pieces[0].data - run.src_start
        at, end = run.src_start, run.src_end
        while at < end:
            if self._stop.is_set():
                return
            # big chunks, smaller towards the end: the checker re-reads each
            # one after it lands, and only the last one's re-read is not overlapped
            want = min(SPAN_CHUNK, max(TAIL_CHUNK, (end - at) // 4), end - at)
            n = self._copy(at, want, at + delta)
            if n <= 0:
                raise CorruptCheckpointError(
                    f"the input ends {end - at} bytes early, inside its storage records",
                    "the file was probably cut short while copying; nothing was written")
            self._advance(min(n, end - at))
            at += n
            # hand over what is fully written (the run's header came first)
            ready = []
            while pending and pending[0][1] + pending[0][2] <= at + delta:
                ready.append(pending.popleft())
            self.checker.check_many(ready)

    def _copy(self, src_at: int, size: int, dst_at: int) -> int:
        """Copy up to ``size`` bytes; returns how many (0 at the source's end)."""
        if self._kernel:
            try:
                return os.copy_file_range(self.src_fd, self.dst_fd, size, src_at, dst_at)
            except OSError:
                self._kernel = False  # another filesystem, or not supported: copy ourselves
        chunk = os.pread(self.src_fd, size, src_at)
        return os.pwrite(self.dst_fd, chunk, dst_at) if chunk else 0

    def _advance(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.layout.total)
