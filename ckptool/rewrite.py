"""Carry out a rewrite plan: write the new file, verify it, put it in place.

The file is read faithfully (``resolve.faithful``), the plan applied
(``ckptool.plan``), and the output written in the input's own format:
torch zip records are copied by the kernel where unchanged, cast where
``--dtype`` asks, and the pickle is written anew; legacy files get their
five pickles and storage records the same way. The output goes to a
temporary file beside the target (``ckptool.atomic``), is read back and
checked against the plan (every tensor's metadata, every storage's bytes by
CRC), and only then renamed into place. The input is never modified, except
by ``in_place``, which replaces it atomically.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ckptool import formats, inplace, repickle, safe_pickle
from ckptool.atomic import AtomicOutput
from ckptool.bytecheck import ByteChecker
from ckptool.conversion import cast_bytes, verify, write_safetensors
from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError, UsageError
from ckptool.formats.safetensors_fmt import SAFETENSORS
from ckptool.formats.torch_legacy import TORCH_LEGACY
from ckptool.formats.torch_zip import TORCH_ZIP
from ckptool.model import Checkpoint
from ckptool.plan import FixOptions, Plan, make_plan, new_pid, unsafe_in, used_storages
from ckptool.reader import assemble, open_checkpoint
from ckptool.resolve import faithful
from ckptool.tensor_data import TensorData
from ckptool.tensors import StorageRef
from ckptool.walk import walk
from ckptool.zipwriter import ZipWriter

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


def default_output(src: str) -> str:
    """``model.pth`` -> ``model.fixed.pth``, beside the input."""
    path = Path(src)
    return str(path.with_name(f"{path.stem}.fixed{path.suffix}"))


def fix(src: str, opts: FixOptions, output: str | None = None, *, force: bool = False,
        in_place: bool = False, dry_run: bool = False,
        progress: Progress | None = None) -> FixResult:
    if in_place and output is not None:
        raise UsageError("--in-place and -o both name the output", "use one of them")
    with faithful():
        raw = formats.read(src)
    if raw.format not in (TORCH_ZIP, TORCH_LEGACY, SAFETENSORS):
        raise UnsupportedCheckpointError(
            f"ckptool fix rewrites torch.save files and safetensors; this is {raw.format}",
            "for TorchScript, take the weights out first: "
            "`ckptool convert FILE.pt FILE.safetensors`")
    if raw.format == SAFETENSORS and (opts.to or opts.maps):
        raise UsageError("safetensors files record no device: there is nothing to retarget",
                         "pick the device when loading: load_file(path, device='cuda:0')")
    source = assemble(src, raw)
    plan = make_plan(source, opts)
    unsafe = unsafe_in(plan.root)
    if unsafe:
        raise UnsupportedCheckpointError(
            f"the output would keep unsafe globals: {', '.join(unsafe)}",
            "drop the entries that hold them (--drop PATH) or keep only the weights "
            "(--extract); see `ckptool inspect` for where they are")
    target = src if in_place else (output or default_output(src))
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
    with AtomicOutput(target, force=force or in_place) as out:
        if raw.format == SAFETENSORS:
            _write_safetensors(source, plan, out, progress)
            result.bytes_written = out.file.tell()
            result.verified_storages = len(plan.root)
            out.commit()
            result.output = target
            return result
        if raw.format == TORCH_ZIP:
            expected = _write_zip(src, source, plan, out.file, progress)
        else:
            expected = _write_legacy(src, source, plan, out.file, progress)
        result.bytes_written = out.file.tell()
        out.sync_in_background()
        result.verified_storages = _verify(out.read_path, plan, expected)
        out.commit()
    result.output = target
    return result


def _total(refs: dict[str, StorageRef]) -> int:
    return sum(r.nbytes for r in refs.values())


def _storage_bytes(reader: TensorData, sid: str) -> bytearray:
    info = reader.storage(sid)
    return reader.read_range(sid, 0, info.nbytes)


# where each output storage's bytes are, and the CRC they must have
Expected = dict[str, tuple[int, int, int]]  # storage id -> (offset, size, crc)


def _write_zip(src: str, source: Checkpoint, plan: Plan, out: IO[bytes],
               progress: Progress | None) -> Expected:
    """Write the zip; returns where each storage went and the CRC it must have."""
    used = used_storages(plan.root)
    shared: dict[str, Any] = {}
    pickled = repickle.dumps(plan.root, lambda ref: new_pid(ref, plan, shared))
    total, done = _total(used), 0
    expected: Expected = {}
    with TensorData(source) as reader, open(src, "rb") as f:
        from ckptool.formats.torch_zip import open_archive

        archive = open_archive(f)
        root = source.metadata.get("archive_root", "")
        prefix = f"{root}/" if root else ""
        writer = ZipWriter(out)

        def step(n: int) -> None:
            nonlocal done
            done += n
            if progress is not None:
                progress(done, total)

        checker = ByteChecker(out.fileno())
        for name, member in archive.members.items():
            inner = name[len(prefix):] if name.startswith(prefix) else name
            if inner == "data.pkl":
                writer.write_bytes(name, pickled)
            elif inner.startswith("data/"):
                key = inner[len("data/"):]
                if key not in used:
                    continue  # only dropped or extracted-away entries viewed it
                if key in plan.casts:
                    rec = writer.write_bytes(name, cast_bytes(_storage_bytes(reader, key),
                                                         *plan.casts[key]))
                    step(used[key].nbytes)
                else:
                    rec = writer.copy_record(name, f, archive.data_offset(member),
                                             member.size, member.crc, step)
                expected[key] = (rec.data_offset, rec.size, rec.crc)
                out.flush()
                checker.check(key, rec.data_offset, rec.size, rec.crc)
            else:
                writer.write_bytes(name, archive.read(name, 1 << 20))
        writer.close()
        _finish(checker)
    return expected


def _finish(checker: ByteChecker) -> None:
    failed = checker.finish()
    if failed:
        raise CorruptCheckpointError(
            f"storage {failed[0]} of the output does not match the input's bytes",
            "the input may be damaged (its checksum fails), or the disk is; "
            "nothing was written")


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
        spans = write_safetensors(out.file, items, dict(meta), reader, progress)
    out.sync_in_background()
    verify(out.read_path, {n: (t.shape, d) for n, t, d in items}, spans)


def _legacy_header_end(f: IO[bytes]) -> int:
    """Offset after the magic number, protocol version and sys_info pickles."""
    seen = safe_pickle.GlobalsSeen()
    for _ in range(3):
        safe_pickle.load(f, None, seen)
    return f.tell()


def _write_legacy(src: str, source: Checkpoint, plan: Plan, out: IO[bytes],
                  progress: Progress | None) -> Expected:
    used = used_storages(plan.root)
    if any((r.pid or (None,) * 6)[5] is not None for r in used.values()):
        raise UnsupportedCheckpointError("storage views of torch < 0.4 files cannot be rewritten",
                                         "load and re-save the file with an older torch")
    shared: dict[str, Any] = {}
    pickled = repickle.dumps(plan.root, lambda ref: new_pid(ref, plan, shared))
    keys = sorted(used)  # torch writes the storage keys sorted, as strings
    total, done = _total(used), 0
    expected: Expected = {}
    with TensorData(source) as reader, open(src, "rb") as f:
        header_end = _legacy_header_end(f)
        out.write(os.pread(f.fileno(), header_end, 0))
        out.write(pickled)
        out.write(repickle.dumps(keys, lambda ref: ()))
        checker = ByteChecker(out.fileno())
        for key in keys:
            ref = used[key]
            data = bytes(_storage_bytes(reader, key))
            if key in plan.casts:
                data = cast_bytes(data, *plan.casts[key])
            out.write(struct.pack("<q", ref.numel))
            expected[key] = (out.tell(), len(data), zlib.crc32(data))
            out.write(data)
            out.flush()
            checker.check(key, *expected[key])
            done += ref.nbytes
            if progress is not None:
                progress(done, total)
        _finish(checker)
    return expected


def _verify(path: str, plan: Plan, expected: Expected) -> int:
    """Read the written file back; compare it with the plan. Returns storages checked.

    Metadata through a fresh read of ``path``; the bytes were read back and
    CRC-checked as they were written (``ByteChecker``), and here the file's own
    directory must point at exactly those bytes."""
    try:
        written = open_checkpoint(path)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"the output does not read back: {exc.message}",
                                     "nothing was written; report this as a bug") from exc
    want = {key: rec for key, rec in walk(plan.root).tensors}
    got = {t.key: t for t in written.tensors}
    if set(want) != set(got):
        missing = sorted(set(want) ^ set(got))[:3]
        raise CorruptCheckpointError(f"the output's keys differ from the plan: {missing}",
                                     "nothing was written; report this as a bug")
    for key, rec in want.items():
        t = got[key]
        sid = rec.storage.key if rec.storage is not None else None
        dtype = plan.casts[sid][1] if sid in plan.casts else rec.dtype
        location = plan.retargets.get(sid or "", rec.location)
        if (t.shape, t.stride, t.storage_offset, t.dtype, t.location, t.storage) != (
                rec.shape, rec.stride, rec.storage_offset, dtype, location, sid):
            raise CorruptCheckpointError(f"the output's {key} does not match the plan",
                                         "nothing was written; report this as a bug")
    with TensorData(written) as reader:
        for sid, (offset, size, _) in expected.items():
            # the output's own directory must point at the bytes checked here
            if reader.storage_offset(sid) != offset or written.storages[sid].nbytes > size:
                raise CorruptCheckpointError(f"storage {sid} of the output is misplaced",
                                             "nothing was written; report this as a bug")
    return len(expected)


__all__ = ["FixOptions", "FixResult", "default_output", "fix"]
