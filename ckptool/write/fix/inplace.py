"""``fix --in-place`` for renames and retargets: rewrite only the pickle.

Key renames and device retargets change ``data.pkl`` and nothing else, so
the tensor bytes stay where they are. A new ``data.pkl`` record, a new
central directory and a new end record are appended; the old ones stay as
dead bytes. The cost follows the pickle's size, not the file's.

Crash safety without a temporary copy: zip readers (torch's miniz, and
ckptool's own) find the archive from the end record nearest the end of the
file. So, in order:

1. a copy of the old end records is written where the new content will end:
   the file still ends with the old end record and loads as the old
   checkpoint, whatever lies before it;
2. the new content is written in front of that copy;
3. ``ftruncate`` cuts the copy off: one atomic metadata operation after
   which the file ends with the new end record and loads as the new one.

The new checkpoint is read back and verified between 2 and 3, as the file
will read once cut (a failure leaves the old one). A kill at any point
leaves the old or the new checkpoint; a Ctrl-C during 3 is held until it is
done (``ckptool.write.interrupt``). Each run grows the file by the new
pickle and directory.

In a directory of shards, 3 is left to the directory's journal
(``pending``: ``ckptool.read.layouts.journal``), which cuts every shard and
replaces the index together. The file is written through its path: a caller
never gives a symbolic link or a file with other hard links (their other
names would change too).
"""

from __future__ import annotations

import contextlib
import io
import os
import zlib
from typing import Any

from ckptool.errors import CorruptCheckpointError, UsageError
from ckptool.model import Checkpoint
from ckptool.read import dispatch
from ckptool.read.formats.torch_zip import open_archive
from ckptool.read.layouts.journal import Step
from ckptool.read.reader import assemble
from ckptool.read.ziparchive import ZipArchive, ZipError
from ckptool.write import repickle, verify
from ckptool.write.fix.plan import Plan, new_pid
from ckptool.write.interrupt import Change
from ckptool.write.zipwriter import ZipWriter

CRASH_ENV = "CKPTOOL_TEST_CRASH_AT"  # tests: die at a named step, as kill -9 would


def supported(plan: Plan) -> bool:
    """Only renames and retargets leave every storage record as it is."""
    return not (plan.casts or plan.dropped or plan.extracted is not None)


def _step(name: str) -> None:
    if os.environ.get(CRASH_ENV) == name:
        os._exit(137)


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def rewrite_in_place(path: str, source: Checkpoint, plan: Plan, change: Change | None = None,
                     pending: list[Step] | None = None) -> int:
    """Apply a rename/retarget plan to the zip at ``path``; returns bytes
    appended. The commit runs as ``change`` commits (Ctrl-C held); with
    ``pending``, it is not made: the journal step that makes it is appended."""
    if not supported(plan):
        raise UsageError("metadata-only rewrite asked for a plan that changes tensor bytes",
                         "this is a bug: such plans are rewritten in full")
    shared: dict[str, Any] = {}
    pickled = repickle.dumps(plan.root, lambda ref: new_pid(ref, plan, shared))
    with open(path, "r+b") as f:
        archive = open_archive(f)
        size = archive.size
        fd = f.fileno()
        tail = os.pread(fd, size - archive.tail_start, archive.tail_start)
        buf = io.BytesIO()
        writer = ZipWriter(buf, start=size)
        root = source.metadata.get("archive_root", "")
        pkl = f"{root}/data.pkl" if root else "data.pkl"
        for name, m in archive.members.items():
            if name == pkl:
                writer.write_bytes(name, pickled)
            else:
                if m.method != 0:
                    raise UsageError(f"{name} is compressed; cannot rewrite in place",
                                     "drop --in-place to write a new file")
                writer.add_existing(name, m.header_offset, m.size, m.crc, m.flags)
        writer.close()
        content = buf.getvalue()
        end = size + len(content)
        _pwrite_all(fd, tail, end)  # 1: the old end records, at the new end
        os.fsync(fd)
        _step("tail-copied")
        _pwrite_all(fd, content, size)  # 2: the new records in front of them
        os.fsync(fd)
        _step("content-written")
        _verify(path, plan, end)
        if pending is not None:  # 3 is the journal's
            pending.append(Step(os.path.basename(path), end, start=size,
                                crc=zlib.crc32(content)))
            return len(content)
        with change.committing() if change else contextlib.nullcontext():
            os.ftruncate(fd, end)  # 3: commit
            os.fsync(fd)
        _step("committed")
    return len(content)


def _verify(path: str, plan: Plan, size: int) -> None:
    """The rewritten file read back as it reads once cut to ``size``: every
    tensor as the plan wants it."""
    try:
        with open(path, "rb") as f:
            raw = dispatch.read_zip(path, ZipArchive(f, size))
        verify.check_tensors(assemble(path, raw, size), plan)
    except (CorruptCheckpointError, ZipError) as exc:
        raise CorruptCheckpointError(getattr(exc, "message", str(exc)),
                                     f"{path} is unchanged; report this as a bug") from exc
