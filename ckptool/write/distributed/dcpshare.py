"""A rank's share of a DCP output: its tensors handed to one ``dcp.save`` of
every rank (torch writes ``__<rank>_0.distcp`` for each, and rank 0 the
``.metadata`` once all have written), then read back and checked.

A DCP file's offsets live in the ``.metadata`` torch writes at the end, so
a rank's file can be kept by a re-run only whole: each rank records, in
the staging directory, the write results torch returned for its file (the
``.metadata``'s part for it), the file's size and CRC, and what it was
asked to write. A re-run on as many ranks, with the same items for this
rank, that finds the file of that size and CRC hands torch the recorded
results instead of writing it again.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from typing import Any

from ckptool.errors import CkptoolError, OutputError
from ckptool.read.reader import open_checkpoint
from ckptool.write.convert.dcpwriter import ElsewhereError, check_values, write_dcp
from ckptool.write.distributed.coordinate import Coordinator
from ckptool.write.distributed.plan import Plan
from ckptool.write.distributed.staging import Staging
from ckptool.write.failures import output_error
from ckptool.write.fastcrc import crc_file_range
from ckptool.write.sources import TensorSource


def write_share(plan: Plan, world: Any, coord: Coordinator, staging: Staging,
                tensors: TensorSource, durable: bool,
                advance: Callable[[int], None]) -> dict[str, Any]:
    """This rank's tensors through one ``dcp.save`` of every rank; then the
    values it wrote read back (every rank returns from ``dcp.save`` once the
    metadata is written). Another rank's failure inside ``dcp.save`` reaches
    every rank; it is that rank's to say."""
    rank = coord.rank
    share = plan.share(rank)
    nbytes = sum(u.nbytes for u in share)
    crcs: dict[str, int] = {}
    done = [0]

    def step(n: int) -> None:
        done[0] += n
        advance(done[0])

    record = RankFile(staging, rank, plan.size)
    # every rank ready (or a failure heard) before the first collective call,
    # which would wait for a rank that failed on its way there
    coord.publish(f"dcp-ready/{rank}", "1")
    for r in range(plan.size):
        coord.wait_for(f"dcp-ready/{r}")
    try:
        world.ensure_group()  # gloo: dcp.save is collective
        write_dcp(plan.job.written, tensors, str(staging.path), staging.target, durable, step,
                  crcs, names=[u.name for u in share], distributed=True, resume=record)
    except ElsewhereError as exc:
        raise coord.heard_from(exc.rank, exc) from exc
    except OutputError as exc:  # this rank's own write failed
        raise _full(staging, nbytes) or exc from exc
    except RuntimeError as exc:  # gloo: a peer went away inside a collective call
        raise coord.heard_from(None, CkptoolError(
            f"a process stopped answering during dcp.save ({_first_line(exc)})")) from exc
    if record.reused:
        advance(nbytes)
    else:
        check_values(open_checkpoint(str(staging.path)), crcs)
    return {"tensors": len(share), "files": [f"__{rank}_0.distcp"],
            "bytes_read": 0 if record.reused else sum(u.read for u in share),
            "bytes_written": 0 if record.reused else nbytes,
            "bytes_kept": nbytes if record.reused else 0}


def _full(staging: Staging, share: int) -> OutputError | None:
    """The disk-full error, when torch's writer failed with the filesystem
    out of room for this rank's share (``share`` bytes, at least 1 MiB).
    (torch hands each rank's error to every rank pickled, without the
    ``OSError`` it was raised from: the zip writer's "unexpected pos" is all
    that is left of a write cut short.)"""
    try:
        free = shutil.disk_usage(staging.path).free
    except OSError:
        return None
    if free >= max(share, 1 << 20):
        return None
    return output_error(staging.target, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))


class RankFile:
    """The record of this rank's ``.distcp`` file (``ckptool.write.convert.dcpwriter.Resume``)."""

    def __init__(self, staging: Staging, rank: int, size: int) -> None:
        self.staging, self.rank, self.size = staging, rank, size
        self.path = staging.meta / f"dcp-{rank}.json"
        self.reused = False

    def _asked(self, plan: Any) -> list[Any]:
        """What torch asks this rank to write: its file prefix and items."""
        items = sorted([i.index.fqn, list(i.index.offset) if i.index.offset is not None else None,
                        i.type.name] for i in plan.items)
        return [self.rank, self.size, str(plan.storage_data.prefix), items]

    def kept(self, plan: Any) -> list[Any] | None:
        try:
            record = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("asked") != self._asked(plan):
            return None
        for name, (size, crc) in record["files"].items():
            path = self.staging.file(name)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                return None
            try:
                if os.fstat(fd).st_size != size or crc_file_range(fd, 0, size) != crc:
                    return None
            finally:
                os.close(fd)
        self.reused = True
        return [_result(r) for r in record["results"]]

    def record(self, plan: Any, results: list[Any]) -> None:
        files = {}
        for name in sorted({r.storage_data.relative_path for r in results}):
            fd = os.open(self.staging.file(name), os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                files[name] = [size, crc_file_range(fd, 0, size)]
            finally:
                os.close(fd)
        data = {"asked": self._asked(plan), "files": files,
                "results": [_plain(r) for r in results]}
        temp = self.path.with_name(self.path.name + ".tmp")
        temp.write_text(json.dumps(data))
        os.replace(temp, self.path)


def _plain(result: Any) -> dict[str, Any]:
    """A torch WriteResult as JSON."""
    info = result.storage_data
    return {"fqn": result.index.fqn,
            "offset": list(result.index.offset) if result.index.offset is not None else None,
            "index": result.index.index, "size": result.size_in_bytes,
            "file": info.relative_path, "at": info.offset, "length": info.length,
            "transforms": list(info.transform_descriptors or []) or None}


def _result(plain: dict[str, Any]) -> Any:
    """A WriteResult again, as torch's FileSystemWriter made it."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    offset = torch.Size(plain["offset"]) if plain["offset"] is not None else None
    return WriteResult(MetadataIndex(plain["fqn"], offset, plain["index"]), plain["size"],
                       _StorageInfo(plain["file"], plain["at"], plain["length"],
                                    plain["transforms"]))


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
