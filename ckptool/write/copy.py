"""Stage 4 of a rewrite, the copy: write a layout's segments into the output,
on a thread of its own, handing every byte range to the checker as soon as
it is in the file.

How each segment is written:

- a ``Span`` whose input and output offsets agree modulo the page size, and
  that is large enough to pay for it, is copied by the kernel
  (``copy_file_range``), in chunks, so the checker re-reads each chunk while
  the next is copied. The kernel moves whole page-cache pages then: on a
  2 GB checkpoint 0.46 to 0.58 s, against 0.75 to 0.86 s for the same bytes
  shifted (``ckptool.write.formats.torch_zip`` lays storage records out
  that way);
- other spans, one run of them at a time, are read ahead on a second thread
  into small buffers and written from this one (``ckptool.write.gather``):
  two memory copies on two cores beat one shifted kernel copy (a run of
  less than 1 MiB is not worth the thread: the kernel copies it);
- ``Data`` and ``Made`` bytes are written as they are (``Made`` made first).

The layout arrives in parts (``add``): a rewritten zip's storage records can
be copied while the file's pickle is still being read and planned, and its
pickle and directory follow once they exist. ``finish()`` waits and raises
what went wrong on the copy's thread; ``cancel()`` stops after the chunk in
hand and writes nothing more.
"""

from __future__ import annotations

import os
import queue
import threading
import zlib
from collections import deque
from collections.abc import Callable

from ckptool.errors import CorruptCheckpointError
from ckptool.write.bytecheck import ByteChecker
from ckptool.write.fastcrc import Observe, crc_file_range
from ckptool.write.gather import copy_pieces
from ckptool.write.layout import CONGRUENT_MIN, PAGE, Check, Data, Made, Segment, Span

Progress = Callable[[int, int], None]  # (bytes done, bytes total)
# bytes per kernel copy call: the copier takes the GIL between calls, and a
# busy main thread can make it wait for it each time
SPAN_CHUNK = 256 << 20
TAIL_CHUNK = 16 << 20
CHECK_BATCH = 64 << 20  # bytes of small ranges handed to the checker at a time
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
        self._kernel = hasattr(os, "copy_file_range")
        self._queue: queue.Queue[list[Segment] | None] = queue.Queue()
        self._pending: list[Check] = []  # small ranges not yet handed to the checker
        self._pending_bytes = 0
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
        """Wait until every segment added is written (and handed to the checker)."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """Stop after the chunk being copied; write and check nothing more."""
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
                self._hand_over()
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
        second thread when they come to enough bytes to pay for it, else one
        kernel copy each."""
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
        self._advance(data.size)
        self._check((data.name, data.at, data.size, data.crc))

    def _write_made(self, made: Made) -> None:
        data = made.make()
        if len(data) != made.size:
            raise CorruptCheckpointError(
                f"{made.name} came to {len(data)} bytes, {made.size} planned",
                "report this as a bug; nothing was written")
        made.crc = zlib.crc32(data)
        self._pwrite(data, made.at)
        self._advance(made.size)
        self._check((made.name, made.at, made.size, made.crc))

    def _copy_span(self, span: Span) -> None:
        """A kernel copy, a chunk at a time; the checks of what is fully
        written go to the checker after each chunk."""
        if not span.checks:  # its CRC, from the input, before it is copied
            span.crc = crc_file_range(span.fd, span.src, span.size)
            span.checks = [(span.name, span.at, span.size, span.crc)]
        pending = deque(sorted(span.checks, key=lambda c: c[1]))
        delta = span.at - span.src
        at, end = span.src, span.src + span.size
        while at < end:
            if self._stop.is_set():
                return  # cancelled mid-span: nothing more is written or checked
            # big chunks, smaller towards the end: the checker re-reads each
            # one after it lands, and only the last one's re-read is not overlapped
            want = min(SPAN_CHUNK, max(TAIL_CHUNK, (end - at) // 4), end - at)
            n = self._kernel_copy(span.fd, at, want, at + delta)
            if n <= 0:
                raise CorruptCheckpointError(
                    f"the input ends {end - at} bytes early, inside {span.name}", _SHORT)
            self._advance(min(n, end - at))
            at += n
            ready = []
            while pending and pending[0][1] + pending[0][2] <= at + delta:
                ready.append(pending.popleft())
            if ready:
                self._hand_over()  # the checks of the segments before this one go first
            self.checker.check_many(ready)

    def _kernel_copy(self, fd: int, src_at: int, size: int, dst_at: int) -> int:
        """Copy up to ``size`` bytes; returns how many (0 at the source's end)."""
        if self._kernel:
            try:
                return os.copy_file_range(fd, self.out_fd, size, src_at, dst_at)
            except OSError:
                self._kernel = False  # another filesystem, or not supported: copy ourselves
        chunk = os.pread(fd, size, src_at)
        return os.pwrite(self.out_fd, chunk, dst_at) if chunk else 0

    def _gather(self, spans: list[Span]) -> None:
        """Spans of one input, read ahead on a second thread (``gather``)."""
        spans.sort(key=lambda s: s.at)

        def copied(i: int, crc: int | None) -> None:
            span = spans[i]
            if crc is not None:
                span.crc = crc
                span.checks = [(span.name, span.at, span.size, crc)]
            self._advance(span.size)
            for check in span.checks:
                self._check(check)

        unknown = frozenset(i for i, s in enumerate(spans) if not s.checks)
        try:
            copy_pieces(spans[0].fd, self.out_fd, [(s.src, s.size, s.at) for s in spans],
                        copied, unknown)
        except EOFError as exc:
            raise CorruptCheckpointError(f"{exc}, inside its tensor bytes", _SHORT) from exc

    def _pwrite(self, data: bytes | memoryview, at: int) -> None:
        done = 0
        while done < len(data):
            done += os.pwrite(self.out_fd, memoryview(data)[done:], at + done)

    def _check(self, check: Check) -> None:
        self._pending.append(check)
        self._pending_bytes += check[2]
        if self._pending_bytes >= CHECK_BATCH:
            self._hand_over()

    def _hand_over(self) -> None:
        """Ranges re-read together, in file order (few GIL round trips)."""
        if self._pending:
            self.checker.check_many(self._pending)
            self._pending, self._pending_bytes = [], 0

    def _advance(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)


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
    """Write ``segments`` now and wait until every byte of them has been
    re-read and found as written (``verify.check_bytes``); ``observe`` is
    shown the bytes re-read, in file order where the segments are."""
    from ckptool.write.verify import check_bytes

    with ByteChecker(out_fd, durable, observe) as checker:
        write(out_fd, checker, segments, progress)
        check_bytes(checker)
