"""Carry out a rewrite plan: write the new file, verify it, put it in place.

The file is read faithfully (``resolve.faithful``), the plan applied
(``ckptool.write.plan``), and the output written in the input's own format: a
torch zip by ``ckptool.write.zipfix`` (storage records copied by the kernel on a
thread of their own, cast where ``--dtype`` asks, the pickle written anew
after them), a legacy file as its five pickles and storage records,
safetensors as a new header and the bytes streamed. The output goes to a
temporary file beside the target (``ckptool.write.atomic``), is read back and
checked against the plan (``ckptool.write.outputcheck``: every tensor's metadata;
by CRC every storage's bytes, and in a zip every other byte too), and only
then put in place. The input is never modified, except by ``in_place``,
which replaces it atomically; an input that changes while it is read (a
re-save by rename) stops the rewrite.
"""

from __future__ import annotations

import contextlib
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptool.errors import UnsupportedCheckpointError, UsageError
from ckptool.model import Checkpoint
from ckptool.read import formats
from ckptool.read.formats import torch_legacy
from ckptool.read.formats.safetensors_fmt import SAFETENSORS
from ckptool.read.formats.torch_zip import TORCH_ZIP
from ckptool.read.reader import assemble
from ckptool.read.resolve import faithful
from ckptool.read.tensor_data import Identity, TensorData, check_unchanged, file_identity
from ckptool.read.tensors import StorageRef
from ckptool.write import inplace, outputcheck, repickle, zipfix
from ckptool.write.atomic import AtomicOutput
from ckptool.write.bytecheck import ByteChecker
from ckptool.write.conversion import cast_bytes, verify, write_safetensors
from ckptool.write.plan import FixOptions, Plan, check_rewritable, make_plan, new_pid, refuse_unsafe

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


@dataclass
class FixResult:
    plan: Plan
    source: Checkpoint
    target: str = ""  # the path written, or that a dry run would write
    output: str | None = None  # None for a dry run
    bytes_written: int = 0
    verified_storages: int = 0
    metadata_only: bool = False  # --in-place appended a new pickle, bytes untouched

    def moves(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Device moves and casts, grouped: ``{"from", "to", "storages"}`` each."""
        storages = self.source.storages
        moves: dict[tuple[str, str], int] = {}
        for sid, tag in self.plan.retargets.items():
            old = (storages[sid].location if sid in storages else None) or "unrecorded"
            moves[(old, tag)] = moves.get((old, tag), 0) + 1
        casts: dict[tuple[str, str], int] = {}
        for pair in self.plan.casts.values():
            casts[pair] = casts.get(pair, 0) + 1
        return ([{"from": a, "to": b, "storages": n} for (a, b), n in moves.items()],
                [{"from": a, "to": b, "storages": n} for (a, b), n in casts.items()])


def default_output(src: str) -> str:
    """``model.pth`` -> ``model.fixed.pth``, beside the input."""
    path = Path(src)
    return str(path.with_name(f"{path.stem}.fixed{path.suffix}"))


def fix(src: str, opts: FixOptions, output: str | None = None, *, force: bool = False,
        in_place: bool = False, dry_run: bool = False, progress: Progress | None = None,
        fsync: bool = False) -> FixResult:
    """Rewrite ``src`` as ``opts`` ask. The output is durable on disk before
    this returns when ``fsync`` is set or it replaces a file (``AtomicOutput``)."""
    if in_place and output is not None:
        raise UsageError("--in-place and -o both name the output", "use one of them")
    target = src if in_place else (output or default_output(src))
    try:  # the version of the file that is read; every later open must be it
        identity: Identity | None = file_identity(os.stat(src))
    except OSError:
        identity = None  # the read says what is wrong with the path
    with contextlib.ExitStack() as stack:
        early = None
        if not (dry_run or in_place):
            early = zipfix.copy_early(src, target, opts, force, fsync, progress, stack,
                                      identity)
        with faithful():
            # the early copy's own open file, when there is one: one version
            raw = formats.read_zip(src, early.archive) if early else formats.read(src)
        check_unchanged(src, identity)
        check_rewritable(raw.format, opts)
        source = assemble(src, raw)
        plan = make_plan(source, opts)
        refuse_unsafe(plan.unsafe)
        result = FixResult(plan, source, target)
        if dry_run:
            return result
        if in_place and raw.format == TORCH_ZIP and inplace.supported(plan):
            result.bytes_written = inplace.rewrite_in_place(src, source, plan)
            result.output = src
            result.metadata_only = True
            return result
        if not in_place and os.path.exists(target) and os.path.samefile(target, src):
            raise UsageError("the output would overwrite the input",
                             "choose another path with -o, or pass --in-place")
        out = early.out if early is not None else stack.enter_context(
            AtomicOutput(target, force=force or in_place, fsync=fsync))
        if raw.format == SAFETENSORS:
            _write_safetensors(source, plan, out, progress)
            result.bytes_written = out.file.tell()
            result.verified_storages = len(plan.root)
            out.commit()
            result.output = target
            return result
        if raw.format == TORCH_ZIP:
            result.verified_storages = zipfix.write_zip(src, source, plan, out, progress,
                                                        early, stack, identity)
            result.bytes_written = out.file.tell()
            out.sync_in_background()
        else:
            expected = _write_legacy(src, source, plan, out, progress, identity)
            result.bytes_written = out.file.tell()
            out.sync_in_background()
            result.verified_storages = outputcheck.check_file(out.read_path, plan, expected)
        out.commit()
    result.output = target
    return result


def _total(refs: dict[str, StorageRef]) -> int:
    return sum(r.nbytes for r in refs.values())


def _write_safetensors(source: Checkpoint, plan: Plan, out: AtomicOutput,
                       progress: Progress | None) -> None:
    """Renamed, dropped or cast safetensors: a new header, the bytes streamed."""
    by_storage = {t.storage: t for t in source.tensors}
    items = []
    for name, rec in plan.root.items():
        t = by_storage[rec.storage.key]
        items.append((name, t, plan.casts.get(t.storage or "", (t.dtype, t.dtype))[1]))
    meta = source.metadata.get("metadata") or {}
    with TensorData(source) as reader:
        spans = write_safetensors(out.file, items, dict(meta), reader, progress, out.durable)
    out.sync_in_background()
    verify(out.read_path, {n: (t.shape, d) for n, t, d in items}, spans)


def _write_legacy(src: str, source: Checkpoint, plan: Plan, output: AtomicOutput,
                  progress: Progress | None, identity: Identity | None) -> outputcheck.Expected:
    used = plan.storages
    if any((r.pid or (None,) * 6)[5] is not None for r in used.values()):
        raise UnsupportedCheckpointError("storage views of torch < 0.4 files cannot be rewritten",
                                         "load and re-save the file with an older torch")
    shared: dict[str, Any] = {}
    pickled = repickle.dumps(plan.root, lambda ref: new_pid(ref, plan, shared))
    keys = sorted(used)  # torch writes the storage keys sorted, as strings
    total, done = _total(used), 0
    expected: outputcheck.Expected = {}
    out = output.file
    with TensorData(source) as reader, open(src, "rb") as f:
        check_unchanged(src, identity, f.fileno())
        check_unchanged(src, identity, reader.fileno())
        header_end = torch_legacy.header_end(f)
        out.write(os.pread(f.fileno(), header_end, 0))
        out.write(pickled)
        out.write(repickle.dumps(keys, lambda ref: ()))
        with ByteChecker(out.fileno(), output.durable) as checker:
            for key in keys:
                ref = used[key]
                data = bytes(reader.storage_bytes(key))
                if key in plan.casts:
                    data = cast_bytes(data, *plan.casts[key])
                out.write(struct.pack("<q", ref.numel))
                expected[key] = (out.tell(), len(data), zlib.crc32(data))
                out.write(data)
                out.flush()
                checker.check(f"storage {key}", *expected[key])
                done += ref.nbytes
                if progress is not None:
                    progress(done, total)
            outputcheck.check_bytes(checker)
    return expected


__all__ = ["FixOptions", "FixResult", "default_output", "fix"]
