"""A streaming writer for torch's zip layout, without importing torch.

Mirrors what ``torch.save`` writes: stored (uncompressed) records, each
payload aligned to 64 bytes by an ``FB`` padding extra field, flags 0x808
(data descriptor after the data, UTF-8 names), the CRC and sizes in the
data descriptor and the central directory, and ZIP64 records once sizes or
offsets pass 4 GiB. Payloads are written in chunks, so memory stays flat
whatever the record size.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from ckptool.write.layout import PAGE

ALIGNMENT = 64
_LIMIT = 0xFFFFFFFF  # sizes and offsets from here on need ZIP64 fields
_MASK = 0xFFFFFFFF  # what a 32-bit field holds when the ZIP64 field has the value
_FLAGS = 0x0808
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<IHHHHIIH")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR64 = struct.Struct("<IIQI")


@dataclass
class Written:
    name: str
    offset: int  # of the local header
    size: int
    crc: int
    flags: int = _FLAGS
    data_offset: int = 0  # of the first data byte


class Writable(Protocol):
    def write(self, data: bytes, /) -> int: ...


class ZipWriter:
    """Write records one by one to ``f``; ``close()`` writes the central directory."""

    def __init__(self, f: Writable, start: int = 0) -> None:
        self.f = f
        self.pos = start
        self.records: list[Written] = []

    def _local_header(self, name: bytes) -> bytes:
        return local_header(name, self.pos)

    def write_record(self, name: str, chunks: Iterable[bytes]) -> Written:
        """Write one record from ``chunks``; returns its offset, size and CRC."""
        raw = name.encode("utf-8")
        header = self._local_header(raw)
        offset = self.pos
        self.f.write(header)
        self.pos += len(header)
        data_offset = self.pos
        crc, size = 0, 0
        for chunk in chunks:
            self.f.write(chunk)
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
        self.pos += size
        desc = descriptor(crc, size)
        self.f.write(desc)
        self.pos += len(desc)
        rec = Written(name, offset, size, crc, data_offset=data_offset)
        self.records.append(rec)
        return rec

    def add_existing(self, name: str, offset: int, size: int, crc: int, flags: int,
                     data_offset: int = 0) -> None:
        """List a stored record already in the file (copied, or kept in place)."""
        self.records.append(Written(name, offset, size, crc, flags, data_offset))

    def write_bytes(self, name: str, data: bytes) -> Written:
        return self.write_record(name, (data,))

    def close(self) -> int:
        """Write the central directory and end records; returns the end offset."""
        cd_start = self.pos
        for rec in self.records:
            raw = rec.name.encode("utf-8")
            extra = b""
            size32 = rec.size if rec.size < _LIMIT else _MASK
            off32 = rec.offset if rec.offset < _LIMIT else _MASK
            fields = [v for v, v32 in ((rec.size, size32), (rec.size, size32),
                                       (rec.offset, off32)) if v32 == _MASK]
            if fields:
                extra = struct.pack("<HH", 1, 8 * len(fields)) + struct.pack(
                    f"<{len(fields)}Q", *fields)
            entry = _CENTRAL.pack(0x02014B50, 45, 45, rec.flags, 0, 0, 0, rec.crc, size32,
                                  size32, len(raw), len(extra), 0, 0, 0, 0, off32)
            self.f.write(entry + raw + extra)
            self.pos += len(entry) + len(raw) + len(extra)
        cd_size = self.pos - cd_start
        count = len(self.records)
        if count >= 0xFFFF or cd_start >= _LIMIT or cd_size >= _LIMIT:
            eocd64_at = self.pos
            self.f.write(_EOCD64.pack(0x06064B50, 44, 45, 45, 0, 0, count, count,
                                      cd_size, cd_start))
            self.f.write(_LOCATOR64.pack(0x07064B50, 0, eocd64_at, 1))
            self.pos += _EOCD64.size + _LOCATOR64.size
            self.f.write(_EOCD.pack(0x06054B50, 0, 0, 0xFFFF, 0xFFFF, _MASK, _MASK, 0))
        else:
            self.f.write(_EOCD.pack(0x06054B50, 0, 0, count, count, cd_size, cd_start, 0))
        self.pos += _EOCD.size
        return self.pos


def local_header(name: bytes, at: int, congruent_to: int | None = None) -> bytes:
    """A stored record's local header for a record starting at offset ``at``.

    Its ``FB`` extra field pads the header so that the data starts 64-byte
    aligned, as torch writes it, or, given ``congruent_to`` (a 64-byte
    aligned offset), at an offset equal to it modulo the page size, so that
    the kernel can copy whole pages into it (``ckptool.write.copy``)."""
    base = at + _LOCAL.size + len(name) + 4
    pad = -base % ALIGNMENT if congruent_to is None else (congruent_to - base) % PAGE
    extra = b"FB" + struct.pack("<H", pad) + b"\0" * pad
    return _LOCAL.pack(0x04034B50, 45, _FLAGS, 0, 0, 0, 0, 0, 0,
                       len(name), len(extra)) + name + extra


def descriptor(crc: int, size: int) -> bytes:
    """The data descriptor after a record's bytes (ZIP64 ones carry 8-byte sizes)."""
    if size >= _LIMIT:
        return struct.pack("<IIQQ", 0x08074B50, crc, size, size)
    return struct.pack("<IIII", 0x08074B50, crc, size, size)
