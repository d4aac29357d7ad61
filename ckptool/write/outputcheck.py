"""Check a rewritten checkpoint against the plan that made it.

``fix`` re-reads what it wrote before the file takes its name: every tensor
read back must be the one the plan wants (key, shape, stride, offset, dtype,
device, storage), and every byte range re-read by a ``ByteChecker`` must
have the CRC it was written with. Any difference is an error and nothing
is put in place.
"""

from __future__ import annotations

from ckptool.errors import CorruptCheckpointError
from ckptool.model import Checkpoint
from ckptool.read.formats.base import RawRead
from ckptool.read.reader import open_checkpoint, tensor_info
from ckptool.read.tensor_data import TensorData
from ckptool.read.walk import walk
from ckptool.write.bytecheck import ByteChecker
from ckptool.write.plan import Plan

# where each output storage's (or tensor's) bytes are, and the CRC they must have
Expected = dict[str, tuple[int, int, int]]  # storage id or name -> (offset, size, crc)
_BUG = "nothing was written; report this as a bug"


def check_bytes(checker: ByteChecker) -> None:
    """Wait for the checker; any range whose bytes differ is an error."""
    failed = checker.finish()
    if failed:
        why = f" (it could not be read back: {checker.problem})" if checker.problem else ""
        raise CorruptCheckpointError(
            f"the output's {failed[0]} does not match what was written{why}",
            "the input may be damaged (a record that fails its own checksum), or the "
            "disk is; nothing was written")


def check_file(path: str, plan: Plan, expected: Expected) -> int:
    """Read the written file back; compare it with the plan. Returns storages checked.

    Metadata through a fresh read of ``path``; the bytes were read back and
    CRC-checked as they were written (``ByteChecker``), and here the file's own
    directory must point at exactly those bytes."""
    try:
        written = open_checkpoint(path)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"the output does not read back: {exc.message}",
                                     _BUG) from exc
    check_tensors(written, plan)
    with TensorData(written) as reader:
        for sid, (offset, size, _) in expected.items():
            # the output's own directory must point at the bytes checked here
            if reader.storage_offset(sid) != offset or written.storages[sid].nbytes > size:
                raise CorruptCheckpointError(f"storage {sid} of the output is misplaced",
                                             _BUG)
    return len(expected)


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
        t = got[key]
        sid = rec.storage.key if rec.storage is not None else None
        dtype = plan.casts[sid][1] if sid in plan.casts else rec.dtype
        location = plan.retargets.get(sid or "", rec.location)
        if (t.shape, t.stride, t.storage_offset, t.dtype, t.location, t.storage) != (
                rec.shape, rec.stride, rec.storage_offset, dtype, location, sid):
            raise CorruptCheckpointError(f"the output's {key} does not match the plan",
                                         _BUG)
