"""Stage 3 of a rewrite, the layout: where every byte of the output comes from.

An output file is laid out as a list of segments, each at its offset in the
output, before a byte is written:

- ``Data``: bytes already in memory (a header, a pickle, a zip directory);
- ``Span``: a range of an input file, copied as it is (tensor bytes);
- ``Made``: bytes made when their turn comes (a cast, a strided tensor
  gathered through torch, a zip descriptor that needs the CRC of what
  precedes it).

Each output format lays its files out this way (``ckptool.write.formats``),
``ckptool.write.copy`` writes any layout, checking every byte as it writes
it (``ckptool.write.bytecheck``). A ``Span`` may carry the CRCs its ranges
must have, known from the input (a zip record's directory entry: the bytes
written are checked against them); without them, its CRC is taken from the
bytes as they are copied.
"""

from __future__ import annotations

import ctypes
import math
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ckptool import dtypes
from ckptool.errors import CorruptCheckpointError
from ckptool.model import TensorInfo
from ckptool.read.tensor_data import TensorData

Check = tuple[str, int, int, int]  # (what, output offset, size, expected CRC)
# a span whose input and output offsets agree modulo the page size is copied
# by whole pages (``ckptool.write.copy``); from this size up, laying it out
# that way pays
PAGE = 4096
CONGRUENT_MIN = 1 << 20
PIECE = 8 << 20  # bytes of a remote input fetched and written at once


@dataclass
class Data:
    """Bytes already in memory."""

    at: int
    data: bytes
    name: str

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def crc(self) -> int:
        return zlib.crc32(self.data)


@dataclass
class Span:
    """``size`` bytes of the input file ``fd`` from offset ``src``, copied as they are."""

    at: int
    fd: int
    src: int
    size: int
    name: str
    # output ranges the span covers, with the CRCs they must have, where the
    # input says (zip records); empty: the CRC of the bytes copied, in ``crc``
    checks: list[Check] = field(default_factory=list)
    crc: int | None = None  # of the whole span: set once copied when no check gives it


@dataclass
class Made:
    """``size`` bytes that ``make()`` returns when the copy reaches them."""

    at: int
    size: int
    name: str
    make: Callable[[], bytes | memoryview | Iterator[bytes]]  # (pieces: written in order)
    crc: int | None = None  # set once made
    # made from every other segment's CRC (a zip directory): written last,
    # once the rest of the file is (by one process, when several write it)
    final: bool = False


Segment = Data | Span | Made
# an input file: its descriptor, or a remote file read by ranges (``read.remote``)
Source = Any


def source_of(f: Any) -> Source:
    """The input an open file copies from: its descriptor, or a remote file."""
    return f if getattr(f, "url", None) is not None else f.fileno()


def read_at(source: Source, n: int, offset: int) -> bytes:
    """``os.pread`` of an input, local or remote."""
    return os.pread(source, n, offset) if isinstance(source, int) else source.pread(offset, n)


def input_segment(source: Source, at: int, src: int, size: int, name: str,
                  checks: list[Check] | None = None, crc: int | None = None) -> Span | Made:
    """``size`` bytes of an input from ``src``, copied as they are: a
    ``Span`` of a local file (copied by the kernel or through a mapping), or
    for a remote one (``source`` has ``pread``) bytes ``Made`` by one range
    request when the copy reaches them, checked against the CRC the input
    gives them where it gives one (a zip record's)."""
    if isinstance(source, int):
        return Span(at, source, src, size, name, checks or [], crc)
    return _fetched(source, at, src, size, name,
                    [c[3] for c in checks or [] if c[1] == at and c[2] == size])


def input_segments(source: Source, at: int, src: int, size: int, name: str,
                   checks: list[Check]) -> list[Segment]:
    """``input_segment`` of a range holding several checked ranges (the
    records of a zip, back to back): one ``Span`` of a local file; of a
    remote one, one ``Made`` for each checked range and each range between
    them, so that one record's bytes are in memory at a time."""
    if isinstance(source, int):
        return [Span(at, source, src, size, name, checks)]
    out: list[Segment] = []
    pos = at
    for what, c_at, c_size, c_crc in sorted(checks, key=lambda c: c[1]):
        if c_at > pos:
            out.append(_fetched(source, pos, src + pos - at, c_at - pos, name, []))
        out.append(_fetched(source, c_at, src + c_at - at, c_size, what, [c_crc]))
        pos = c_at + c_size
    if pos < at + size:
        out.append(_fetched(source, pos, src + pos - at, at + size - pos, name, []))
    return out


def _fetched(source: Source, at: int, src: int, size: int, name: str,
             expected: list[int]) -> Made:
    """Bytes of a remote input, fetched when the copy reaches them (by the
    input's read-ahead, ``readahead``), a ``PIECE`` at a time, and checked
    against the CRC the input gives them, if it gives one: memory holds a
    few pieces, never a whole large tensor."""
    from ckptool.write import readahead

    ahead = readahead.of(source)
    pieces = [(ahead.add(src + off, min(PIECE, size - off)), min(PIECE, size - off))
              for off in range(0, size, PIECE)] or [(ahead.add(src, 0), 0)]

    def fetch() -> Iterator[bytes]:
        crc = 0
        for index, n in pieces:
            data = ahead.take(index)
            if len(data) != n:
                raise CorruptCheckpointError(f"{name}: the input ends before its bytes do",
                                             "the remote file changed or is cut short; "
                                             "nothing was written")
            crc = zlib.crc32(data, crc)
            yield data
        if expected and crc != expected[0]:
            raise CorruptCheckpointError(
                f"{name} does not match the CRC the input gives it",
                "the remote file is damaged: nothing was written")

    return Made(at, size, name, fetch)


@dataclass
class Layout:
    """An output file's segments, in output order, back to back or with gaps
    (never overlapping)."""

    segments: list[Segment] = field(default_factory=list)

    @property
    def end(self) -> int:
        return max((s.at + s.size for s in self.segments), default=0)

    @property
    def total(self) -> int:
        """Bytes the copy writes (for progress)."""
        return sum(s.size for s in self.segments)

    def add(self, segment: Segment) -> Segment:
        self.segments.append(segment)
        return segment


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def is_dense(t: TensorInfo) -> bool:
    """Whether ``t``'s elements lie in its storage in C order without gaps."""
    return t.numel <= 1 or tuple(
        s for s, n in zip(t.stride or (), t.shape, strict=True) if n > 1) == tuple(
        s for s, n in zip(contiguous_strides(t.shape), t.shape, strict=True) if n > 1)


def tensor_segment(reader: TensorData, t: TensorInfo, dtype: str, at: int,
                   name: str) -> Span | Made:
    """``t``'s elements, C-contiguous, as ``dtype``, written at ``at``.

    A tensor kept as it is and laid out densely in its storage is a
    ``Span`` of the input; its CRC comes from the zip directory when it
    fills its record. Casts, strided views and the values of a big-endian
    file (written little-endian) are made through torch."""
    size = t.numel * dtypes.itemsize(dtype)
    swapped = reader.byteswap and dtypes.itemsize(t.dtype) > 1
    if dtype == t.dtype and t.storage is not None and is_dense(t) and not swapped:
        src = reader.storage_offset(t.storage) + t.storage_offset * dtypes.itemsize(t.dtype)
        whole = t.storage_offset == 0 and size == reader.storage(t.storage).nbytes
        crc = reader.record_crc(t.storage) if whole else None
        checks = [(name, at, size, crc)] if crc is not None else []
        return input_segment(reader.source(), at, src, size, name, checks, crc)

    def make() -> bytes:
        values = reader.values(t, checked=True).contiguous()
        data = ctypes.string_at(values.data_ptr(), values.numel() * values.element_size())
        return cast_bytes(data, t.dtype, dtype) if dtype != t.dtype else data

    return Made(at, size, name, make)


def cast_bytes(data: bytes | bytearray, src: str, dst: str) -> bytes:
    """Elements of dtype ``src`` as dtype ``dst`` (through torch)."""
    import torch  # only casts need torch

    if not data:
        return b""
    cast = torch.frombuffer(bytearray(data), dtype=getattr(torch, src)).to(getattr(torch, dst))
    return ctypes.string_at(cast.data_ptr(), cast.numel() * cast.element_size())


def checked_cast(reader: TensorData, key: str, src: str, dst: str) -> bytes:
    """A whole storage cast from ``src`` to ``dst``, its input bytes checked
    against the zip directory's CRC first (a copy is checked by its CRC; a
    cast must not turn damaged bytes into plausible ones)."""
    data = reader.storage_bytes(key)
    crc = reader.record_crc(key)
    if crc is not None and zlib.crc32(data) != crc:
        raise CorruptCheckpointError(
            f"storage {key} of the input does not match its own checksum",
            "the file is damaged: fetch or copy it again; nothing was written")
    return cast_bytes(data, src, dst)
