"""``convert`` into a directory: Hugging Face shards (``hf``: safetensors,
``hf-bin``: torch zips, each with its index) or a ``torch.distributed.checkpoint``
directory (``dcp``), from any checkpoint ckptool reads.

The directory is written beside the target and renamed into place when it
is complete and verified (``ckptool.write.outdir``). Each shard is written
as ``convert`` writes one file (every byte CRC-checked as it is written,
names, shapes and dtypes read back), the index last; then the whole directory is read back as a
checkpoint and must hold what was planned.

DCP is written by torch's own writer (``ckptool.write.convert.dcpwriter``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ckptool.errors import CorruptCheckpointError
from ckptool.keys import escape
from ckptool.model import Checkpoint
from ckptool.read.reader import open_checkpoint
from ckptool.write import shards
from ckptool.write.convert.dcpwriter import check_values, write_dcp
from ckptool.write.convert.files import write_safetensors, write_torch
from ckptool.write.convert.folder import Extra, top_names, write_extras
from ckptool.write.convert.job import Job, hf_files, hf_index
from ckptool.write.convert.plan import Written
from ckptool.write.failures import needing
from ckptool.write.outdir import AtomicDirectory
from ckptool.write.results import ConvertResult
from ckptool.write.sources import TensorSource
from ckptool.write.streamhash import Streams

if TYPE_CHECKING:
    pass

Progress = Callable[[int, int], None]
_BUG = "this is a bug in ckptool; nothing was written"


def convert(job: Job, *, force: bool = False, progress: Progress | None = None,
            fsync: bool = False, streams: Streams | None = None) -> ConvertResult:
    """Write a planned conversion into a directory (hf, hf-bin, dcp)."""
    result = job.result
    result.files, result.bytes_written = write_directory(
        job.source, job.written, job.kind, job.dst, force=force, fsync=fsync,
        progress=progress, planned=None if job.kind == "dcp" else job.shards,
        extras=job.extras, stem=job.stem, streams=streams)
    return result


def write_directory(source: Checkpoint, written: Written, kind: str, dst: str, *,
                    force: bool = False, fsync: bool = False, progress: Progress | None = None,
                    planned: list[shards.Shard] | None = None,
                    extras: Sequence[Extra] = (),
                    stem: str | None = None,
                    streams: Streams | None = None) -> tuple[list[str], int]:
    """Write ``written`` (of ``source``) as directory ``dst`` of ``kind``, in
    the ``planned`` shards (hf, hf-bin; the index named for ``stem``), with
    the files ``extras`` beside them (``folder``: a framework's); returns
    its files and their bytes."""
    total = sum(written.nbytes(n) for n in written.tensors)
    with needing(total), \
            AtomicDirectory(dst, force, fsync, source=source.directory or source.path,
                            writes=top_names(extras)) as outdir, \
            TensorSource(source) as tensors:
        crcs: dict[str, int] = {}
        if kind == "dcp":
            overall = _Overall(progress, total)
            files = write_dcp(written, tensors, outdir.path, outdir.target, outdir.durable,
                              overall.advance, crcs)
        else:
            assert planned is not None
            files = _write_hf(written, kind, tensors, outdir, planned, _Overall(progress, total),
                              stem, streams)
        files += write_extras(extras, outdir)
        back = check_whole(outdir.path, written, kind)
        check_values(back, crcs)
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
              planned: list[shards.Shard], overall: _Overall, stem: str | None,
              streams: Streams | None = None) -> list[str]:
    names = []
    for (name, part, meta), shard in zip(hf_files(written, kind, planned), planned, strict=True):
        if meta is not None:
            write_safetensors(part, meta, tensors, outdir.file(name), overall.part(shard.nbytes),
                              streams)
        else:
            write_torch(part, tensors, outdir.file(name), overall.part(shard.nbytes), streams)
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


def check_whole(path: str, written: Written, kind: str) -> Checkpoint:
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


