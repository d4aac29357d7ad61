"""``convert`` into a DCP directory, through ``torch.distributed.checkpoint``'s
own ``FileSystemWriter``, so that ``dcp.load`` and ``dcp_to_torch_save``
read it as theirs: in one process, or as one rank's part of a ``dcp.save``
of many (``ckptool.write.distributed``: torch writes ``__<rank>_0.distcp``
per rank, and rank 0 the ``.metadata``).

The state dict it is handed holds ``meta`` tensors (shape and
dtype only); each tensor's values are made when the writer asks for them
(``resolve_data``). The writer keeps a reference to every tensor of a
``.distcp`` file until it closes the file (it would hand them to safetensors
in that format), and, with one thread and no copy-ahead, asks for the next
tensor only once the last one is written: so the last one's memory is given
back then (its storage resized to nothing; the writer never reads a written
tensor again), and memory stays one tensor. Their CRCs are kept, and every tensor
is read back from the written files and must match. What stops the writer
(torch wraps it in a ``CheckpointException``: a full disk, Ctrl-C, an input
that turns out corrupt) is raised as ckptool raises it: the output's
``OutputError`` naming the directory, ``KeyboardInterrupt``, the input's
error.
"""

from __future__ import annotations

import ctypes
import os
import warnings
import zlib
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ckptool.errors import CkptoolError, CorruptCheckpointError, OutputError
from ckptool.keys import unescape
from ckptool.model import Checkpoint
from ckptool.read.layouts import tensor_bytes
from ckptool.read.layouts.dcp import nest
from ckptool.write.convert.plan import Written
from ckptool.write.sources import TensorSource

if TYPE_CHECKING:
    import torch

_BUG = "this is a bug in ckptool; nothing was written"


def write_dcp(written: Written, tensors: TensorSource, path: str, target: Path,
              durable: bool, advance: Callable[[int], None], crcs: dict[str, int],
              names: Collection[str] | None = None, distributed: bool = False,
              resume: Resume | None = None) -> list[str]:
    """Write ``written`` into directory ``path`` (the staging directory of
    ``target``) through torch's FileSystemWriter; ``crcs`` gets each
    tensor's values' CRC by its DCP key. With ``distributed``, this is one
    rank's part of a ``dcp.save`` of every rank (the default process
    group): the tensors ``names`` (and the names tied to them), and the
    plain values on rank 0 only. ``resume`` may keep this rank's file from
    an earlier run (its tensors are then not asked for) and records the one
    written."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    mine = set(written.tensors) if names is None else set(names)
    metas = {n: torch.empty(t.shape, dtype=_dtype(written.dtype(n)), device="meta")
             for n, t in written.tensors.items() if n in mine}
    flat: dict[str, Any] = dict(metas)
    flat.update((a, metas[k]) for a, k in written.aliases.items() if k in mine)
    if not distributed or torch.distributed.get_rank() == 0:
        flat.update(written.entries)
    state = nest(flat, written.paths) if written.paths else flat
    by_path = {written.paths.get(n, (n,)): n for n in flat}
    last: list[torch.Tensor] = []  # the tensor handed over last, written by now

    def release() -> None:
        """The last tensor's memory back: the writer asks for the next item
        only once it has written that one, but keeps a reference to it."""
        for values in last:
            storage = values.untyped_storage()
            if storage.resizable():
                storage.resize_(0)
        last.clear()

    class Planner(DefaultSavePlanner):
        """Values made when the writer asks for them, one tensor at a time."""

        def resolve_data(self, write_item: WriteItem) -> Any:
            release()
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            name = by_path[tuple(self.mappings[write_item.index.fqn])]
            name = written.aliases.get(name, name)
            values = tensors.values(written.tensors[name])
            if name in written.cast:  # fix --dtype
                values = values.to(_dtype(written.cast[name]))
            if not values.untyped_storage().resizable():  # bytes read into a buffer
                values = values.clone()  # torch's own memory, which release() can free
            crcs[write_item.index.fqn] = _crc(values)
            advance(written.nbytes(name))
            last.append(values)
            return values

    # no copy-ahead: with CUDA present torch would otherwise ask for tensors
    # before writing the ones it has, and release() must free only written ones
    writer = _writer_type(resume)(path, single_file_per_rank=True, sync_files=durable,
                                  thread_count=1, per_thread_copy_ahead=0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled..." and the like
            dcp.save(state, storage_writer=writer, planner=Planner(),
                     no_dist=not distributed)
    except dcp.CheckpointException as exc:  # (a BaseException: Ctrl-C is wrapped too)
        failed = sorted(getattr(exc, "failures", None) or {})
        if distributed and failed and torch.distributed.get_rank() not in failed:
            cause = _failure(exc, target)  # another rank's: its own error says it
            raise ElsewhereError(failed[0], str(getattr(cause, "message", cause))) from exc
        raise _failure(exc, target) from exc
    release()
    return sorted(n for n in os.listdir(path) if not n.startswith(".ckptool"))


class ElsewhereError(CkptoolError):
    """This rank's part of a ``dcp.save`` of many was written; another rank's failed."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank


class Resume(Protocol):
    """What keeps a rank's DCP file from an earlier run of the same plan."""

    def kept(self, plan: Any) -> list[Any] | None:
        """The write results of this rank's file for ``plan`` (a SavePlan),
        when an earlier run wrote it and it is intact; else None."""

    def record(self, plan: Any, results: list[Any]) -> None:
        """This rank's file, just written for ``plan``, with its results."""


def _writer_type(resume: Resume | None) -> Any:
    """torch's FileSystemWriter; with ``resume``, one that skips a file kept."""
    import torch.distributed.checkpoint as dcp
    from torch.futures import Future

    if resume is None:
        return dcp.FileSystemWriter
    hook = resume

    class Resuming(dcp.FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            kept = hook.kept(plan)
            if kept is not None:
                done: Future[list[Any]] = Future()
                done.set_result(kept)
                return done
            written = super().write_data(plan, planner)
            hook.record(plan, written.wait())
            return written

    return Resuming


def _failure(exc: BaseException, target: Path) -> BaseException:
    """What stopped torch's writer, as ckptool raises it. torch wraps it in a
    ``CheckpointException`` (each rank's error), and an error inside
    ``torch.save`` of a chunk surfaces as the zip writer's ``RuntimeError``
    (``unexpected pos``) with the ``OSError`` that caused it as its context."""
    failures = getattr(exc, "failures", None) or {0: (exc, None)}
    first = next(iter(failures.values()))[0]
    causes = list(_chain(first))
    for cause in causes:  # Ctrl-C, or the input's own error while its bytes were read
        if isinstance(cause, (KeyboardInterrupt, CkptoolError)):
            return cause
    for cause in causes:
        if isinstance(cause, OSError):
            # the output's (the disk filled...) is named by the AtomicDirectory
            # it is raised through; a read of another file is said as any is
            return cause
    said = (str(first).strip().splitlines() or [type(first).__name__])[0]
    return OutputError(f"cannot write {target}: torch's DCP writer failed: {said}",
                       "this is likely a bug; `ckptool --traceback ...` shows where "
                       "(nothing was left half-written)")


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    assert isinstance(dtype, torch.dtype), name
    return dtype


def _crc(values: torch.Tensor) -> int:
    """The CRC of a contiguous tensor's bytes, read in place (through ctypes:
    a numpy view would pin its storage, which ``release`` must free)."""
    nbytes = values.numel() * values.element_size()
    if nbytes == 0:
        return zlib.crc32(b"")
    return zlib.crc32((ctypes.c_char * nbytes).from_address(values.data_ptr()))


def check_values(back: Checkpoint, crcs: dict[str, int]) -> None:
    """Every tensor written through torch's DCP writer reads back with the
    CRC of the values handed to it."""
    for t in back.tensors:
        crc = crcs.get(unescape(t.key))
        if crc is not None and _crc(tensor_bytes.read_tensor(back, t)) != crc:
            raise CorruptCheckpointError(
                f"{t.key} reads back from the written DCP directory with other values "
                "than were written", _BUG)
