"""A DCP ``.distcp`` data file checked without its ``.metadata``.

``dcp.save``'s ``FileSystemWriter`` writes each item of a data file (a
tensor chunk, or a value) as a whole ``torch.save`` zip archive, one after
the other, and ``.metadata`` says where each lies. With ``.metadata`` gone
(``cp src/* dst/`` skips dot files; a save killed before its end), the file
is no zip of its own: read as one, its last archive's ZIP64 records point
into its first bytes. Each archive's end records say where it starts,
though: the ZIP64 locator gives the ZIP64 end record's offset from the
archive's start (or, without ZIP64, the end record gives the directory's
size and offset), so the file is walked from its end back to byte 0,
reading a few dozen bytes per item, and each archive checked as
``dcpcheck`` checks an item: its records against its bounds, their CRC-32
(on the pool), its pickle.

Items stored through a transform (compressed), or written by a writer
that does not save them as ``torch.save`` archives, neither start with a
zip header nor end with zip end records: such a file is not checked (a
note says so), never called damaged.
"""

from __future__ import annotations

import struct
from typing import IO

from ckptool.check.verify.files import CkptoolErrors, Run, stat_file
from ckptool.check.verify.problems import HEADER, PICKLE, TRUNCATED, Problem, classify
from ckptool.check.verify.zipcheck import records_of
from ckptool.describe import plural
from ckptool.read import fs
from ckptool.read.formats import torch_zip
from ckptool.read.layouts.embedded import ZIP_MAGIC, Window
from ckptool.read.ziparchive import ZipArchive, ZipError

_END = struct.Struct("<IHHHHIIH")  # end of central directory record (22 bytes)
_LOCATOR = struct.Struct("<IIQI")  # ZIP64 end of central directory locator (20 bytes)
_END64 = struct.Struct("<IQHHIIQQQQ")  # ZIP64 end of central directory record (56 bytes)
_END_SIG, _LOCATOR_SIG, _END64_SIG = 0x06054B50, 0x07064B50, 0x06064B50


def check(run: Run, name: str) -> None:
    """Data file ``name`` of a DCP directory that has no ``.metadata``: every
    archive in it found from its end and checked; what cannot be found is
    a problem when the file starts as DCP's files do, else a note."""
    size = stat_file(run, name)
    if size is None:
        return
    path = run.path(name)
    try:
        with fs.open_binary(path) as f:
            starts = _walk(run, f, name, size, f.read(4) == ZIP_MAGIC)
            for start, end in starts:
                _archive(run, f, path, name, start, end)
    except OSError as exc:
        run.add(Problem("unreadable", f"cannot read it ({exc.strerror or exc})", name))


def _walk(run: Run, f: IO[bytes], name: str, size: int,
          zipped: bool) -> list[tuple[int, int]]:
    """The ``(start, end)`` of each archive of the file, first to last, as
    far back from its end as they can be found (what stops the walk is a
    problem). ``zipped``: the file starts with a zip header, as DCP's do."""
    found: list[tuple[int, int]] = []
    end = size
    while end > 0:
        start = _start_of(f, end)
        if start is None or start >= end:
            if end == size and not zipped:
                run.note(f"{name}: its items are not torch.save archives (stored through a "
                         "transform?): not checked without .metadata")
            elif end == size:
                run.add(Problem(TRUNCATED, "no torch.save archive ends at its end, where "
                                "DCP's last item ends: the file was cut short (or its last "
                                "bytes damaged)", name))
            else:
                run.add(Problem(HEADER, f"no torch.save archive ends at byte {end}, where the "
                                f"next one starts: bytes 0..{end} are damaged ("
                                f"{plural(len(found), 'archive')} after them checked)", name))
            break
        found.append((start, end))
        end = start
    return found[::-1]


def _start_of(f: IO[bytes], end: int) -> int | None:
    """Where the archive whose last byte is ``end - 1`` starts, by its end
    records (torch writes no zip comment); None where none ends there."""
    if end < _END.size:
        return None
    f.seek(end - _END.size)
    sig, _, _, _, _, cd_size, cd_offset, comment = _END.unpack(f.read(_END.size))
    if sig != _END_SIG or comment:
        return None
    at = end - _END.size
    if at >= _LOCATOR.size + _END64.size:
        f.seek(at - _LOCATOR.size)
        lsig, _, end64, _ = _LOCATOR.unpack(f.read(_LOCATOR.size))
        if lsig == _LOCATOR_SIG:
            pos = at - _LOCATOR.size - _END64.size  # the ZIP64 record, with no extensible data
            f.seek(pos)
            fields = _END64.unpack(f.read(_END64.size))
            if fields[0] != _END64_SIG:
                return None
            start = pos - end64
            return start if start >= 0 and start + fields[9] + fields[8] == pos else None
    start = at - cd_size - cd_offset
    return start if start >= 0 else None


def _archive(run: Run, f: IO[bytes], path: str, name: str, start: int, end: int) -> None:
    """One item's archive checked as ``dcpcheck`` checks an item."""
    where = f"its archive at bytes {start}..{end}: "
    f.seek(start)
    head = f.read(4)
    if head != ZIP_MAGIC:
        run.add(Problem(HEADER, f"{where}no zip header starts there (it starts with "
                        f"{head!r}): the archive's first bytes are damaged", name))
        return
    try:
        archive = ZipArchive(Window(f, start, end - start), end - start)  # type: ignore[arg-type]
    except ZipError as exc:
        run.add(Problem(classify(str(exc), HEADER), f"{where}its zip directory is damaged "
                        f"({exc})", name))
        return
    found = records_of(archive, start, name, None, where)
    run.add(*found.problems)
    run.pool.checked += found.checked
    run.pool.submit(path, name, found.records, (None, where))
    try:
        torch_zip.read_archive(archive)
    except CkptoolErrors as exc:
        if "checksum" not in exc.message or found.unrecorded:  # else: the CRC says it
            run.add(Problem(classify(exc.message, PICKLE), f"{where}{exc.message}", name))
