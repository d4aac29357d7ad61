"""``ckptool fix``: rewrite a checkpoint in its own format, as a pipeline.

1. read: the file is read faithfully (``resolve.faithful``: every stand-in
   can be written back as it was), and the version read is remembered:
   every later open of the input must be that version;
2. plan: ``make_plan`` applies the options to the object tree;
3. lay out: the output format's module (``ckptool.write.formats``) says
   where each byte of the output comes from;
4. copy: ``ckptool.write.copy`` writes the layout, every byte read once
   and written once;
5. verify: every byte is CRC-checked as it is written, from the bytes
   written (nothing is read back), and the output's records are read back
   and compared with the plan (``ckptool.write.verify``);
6. commit: the temporary file takes the output's name
   (``ckptool.write.commit``).

A torch zip whose storages are all kept as they are starts its copy first,
before step 1, from the zip directory alone (``_start_zip``): reading,
planning and re-pickling then cost no extra time. The input is never
modified, except by ``in_place``, which replaces it atomically, or rewrites
only its pickle (``ckptool.write.fix.inplace``).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptool import dtypes
from ckptool.describe import beside, shell_word
from ckptool.errors import CkptoolError, UnsupportedCheckpointError, UsageError
from ckptool.keys import unescape
from ckptool.model import Checkpoint
from ckptool.read import dispatch, fs
from ckptool.read.companions import framework_of
from ckptool.read.formats import torch_legacy as legacy_reader
from ckptool.read.formats import torch_zip as zip_reader
from ckptool.read.formats.safetensors_fmt import SAFETENSORS
from ckptool.read.formats.torch_zip import TORCH_ZIP
from ckptool.read.layouts import journal, recognise
from ckptool.read.layouts.journal import Pending, Step
from ckptool.read.layouts.layout import DS_UNIVERSAL
from ckptool.read.reader import assemble, open_checkpoint
from ckptool.read.resolve import faithful
from ckptool.read.tensor_data import Identity, TensorData, check_unchanged, file_identity
from ckptool.read.ziparchive import ZipArchive, ZipError
from ckptool.write import copy, interrupt, repickle, verify
from ckptool.write.bytecheck import ByteChecker
from ckptool.write.commit import AtomicOutput, shared_file
from ckptool.write.failures import NEEDED, naming, needing
from ckptool.write.fastcrc import Observe
from ckptool.write.fix import folder as fix_folder
from ckptool.write.fix import inplace
from ckptool.write.fix.outputs import default_output, fresh_output
from ckptool.write.fix.plan import (
    FixOptions,
    Plan,
    check_rewritable,
    make_plan,
    new_pid,
    refuse_unsafe,
)
from ckptool.write.fix.targets import check_suffix, check_target
from ckptool.write.flagged import prove_clean, refuse_flagged
from ckptool.write.formats import safetensors, torch_legacy, torch_zip
from ckptool.write.layout import checked_cast, source_of
from ckptool.write.outlock import OutputLock
from ckptool.write.results import FixResult
from ckptool.write.streamhash import StreamHash, Streams

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


def fix(src: str, opts: FixOptions, output: str | None = None, *, force: bool = False,
        in_place: bool = False, dry_run: bool = False, progress: Progress | None = None,
        fsync: bool = False, pending: Pending | None = None,
        streams: Streams | None = None) -> FixResult:
    """Rewrite ``src`` as ``opts`` ask. The output is durable on disk before
    this returns when ``fsync`` is set or it replaces a file (``AtomicOutput``).

    ``in_place`` replaces ``src`` (a link or a file with other hard links by a
    new file: its other names keep the old one); with ``pending`` (a shard of
    a directory fixed in place) the change is written beside ``src`` (to
    ``pending.temp``) and verified, and the journal step that makes it is
    appended to ``pending.steps``, not made. ``streams``: the hashes of a
    rewritten file, taken from the bytes as they are written (``write.streamhash``)."""
    if in_place and output is not None:
        raise UsageError("--in-place and -o both name the output", "use one of them")
    if in_place and fs.is_remote(src):
        raise UsageError(f"{src} is remote: ckptool does not change it in place",
                         "write a fixed copy here: -o FILE (the default writes "
                         f"{default_output(src)} in the current directory)")
    layout = recognise.recognise(src)
    if layout is not None and layout.kind != recognise.FILE:  # HF shards, DCP
        from ckptool.write.fix import dcp as fix_dcp
        from ckptool.write.fix import shards as fix_shards

        if layout.kind in (recognise.DEEPSPEED, recognise.PER_RANK, recognise.HF_STORAGE,
                           recognise.MEGATRON, DS_UNIVERSAL):
            what = {recognise.DEEPSPEED: "a DeepSpeed checkpoint",
                    DS_UNIVERSAL: "a DeepSpeed universal checkpoint",
                    recognise.MEGATRON: "a legacy Megatron checkpoint",
                    recognise.PER_RANK: "a checkpoint saved per rank"}.get(
                layout.kind, "a HuggingFaceStorageWriter checkpoint")
            raise UnsupportedCheckpointError(
                f"{src} is {what}: fix rewrites state dicts, and this one is "
                "partitioned over its ranks' files",
                f"consolidate it first: ckptool convert {shell_word(src)} "
                f"{shell_word(beside(src, '.safetensors'))}, then fix that file")
        hf = layout.kind == recognise.HF
        with fix_shards.guarded(layout.directory, hf and in_place, dry_run) as locks:
            # an in-place fix a crash cut short is settled first
            resumed = fix_shards.resume(layout.directory, opts, in_place) if hf else None
            source = open_checkpoint(src)
            refuse_flagged(source, opts.salvage, "fix")
            output = output or fix_shards.default_output(src)
            if not hf:
                return fix_dcp.fix(source, opts, output, force=force, in_place=in_place,
                                   dry_run=dry_run, progress=progress, fsync=fsync)
            return fix_shards.fix(source, opts, output, fix_file=fix, force=force,
                                  in_place=in_place, dry_run=dry_run, progress=progress,
                                  fsync=fsync, resumed=resumed, locks=locks)
    given = src
    if layout is not None and layout.file is not None:
        src = layout.file  # a directory holding one checkpoint file is that file
    folder = None if in_place or pending is not None else fix_folder.wanted(given, output)
    if folder is not None:  # the fixed file, with its framework's configs beside it
        return fix_folder.fix(given, src, layout, opts, folder, fix_file=fix, force=force,
                              dry_run=dry_run, progress=progress, fsync=fsync, streams=streams)
    if in_place and pending is None and not dry_run:
        # a fix of its directory that a crash cut short is settled first (and said):
        # its journal would otherwise undo this change, or redo its own over it
        journal.settle(os.path.dirname(os.path.abspath(src)))
    target = src if in_place else (output or default_output(src))
    if pending is not None:  # made by the directory's journal: a new file beside src
        target = os.path.join(os.path.dirname(src), pending.temp)
    shared = shared_file(src) if in_place and os.path.lexists(src) else None
    try:  # the version of the file that is read; every later open must be it
        identity: Identity | None = file_identity(os.stat(src))
    except OSError:
        identity = None  # the read says what is wrong with the path
    with contextlib.ExitStack() as stack:
        alone = in_place and pending is None  # a Ctrl-C says what it left of src
        change = stack.enter_context(interrupt.changing(src)) if alone else None
        early = None
        if not (dry_run or in_place):
            stack.enter_context(OutputLock(target))  # one writer of OUT, convert's too
            if identity is not None:  # what a full disk says the output needs (then: cast)
                stack.enter_context(needing(identity[2]))
            early = _start_zip_early(src, target, opts, force, fsync, progress, stack, identity,
                                     streams)
        # 1. read (a started copy's own open file, when there is one: one version)
        with faithful():
            raw = dispatch.read_zip(src, early.archive) if early else dispatch.read(src)
        check_unchanged(src, identity)
        source = assemble(src, raw)
        source.framework = framework_of(given, layout, source)
        # a flagged file is refused as flagged, whatever else fix says of it
        refuse_flagged(source, opts.salvage, "fix")
        check_rewritable(raw.format, opts, src)
        # 2. plan
        plan = make_plan(source, opts)
        refuse_unsafe(plan.unsafe)
        if plan.casts and identity is not None:
            NEEDED.set(identity[2] + sum(  # + what casts add (reset above)
                r.numel * (dtypes.itemsize(to) - dtypes.itemsize(r.dtype))
                for sid, (_, to) in plan.casts.items() if (r := plan.storages.get(sid))))
        result = FixResult(plan, source, src if in_place else target)
        if shared:
            plan.notes.append(f"{shared}: it is now a file of its own, and the file it shared "
                              "is untouched")
        if not in_place:  # what the write would refuse, a dry run refuses too
            check_target(src, target, force)
            check_suffix(raw.format, target)
        if dry_run:
            return result
        # (a salvage is read back before commit: never the metadata-only path)
        # (nor a file other paths share: they would change with it)
        if in_place and raw.format == TORCH_ZIP and inplace.supported(plan) and not (
                opts.salvage or shared):
            # a full disk: the error names the file (a directory's journal cuts it back)
            with naming(src, clean=pending is not None):
                result.bytes_written = inplace.rewrite_in_place(
                    src, source, plan, change, pending.steps if pending else None)
            result.output, result.metadata_only = src, True
            return result
        later = src if pending is not None else None  # replaced later, by the journal
        out = early.out if early is not None else stack.enter_context(AtomicOutput(
            target, force=force or alone, fsync=fsync or in_place, shown=later,
            follow_links=not in_place, like=later))
        # 3 to 5: lay out, copy, verify, in the input's own format
        if raw.format == TORCH_ZIP:
            job = early or _start_zip(src, source, plan, out, progress, stack, identity,
                                      None if in_place else streams)
            result.verified_storages = _finish_zip(job, source, plan, out)
        elif raw.format == SAFETENSORS:
            result.verified_storages = _write_safetensors(source, plan, out, progress, stack,
                                                          None if in_place else streams)
        else:
            result.verified_storages = _write_legacy(src, source, plan, out, progress, stack,
                                                     identity)
        result.bytes_written = os.fstat(out.file.fileno()).st_size
        if opts.salvage:
            prove_clean(out.read_path, target)
        # 6. commit
        with change.committing() if change else contextlib.nullcontext():
            out.commit()
    if pending is not None:
        pending.steps.append(Step(os.path.basename(src), result.bytes_written,
                                  temp=pending.temp))
    result.output = src if in_place else target
    return result


@dataclass
class _ZipJob:
    """A torch zip's storage records, laid out and being copied on their own thread."""

    archive: ZipArchive
    storages: torch_zip.Storages
    out: AtomicOutput
    checker: ByteChecker
    copier: copy.Copier

    def stop(self) -> None:
        """Stop the threads (on any way out: a no-op once they are done); what
        is still queued is dropped, not read."""
        self.copier.cancel()
        self.checker.cancel()


def _copy_storages(archive: ZipArchive, storages: torch_zip.Storages, out: AtomicOutput,
                   progress: Progress | None, stack: contextlib.ExitStack,
                   streams: Streams | None = None) -> _ZipJob:
    """Step 4 for the storage records, laid out: start copying them (with
    ``streams``, hashing the file and each storage as they are written)."""
    observe = _stream(streams, out, {p.key: (p.data, p.size) for p in storages.pieces}, -1)
    checker = ByteChecker(out.file.fileno(), out.durable, observe)
    copier = copy.Copier(out.file.fileno(), checker, progress).start()
    job = _ZipJob(archive, storages, out, checker, copier)
    stack.callback(job.stop)
    copier.add(storages.segments)
    return job


def _stream(streams: Streams | None, out: AtomicOutput, ranges: dict[str, tuple[int, int]],
            size: int) -> Observe | None:
    """A ``StreamHash`` of ``out`` (its size -1: the file's once written), registered."""
    if streams is None:
        return None
    streams[os.path.realpath(out.shown)] = (stream := StreamHash(ranges), size)
    return stream.feed


def _start_zip_early(src: str, target: str, opts: FixOptions, force: bool, fsync: bool,
                     progress: Progress | None, stack: contextlib.ExitStack,
                     identity: Identity | None, streams: Streams | None) -> _ZipJob | None:
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
    root = zip_reader.root_of(list(archive.members)) if archive.members else ""
    prefix = f"{root}/" if root else ""
    if f"{prefix}data.pkl" not in archive.members or f"{prefix}constants.pkl" in archive.members:
        return None  # not a torch.save zip (the read says what it is)
    try:
        storages = torch_zip.lay_out_storages(
            f.fileno(), archive, torch_zip.storage_members(archive, prefix), {})
        out = stack.enter_context(AtomicOutput(target, force=force, fsync=fsync))
    except CkptoolError:
        return None  # the ordinary path meets the same problem, and says it
    return _copy_storages(archive, storages, out, progress, stack, streams)


def _start_zip(src: str, source: Checkpoint, plan: Plan, out: AtomicOutput,
               progress: Progress | None, stack: contextlib.ExitStack,
               identity: Identity | None, streams: Streams | None) -> _ZipJob:
    """The storage records the plan keeps, cast where it casts them."""
    used = plan.storages
    root = source.metadata.get("archive_root", "")
    f = stack.enter_context(fs.open_binary(src))  # (the stack closes it)
    remote = fs.is_remote(src)
    check_unchanged(src, identity, None if remote else f.fileno())
    archive = zip_reader.open_archive(f)
    members = torch_zip.storage_members(archive, f"{root}/" if root else "")
    reader = stack.enter_context(TensorData(source))
    check_unchanged(src, identity, None if remote else reader.fileno())
    casts: dict[str, torch_zip.Cast] = {
        key: (used[key].numel * dtypes.itemsize(dst),
              functools.partial(checked_cast, reader, key, a, dst))
        for key, (a, dst) in plan.casts.items() if key in used}
    storages = torch_zip.lay_out_storages(source_of(f), archive,
                                          {k: members[k] for k in used}, casts)
    return _copy_storages(archive, storages, out, progress, stack, streams)


def _finish_zip(job: _ZipJob, source: Checkpoint, plan: Plan, out: AtomicOutput) -> int:
    """The rest of a zip after its storage records: the new pickle and the
    small records (3, 4), checked before and after they are written (5)."""
    root = source.metadata.get("archive_root", "")
    prefix = f"{root}/" if root else ""
    shared: dict[str, Any] = {}
    pickled = repickle.dumps(plan.root, lambda ref: new_pid(ref, plan, shared))
    # the new pickle, read back as torch will, while the storages are copied
    torch_zip.check_planned(job.archive, prefix, pickled, job.storages.pieces, plan)
    tail = torch_zip.Tail(job.archive, prefix, pickled, job.storages.pieces, job.storages.end)
    job.copier.add([tail.segment])
    job.copier.finish()
    out.sync_in_background()
    verify.check_bytes(job.checker)
    verify.check_directory(out.read_path, tail.records)
    return len(plan.storages)


def _write_safetensors(source: Checkpoint, plan: Plan, out: AtomicOutput,
                       progress: Progress | None, stack: contextlib.ExitStack,
                       streams: Streams | None) -> int:
    """Renamed, dropped or cast safetensors: a new header, the bytes streamed."""
    by_storage = {t.storage: t for t in source.tensors}
    items = []
    for name, rec in plan.root.items():
        t = by_storage[rec.storage.key]
        items.append((name, t, plan.casts.get(t.storage or "", (t.dtype, t.dtype))[1]))
    # the ties the header records follow their tensors (and read back as tensors)
    meta, ties, notes = safetensors.carry_ties(
        source.metadata.get("metadata") or {},
        {unescape(t.key): name for name, t, _ in items}, plan.rename)
    plan.notes += notes
    reader = stack.enter_context(TensorData(source))
    layout, starts = safetensors.lay_out(items, meta, safetensors.of_file(reader))
    sizes = {n: t.numel * dtypes.itemsize(d) for n, t, d in items}
    copy.write_checked(out.file.fileno(), out.durable, layout.segments, progress, _stream(
        streams, out, {n: (at, sizes[n]) for n, at in starts.items()}, layout.end))
    out.sync_in_background()
    expect = {n: (t.shape, d) for n, t, d in items}
    expect.update({a: expect[k] for a, k in ties.items()})
    verify.check_offsets(out.read_path, expect, starts)
    return len(items)


def _write_legacy(src: str, source: Checkpoint, plan: Plan, out: AtomicOutput,
                  progress: Progress | None, stack: contextlib.ExitStack,
                  identity: Identity | None) -> int:
    reader = stack.enter_context(TensorData(source))
    f = stack.enter_context(fs.open_binary(src))  # (the stack closes it)
    if not fs.is_remote(src):
        check_unchanged(src, identity, f.fileno())
        check_unchanged(src, identity, reader.fileno())
    layout, placed = torch_legacy.lay_out(plan, source_of(f), legacy_reader.header_end(f),
                                          reader)
    copy.write_checked(out.file.fileno(), out.durable, layout.segments, progress)
    out.sync_in_background()
    return verify.check_storages(out.read_path, plan, placed)


__all__ = ["FixOptions", "FixResult", "default_output", "fix", "fresh_output"]
