"""Stage 5 of a rewrite, verification: the output is read back before it
takes its name, and any difference is an error that leaves nothing behind.

Two kinds of check, both on the output as written:

- bytes: every range the copy writes is checked as it is written, its CRC
  taken from the very bytes handed to the write, against the CRC the input
  gives it (``ckptool.write.copy``; ``check_bytes`` collects the verdict of
  its ``ByteChecker``): every byte is read once and written once;
- structure: the output is read as a checkpoint again, and every tensor
  must be the one the plan wants (key, shape, stride, offset, dtype,
  device, storage: ``check_tensors``), and its own index (a zip directory,
  a safetensors header, a legacy file's records) must point at exactly the
  bytes that were checked (``check_storages``, ``check_directory``,
  ``check_offsets``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ckptool.errors import CorruptCheckpointError
from ckptool.model import Checkpoint, TensorInfo
from ckptool.read.formats.base import RawRead
from ckptool.read.reader import open_checkpoint, tensor_info
from ckptool.read.tensor_data import TensorData
from ckptool.read.walk import walk
from ckptool.read.ziparchive import ZipArchive, ZipError
from ckptool.write.bytecheck import ByteChecker
from ckptool.write.fix.plan import Plan
from ckptool.write.zipwriter import Written

# where each output storage's (or tensor's) bytes are, and how many
Placed = dict[str, tuple[int, int]]  # storage id or tensor name -> (offset, size)
_BUG = "nothing was written; report this as a bug"


def check_bytes(checker: ByteChecker) -> None:
    """The checker's verdict; any range whose bytes differ is an error."""
    failed = checker.finish()
    if failed:
        raise CorruptCheckpointError(
            f"the output's {failed[0]} does not match what was written",
            "the input may be damaged (a record that fails its own checksum), or the "
            "disk is; nothing was written")


def check_storages(path: str, plan: Plan, placed: Placed) -> int:
    """Read the written file back; compare it with the plan. Returns storages checked.

    Metadata through a fresh read of ``path``; the bytes were CRC-checked as
    they were written (``ByteChecker``), and here the file's own
    records must point at exactly those bytes."""
    try:
        written = open_checkpoint(path)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"the output does not read back: {exc.message}",
                                     _BUG) from exc
    check_tensors(written, plan)
    with TensorData(written) as reader:
        for sid, (offset, size) in placed.items():
            # the output's own directory must point at the bytes checked here
            if reader.storage_offset(sid) != offset or written.storages[sid].nbytes > size:
                raise CorruptCheckpointError(f"storage {sid} of the output is misplaced",
                                             _BUG)
    return len(placed)


def check_tensors(written: Checkpoint | RawRead, plan: Plan) -> None:
    """Every tensor read back from the output is the one the plan wants."""
    want = {key: rec for key, rec in walk(plan.root).tensors}
    if isinstance(written, RawRead):
        got = {key: tensor_info(key, rec) for key, rec in walk(written.root).tensors}
    else:
        got = {t.key: t for t in written.tensors}
    if set(want) != set(got):
        missing = sorted(set(want) ^ set(got))[:3]
        raise CorruptCheckpointError(f"the output's keys differ from the plan: {missing}",
                                     _BUG)
    for key, rec in want.items():
        if _fields(got[key]) != _fields(_planned(tensor_info(key, rec), plan)):
            raise CorruptCheckpointError(f"the output's {key} does not match the plan",
                                         _BUG)


def _planned(t: TensorInfo, plan: Plan) -> TensorInfo:
    """A tensor of the input as the plan writes it: cast, retargeted."""
    if t.parts:  # a sparse tensor: its parts are, and it is where its values are
        parts = tuple(_planned(p, plan) for p in t.parts)
        main = next((p for p in parts if p.key.endswith("/values")), parts[0])
        return dataclasses.replace(t, dtype=main.dtype, location=main.location, parts=parts)
    sid = t.storage or ""
    return dataclasses.replace(t, dtype=plan.casts[sid][1] if sid in plan.casts else t.dtype,
                               location=plan.retargets.get(sid, t.location))


def _fields(t: TensorInfo) -> tuple[Any, ...]:
    """What must match: where and what it is, and the same of its parts."""
    return (t.shape, t.stride, t.storage_offset, t.dtype, t.location, t.storage, t.layout,
            tuple(_fields(p) for p in t.parts))


def check_directory(path: str, records: list[Written]) -> None:
    """The written zip's own directory and local headers must list exactly
    the planned records, at the offsets whose bytes were checked."""
    try:
        with open(path, "rb") as f:
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
        raise CorruptCheckpointError(f"the output's zip directory is wrong: {exc}", _BUG) from exc


def check_offsets(path: str, expect: dict[str, tuple[tuple[int, ...], str]],
                  starts: dict[str, int], by_key: bool = False) -> None:
    """A written state dict (``convert``'s output): names, shapes and dtypes
    from a fresh read of ``path`` (``by_key``: every tensor of a nested tree,
    by key); each tensor's bytes were CRC-checked as they were written, and
    here the file must point at them."""
    written = open_checkpoint(path)
    got = {t.key: t for t in written.tensors} if by_key else \
        written.state_dict() or {t.key: t for t in written.tensors}
    if {k: (t.shape, t.dtype) for k, t in got.items()} != expect:
        raise CorruptCheckpointError("the converted file's tensors differ from the input's",
                                     _BUG)
    with TensorData(written) as reader:
        for name, start in starts.items():
            t = got[name]
            at = reader.storage_offset(t.storage) if t.storage is not None else -1
            if at != start:
                raise CorruptCheckpointError(f"the converted {name} does not match its bytes",
                                             _BUG)
