"""``convert`` into a directory: Hugging Face shards (``hf``: safetensors,
``hf-bin``: torch zips, each with its index) or a ``torch.distributed.checkpoint``
directory (``dcp``), from any checkpoint ckptool reads.

The directory is written beside the target and renamed into place when it
is complete and verified (``ckptool.write.outdir``). Each shard is written
as ``convert`` writes one file (every byte re-read, names, shapes and dtypes
read back), the index last; then the whole directory is read back as a
checkpoint and must hold what was planned.

DCP is written by ``torch.distributed.checkpoint``'s own ``FileSystemWriter``
in this one process, so that ``dcp.load`` and ``dcp_to_torch_save`` read it
as theirs. The state dict it is handed holds ``meta`` tensors (shape and
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
import shutil
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ckptool.errors import CkptoolError, CorruptCheckpointError, OutputError
from ckptool.keys import escape, unescape
from ckptool.model import Checkpoint
from ckptool.read.layouts import tensor_bytes
from ckptool.read.layouts.dcp import nest
from ckptool.read.reader import open_checkpoint
from ckptool.write import shards
from ckptool.write.convert.files import write_safetensors, write_torch
from ckptool.write.convert.job import Job, hf_files, hf_index
from ckptool.write.convert.plan import Written
from ckptool.write.outdir import AtomicDirectory
from ckptool.write.results import ConvertResult
from ckptool.write.sources import TensorSource

if TYPE_CHECKING:
    import torch

Progress = Callable[[int, int], None]
_BUG = "this is a bug in ckptool; nothing was written"


def convert(job: Job, *, force: bool = False, progress: Progress | None = None,
            fsync: bool = False) -> ConvertResult:
    """Write a planned conversion into a directory (hf, hf-bin, dcp)."""
    result = job.result
    result.files, result.bytes_written = write_directory(
        job.source, job.written, job.kind, job.dst, force=force, fsync=fsync,
        progress=progress, planned=None if job.kind == "dcp" else job.shards,
        extras=job.extras, stem=job.stem)
    return result


def write_directory(source: Checkpoint, written: Written, kind: str, dst: str, *,
                    force: bool = False, fsync: bool = False, progress: Progress | None = None,
                    planned: list[shards.Shard] | None = None,
                    extras: Sequence[tuple[str, str]] = (),
                    stem: str | None = None) -> tuple[list[str], int]:
    """Write ``written`` (of ``source``) as directory ``dst`` of ``kind``, in
    the ``planned`` shards (hf, hf-bin; the index named for ``stem``), with
    the files ``extras`` ((path, name in dst)) copied as they are; returns
    its files and their bytes."""
    total = sum(written.nbytes(n) for n in written.tensors)
    with AtomicDirectory(dst, force, fsync, source=source.directory or source.path) as outdir, \
            TensorSource(source) as tensors:
        crcs: dict[str, int] = {}
        if kind == "dcp":
            files = _write_dcp(written, tensors, outdir, _Overall(progress, total), crcs)
        else:
            assert planned is not None
            files = _write_hf(written, kind, tensors, outdir, planned, _Overall(progress, total),
                              stem)
        for path, name in extras:
            with open(path, "rb") as f, \
                    outdir.file(name) as out:
                shutil.copyfileobj(f, out.file)
                out.file.flush()
                out.commit()
            files.append(name)
        back = _check_whole(outdir.path, written, kind)
        _check_values(back, crcs)
        outdir.commit()
    return files, back.file_size


class _Overall:
    """Progress over the whole job (the tensor bytes of every file), from
    each file's own; it never goes back."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress, self.total, self.base, self.shown = progress, max(total, 1), 0, 0

    def _show(self, done: int) -> None:
        self.shown = max(self.shown, min(done, self.total))
        if self.progress is not None:
            self.progress(self.shown, self.total)

    def part(self, nbytes: int) -> Progress | None:
        """The progress of a file holding ``nbytes`` of tensors (and headers)."""
        if self.progress is None:
            return None
        base = self.base
        return lambda done, _total: self._show(base + min(done, nbytes))

    def advance(self, nbytes: int) -> None:
        self.base += nbytes
        self._show(self.base)


def _write_hf(written: Written, kind: str, tensors: TensorSource, outdir: AtomicDirectory,
              planned: list[shards.Shard], overall: _Overall, stem: str | None) -> list[str]:
    names = []
    for (name, part, meta), shard in zip(hf_files(written, kind, planned), planned, strict=True):
        if meta is not None:
            write_safetensors(part, meta, tensors, outdir.file(name), overall.part(shard.nbytes))
        else:
            write_torch(part, tensors, outdir.file(name), overall.part(shard.nbytes))
        overall.advance(shard.nbytes)
        names.append(name)
    index = hf_index(written, kind, planned, stem)
    if index is not None:
        with outdir.file(index[0]) as out:
            out.file.write(index[1])
            out.file.flush()
            out.commit()
        names.append(index[0])
    return names


def _write_dcp(written: Written, tensors: TensorSource, outdir: AtomicDirectory,
               overall: _Overall, crcs: dict[str, int]) -> list[str]:
    """Write through torch's FileSystemWriter; ``crcs`` gets each tensor's
    values' CRC by its DCP key."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    metas = {n: torch.empty(t.shape, dtype=_dtype(written.dtype(n)), device="meta")
             for n, t in written.tensors.items()}
    flat: dict[str, Any] = dict(metas)
    flat.update((a, metas[k]) for a, k in written.aliases.items())
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
            overall.advance(written.nbytes(name))
            last.append(values)
            return values

    # no copy-ahead: with CUDA present torch would otherwise ask for tensors
    # before writing the ones it has, and release() must free only written ones
    writer = dcp.FileSystemWriter(outdir.path, single_file_per_rank=True,
                                  sync_files=outdir.durable, thread_count=1,
                                  per_thread_copy_ahead=0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled..." and the like
            dcp.save(state, storage_writer=writer, planner=Planner(), no_dist=True)
    except dcp.CheckpointException as exc:  # (a BaseException: Ctrl-C is wrapped too)
        raise _failure(exc, outdir) from exc
    release()
    return sorted(os.listdir(outdir.path))


def _failure(exc: BaseException, outdir: AtomicDirectory) -> BaseException:
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
    return OutputError(f"cannot write {outdir.target}: torch's DCP writer failed: {said}",
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


def _check_whole(path: str, written: Written, kind: str) -> Checkpoint:
    """The written directory, read back as a checkpoint: it holds the
    planned names, shapes and dtypes, aliases too (torch shards and DCP
    share storage; an index records the ties of safetensors shards, and they
    read back as tensors of their own, as one safetensors file's
    ``__metadata__`` records them)."""
    back = open_checkpoint(path)
    expect = {n: (t.shape, written.dtype(n)) for n, t in written.tensors.items()}
    expect.update({a: expect[k] for a, k in written.aliases.items()})
    want = {escape(".".join(str(p) for p in written.paths.get(n, (n,)))): v
            for n, v in expect.items()}
    have = {t.key: (t.shape, t.dtype) for t in back.tensors
            if kind != "dcp" or t.chunks}
    if have != want:
        odd = sorted(set(want) ^ set(have)) or sorted(k for k in want if want[k] != have[k])
        raise CorruptCheckpointError(
            f"the written directory's tensors differ from the plan (e.g. {odd[0]})", _BUG)
    return back


def _check_values(back: Checkpoint, crcs: dict[str, int]) -> None:
    """Every tensor written through torch's DCP writer reads back with the
    CRC of the values handed to it."""
    for t in back.tensors:
        crc = crcs.get(unescape(t.key))
        if crc is not None and _crc(tensor_bytes.read_tensor(back, t)) != crc:
            raise CorruptCheckpointError(
                f"{t.key} reads back from the written DCP directory with other values "
                "than were written", _BUG)
