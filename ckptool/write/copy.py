"""Stage 4 of a rewrite, the copy: write a layout's segments into the output,
on a thread of its own, checking every byte as it is written.

Every byte is read once and written once, and the CRC of each checked range
is taken from the very bytes handed to the write, then compared with the
CRC the input gives it (a zip record's directory entry) or recorded (a span
with none: its CRC goes into the zip directory written after it). The
verdict is a ``ByteChecker``'s (``ckptool.write.verify.check_bytes``).
Nothing is read back.

How each segment is written:

- a ``Span`` whose input and output offsets agree modulo the page size (1
  MiB or more), or a run of shifted spans under 1 MiB, is copied through a
  mapping of the input (``ckptool.write.mapcopy``), a piece at a time: the
  checker's thread takes the CRCs of a piece from the mapped page-cache
  pages while the piece before it is written, then the piece is written
  from those same bytes (one memory copy, as the kernel's
  ``copy_file_range``, which could only be checked by a second read);
- a run of shifted spans of 1 MiB or more is read ahead on a second thread
  into small buffers, checked there and written from this one
  (``ckptool.write.gather``): neighbouring tensors share one read;
- ``Data`` and ``Made`` bytes are written as they are (``Made`` made first),
  their CRC taken from them.

The layout arrives in parts (``add``): a rewritten zip's storage records can
be copied while the file's pickle is still being read and planned, and its
pickle and directory follow once they exist. ``finish()`` waits and raises
what went wrong on the copy's thread; ``cancel()`` stops after the piece in
hand and writes nothing more.
"""

from __future__ import annotations

import os
import queue
import threading
import zlib
from collections import deque
from collections.abc import Callable, Iterator

from ckptool.errors import CorruptCheckpointError
from ckptool.write import mapcopy
from ckptool.write.bytecheck import ByteChecker, Part, Ranges, Source
from ckptool.write.fastcrc import Observe
from ckptool.write.gather import copy_pieces
from ckptool.write.layout import CONGRUENT_MIN, PAGE, Data, Made, Segment, Span

Progress = Callable[[int, int], None]  # (bytes done, bytes total)
AHEAD = 2  # pieces the checker may take before the writer writes them
# bytes per write call: a bigger write makes the kernel give the new file
# bigger page-cache folios, which cost more to come by (on a VM that returns
# free memory to its host, several times more: 2 GB in 1 MiB writes took 1.8
# to 4.0 CPU-seconds, in 64 KiB ones 0.6 to 0.8); smaller ones cost more
# round trips through the GIL (docs/benchmarks.md)
WRITE = 512 << 10
_SHORT = "the file was probably cut short while copying; nothing was written"


class Copier:
    """Writes segments into ``out_fd`` on its own thread: ``start()``, then
    ``add(segments)`` any number of times, then ``finish()``."""

    def __init__(self, out_fd: int, checker: ByteChecker, progress: Progress | None = None,
                 total: int = 0) -> None:
        self.out_fd = out_fd
        self.checker = checker
        self.progress = progress
        self.total = total  # for progress: grows as parts are added
        self.done = 0
        self._queue: queue.Queue[list[Segment] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptool-copy", daemon=True)

    def start(self) -> Copier:
        self._thread.start()
        return self

    def add(self, segments: list[Segment]) -> None:
        """More of the layout, after what was added before (in output order
        or not: each segment says where it goes)."""
        self.total += sum(s.size for s in segments)
        self._queue.put(list(segments))

    def finish(self) -> None:
        """Wait until every segment added is written and checked."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """Stop after the piece being copied; write and check nothing more."""
        self._stop.set()
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join()

    # -- the copy's thread ---------------------------------------------------

    def _run(self) -> None:
        try:
            while (segments := self._queue.get()) is not None:
                if self._stop.is_set():
                    return
                self._write_all(segments)
        except BaseException as exc:  # re-raised on the caller's thread by finish()
            self._error = exc
            self._stop.set()

    def _write_all(self, segments: list[Segment]) -> None:
        shifted: list[Span] = []  # a run of spans for the read-ahead copy
        for segment in segments:
            if self._stop.is_set():
                return
            if isinstance(segment, Span) and not self._congruent(segment):
                if shifted and shifted[-1].fd != segment.fd:
                    self._copy_shifted(shifted)
                    shifted = []
                shifted.append(segment)
                continue
            self._copy_shifted(shifted)
            shifted = []
            if isinstance(segment, Span):
                self._copy_span(segment)
            elif isinstance(segment, Made):
                self._write_made(segment)
            else:
                self._write_data(segment)
        self._copy_shifted(shifted)

    def _copy_shifted(self, spans: list[Span]) -> None:
        """A run of spans not congruent with their input: read ahead on a
        second thread when they come to enough bytes to pay for it, else
        each through a mapping of the input."""
        if sum(s.size for s in spans) >= CONGRUENT_MIN:
            self._gather(spans)
            return
        for span in spans:
            self._copy_span(span)

    @staticmethod
    def _congruent(span: Span) -> bool:
        return span.size >= CONGRUENT_MIN and (span.src - span.at) % PAGE == 0

    def _write_data(self, data: Data) -> None:
        self._pwrite(data.data, data.at)
        self.checker.written(data.at, data.size)
        self.checker.wrote(data.at, data.data, 0, data.size)
        self._advance(data.size)

    def _write_made(self, made: Made) -> None:
        data = made.make()
        if not isinstance(data, (bytes, bytearray, memoryview)):  # pieces, in order
            self._write_pieces(made, data)
            return
        if len(data) != made.size:
            raise CorruptCheckpointError(
                f"{made.name} came to {len(data)} bytes, {made.size} planned",
                "report this as a bug; nothing was written")
        made.crc = zlib.crc32(data)
        self._pwrite(data, made.at)
        self.checker.written(made.at, made.size)
        if self.checker.observe is not None:  # bytes of its own, that nothing changes
            self.checker.wrote(made.at, bytes(data), 0, made.size)
        self._advance(made.size)

    def _write_pieces(self, made: Made, pieces: Iterator[bytes]) -> None:
        """A ``Made`` that comes a piece at a time (a large tensor of a
        remote input: one piece in memory, not the whole)."""
        crc, at = 0, made.at
        for piece in pieces:
            if at + len(piece) > made.at + made.size:
                break
            self._pwrite(piece, at)
            crc = zlib.crc32(piece, crc)
            if self.checker.observe is not None:
                self.checker.wrote(at, bytes(piece), 0, len(piece))
            at += len(piece)
            if self._stop.is_set():
                return
        if at != made.at + made.size:
            raise CorruptCheckpointError(
                f"{made.name} came to {at - made.at} bytes or more, {made.size} planned",
                "report this as a bug; nothing was written")
        made.crc = crc
        self.checker.written(made.at, made.size)
        self._advance(made.size)

    def _copy_span(self, span: Span) -> None:
        """Through a mapping of the input, a piece at a time: the checker
        takes the CRCs of a piece's ranges while the piece before it is
        written, then the piece is written from the very bytes checked."""
        ranges = Ranges(_parts(span))
        before = _version(span.fd)
        ahead: deque[tuple[Source, int, int, int, threading.Event]] = deque()
        at = span.at
        try:
            for buffer, start, n in mapcopy.pieces(span.fd, span.src, span.size):
                ahead.append((buffer, start, at, n,
                              self.checker.take(at, buffer, start, n, ranges)))
                at += n
                if len(ahead) > AHEAD and not self._write_piece(*ahead.popleft()):
                    return  # cancelled mid-span: nothing more is written
            while ahead:
                if not self._write_piece(*ahead.popleft()):
                    return
        except EOFError as exc:
            raise CorruptCheckpointError(f"{exc}, inside {span.name}", _SHORT) from exc
        if _version(span.fd) != before:
            raise CorruptCheckpointError(
                f"the input changed while {span.name} was copied",
                "let whatever writes it finish, then run the command again; nothing was written")
        if not span.checks:  # its CRC, for what is made after it (a zip directory)
            span.crc = ranges.crcs[0] if ranges.crcs else 0

    def _write_piece(self, buffer: Source, start: int, at: int, n: int,
                     checked: threading.Event) -> bool:
        """Write a piece once the checker has taken it, in writes of
        ``WRITE`` bytes; False once the copy is cancelled."""
        while not checked.wait(0.05):
            if self._stop.is_set():
                return False
        if self._stop.is_set():
            return False
        with memoryview(buffer) as view:
            for done in range(0, n, WRITE):
                with view[start + done:start + min(n, done + WRITE)] as part:
                    self._pwrite(part, at + done)
        self.checker.written(at, n)
        self._advance(n)
        return True

    def _gather(self, spans: list[Span]) -> None:
        """Spans of one input, read ahead on a second thread (``gather``),
        their CRCs taken there from the buffers written."""
        spans.sort(key=lambda s: s.at)
        parts = [(span, part) for span in spans for part in _parts(span)]

        def copied(i: int, crc: int) -> None:
            span, (name, _, _, expected) = parts[i]
            if expected is not None:
                self.checker.check(name, crc, expected)
            elif not span.checks:
                span.crc = crc
            if i + 1 == len(parts) or parts[i + 1][0] is not span:
                self._advance(span.size)

        def wrote(at: int, view: memoryview) -> None:  # the buffer is used again: a copy
            self.checker.written(at, len(view))
            if self.checker.observe is not None:
                self.checker.wrote(at, view.tobytes(), 0, len(view))

        src = {id(span): span.src - span.at for span in spans}
        try:
            copy_pieces(spans[0].fd, self.out_fd,
                        [(at + src[id(span)], size, at) for span, (_, at, size, _) in parts],
                        copied, wrote)
        except EOFError as exc:
            raise CorruptCheckpointError(f"{exc}, inside its tensor bytes", _SHORT) from exc

    def _pwrite(self, data: bytes | memoryview, at: int) -> None:
        """Write all of ``data`` at ``at`` (every write goes through here)."""
        done = 0
        with memoryview(data) as view:
            while done < len(view):
                done += os.pwrite(self.out_fd, view[done:], at + done)

    def _advance(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)


def _version(fd: int) -> tuple[int, int]:
    """What changes when a file is written: its size and modification time
    (``file_identity``'s, for an open file)."""
    st = os.fstat(fd)
    return st.st_size, st.st_mtime_ns


def _parts(span: Span) -> list[Part]:
    """The span's checked ranges, and the bytes between them unchecked, in
    order; a span with none is one range, whose CRC is recorded."""
    if not span.checks:
        return [(span.name, span.at, span.size, None)]
    parts: list[Part] = []
    pos, end = span.at, span.at + span.size
    for name, at, size, crc in sorted(span.checks, key=lambda c: c[1]):
        if at < pos or at + size > end:
            raise CorruptCheckpointError(f"{name} lies outside {span.name} or over another "
                                         "range", "report this as a bug; nothing was written")
        if at > pos:
            parts.append((span.name, pos, at - pos, None))
        parts.append((name, at, size, crc))
        pos = at + size
    if pos < end:
        parts.append((span.name, pos, end - pos, None))
    return parts


def write(out_fd: int, checker: ByteChecker, segments: list[Segment],
          progress: Progress | None = None) -> None:
    """Write ``segments`` now (on the copy's thread, waited for)."""
    copier = Copier(out_fd, checker, progress).start()
    try:
        copier.add(segments)
        copier.finish()
    finally:
        copier.cancel()


def write_checked(out_fd: int, durable: bool, segments: list[Segment],
                  progress: Progress | None = None, observe: Observe | None = None) -> None:
    """Write ``segments`` now, every byte checked as it is written; raises
    where a range's bytes differ (``verify.check_bytes``). ``observe`` is
    shown the bytes written, in file order where the segments are."""
    from ckptool.write.verify import check_bytes

    with ByteChecker(out_fd, durable, observe) as checker:
        write(out_fd, checker, segments, progress)
        check_bytes(checker)
