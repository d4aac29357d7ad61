"""Writing the files of a distributed convert: each rank its units, at
their offsets, into the staging directory's files; rank 0 what needs every
unit (a zip directory, from every record's CRC), then the checks.

A rank lays each file it writes into out exactly as ``convert`` lays it out
in one process (``ckptool.write.convert.files``), with the tensors of other
ranks' units as placeholders of their size (never made): so every offset,
header and record is the one-process file's, byte for byte. Of the layout's
segments it writes those of its units, in batches of about ``BATCH`` bytes,
through the one-process pipeline (``copy.write_checked``: every byte
re-read and CRC-checked); after each batch it appends the units, with the
ranges they cover and their CRCs, to its manifest. A re-run checks those
ranges again and keeps the units whose bytes still match.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptool import dtypes
from ckptool.errors import CorruptCheckpointError
from ckptool.model import TensorInfo
from ckptool.write import copy
from ckptool.write.convert.files import FileLayout, lay_out_safetensors, lay_out_torch
from ckptool.write.distributed.plan import OutFile, Plan, Unit
from ckptool.write.distributed.staging import Staging
from ckptool.write.fastcrc import crc_file_ranges
from ckptool.write.layout import Data, Made, Segment, Span
from ckptool.write.sources import TensorSource

# bytes of units written between two manifest records: a sixteenth of a
# rank's share, within these bounds (a resumed run redoes at most one batch)
BATCH, MIN_BATCH = 256 << 20, 4 << 20
_BUG = "this is a bug in ckptool; nothing was committed"
Progress = Callable[[int], None]  # bytes written by this rank so far


@dataclass
class Laid:
    """One output file laid out on this rank: its layout, and the unit each
    segment belongs to (None: made last, by rank 0)."""

    file: FileLayout
    owners: list[str | None]
    tensors: dict[int, str]  # id of a tensor's segment -> the unit (tensor) it holds


def lay_out(f: OutFile, tensors: TensorSource, mine: set[str]) -> Laid:
    """``f`` laid out, the tensors of ``mine`` from the input, the rest placeholders."""
    tagged: dict[int, str] = {}
    names = {f"tensor {n}": n for n in f.written.tensors}

    def segments_at(t: TensorInfo, dtype: str, at: int, name: str) -> list[Segment]:
        unit = names[name]
        segments: list[Segment] = tensors.segments(t, dtype, at, name) if unit in mine \
            else [_placeholder(t, dtype, at, name)]
        tagged.update((id(s), unit) for s in segments)
        return segments

    def single_at(t: TensorInfo, dtype: str, at: int, name: str) -> Segment:
        return segments_at(t, dtype, at, name)[0] if names[name] not in mine else \
            _tag(tagged, tensors.single(t, dtype, at, name), names[name])

    if f.meta is not None:
        laid = lay_out_safetensors(f.written, f.meta, segments_at)
    else:
        laid = lay_out_torch(f.written, single_at, os.path.splitext(f.name)[0])
    owners: list[str | None] = []
    current = next(iter(f.written.tensors), None)  # a header goes with the first unit
    for segment in laid.layout.segments:
        if isinstance(segment, Made) and segment.final:
            owners.append(None)
            continue
        current = tagged.get(id(segment), current)
        owners.append(current)
    return Laid(laid, owners, tagged)


def _tag(tagged: dict[int, str], segment: Segment, unit: str) -> Segment:
    tagged[id(segment)] = unit
    return segment


def _placeholder(t: TensorInfo, dtype: str, at: int, name: str) -> Made:
    def never() -> bytes:
        raise AssertionError(f"{name} is another rank's to write")

    return Made(at, t.numel * dtypes.itemsize(dtype), name, never)


def write_share(plan: Plan, rank: int, staging: Staging, tensors: TensorSource,
                durable: bool, progress: Progress, resumed: bool) -> dict[str, Any]:
    """Write this rank's units; returns its report's counts."""
    share = plan.share(rank)
    recorded = staging.recorded() if resumed else {}
    manifest = staging.manifest(rank)
    counts = {"bytes_read": 0, "bytes_written": 0, "bytes_kept": 0}
    files: list[str] = []
    done = 0
    try:
        for index, units in _by_file(share):
            f = plan.files[index]
            files.append(f.name)
            laid = lay_out(f, tensors, {u.name for u in units})
            mine: dict[str, list[Segment]] = {u.name: [] for u in units}
            for segment, owner in zip(laid.file.layout.segments, laid.owners, strict=True):
                if owner in mine:
                    mine[owner].append(segment)
            kept = {u.name for u in units if _still_there(
                staging, f.name, mine[u.name], recorded.get((f.name, u.name)))}
            todo = [u for u in units if u.name not in kept]
            counts["bytes_kept"] += sum(u.nbytes for u in units if u.name in kept)
            done += sum(u.nbytes for u in units if u.name in kept)
            progress(done)
            if not todo:
                continue
            fd = os.open(staging.file(f.name), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                for batch in _batches(todo, min(BATCH, max(MIN_BATCH, sum(
                        u.nbytes for u in share) // 16))):
                    segments = [s for u in batch for s in mine[u.name]]
                    base = done
                    copy.write_checked(fd, durable, segments, _offset(progress, base))
                    done = base + sum(s.size for s in segments)
                    counts["bytes_written"] += sum(s.size for s in segments)
                    counts["bytes_read"] += sum(u.read for u in batch)
                    manifest.add([_entry(f.name, u.name, mine[u.name], laid.tensors)
                                  for u in batch])
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
    finally:
        manifest.close()
    return {"tensors": len(share), "files": files, **counts}


def _offset(progress: Progress, base: int) -> Callable[[int, int], None]:
    return lambda done, _total: progress(base + done)


def _by_file(units: list[Unit]) -> list[tuple[int, list[Unit]]]:
    out: list[tuple[int, list[Unit]]] = []
    for u in units:
        if not out or out[-1][0] != u.file:
            out.append((u.file, []))
        out[-1][1].append(u)
    return out


def _batches(units: list[Unit], limit: int) -> list[list[Unit]]:
    out: list[list[Unit]] = [[]]
    size = 0
    for u in units:
        if out[-1] and size + u.nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(u)
        size += u.nbytes
    return out


def _entry(file: str, unit: str, segments: list[Segment], tensors: dict[int, str]
           ) -> dict[str, Any]:
    """A unit written and verified, for the manifest: the ranges it covers
    and their CRCs; ``crc``: its tensor's, when one segment holds it (a zip
    record: the directory needs it)."""
    checks = [c for s in segments for c in _checks(s)]
    held = [s for s in segments if id(s) in tensors]
    crc = held[0].crc if len(held) == 1 else None
    return {"file": file, "unit": unit, "crc": crc, "checks": checks}


def _checks(segment: Segment) -> list[list[int]]:
    """The ranges ``segment`` covers and the CRCs of the bytes written
    there: a zip record's, which the input gives; else the CRC the copy took
    from the very bytes it wrote (``Span.crc``, ``Made.crc``)."""
    if isinstance(segment, Data):
        return [[segment.at, segment.size, segment.crc]]
    if isinstance(segment, Span) and segment.checks:
        return [[at, size, crc] for _, at, size, crc in segment.checks]
    assert segment.crc is not None, f"{segment.name} was written"
    return [[segment.at, segment.size, segment.crc]]


def _still_there(staging: Staging, file: str, segments: list[Segment],
                 entry: dict[str, Any] | None) -> bool:
    """Whether a unit an earlier run recorded lies where this run lays it
    (``segments``) and still has the bytes it recorded."""
    if entry is None:
        return False
    checks = entry["checks"]
    if sorted((at, size) for at, size, _ in checks) != sorted(
            (s.at, s.size) for s in segments):
        return False
    try:
        fd = os.open(staging.file(file), os.O_RDONLY)
    except OSError:
        return False
    try:
        if any(at + size > os.fstat(fd).st_size for at, size, _ in checks):
            return False
        crcs = crc_file_ranges(fd, [(at, size) for at, size, _ in checks])
    finally:
        os.close(fd)
    return crcs == [crc for _, _, crc in checks]


def finish(plan: Plan, staging: Staging, tensors: TensorSource, durable: bool) -> list[str]:
    """Rank 0, once every rank has written its units: what needs all of them
    (a zip's directory), then every file read back and checked, and the
    index; returns the files' names."""
    recorded = staging.recorded()
    missing = [u.name for u in plan.units if (plan.files[u.file].name, u.name) not in recorded]
    if missing:
        raise CorruptCheckpointError(f"{len(missing)} tensor(s) were written by no rank "
                                     f"(e.g. {missing[0]})", _BUG)
    names = []
    for f in plan.files:
        laid = lay_out(f, tensors, set())
        for segment in laid.file.layout.segments:
            unit = laid.tensors.get(id(segment))
            if unit is not None and isinstance(segment, (Span, Made)):
                segment.crc = recorded[(f.name, unit)]["crc"]
        last = [s for s, owner in zip(laid.file.layout.segments, laid.owners, strict=True)
                if owner is None]
        path = str(staging.file(f.name))
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if last:
                copy.write_checked(fd, durable, last)
            if os.fstat(fd).st_size != laid.file.layout.end:
                raise CorruptCheckpointError(f"{f.name} came to {os.fstat(fd).st_size} bytes, "
                                             f"{laid.file.layout.end} planned", _BUG)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        laid.file.check(path)
        names.append(f.name)
    _check_coverage(plan)
    return names


def _check_coverage(plan: Plan) -> None:
    """Every tensor of the plan is in exactly one file (each file's own
    header or records were just checked against its part of the plan)."""
    seen: dict[str, str] = {}
    for f in plan.files:
        for name in f.written.tensors:
            if name in seen:
                raise CorruptCheckpointError(f"{name} is in {seen[name]} and in {f.name}", _BUG)
            seen[name] = f.name
    if set(seen) != set(plan.job.written.tensors):
        raise CorruptCheckpointError("the files do not hold every tensor of the plan", _BUG)
