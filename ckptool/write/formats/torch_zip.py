"""The layout of a torch zip (``torch.save``'s format): a rewritten one,
storage records first and page-congruent, or a new one from a state dict.

A rewrite puts the kept storage records first. Each run of records that lie
back to back in the input is one ``Span``, their local headers and data
descriptors included, at an offset congruent with its input offset modulo
the page size (from 1 MiB up), so the kernel copies whole pages
(``ckptool.write.copy``); the first record of a run gets a local header of
its own, padded to land there. A storage cast by ``--dtype`` is ``Made``
alone, its descriptor made after it (it needs the CRC). The layout depends
only on which records are kept, so the copy can start before the pickle is
read. ``data.pkl`` and the small records follow the storages (``Tail``),
once the pickle is ready. The central directory keeps the input's order,
so ``data.pkl`` is still the first entry, where torch takes the archive's
root folder from; zip readers find records through the directory, not by
their position.
"""

from __future__ import annotations

import functools
import io
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.read.formats.torch_zip import read_archive
from ckptool.read.ziparchive import Member, ZipArchive, ZipError
from ckptool.write import verify
from ckptool.write.fix.plan import Plan
from ckptool.write.layout import (
    CONGRUENT_MIN,
    Check,
    Data,
    Layout,
    Made,
    Segment,
    Span,
    input_segments,
    read_at,
)
from ckptool.write.zipwriter import ALIGNMENT, Written, ZipWriter, descriptor, local_header

Cast = tuple[int, Callable[[], bytes]]  # a record's size once cast, and its bytes


@dataclass
class Piece:
    """One storage record of the output."""

    key: str  # the storage key: the record is <root>/data/<key>
    name: str
    header: int  # output offset of its local header
    data: int  # output offset of its first byte
    size: int
    flags: int  # for the central directory, as its local header has them
    copied_crc: int = 0  # a copied record's CRC, from the input's directory
    made: Made | None = None  # a cast record's bytes: its CRC once made

    @property
    def crc(self) -> int:
        if self.made is None:
            return self.copied_crc
        return self.made.crc or 0


@dataclass
class Storages:
    """The storage records of a rewritten zip: what to write, and where each lands."""

    segments: list[Segment]
    pieces: list[Piece]
    end: int  # where the records after the storages start


def storage_members(archive: ZipArchive, prefix: str) -> dict[str, Member]:
    """The archive's storage records, by storage key."""
    folder = f"{prefix}data/"
    return {name[len(folder):]: m for name, m in archive.members.items()
            if name.startswith(folder) and len(name) > len(folder)}


def lay_out_storages(fd: int, archive: ZipArchive, members: dict[str, Member],
                     casts: dict[str, Cast]) -> Storages:
    """Where each kept record goes: ``members`` (by storage key) in their
    input order; ``casts`` gives the records written cast."""
    out = Storages([], [], 0)
    pos = 0
    for group in _group(fd, archive, members, casts):
        (key, member, src, _), *rest = group
        end = rest[-1][2] + rest[-1][1].size if rest else src + member.size
        congruent = src if (key not in casts and src % ALIGNMENT == 0
                            and end - src >= CONGRUENT_MIN) else None
        header = local_header(member.name.encode(), pos, congruent)
        out.segments.append(Data(pos, header, f"storage {key}'s local header"))
        first = Piece(key, member.name, pos, pos + len(header), member.size, 0x0808,
                      member.crc)
        out.pieces.append(first)
        if key in casts:
            size, make = casts[key]
            first.size = size
            first.made = Made(first.data, size, f"storage {key}", make)
            tail_at = first.data + size
            made = first.made
            out.segments += [made, Made(tail_at, len(descriptor(0, size)),
                                        f"storage {key}'s data descriptor",
                                        functools.partial(_descriptor_after, made))]
            pos = tail_at + len(descriptor(0, size))
            continue
        delta = first.data - src
        checks: list[Check] = [(f"storage {key}", first.data, member.size, member.crc)]
        last, last_src = first, src
        for key, member, src, gap in rest:
            # the bytes between two records (a descriptor, then the next local
            # header) are copied as they are, and checked like the rest
            checks.append((f"storage {key}'s local header", last_src + last.size + delta,
                           len(gap), zlib.crc32(gap)))
            last = Piece(key, member.name, member.header_offset + delta, src + delta,
                         member.size, member.flags, member.crc)
            out.pieces.append(last)
            checks.append((f"storage {key}", last.data, member.size, member.crc))
            last_src = src
        src_start = first.data - delta
        out.segments += input_segments(fd, first.data, src_start,
                                       last_src + last.size - src_start,
                                       f"storage {first.key}", checks)
        trailer = descriptor(last.crc, last.size)
        out.segments.append(Data(last.data + last.size, trailer,
                                 f"storage {last.key}'s data descriptor"))
        pos = last.data + last.size + len(trailer)
    out.end = pos
    return out


def _descriptor_after(made: Made) -> bytes:
    """The data descriptor of a record whose bytes were just made."""
    assert made.crc is not None, "made before its descriptor"
    return descriptor(made.crc, made.size)


Group = list[tuple[str, Member, int, bytes]]  # (key, member, input data offset, gap before)


def _group(fd: int, archive: ZipArchive, members: dict[str, Member],
           casts: dict[str, Cast]) -> list[Group]:
    """Kept records in input order, in groups written in one go: a cast
    record alone, or records that follow each other in the input."""
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


def _gap_after(fd: int, prev: Member, prev_src: int, member: Member, src: int) -> bytes | None:
    """The input bytes between ``prev``'s data and ``member``'s when ``member``
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
            gap = read_at(fd, src - prev_end, prev_end)
            if gap[:len(desc)] == desc:
                return gap
    return None


class Tail:
    """The records after the storages: the new ``data.pkl``, the input's
    small records, the central directory. Made once the storages are
    written (the directory needs a cast record's CRC); its size does not
    depend on CRCs, so it is laid out now."""

    def __init__(self, archive: ZipArchive, prefix: str, pickled: bytes,
                 pieces: list[Piece], end: int) -> None:
        self.archive, self.prefix, self.pickled = archive, prefix, pickled
        self.pieces, self.end = pieces, end
        self.records: list[Written] = []
        self.segment = Made(end, len(self._build()), "records after the storages",
                            self._build)

    def _build(self) -> bytes:
        buf = io.BytesIO()
        writer = ZipWriter(buf, start=self.end)
        for piece in self.pieces:
            writer.add_existing(piece.name, piece.header, piece.size, piece.crc, piece.flags,
                                piece.data)
        storage_names = {p.name for p in self.pieces}
        # the small records as they are; never a pickle but data.pkl, written anew
        others = sorted((m for m in self.archive.members.values()
                         if m.name not in storage_names
                         and not m.name.startswith(f"{self.prefix}data/")
                         and (not m.name.lower().endswith(".pkl")
                              or m.name == f"{self.prefix}data.pkl")),
                        key=lambda m: m.header_offset)
        for member in others:
            if member.name == f"{self.prefix}data.pkl":
                writer.write_bytes(member.name, self.pickled)
                continue
            try:
                writer.write_bytes(member.name, self.archive.read(member.name, 1 << 20))
            except ZipError as exc:
                raise CorruptCheckpointError(f"cannot copy {member.name}: {exc}",
                                             "the file is damaged; nothing was written") from exc
        # the directory lists records in the input's order: data.pkl first, as
        # torch takes the archive's root folder from its first entry
        rank = {name: i for i, name in enumerate(self.archive.members)}
        writer.records.sort(key=lambda r: rank[r.name])
        writer.close()
        self.records = writer.records
        return buf.getvalue()


def check_planned(archive: ZipArchive, prefix: str, pickled: bytes, pieces: list[Piece],
                  plan: Plan) -> None:
    """Read the output's pickle back as torch will, from the bytes about to be
    written, and compare every tensor with the plan (``verify.check_tensors``)."""
    try:
        written = read_archive(_PlannedArchive(archive, prefix, pickled, pieces))
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"the output does not read back: {exc.message}",
                                     "nothing was written; report this as a bug") from exc
    verify.check_tensors(written, plan)


class _PlannedArchive:
    """The output archive as planned, for ``read_archive`` to read back before
    its directory is written: the new pickle from memory, the small records
    from the input, storage records' sizes from the layout."""

    def __init__(self, source: ZipArchive, prefix: str, pickled: bytes,
                 pieces: list[Piece]) -> None:
        self.source = source
        self.pickle_name = f"{prefix}data.pkl"
        self.pickled = pickled
        self.members: dict[str, Member] = {
            name: m for name, m in source.members.items()
            if not name.startswith(f"{prefix}data/")}
        self.members[self.pickle_name] = Member(self.pickle_name, 0x0808, 0,
                                                zlib.crc32(pickled), len(pickled),
                                                len(pickled), -1)
        for piece in pieces:
            self.members[piece.name] = Member(piece.name, piece.flags, 0, piece.crc,
                                              piece.size, piece.size, piece.header)

    def read(self, name: str, max_size: int) -> bytes:
        if name == self.pickle_name:
            return self.pickled
        return self.source.read(name, max_size)


class NewArchive:
    """The layout of a torch zip written from nothing (``convert`` to torch):
    records one after another as ``torch.save`` orders them, then the
    directory, made last (a record's CRC is known once it is copied)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.layout = Layout()
        self.pos = 0
        # name, header offset, data offset, size, where its CRC comes from
        self._records: list[tuple[str, int, int, int, Data | Span | Made]] = []

    def add_bytes(self, name: str, data: bytes) -> None:
        self.add(name, len(data), lambda at: Data(at, data, f"{self.root}/{name}"))

    def add(self, name: str, size: int,
            segment_at: Callable[[int], Data | Span | Made]) -> Data | Span | Made:
        """A record of ``size`` bytes whose bytes ``segment_at(offset)`` gives;
        returns that segment."""
        full = f"{self.root}/{name}"
        header = local_header(full.encode(), self.pos)
        self.layout.add(Data(self.pos, header, f"{full}'s local header"))
        segment = segment_at(self.pos + len(header))
        self.layout.add(segment)
        self._records.append((full, self.pos, segment.at, size, segment))
        after = segment.at + size
        self.layout.add(Made(after, len(descriptor(0, size)), f"{full}'s data descriptor",
                             lambda: descriptor(self._crc(segment), size)))
        self.pos = after + len(descriptor(0, size))
        return segment

    @staticmethod
    def _crc(segment: Data | Span | Made) -> int:
        crc = segment.crc
        assert crc is not None, "a record's CRC is known once it is written"
        return crc

    def records(self, crcs: bool = True) -> list[Written]:
        """The records written (their CRCs are known once they are copied;
        without ``crcs``, zeros: the directory's size does not depend on them)."""
        return [Written(name, offset, size, self._crc(seg) if crcs else 0, data_offset=data)
                for name, offset, data, size, seg in self._records]

    def close(self) -> Layout:
        """The layout, ended by the central directory."""
        start = self.pos
        size = len(_directory(self.records(crcs=False), start))
        self.layout.add(Made(start, size, "the zip directory",
                             lambda: _directory(self.records(), start), final=True))
        return self.layout


def _directory(records: list[Written], start: int) -> bytes:
    buf = io.BytesIO()
    writer = ZipWriter(buf, start=start)
    writer.records = records
    writer.close()
    return buf.getvalue()
