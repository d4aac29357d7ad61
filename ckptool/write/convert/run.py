"""``ckptool convert``: torch checkpoints to safetensors and back, and the
weights of the torch files ``fix`` cannot rewrite (TorchScript archives,
plain pickles) into a torch zip, as a pipeline (read, plan, lay out, copy,
verify, commit: see ``ckptool.write.fix.run``).

torch -> safetensors writes the main state dict (of any torch format,
legacy, TorchScript and plain pickles included). safetensors cannot share
memory, so tied weights (exact aliases: same storage, offset, shape, stride
and dtype) are written once and the other names recorded under
``ckptool.aliases`` in ``__metadata__``; other views and non-contiguous
tensors are written as their own contiguous copies. Plain non-tensor entries
go to ``__metadata__`` as JSON under ``ckptool.entries``; everything else is
reported as left out, never silently dropped.

safetensors -> torch writes a torch zip state dict (``torch.save``'s layout),
restoring the recorded aliases as tensors that share storage again.
TorchScript or a plain pickle -> torch writes its main state dict the same
way: tied weights share one storage again, other views are their own
contiguous copies, and the rest (entries, sparse and quantized tensors,
tensors outside the state dict) is reported as left out. A torch.save file
is ``fix``'s to rewrite (``fix --extract`` keeps only its state dict).

A checkpoint of many files (Hugging Face shards, a DCP directory) converts
the same way, into one file or into a directory (``--format hf``, ``hf-bin``
or ``dcp``: ``ckptool.write.convert.directory``); which names and values are
written is ``ckptool.write.convert.plan``'s to decide, where each tensor's
bytes come from ``ckptool.write.sources``'s (a DCP tensor is made whole from
its chunks, one tensor at a time).

Every output streams tensor bytes into a temporary file, each byte read
once and written once with its CRC checked from the bytes written
(``ckptool.write.copy``), reads the file's records back to check names,
shapes and dtypes, then renames it into place.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ckptool.write.commit import AtomicOutput
from ckptool.write.convert.files import write_safetensors, write_torch
from ckptool.write.convert.job import Job, output_format, prepare
from ckptool.write.failures import needing
from ckptool.write.outdir import check_apart
from ckptool.write.outlock import OutputLock
from ckptool.write.results import ConvertResult
from ckptool.write.sources import TensorSource
from ckptool.write.streamhash import Streams

__all__ = ["ConvertResult", "convert", "output_format", "write"]

Progress = Callable[[int, int], None]


def convert(src: str, dst: str, *, force: bool = False, progress: Progress | None = None,
            fsync: bool = False, fmt: str | None = None, max_shard_size: int | None = None,
            dtype: str | None = None, weights: str | None = None,
            salvage: bool = False, streams: Streams | None = None,
            unstack_layers: bool = False, hf_map: str | None = None) -> ConvertResult:
    """Convert ``src`` into ``dst``: one file (the format from its extension)
    or a directory of ``fmt`` (hf, hf-bin, dcp), its floating tensors cast to
    ``dtype`` if given; of a DeepSpeed checkpoint, ``weights="module"``
    writes the module's (half-precision) weights instead of the fp32
    masters. The output is durable on disk before this returns when
    ``fsync`` is set or it replaces a file. A checkpoint whose verdict is
    unsafe is refused unless ``salvage`` (convert writes no byte of its
    pickles: tensors, and plain values it pickles itself). Of a Megatron
    checkpoint, ``unstack_layers`` writes one tensor per layer, ``hf_map`` the
    Hugging Face model of that name (``ckptool.read.megatron.views``)."""
    job = prepare(src, dst, fmt=fmt, max_shard_size=max_shard_size, dtype=dtype,
                  weights=weights, salvage=salvage, unstack_layers=unstack_layers,
                  hf_map=hf_map)  # 1. read, 2. plan
    return write(job, force=force, progress=progress, fsync=fsync, streams=streams)


def write(job: Job, *, force: bool = False, progress: Progress | None = None,
          fsync: bool = False, streams: Streams | None = None) -> ConvertResult:
    """Write a planned conversion in this one process (``streams``: each
    file's hashes taken as it is written, for ``--manifest``)."""
    # OUT is not the input, by any name (a link to it, a path through one)
    check_apart(Path(job.source.directory or job.source.path), Path(job.dst))
    needs = sum(job.written.nbytes(n) for n in job.written.tensors)
    with OutputLock(job.dst), needing(needs):  # one writer of OUT, on one process or many
        return _write(job, force, progress, fsync, streams)


def _write(job: Job, force: bool, progress: Progress | None, fsync: bool,
           streams: Streams | None) -> ConvertResult:
    if job.is_directory:
        from ckptool.write.convert import directory as convert_dir

        return convert_dir.convert(job, force=force, progress=progress, fsync=fsync,
                                   streams=streams)
    result = job.result
    with TensorSource(job.source) as tensors:
        output = AtomicOutput(job.dst, force, fsync)
        if job.kind == "safetensors":
            result.bytes_written = write_safetensors(job.written, job.meta, tensors, output,
                                                     progress, streams)
        else:
            result.bytes_written = write_torch(job.written, tensors, output, progress,
                                               streams)
    return result
