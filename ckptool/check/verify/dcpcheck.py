"""A ``torch.distributed.checkpoint`` directory against its ``.metadata``,
every disagreement listed: each data file the items name exists and holds
their byte ranges, items do not overlap, each item is the ``torch.save``
archive ``.metadata`` says (a tensor chunk of the shape and dtype it
gives; a value whose pickle parses), every record of every item matches
its CRC-32, each tensor's chunks cover it exactly once, and no ``.distcp``
file is left that nothing names.

Each item is a whole ``torch.save`` zip, so DCP's tensor bytes do carry a
CRC-32 per chunk: a flipped byte is found here, in the item that holds it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import IO

from ckptool import dtypes
from ckptool.check.verify.files import (
    CkptoolErrors,
    Run,
    check_file,
    lexists,
    local,
    read_alone,
    stat_file,
)
from ckptool.check.verify.problems import (
    BOUNDS,
    EXTRA_FILE,
    GAP,
    HEADER,
    MISMATCH,
    MISSING_FILE,
    OVERLAP,
    PICKLE,
    SIZE,
    TRUNCATED,
    UNREADABLE,
    Problem,
    classify,
)
from ckptool.check.verify.zipcheck import records_of
from ckptool.describe import plural
from ckptool.errors import CorruptCheckpointError
from ckptool.read import fs
from ckptool.read.formats import torch_zip
from ckptool.read.layouts import dcp_metadata
from ckptool.read.layouts.base import member
from ckptool.read.layouts.dcp_metadata import Item, Metadata
from ckptool.read.layouts.embedded import ZIP_MAGIC, Window
from ckptool.read.layouts.recognise import Layout
from ckptool.read.seen import GlobalsSeen
from ckptool.read.tensors import TensorRecord
from ckptool.read.values import brief
from ckptool.read.ziparchive import ZipArchive, ZipError


@dataclass(frozen=True)
class Piece:
    """One item to check: a tensor's chunk (``sizes`` set) or a value."""

    fqn: str
    item: Item
    offsets: tuple[int, ...] | None = None
    sizes: tuple[int, ...] | None = None
    dtype: str | None = None

    @property
    def where(self) -> str:
        what = f"its chunk at {list(self.offsets)}" if self.offsets is not None else "its value"
        end = self.item.offset + self.item.length
        return f"{what} (bytes {self.item.offset}..{end}): "


def check(run: Run, layout: Layout) -> int | None:
    """Every check of a DCP directory; the number of tensors it describes
    (None when a ``.metadata`` could not be read)."""
    metas = _metadata(run, layout)
    pieces, tensors = _merge(run, metas)
    for name in layout.extras:  # Lightning's meta.pt
        if check_file(run, name):
            read_alone(run, name)
    by_file: dict[str, list[Piece]] = {}
    for piece in pieces:
        by_file.setdefault(piece.item.file, []).append(piece)
    named_by = layout.metadata[0] if layout.metadata else ".metadata"
    for file, items in sorted(by_file.items()):
        _data_file(run, file, items, named_by)
    if len(metas) < len(layout.metadata):  # an unread one may name other files
        run.note("the data files no readable .metadata names are not checked")
        return None
    _extra_files(run, layout, set(by_file))
    return tensors


def _metadata(run: Run, layout: Layout) -> list[tuple[str, Metadata]]:
    out = []
    for name in layout.metadata:
        if stat_file(run, name) is None:
            continue
        try:
            md = dcp_metadata.parse(layout.directory, name, GlobalsSeen())
        except CkptoolErrors as exc:
            message = local(exc.message, run.path(name), name)
            run.add(Problem(classify(message, PICKLE), message, name))
            continue
        if md.other is not None:
            run.add(Problem(HEADER, f"holds {brief(md.other)}, not a "
                            "torch.distributed.checkpoint Metadata", name))
            continue
        out.append((name, md))
    return out


def _merge(run: Run, metas: list[tuple[str, Metadata]]) -> tuple[list[Piece], int]:
    """Every item of every ``.metadata`` (a chunk several name, once), each
    tensor's chunks checked to cover it; and the number of tensors."""
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    said_by: dict[str, str] = {}  # tensor -> the .metadata that first describes it
    boxes: dict[str, dict[tuple[int, ...], Piece]] = {}
    values: dict[str, Piece] = {}
    for name, md in metas:
        for fqn, tm in md.tensors.items():
            have = shapes.setdefault(fqn, (tm.shape, tm.dtype))
            said_by.setdefault(fqn, name)
            if have != (tm.shape, tm.dtype):
                run.add(Problem(MISMATCH, f"{list(tm.shape)} {tm.dtype} here, "
                                f"{list(have[0])} {have[1]} in another .metadata", name, fqn))
                continue
            for offsets, sizes, item in tm.boxes:
                boxes.setdefault(fqn, {}).setdefault(
                    offsets, Piece(fqn, item, offsets, sizes, tm.dtype))
        for fqn, item in md.values.items():
            values.setdefault(fqn, Piece(fqn, item))
    for fqn, (shape, dtype) in shapes.items():
        chunks = list(boxes.get(fqn, {}).values())
        problem = dcp_metadata.check_cover(shape, [(c.offsets or (), c.sizes or ())
                                                   for c in chunks])
        if problem:
            kind = BOUNDS if "outside" in problem else OVERLAP if "both hold" in problem \
                else GAP
            run.add(Problem(kind, f"its chunks do not make it whole: {problem}",
                            said_by[fqn], fqn))
        itemsize = dtypes.itemsize(dtype)
        for c in chunks:
            need = math.prod(c.sizes or ()) * itemsize
            if need and not c.item.transforms and c.item.length < need:
                run.add(Problem(SIZE, f"{c.where}its item is {c.item.length} bytes, but "
                                f"{list(c.sizes or ())} {dtype} takes {need}", c.item.file, fqn))
    pieces = [p for chunks in boxes.values() for p in chunks.values()] + list(values.values())
    return pieces, len(shapes)


def _data_file(run: Run, file: str, pieces: list[Piece], named_by: str) -> None:
    try:
        member(run.directory, file, named_by)
    except CorruptCheckpointError as exc:
        run.add(Problem(HEADER, exc.message, named_by))
        return
    if not lexists(run.path(file)):
        run.add(Problem(MISSING_FILE, f"the file is missing; {named_by} puts "
                        f"{plural(len(pieces), 'item')} in it (the first: {pieces[0].fqn})",
                        file))
        return
    size = stat_file(run, file, named_by)
    if size is None:
        return
    pieces.sort(key=lambda p: (p.item.offset, p.item.length))
    past = [p for p in pieces if p.item.offset + p.item.length > size]
    if past:
        run.add(Problem(TRUNCATED, f"the file is {size} bytes long, but "
                        f"{plural(len(past), 'item')} of .metadata lie past its end (the first: "
                        f"{past[0].fqn}, bytes {past[0].item.offset}.."
                        f"{past[0].item.offset + past[0].item.length})", file, past[0].fqn))
    end, last = 0, None
    for p in pieces:
        if p.item.length and p.item.offset < end and last is not None:
            run.add(Problem(BOUNDS, f"{p.where}overlaps the item of {last.fqn}", file, p.fqn))
        if p.item.length:
            end, last = max(end, p.item.offset + p.item.length), p
    transformed = 0
    path, cut = run.path(file), {id(p) for p in past}
    try:
        with fs.open_binary(path) as f:
            for p in pieces:
                if id(p) in cut or not p.item.length:
                    continue
                if p.item.transforms:
                    transformed += 1
                    continue
                _item(run, f, path, file, p)
    except OSError as exc:
        run.add(Problem(UNREADABLE, f"cannot read it ({exc.strerror or exc})", file))
    if transformed:
        run.note(f"{file}: {plural(transformed, 'item')} stored through a transform "
                 "(compressed) are not checked: ckptool does not undo them yet")


def _item(run: Run, f: IO[bytes], path: str, file: str, p: Piece) -> None:
    start, length = p.item.offset, p.item.length
    f.seek(start)
    head = f.read(4)
    if head != ZIP_MAGIC:
        run.add(Problem(MISMATCH, f"{p.where}no torch.save archive starts there (it starts "
                        f"with {head!r}): .metadata does not match the file", file, p.fqn))
        return
    try:
        archive = ZipArchive(Window(f, start, length), length)  # type: ignore[arg-type]
    except ZipError as exc:
        run.add(Problem(classify(str(exc), HEADER), f"{p.where}its archive is damaged ({exc})",
                        file, p.fqn))
        return
    found = records_of(archive, start, file, p.fqn, p.where)
    run.add(*found.problems)
    run.pool.checked += found.checked
    run.pool.submit(path, file, found.records, (p.fqn, p.where))
    try:
        raw = torch_zip.read_archive(archive)
    except CkptoolErrors as exc:
        if "checksum" not in exc.message or found.unrecorded:  # else: the CRC says it
            run.add(Problem(classify(exc.message, PICKLE), f"{p.where}{exc.message}", file,
                            p.fqn))
        return
    if p.sizes is None:
        return
    rec = raw.root
    if not isinstance(rec, TensorRecord) or rec.storage is None:
        run.add(Problem(MISMATCH, f"{p.where}the archive holds {brief(rec)}, not a tensor",
                        file, p.fqn))
    elif (rec.shape, rec.dtype) != (p.sizes, p.dtype):
        run.add(Problem(MISMATCH, f"{p.where}the archive holds a {list(rec.shape)} "
                        f"{rec.dtype} tensor, .metadata says {list(p.sizes)} {p.dtype} (a chunk "
                        "moved, or the file was replaced)", file, p.fqn))


def _extra_files(run: Run, layout: Layout, named: set[str]) -> None:
    """``.distcp`` files beside the ``.metadata`` that no item names."""
    for folder in sorted({os.path.dirname(m) for m in layout.metadata}):
        try:
            names = sorted(fs.listdir(run.path(folder) if folder else run.directory or "."))
        except OSError:
            continue
        for name in names:
            rel = os.path.join(folder, name) if folder else name
            if name.endswith(".distcp") and rel not in named and fs.isfile(run.path(rel)):
                run.add(Problem(EXTRA_FILE, "a data file that no .metadata names (left by "
                                "another save, or renamed)", rel))
                run.sizes[rel] = fs.getsize(run.path(rel))
