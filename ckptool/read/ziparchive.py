"""Read a zip archive's central directory and its records' offsets.

Lighter than ``zipfile`` (which costs ~15 ms just to import, through
``pathlib``, and builds a ``ZipInfo`` per record): torch checkpoints hold
thousands of records, and ckptool needs each one's data offset (to copy it
without reading it), which ``zipfile`` does not expose. Handles ZIP64,
stored and deflated records, and checks CRCs of what it reads whole.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import IO

_EOCD = struct.Struct("<IHHHHIIH")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR64 = struct.Struct("<IIQI")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_MAX_COMMENT = 0xFFFF
_U32_MAX = 0xFFFFFFFF


class ZipError(ValueError):
    """The archive is truncated or malformed."""


class ChecksumMismatch(ZipError):
    """A record of the size it claims whose CRC-32 is not the one recorded:
    torch's reader (miniz, as torch.load uses it) does not check it and
    reads ``data`` as it is."""

    def __init__(self, message: str, data: bytes) -> None:
        super().__init__(message)
        self.data = data


@dataclass(slots=True)
class Member:
    name: str
    flags: int
    method: int
    crc: int
    compressed_size: int
    size: int
    header_offset: int


class ZipArchive:
    """The members of the zip archive in ``f`` (``size`` bytes long)."""

    def __init__(self, f: IO[bytes], size: int) -> None:
        self.f = f
        self.size = size
        self.members: dict[str, Member] = {}  # by name: the last of a repeated name
        self.duplicates: list[str] = []  # names the directory repeats
        self._read_directory()

    def _read_directory(self) -> None:
        f, size = self.f, self.size
        tail_len = min(size, _EOCD.size + _MAX_COMMENT)
        f.seek(size - tail_len)
        tail = f.read(tail_len)
        at = tail.rfind(b"PK\x05\x06")
        if at < 0 or at + _EOCD.size > len(tail):
            raise ZipError("no end-of-central-directory record (truncated?)")
        eocd_pos = size - tail_len + at
        _, disk, _, _, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, at)
        self.tail_start = eocd_pos  # end records: [zip64 end + locator] + end record
        if disk != 0:
            raise ZipError("multi-disk archives are not supported")
        loc = at - _LOCATOR64.size
        if loc >= 0 and tail[loc:loc + 4] == b"PK\x06\x07":
            _, _, eocd64_pos, _ = _LOCATOR64.unpack_from(tail, loc)
            if eocd64_pos + _EOCD64.size > size - tail_len + loc:
                raise ZipError("the ZIP64 end record's locator points past it")
            self.tail_start = min(eocd64_pos, size - tail_len + loc)
            f.seek(eocd64_pos)
            raw = f.read(_EOCD64.size)
            if len(raw) < _EOCD64.size or raw[:4] != b"PK\x06\x06":
                raise ZipError("bad ZIP64 end record")
            _, _, _, _, _, _, _, count, cd_size, cd_offset = _EOCD64.unpack(raw)
        if cd_offset + cd_size > eocd_pos:
            raise ZipError("central directory lies past its end record (truncated?)")
        f.seek(cd_offset)
        cd = f.read(cd_size)
        if len(cd) < cd_size:
            raise ZipError("central directory is cut short")
        pos, end, entry = 0, len(cd), _CENTRAL.size
        unpack, members = _CENTRAL.unpack_from, self.members
        last_start = size - _LOCAL.size  # the latest a record's local header may start
        for _ in range(count):  # hot: 100,000 records in an optimizer state
            if pos + entry > end:
                raise ZipError("central directory is cut short")
            (sig, _, _, flags, method, _, _, crc, csize, usize, nlen, xlen, clen,
             _, _, _, offset) = unpack(cd, pos)
            if sig != 0x02014B50:
                raise ZipError("bad central directory entry")
            pos += entry
            raw_name = cd[pos:pos + nlen]
            at = pos + nlen  # its extra field
            pos = at + xlen + clen
            if pos > end:
                raise ZipError("central directory is cut short")
            try:
                name = raw_name.decode("utf-8" if flags & 0x800 else "cp437")
            except UnicodeDecodeError as exc:
                raise ZipError(f"undecodable record name {raw_name[:40]!r}") from exc
            if csize == _U32_MAX or usize == _U32_MAX or offset == _U32_MAX:
                usize, csize, offset = _zip64_fields(cd[at:at + xlen], usize, csize, offset)
            if offset > last_start:
                raise ZipError(f"record {name} starts past the end of the file (truncated?)")
            if name in members:
                self.duplicates.append(name)
            members[name] = Member(name, flags, method, crc, csize, usize, offset)
        self.end_of_records = cd_offset  # where the central directory starts

    def data_offset(self, member: Member) -> int:
        """Absolute offset of ``member``'s first data byte (reads its local header)."""
        self.f.seek(member.header_offset)
        raw = self.f.read(_LOCAL.size)
        if len(raw) < _LOCAL.size or raw[:4] != b"PK\x03\x04":
            raise ZipError(f"bad local header for {member.name}")
        nlen, xlen = struct.unpack_from("<HH", raw, 26)
        start = member.header_offset + _LOCAL.size + nlen + xlen
        if start + member.compressed_size > self.size:
            raise ZipError(f"record {member.name} runs past the end of the file (truncated?)")
        return start

    def read(self, name: str, max_size: int) -> bytes:
        """A whole record's bytes, CRC-checked; at most ``max_size`` unpacked."""
        member = self.members[name]
        if member.flags & 0x1:
            raise ZipError(f"{name} is encrypted")
        if member.size > max_size:
            raise ZipError(f"{name} claims {member.size} bytes, more than {max_size}")
        self.f.seek(self.data_offset(member))
        raw = self.f.read(member.compressed_size)
        if member.method == 0:
            data = raw
        elif member.method == 8:
            try:
                inflater = zlib.decompressobj(-15)
                data = inflater.decompress(raw, member.size + 1)
            except zlib.error as exc:
                raise ZipError(f"cannot inflate {name}: {exc}") from exc
        else:
            raise ZipError(f"{name} uses unsupported compression method {member.method}")
        if len(data) != member.size:
            raise ZipError(f"{name} does not match its recorded size (damaged)")
        if zlib.crc32(data) != member.crc:
            raise ChecksumMismatch(f"{name} does not match its checksum (damaged or "
                                   "changed after it was written)", data)
        return data


def _zip64_fields(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4:pos + 4 + length]
        if tag == 1:
            values = [v for (v,) in struct.iter_unpack("<Q", body[: len(body) // 8 * 8])]
            fields = [usize, csize, offset]
            for i, field in enumerate(fields):
                if field == _U32_MAX:
                    if not values:
                        raise ZipError("ZIP64 extra field is too short")
                    fields[i] = values.pop(0)
            return fields[0], fields[1], fields[2]
        pos += 4 + length
    raise ZipError("record claims ZIP64 sizes but has no ZIP64 extra field")
