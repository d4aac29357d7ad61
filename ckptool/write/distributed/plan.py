"""Which rank writes what: computed alike on every rank from the metadata.

A conversion (``ckptool.write.convert.job``) writes files; each file's
tensors, in order, are its *units*: a unit is one tensor's bytes and the
small records around it (a zip record's local header and data descriptor;
a file's header goes with its first unit). Units of every file are taken in
the files' order and cut into one contiguous run per rank, balanced by the
bytes written: rank ``r`` takes the units that start in the ``r``-th
``1/N`` of the bytes, so a rank writes at most ``1/N`` of them plus one
tensor, reads the input bytes of those tensors only, and mostly writes whole
files (a file that straddles a cut is written by two ranks at once, each
at its own offsets). A DCP output's units are its tensors: each rank hands
its own to ``dcp.save``.

The plan depends on the checkpoint's metadata, the options and the number
of ranks only, so every rank computes the same one without talking to the
others; its ``fingerprint`` (independent of the number of ranks: a resumed
run may have another) is compared across ranks and recorded in the staging
directory, so that a re-run resumes only the same conversion.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from ckptool import dtypes
from ckptool.model import TensorInfo
from ckptool.write.convert.job import Job, hf_files, hf_index
from ckptool.write.convert.plan import Written


@dataclass(frozen=True)
class OutFile:
    """One file of the output, laid out as the one-process ``convert`` lays it out."""

    name: str  # in the output directory (one file: the output's own name)
    written: Written
    meta: dict[str, str] | None  # safetensors' __metadata__; None: a torch zip


@dataclass(frozen=True)
class Unit:
    """One tensor of one output file."""

    file: int  # index in ``Plan.files``; -1 for a DCP output
    name: str  # the tensor's name in its file's plan (``Written.tensors``)
    nbytes: int  # bytes written
    read: int  # tensor bytes read from the input


@dataclass
class Plan:
    job: Job
    size: int  # ranks
    files: list[OutFile]
    units: list[Unit]
    bounds: list[int] = field(default_factory=list)  # rank r: units[bounds[r]:bounds[r + 1]]
    index: tuple[str, bytes] | None = None  # an HF index: (name, text), written last

    def share(self, rank: int) -> list[Unit]:
        return self.units[self.bounds[rank]:self.bounds[rank + 1]]

    @property
    def total(self) -> int:
        """Tensor bytes the whole job writes."""
        return sum(u.nbytes for u in self.units)

    def rows(self) -> list[dict[str, Any]]:
        """Per rank: the files it writes into, its tensors, their bytes as
        written (``tensor_bytes``: headers aside) and as read from the input
        (``--dry-run``, ``--json``)."""
        out = []
        for rank in range(self.size):
            share = self.share(rank)
            if self.files:
                names = list(dict.fromkeys(self.files[u.file].name for u in share))
            else:  # torch writes one for every rank, empty or not
                names = [f"__{rank}_0.distcp"]
            out.append({"rank": rank, "files": names, "tensors": len(share),
                        "tensor_bytes": sum(u.nbytes for u in share),
                        "bytes_read": sum(u.read for u in share)})
        return out

    def fingerprint(self) -> str:
        """What the output depends on: the input's files (names, sizes,
        times), the output's kind, files and tensors, and where each tensor's
        bytes come from in the input (``--weights module`` reads others than
        the fp32 masters, of the same names and shapes). Where each unit lies
        in its output file is checked unit by unit when a run resumes."""
        h = hashlib.sha256()
        job = self.job
        h.update(json.dumps([job.kind, _identity(job.source.directory
                                                               or job.source.path)]).encode())
        for f in self.files:
            h.update(json.dumps([f.name, f.meta, f.written.aliases, f.written.paths and {
                n: list(p) for n, p in f.written.paths.items()}], default=repr).encode())
            h.update(json.dumps([[n, f.written.dtype(n), list(t.shape), _source(t)]
                                 for n, t in f.written.tensors.items()]).encode())
        if self.index is not None:
            h.update(self.index[1])
        return h.hexdigest()[:32]


def make(job: Job, size: int) -> Plan:
    """The plan of ``job`` on ``size`` ranks."""
    written = job.written
    if job.kind == "dcp":
        files: list[OutFile] = []
        units = [_unit(-1, written, n) for n in written.tensors]
    else:
        if job.is_directory:
            files = [OutFile(name, part, meta)
                     for name, part, meta in hf_files(written, job.kind, job.shards)]
        else:
            files = [OutFile(os.path.basename(job.dst.rstrip("/")), written,
                             job.meta if job.kind == "safetensors" else None)]
        units = [_unit(i, f.written, n) for i, f in enumerate(files) for n in f.written.tensors]
    plan = Plan(job, size, files, units, assign([u.nbytes for u in units], size))
    if job.is_directory and job.kind != "dcp":
        plan.index = hf_index(written, job.kind, job.shards, job.stem)
    return plan


def _unit(file: int, written: Written, name: str) -> Unit:
    t = written.tensors[name]
    return Unit(file, name, written.nbytes(name), t.numel * dtypes.itemsize(t.dtype))


def assign(sizes: list[int], ranks: int) -> list[int]:
    """Cut items of ``sizes`` bytes, in order, into ``ranks`` contiguous runs:
    item ``i`` goes to the rank in whose ``1/ranks`` of the total bytes it
    starts. Returns the ``ranks + 1`` bounds."""
    total = sum(sizes)
    bounds = [0] * (ranks + 1)
    at = 0
    rank = 0
    for i, size in enumerate(sizes):
        owner = min(ranks - 1, at * ranks // total) if total else 0
        while rank < owner:
            rank += 1
            bounds[rank] = i
        at += size
    for r in range(rank + 1, ranks + 1):
        bounds[r] = len(sizes)
    return bounds


def _source(t: TensorInfo) -> list[object]:
    """Where a tensor's bytes are read from."""
    return [t.file, t.key, t.storage, t.storage_offset, t.dtype,
            list(t.stride) if t.stride is not None else None,
            [[c.file, c.byte_offset, c.byte_length] for c in t.chunks]]


def _identity(path: str) -> list[object]:
    """The input's files as they are now: (name, size, modification time)."""
    try:
        if os.path.isdir(path):
            entries = sorted(os.scandir(path), key=lambda e: e.name)
            return [[e.name, e.stat().st_size, e.stat().st_mtime_ns] for e in entries
                    if e.is_file()]
        st = os.stat(path)
    except OSError:
        return [path]
    return [[path, st.st_size, st.st_mtime_ns]]
