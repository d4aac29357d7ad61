"""Zip archives checked against themselves: the central directory against
the file, each record's local header and data inside the file, and every
stored record's CRC-32 (torch's loader never checks it), computed in
parallel by a ``CrcPool``.

A torch file is one archive; a DCP ``.distcp`` file is one archive per item
(``base`` is where the item starts). No record's bytes are read here except
by the CRC, through ``ckptool.write.fastcrc``'s ``mmap`` windows (libdeflate
where the system has it): records are grouped into units of about
``UNIT`` bytes, so that a large file keeps several threads busy and a
checkpoint of many files all of them.
"""

from __future__ import annotations

import os
import struct
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO

from ckptool.check.verify.problems import BOUNDS, CRC, HEADER, SIZE, Problem, classify
from ckptool.describe import human_bytes
from ckptool.errors import InputError
from ckptool.read import fs
from ckptool.read.remote import stream
from ckptool.read.ziparchive import ChecksumMismatch, Member, ZipArchive, ZipError
from ckptool.write.fastcrc import crc_file_ranges

UNIT = 256 << 20  # bytes of records one thread checks at a time
MAX_DEFLATED = 256 << 20  # a compressed record is inflated whole to check it
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_U32_MAX = 0xFFFFFFFF


@dataclass(frozen=True)
class Record:
    """A stored record's data: where it lies in its file, and its CRC-32."""

    name: str
    offset: int  # absolute, in the file
    size: int
    crc: int


@dataclass
class Records:
    """What an archive's directory says of its records, once checked."""

    records: list[Record] = field(default_factory=list)  # stored records, to CRC
    problems: list[Problem] = field(default_factory=list)
    checked: int = 0  # bytes of compressed records checked while reading them
    unrecorded: bool = False  # every CRC is 0: saved with compute_crc32=False


def open_zip(f: IO[bytes], size: int, file: str) -> tuple[ZipArchive | None, list[Problem]]:
    """The archive of a whole file, or the problem its directory has."""
    try:
        return ZipArchive(f, size), []
    except ZipError as exc:
        return None, [Problem(classify(str(exc), HEADER), f"zip directory: {exc}", file)]


def records_of(archive: ZipArchive, base: int, file: str, tensor: str | None = None,
               where: str = "") -> Records:
    """Every record of ``archive`` (which starts at ``base`` in ``file``)
    checked against the archive's bounds; the stored ones listed for their
    CRC. ``tensor`` and ``where`` ("its chunk at [0, 0]: ") name what the
    archive holds in each problem."""
    out = Records()
    _prefetch(archive)
    for name in archive.duplicates:
        out.problems.append(Problem(HEADER, f"{where}the zip directory names {name} twice",
                                    file, tensor))
    for m in archive.members.values():
        if m.flags & 0x1:
            out.problems.append(Problem(HEADER, f"{where}record {m.name} is encrypted", file,
                                        tensor))
            continue
        try:
            start = _local_header(archive, m)
        except ZipError as exc:
            out.problems.append(Problem(classify(str(exc), HEADER), f"{where}{exc}", file,
                                        tensor))
            continue
        if start + m.compressed_size > archive.end_of_records:
            out.problems.append(Problem(
                BOUNDS, f"{where}record {m.name} runs into the zip directory (its data ends at "
                f"byte {base + start + m.compressed_size}, the directory starts at "
                f"{base + archive.end_of_records})", file, tensor))
        elif m.method == 0:
            if m.compressed_size != m.size:
                out.problems.append(Problem(
                    SIZE, f"{where}record {m.name} is stored in {m.compressed_size} bytes but "
                    f"claims {m.size}", file, tensor))
            else:
                out.records.append(Record(m.name, base + start, m.size, m.crc))
        else:
            out.problems += _inflated(archive, m.name, m.compressed_size, file, tensor, where)
            out.checked += m.compressed_size
    if out.records and all(r.crc == 0 for r in out.records if r.size):
        out.unrecorded = any(r.size for r in out.records)
        out.records = [] if out.unrecorded else out.records
    return out


def _local_header(archive: ZipArchive, m: Member) -> int:
    """Where ``m``'s data starts, from its local header, which must agree
    with the zip directory (its name; its CRC-32 and sizes, given there or
    in the data descriptor after the data, as torch writes them): a byte
    changed in either copy is found here, where no reader looks."""
    f = archive.f
    exact = _exact_reads(f)
    if exact is not None:  # a URL: the header's bytes alone, not 64 KiB of tensor bytes
        raw = exact.read(m.header_offset, _LOCAL.size + _NAME)
        named = raw[_LOCAL.size:]
        raw = raw[:_LOCAL.size]
    else:
        f.seek(m.header_offset)
        raw = f.read(_LOCAL.size)
    if len(raw) < _LOCAL.size or raw[:4] != b"PK\x03\x04":
        raise ZipError(f"bad local header for {m.name}")
    _, _, flags, method, _, _, crc, csize, usize, nlen, xlen = _LOCAL.unpack(raw)
    if exact is not None:
        named = named[:nlen] if nlen <= len(named) else exact.read(
            m.header_offset + _LOCAL.size, nlen)
    else:
        named = f.read(nlen)
    start = m.header_offset + _LOCAL.size + nlen + xlen
    if start + m.compressed_size > archive.size:
        raise ZipError(f"record {m.name} runs past the end of the file (truncated?)")
    if named != m.name.encode("utf-8" if m.flags & 0x800 else "cp437", "replace") \
            or method != m.method:
        raise ZipError(f"record {m.name}'s local header does not match the zip directory "
                       f"(it names {named[:60]!r}, method {method})")
    if flags & 0x8:  # a data descriptor after the data: [signature] CRC-32, sizes
        if exact is not None:  # (with the next record's local header, which follows it)
            tail = exact.read(start + m.compressed_size, 24, _LOCAL.size + _NAME)[:24]
        else:
            f.seek(start + m.compressed_size)
            tail = f.read(24)
        tail = tail[4:] if tail[:4] == b"PK\x07\x08" else tail
        fields = [struct.unpack_from("<III", tail)] if len(tail) >= 12 else []
        fields += [struct.unpack_from("<IQQ", tail)] if len(tail) >= 20 else []
        if (m.crc, m.compressed_size, m.size) not in fields:
            raise ZipError(f"record {m.name}'s data descriptor does not match the zip "
                           "directory (its CRC-32 or sizes)")
    elif any(local not in (central, _U32_MAX) for local, central in (
            (crc, m.crc), (csize, m.compressed_size), (usize, m.size))):
        raise ZipError(f"record {m.name}'s local header does not match the zip directory "
                       "(its CRC-32 or sizes)")
    return start


_NAME = 256  # bytes of a record's name read with its local header (a URL)
PREFETCH_WORKERS = 8


class _Exact:
    """A remote file's small reads, each exactly its range (one request),
    the last one kept: a record's data descriptor and the next record's
    local header come in one request. ``prefetch`` asks for many ranges at
    once (``PREFETCH_WORKERS`` in flight) and keeps them, so that a file of
    thousands of records is not checked one round trip after another."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.at, self.data = -1, b""
        self.kept: dict[int, bytes] = {}

    def read(self, offset: int, n: int, ahead: int = 0) -> bytes:
        kept = self.kept.get(offset)
        if kept is not None and n <= len(kept):
            return kept[:n]
        if not (self.at <= offset and offset + n <= self.at + len(self.data)):
            self.at, self.data = offset, stream.exact(self.f, offset, n + ahead)
        return self.data[offset - self.at:offset - self.at + n]

    def prefetch(self, ranges: list[tuple[int, int]]) -> None:
        """Fetch these (offset, size) ranges at once; failures are left for
        the read that follows to meet and say."""
        wanted = [(o, n) for o, n in ranges if o not in self.kept]
        if len(wanted) < 2:
            return

        def one(r: tuple[int, int]) -> None:
            try:
                self.kept[r[0]] = stream.exact(self.f, r[0], r[1])
            except (OSError, InputError):
                return  # (said by the read that follows, in order)

        with ThreadPoolExecutor(min(PREFETCH_WORKERS, len(wanted))) as pool:
            list(pool.map(one, wanted))


def _prefetch(archive: ZipArchive) -> None:
    """For a remote archive: every record's local header at once, then every
    data descriptor after a record (where the headers place them) at once."""
    exact = _exact_reads(archive.f)
    if exact is None:
        return
    members = [m for m in archive.members.values() if not m.flags & 0x1]
    exact.prefetch([(m.header_offset, _LOCAL.size + _NAME) for m in members])
    tails = []
    for m in members:
        raw = exact.kept.get(m.header_offset, b"")
        if len(raw) >= _LOCAL.size and raw[:4] == b"PK\x03\x04":
            fields = _LOCAL.unpack(raw[:_LOCAL.size])
            if fields[2] & 0x8:
                tails.append((m.header_offset + _LOCAL.size + fields[9] + fields[10]
                              + m.compressed_size, 24))
    exact.prefetch(tails)


_exact: weakref.WeakKeyDictionary[IO[bytes], _Exact] = weakref.WeakKeyDictionary()


def _exact_reads(f: IO[bytes]) -> _Exact | None:
    """Exact reads of ``f`` when it is remote; None for a local file."""
    if not fs.is_remote(getattr(f, "url", None)):
        return None
    if f not in _exact:
        _exact[f] = _Exact(f)
    return _exact[f]


def _inflated(archive: ZipArchive, name: str, size: int, file: str, tensor: str | None,
              where: str) -> list[Problem]:
    """A compressed record (torch never writes one; a rewritten archive
    may) inflated and checked whole."""
    if size > MAX_DEFLATED:
        return []
    try:
        archive.read(name, MAX_DEFLATED)
    except ChecksumMismatch:
        return [Problem(CRC, f"{where}record {name} (compressed) does not match its CRC-32",
                        file, tensor)]
    except ZipError as exc:
        return [Problem(classify(str(exc), HEADER), f"{where}{exc}", file, tensor)]
    return []


@dataclass(frozen=True)
class Failure:
    """A record whose CRC-32 is not the one recorded (or that could not be read)."""

    file: str
    record: Record
    label: object  # what the caller gave with the records (a DCP item's tensor...)
    error: str | None = None  # the OSError, when the bytes could not be read


class CrcPool:
    """CRC-32 of records of many files on ``jobs`` threads: ``submit`` as
    each file's directory is read (the threads work while the next file is
    parsed), then ``failures``."""

    def __init__(self, jobs: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=max(1, jobs),
                                            thread_name_prefix="ckptool-crc")
        self._futures: list[tuple[Future[list[Failure]], int]] = []
        self.checked = 0  # bytes submitted
        # a remote file's records: read only by verify --full (``remotebytes``), with the
        # rest of the file, in one pass
        self.deferred: dict[str, list[tuple[str, Record, object]]] = {}

    def submit(self, path: str, file: str, records: list[Record], label: object = None) -> None:
        if fs.is_remote(path) and fs.located(path)[0] == path:  # (a local archive's: now)
            self.deferred.setdefault(path, []).extend((file, r, label) for r in records)
            return
        unit: list[Record] = []
        size = 0
        for r in sorted(records, key=lambda r: r.offset):
            unit.append(r)
            size += r.size
            if size >= UNIT:
                self._send(path, file, unit, label)
                unit, size = [], 0
        if unit:
            self._send(path, file, unit, label)

    def _send(self, path: str, file: str, unit: list[Record], label: object) -> None:
        size = sum(r.size for r in unit)
        self.checked += size
        self._futures.append((self._executor.submit(_check, path, file, unit, label), size))

    def failures(self, done: Callable[[int], None] | None = None) -> list[Failure]:
        """Every failure, once all units are checked; ``done(n)`` after each
        unit, with the bytes it checked."""
        out: list[Failure] = []
        for future, size in self._futures:
            out += future.result()
            if done is not None:
                done(size)
        return out

    def close(self) -> None:
        """Stop the threads (units not started are dropped: an error or a
        Ctrl-C ended the run)."""
        self._executor.shutdown(wait=True, cancel_futures=True)


def _check(path: str, file: str, unit: list[Record], label: object) -> list[Failure]:
    try:
        real, base = fs.located(path)  # (a member of a .nemo: a range of it)
        fd = os.open(real, os.O_RDONLY)
    except OSError as exc:
        return [Failure(file, unit[0], label, exc.strerror or str(exc))]
    try:
        crcs = crc_file_ranges(fd, [(base + r.offset, r.size) for r in unit])
    except OSError as exc:  # shorter than when its directory was read, or unreadable
        return [Failure(file, unit[0], label, exc.strerror or str(exc))]
    finally:
        os.close(fd)
    return [Failure(file, r, label) for r, crc in zip(unit, crcs, strict=True) if crc != r.crc]


def failure_text(f: Failure) -> str:
    """What is wrong with a failed record, without the tensors it holds."""
    r = f.record
    if f.error is not None:
        return f"record {r.name} could not be read for its CRC-32 ({f.error})"
    return (f"record {r.name} ({human_bytes(r.size)} at byte {r.offset}) does not match its "
            "CRC-32: its bytes changed after they were written")
