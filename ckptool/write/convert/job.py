"""What one ``convert`` will write, decided before a byte is: the output's
kind, the tensors and names (``convert_plan``), the files (one, or a
directory's shards and its index, and the files of the framework folder it
was read from written beside them: ``folder``), and the report. The same
job is written by one process (``ckptool.write.convert.run``) or by many
(``ckptool.write.distributed``): both lay out the same files from it, so
they write the same bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ckptool.describe import shell_word
from ckptool.errors import UsageError
from ckptool.model import Checkpoint
from ckptool.read.formats.safetensors_fmt import SAFETENSORS
from ckptool.read.layouts import deepspeed_weights
from ckptool.read.layouts.dcp import DCP
from ckptool.read.reader import open_checkpoint, with_state_dict
from ckptool.write import shards
from ckptool.write.convert import loadable
from ckptool.write.convert import plan as convert_plan
from ckptool.write.convert.folder import Extra, adapters_note, modules_note, plan_folder
from ckptool.write.convert.plan import TORCH, WHOLE, Written
from ckptool.write.fix.plan import REWRITABLE
from ckptool.write.flagged import refuse_flagged
from ckptool.write.outdir import check_apart
from ckptool.write.results import ConvertResult

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")
DIRECTORY_FORMATS = ("hf", "hf-bin", "dcp")
FORMATS = {"hf": "hf-safetensors", "hf-bin": "hf-bin", "dcp": "dcp",
           "safetensors": "safetensors", "torch": "torch-zip"}


@dataclass
class Job:
    """One conversion, planned."""

    source: Checkpoint
    dst: str
    kind: str  # safetensors, torch (one file); hf, hf-bin, dcp (a directory)
    written: Written
    result: ConvertResult
    meta: dict[str, str] = field(default_factory=dict)  # one safetensors file's __metadata__
    shards: list[shards.Shard] = field(default_factory=list)  # hf, hf-bin
    stem: str | None = None  # a framework's name for its weights (hf, hf-bin)
    extras: list[Extra] = field(default_factory=list)  # the framework's files, beside

    @property
    def is_directory(self) -> bool:
        return self.kind in DIRECTORY_FORMATS


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


def prepare(src: str, dst: str, *, fmt: str | None = None, max_shard_size: int | None = None,
            dtype: str | None = None, weights: str | None = None,
            salvage: bool = False, unstack_layers: bool = False,
            hf_map: str | None = None) -> Job:
    """Read ``src`` (metadata only) and plan its conversion into ``dst``
    (see ``ckptool.write.convert.run.convert`` for the options)."""
    kind = output_format(dst, fmt)
    if max_shard_size is not None and kind not in ("hf", "hf-bin"):
        raise UsageError("--max-shard-size sizes the shards of --format hf or hf-bin",
                         "leave it out, or write a Hugging Face directory")
    source = open_checkpoint(src)  # 1. read
    refuse_flagged(source, salvage, "convert")
    if weights == "module":
        source = with_state_dict(source, *deepspeed_weights.module_weights(source))
    if source.directory is not None:  # never written into the directory it reads
        check_apart(Path(source.directory), Path(dst))
    config = None
    if unstack_layers or hf_map:  # Megatron's layers one by one, or a Hugging Face model
        from ckptool.read.megatron import views

        if hf_map and kind not in ("hf", "hf-bin"):
            raise UsageError(f"--map {hf_map} writes a Hugging Face directory with its "
                             "config.json", "name OUT without an extension (or --format hf)")
        source, config = views.for_convert(source, unstack_layers, hf_map)
    if kind in DIRECTORY_FORMATS:
        job = _directory_job(source, dst, kind, max_shard_size, dtype)
        if config is not None:
            data = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
            job.extras.append(Extra("config.json", "", data))
        job.result.notes += _view_notes(source)
        return job
    if kind == "safetensors":
        if source.format == SAFETENSORS:
            raise UsageError(f"{src} is already safetensors", "name a torch output: OUT.pth")
        written = convert_plan.plan(source, SAFETENSORS)  # 2. plan
    else:
        if source.format != SAFETENSORS and source.format in REWRITABLE:  # a torch.save file
            # (--dtype too: `fix --extract --dtype` rewrites it)
            raise UsageError(
                f"{src} is already a torch checkpoint ({source.format}): `ckptool fix` "
                "rewrites it", f"to keep only its state dict: `ckptool fix {shell_word(src)} "
                f"--extract -o {shell_word(dst)}`")
        written = convert_plan.plan(source, WHOLE if source.format == DCP else TORCH)
    if dtype is not None:
        convert_plan.cast(written, dtype)
    job = Job(source, dst, kind, written, ConvertResult.of(source, dst, FORMATS[kind], written))
    if kind == "safetensors":
        job.meta = _st_metadata(written)
    lost = modules_note(source, "one file") or adapters_note(source, "one file")
    if lost is not None:
        job.result.notes.append(lost)
    job.result.notes += _view_notes(source)
    return job


def _view_notes(source: Checkpoint) -> list[str]:
    """What a view of derived tensors (``--unstack-layers``, ``--map``) says."""
    return list(source.metadata.get("notes", [])) if source.derived_from is not None else []


def _directory_job(source: Checkpoint, dst: str, kind: str, max_shard_size: int | None,
                   dtype: str | None) -> Job:
    if kind == "dcp":
        written = convert_plan.plan(source, WHOLE if source.format == DCP else TORCH)
    else:
        written = convert_plan.plan(source, SAFETENSORS if kind == "hf" else TORCH,
                                    keep_entries=False)
    if dtype is not None:
        convert_plan.cast(written, dtype)
    job = Job(source, dst, kind, written, ConvertResult.of(source, dst, FORMATS[kind], written))
    if kind == "dcp" and written.aliases:
        pairs = ", ".join(f"{a} = {k}" for a, k in list(written.aliases.items())[:4])
        job.result.notes.append(f"DCP cannot share storage: each tied name is written as its "
                                f"own copy ({pairs})")
    if kind == "dcp":
        lost = modules_note(source, "a DCP checkpoint") or adapters_note(
            source, "a DCP checkpoint")
        job.result.notes += [lost] if lost is not None else []
        return job
    beside = plan_folder(source, dtype)  # the framework's files, and what is not copied
    job.stem, job.extras = beside.stem, beside.extras
    job.result.notes += beside.notes
    job.shards = loadable.plan_shards(written, kind, max_shard_size, job.stem)
    job.result.notes += loadable.loader_notes(source, dst, kind, job.shards, job.stem)
    return job


def hf_files(written: Written, kind: str, planned: list[shards.Shard]) -> list[
        tuple[str, Written, dict[str, str] | None]]:
    """The ``planned`` shards of ``written`` as hf or hf-bin: (name, its part
    of the plan, its safetensors ``__metadata__``; None for a torch shard)."""
    out = []
    for shard in planned:
        part = Written({n: written.tensors[n] for n in shard.tensors},
                       {a: written.aliases[a] for a in shard.aliases},
                       cast=written.cast, location=written.location)
        meta: dict[str, str] | None = None
        if kind == "hf":
            meta = {"format": "pt"}
            if len(planned) == 1:
                meta.update(written.aliases)
        out.append((shard.name, part, meta))
    return out


def hf_index(written: Written, kind: str, planned: list[shards.Shard],
             stem: str | None) -> tuple[str, bytes] | None:
    """The index of more than one shard: (its name, its text); else None."""
    if len(planned) < 2:
        return None
    text = json.dumps(shards.index(planned, written.aliases, kind), indent=2) + "\n"
    return shards.index_name(kind, stem), text.encode()


def _st_metadata(written: Written) -> dict[str, str]:
    meta = {"format": "pt"}
    if written.aliases:
        meta["ckptool.aliases"] = json.dumps(written.aliases)
    if written.entries:
        meta["ckptool.entries"] = json.dumps(written.entries, default=repr)
    return meta
