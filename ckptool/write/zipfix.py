"""Write a rewritten torch zip: storage records first, copied on a thread
(``ckptool.write.zipcopy``), then the new pickle and the small records; verified
while it is written.

When no option can drop or cast a storage, ``copy_early`` starts the copy
before the file is read: reading, planning and re-pickling then cost no
extra time. While the copy runs, the new pickle is read back from the bytes
that will be written and checked against the plan; once the file is
complete, its own directory and local headers must point at the bytes the
checker re-read.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from typing import IO, Any

from ckptool import dtypes
from ckptool.errors import CkptoolError, CorruptCheckpointError
from ckptool.model import Checkpoint
from ckptool.read.formats import torch_zip
from ckptool.read.formats.torch_zip import open_archive
from ckptool.read.tensor_data import Identity, TensorData, check_unchanged, file_identity
from ckptool.read.ziparchive import Member, ZipArchive, ZipError
from ckptool.write import outputcheck, repickle, zipcopy
from ckptool.write.atomic import AtomicOutput
from ckptool.write.bytecheck import ByteChecker
from ckptool.write.conversion import cast_bytes
from ckptool.write.plan import FixOptions, Plan, new_pid
from ckptool.write.zipwriter import Written, ZipWriter

Progress = zipcopy.Progress


class ZipCopy:
    """The storage records of one zip rewrite, being copied on their own thread."""

    def __init__(self, f: IO[bytes], archive: ZipArchive, layout: zipcopy.Layout,
                 out: AtomicOutput, progress: Progress | None,
                 cast: zipcopy.CastBytes | None = None) -> None:
        self.archive, self.layout, self.out = archive, layout, out
        self.checker = ByteChecker(out.file.fileno(), out.durable)
        self.copier = zipcopy.Copier(f.fileno(), out.file.fileno(), self.layout, self.checker,
                                     progress, cast).start()

    def stop(self) -> None:
        """Stop the threads (on any way out: a no-op once they are done); what
        is still queued is dropped, not read."""
        self.copier.cancel()
        self.checker.cancel()


def copy_early(src: str, target: str, opts: FixOptions, force: bool, fsync: bool,
               progress: Progress | None, stack: contextlib.ExitStack,
               identity: Identity | None = None) -> ZipCopy | None:
    """Start copying every storage record of a torch zip before it is read,
    when no option can drop or cast one. None where that does not apply; the
    ordinary path then reports whatever is wrong, in its usual order."""
    if opts.extract is not None or opts.drop or opts.dtype is not None:
        return None
    if os.path.exists(target) and (not force or os.path.samefile(target, src)):
        return None
    if not os.path.isdir(os.path.dirname(os.path.abspath(target))):
        return None
    try:
        f = stack.enter_context(open(src, "rb"))  # noqa: SIM115 -- the stack closes it
        if f.read(4) != b"PK\x03\x04" or file_identity(os.fstat(f.fileno())) != identity:
            return None
        archive = ZipArchive(f, os.fstat(f.fileno()).st_size)
    except (OSError, ZipError):
        return None
    root = torch_zip.root_of(list(archive.members)) if archive.members else ""
    prefix = f"{root}/" if root else ""
    if f"{prefix}data.pkl" not in archive.members or f"{prefix}constants.pkl" in archive.members:
        return None  # not a torch.save zip (the read says what it is)
    try:
        layout = zipcopy.plan_layout(f.fileno(), archive,
                                     zipcopy.storage_members(archive, prefix), {})
        out = stack.enter_context(AtomicOutput(target, force=force, fsync=fsync))
    except CkptoolError:
        return None  # the ordinary path meets the same problem, and says it
    job = ZipCopy(f, archive, layout, out, progress)
    stack.callback(job.stop)
    return job


def write_zip(src: str, source: Checkpoint, plan: Plan, out: AtomicOutput,
              progress: Progress | None, job: ZipCopy | None,
              stack: contextlib.ExitStack, identity: Identity | None = None) -> int:
    """Write the zip and verify it; returns the number of storages verified.

    Storage records (copied on a thread, or cast) come first, then the new
    pickle and the small records. While the copy runs, the new pickle is
    read back (from the bytes that will be written) and compared with the
    plan; once the file is complete, its directory and local headers are
    re-read and must point at the bytes the checker re-read, the pickle's
    included."""
    used = plan.storages
    root = source.metadata.get("archive_root", "")
    prefix = f"{root}/" if root else ""
    if job is None:
        f = stack.enter_context(open(src, "rb"))  # noqa: SIM115 -- the stack closes it
        check_unchanged(src, identity, f.fileno())
        archive = open_archive(f)
        members = zipcopy.storage_members(archive, prefix)
        reader = stack.enter_context(TensorData(source))
        check_unchanged(src, identity, reader.fileno())
        casts = {key: used[key].numel * dtypes.itemsize(plan.casts[key][1])
                 for key in plan.casts if key in used}

        def cast(key: str) -> bytes:
            data = reader.storage_bytes(key)
            crc = reader.record_crc(key)  # a copy is checked against it; a cast too
            if crc is not None and zlib.crc32(data) != crc:
                raise CorruptCheckpointError(
                    f"storage {key} of the input does not match its own checksum",
                    "the file is damaged: fetch or copy it again; nothing was written")
            return cast_bytes(data, *plan.casts[key])

        layout = zipcopy.plan_layout(f.fileno(), archive, {k: members[k] for k in used}, casts)
        job = ZipCopy(f, archive, layout, out, progress, cast)
        stack.callback(job.stop)
    shared: dict[str, Any] = {}
    pickled = repickle.dumps(plan.root, lambda ref: new_pid(ref, plan, shared))
    planned = _PlannedArchive(job.archive, prefix, pickled, job.layout.pieces())
    try:
        written = torch_zip.read_archive(planned)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"the output does not read back: {exc.message}",
                                     "nothing was written; report this as a bug") from exc
    outputcheck.check_tensors(written, plan)
    job.copier.finish()
    archive = job.archive
    out.file.seek(job.layout.end)
    tail = _Tee(out.file)  # everything after the storages: re-read as one range
    writer = ZipWriter(tail, start=job.layout.end)
    for piece in job.layout.pieces():
        writer.add_existing(piece.name, piece.header, piece.size, piece.crc, piece.flags,
                            piece.data)
    storage_names = {p.name for p in job.layout.pieces()}
    others = sorted((m for m in archive.members.values()
                     if m.name not in storage_names and not m.name.startswith(f"{prefix}data/")),
                    key=lambda m: m.header_offset)
    for member in others:
        if member.name == f"{prefix}data.pkl":
            writer.write_bytes(member.name, pickled)
        else:
            try:
                writer.write_bytes(member.name, archive.read(member.name, 1 << 20))
            except ZipError as exc:
                raise CorruptCheckpointError(f"cannot copy {member.name}: {exc}",
                                             "the file is damaged; nothing was written") from exc
    # the directory lists records in the source's order: data.pkl first, as
    # torch takes the archive's root folder from its first entry
    rank = {name: i for i, name in enumerate(archive.members)}
    writer.records.sort(key=lambda r: rank[r.name])
    writer.close()
    out.file.flush()
    # the pickle, the small records, their headers, the central directory
    job.checker.check("records after the storages", job.layout.end, tail.size, tail.crc)
    outputcheck.check_bytes(job.checker)
    _check_directory(out, writer.records)
    return len(used)


class _Tee:
    """Writes through to ``f`` and keeps the CRC of what went through."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.crc = self.size = 0

    def write(self, data: bytes) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)
        return self.f.write(data)


class _PlannedArchive:
    """The output archive as planned, for ``torch_zip.read_archive`` to read
    back before its directory is written: the new pickle from memory, the
    small records from the source, storage records' sizes from the layout."""

    def __init__(self, source: ZipArchive, prefix: str, pickled: bytes,
                 pieces: list[zipcopy.Piece]) -> None:
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


def _check_directory(out: AtomicOutput, records: list[Written]) -> None:
    """The written file's own directory and local headers must list exactly
    the planned records, at the offsets whose bytes were re-read."""
    try:
        with open(out.read_path, "rb") as f:
            archive = ZipArchive(f, os.fstat(f.fileno()).st_size)
            wanted = {r.name: r for r in records}
            if list(archive.members) != [r.name for r in records]:
                raise ZipError("its records differ from the plan")
            for name, member in archive.members.items():
                rec = wanted[name]
                if (member.size, member.crc, member.header_offset) != (
                        rec.size, rec.crc, rec.offset) or member.method != 0:
                    raise ZipError(f"{name} is not where the plan put it")
                if archive.data_offset(member) != rec.data_offset:
                    raise ZipError(f"{name}'s local header points elsewhere")
    except (OSError, ZipError) as exc:
        raise CorruptCheckpointError(f"the output's zip directory is wrong: {exc}",
                                     "nothing was written; report this as a bug") from exc
