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

Every output streams tensor bytes into a temporary file, re-reads every
byte it wrote (CRC), reads the file back to check names, shapes and dtypes,
then renames it into place.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ckptool.describe import shell_word
from ckptool.errors import UsageError
from ckptool.read.formats.safetensors_fmt import SAFETENSORS
from ckptool.read.layouts import deepspeed
from ckptool.read.reader import open_checkpoint, with_state_dict
from ckptool.write.commit import AtomicOutput
from ckptool.write.convert import plan as convert_plan
from ckptool.write.convert.files import write_safetensors, write_torch
from ckptool.write.convert.plan import TORCH, WHOLE, Written
from ckptool.write.fix.plan import REWRITABLE
from ckptool.write.flagged import refuse_flagged
from ckptool.write.outdir import check_apart
from ckptool.write.results import ConvertResult
from ckptool.write.sources import TensorSource

__all__ = ["ConvertResult", "convert", "output_format"]

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")
DIRECTORY_FORMATS = ("hf", "hf-bin", "dcp")
Progress = Callable[[int, int], None]


def output_format(dst: str, fmt: str | None) -> str:
    """What ``dst`` (with ``--format``) asks for: safetensors or torch (one
    file, from its extension), or a directory: hf (the default), hf-bin, dcp."""
    suffix = Path(dst).suffix.lower()
    one = "safetensors" if suffix == ".safetensors" else "torch" if suffix in TORCH_SUFFIXES \
        else None
    if dst.endswith(("/", "\\")):  # named as a directory
        one = None
    if fmt is not None:
        if one is not None:
            raise UsageError(f"--format {fmt} writes a directory, and {dst!r} is named as "
                             f"a {one} file", "name the output directory without an extension")
        return fmt
    if one is None and dst.endswith(("/", "\\")):
        return "hf"
    if one is None and suffix and not dst.endswith(("/", "\\")):
        raise UsageError(f"cannot tell the output format from {dst!r}",
                         "name it *.safetensors, or *.pt / *.pth / *.bin for torch, or give "
                         "--format hf / hf-bin / dcp for a directory")
    return one or "hf"


def convert(src: str, dst: str, *, force: bool = False, progress: Progress | None = None,
            fsync: bool = False, fmt: str | None = None, max_shard_size: int | None = None,
            dtype: str | None = None, weights: str | None = None,
            salvage: bool = False) -> ConvertResult:
    """Convert ``src`` into ``dst``: one file (the format from its extension)
    or a directory of ``fmt`` (hf, hf-bin, dcp), its floating tensors cast to
    ``dtype`` if given; of a DeepSpeed checkpoint, ``weights="module"``
    writes the module's (half-precision) weights instead of the fp32
    masters. The output is durable on disk before this returns when
    ``fsync`` is set or it replaces a file. A checkpoint whose verdict is
    unsafe is refused unless ``salvage`` (convert writes no byte of its
    pickles: tensors, and plain values it pickles itself)."""
    kind = output_format(dst, fmt)
    if max_shard_size is not None and kind not in ("hf", "hf-bin"):
        raise UsageError("--max-shard-size sizes the shards of --format hf or hf-bin",
                         "leave it out, or write a Hugging Face directory")
    source = open_checkpoint(src)  # 1. read
    refuse_flagged(source, salvage, "convert")
    if weights == "module":
        source = with_state_dict(source, *deepspeed.module_weights(source))
    if source.directory is not None:  # never written into the directory it reads
        check_apart(Path(source.directory), Path(dst))
    if kind in DIRECTORY_FORMATS:
        from ckptool.write.convert import directory as convert_dir

        return convert_dir.convert(source, dst, kind, force=force, progress=progress,
                                   fsync=fsync, max_shard_size=max_shard_size, dtype=dtype)
    if kind == "safetensors":
        if source.format == SAFETENSORS:
            raise UsageError(f"{src} is already safetensors", "name a torch output: OUT.pth")
        written = convert_plan.plan(source, SAFETENSORS)  # 2. plan
        if dtype is not None:
            convert_plan.cast(written, dtype)
        result = ConvertResult.of(source, dst, "safetensors", written)
        with TensorSource(source) as tensors:
            result.bytes_written = write_safetensors(
                written, _st_metadata(written), tensors, AtomicOutput(dst, force, fsync),
                progress)
        return result
    if source.format != SAFETENSORS and source.format in REWRITABLE:  # a torch.save file
        # (--dtype too: `fix --extract --dtype` rewrites it)
        raise UsageError(
            f"{src} is already a torch checkpoint ({source.format}): `ckptool fix` rewrites it",
            f"to keep only its state dict: `ckptool fix {shell_word(src)} --extract -o "
            f"{shell_word(dst)}`")
    written = convert_plan.plan(source, WHOLE if source.format == "dcp" else TORCH)
    if dtype is not None:
        convert_plan.cast(written, dtype)
    result = ConvertResult.of(source, dst, "torch-zip", written)
    with TensorSource(source) as tensors:
        result.bytes_written = write_torch(written, tensors, AtomicOutput(dst, force, fsync),
                                           progress)
    return result


def _st_metadata(written: Written) -> dict[str, str]:
    meta = {"format": "pt"}
    if written.aliases:
        meta["ckptool.aliases"] = json.dumps(written.aliases)
    if written.entries:
        meta["ckptool.entries"] = json.dumps(written.entries, default=repr)
    return meta

