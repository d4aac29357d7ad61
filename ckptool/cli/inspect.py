"""``ckptool inspect``: what is in a checkpoint; the command and its JSON
report (the text view: ``inspect_text.py``).

``inspect_dict`` is the ``--json`` schema, pure data in and plain dicts out,
so the schema is one function that tests and the docs describe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ckptool.cli import json_lines
from ckptool.cli.common import SCHEMA_VERSION, console, one_shot, write_json
from ckptool.cli.inputs import InputPath
from ckptool.keys import Filter

if TYPE_CHECKING:
    from ckptool.model import Checkpoint, Chunk, FileInfo, StorageInfo, TensorInfo


@click.command()
@click.argument("path", type=InputPath())
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")
@click.option("--filter", "-f", "pattern", metavar="GLOB",
              help="Only tensors whose key matches, as browse's filter: a substring, or a glob "
                   "matching the whole key or what follows a /; case-blind in lower case.")
@click.option("--depth", "-d", type=click.IntRange(min=1), metavar="N",
              help="Group tensors by the first N key components (split on / and .).")
@click.option("--limit", "-n", type=click.IntRange(min=0), default=200, show_default=True,
              help="Most tensor rows to print; 0 prints all.")
def inspect(path: str, as_json: bool, pattern: str | None, depth: int | None,
            limit: int) -> None:
    """Show what is in a checkpoint: tensors, devices, entries, unsafe globals."""
    from ckptool.read.reader import open_checkpoint

    with one_shot():
        ckpt = open_checkpoint(path)
        _report(ckpt, as_json, pattern, depth, limit, remote_report(path, ckpt))


def remote_report(path: str, ckpt: Checkpoint) -> dict[str, Any] | None:
    """For ``path`` a URL: the store's own sha256 of each file it keeps one
    of (the Hub's LFS files), the Hub's scan of the repository, and the
    requests and bytes the read made (``ckptool.read.remote``); None for a
    local path."""
    if "://" not in path:
        return None
    from ckptool.read.remote import counts, hub, urls

    if not urls.is_url(path):
        return None
    files = ([urls.join(ckpt.directory, f.path) for f in ckpt.files]
             if ckpt.is_multifile and ckpt.directory else [ckpt.path])
    base = (ckpt.directory or "").rstrip("/") + "/"
    sums = {(u[len(base):] if u.startswith(base) else urls.name(u)): s
            for u, s in hub.sha256s(files).items()}
    scan = hub.scan(path)
    return {**counts.snapshot().as_json(), "sha256": sums, "hub_scan": scan}


def _report(ckpt: Checkpoint, as_json: bool, pattern: str | None, depth: int | None,
            limit: int, remote: dict[str, Any] | None = None) -> None:
    if as_json:
        data = inspect_json(ckpt, pattern)
        if remote is not None:
            data["remote"] = remote
        write_json(data)
        return
    from ckptool.cli.inspect_text import render_inspect
    from ckptool.cli.remote_text import render_remote

    tensors = matching(ckpt.tensors, pattern)
    render_inspect(console(), ckpt, tensors, pattern, depth, limit)
    if remote is not None:
        render_remote(console(), ckpt, remote)


command = inspect


def matching(tensors: list[TensorInfo], pattern: str | None) -> list[TensorInfo]:
    """The tensors whose key matches ``pattern`` as the browser's filter
    would match it (``ckptool.keys``)."""
    keep = Filter(pattern or "")
    if not keep:
        return tensors
    keys = [t.key.lower() if keep.fold else t.key for t in tensors]
    return [t for t, ok in zip(tensors, keep.mask(keys), strict=True) if ok]


def tensor_dict(t: TensorInfo) -> dict[str, Any]:
    return {
        "key": t.key, "shape": list(t.shape), "dtype": t.dtype,
        "stride": list(t.stride) if t.stride is not None else None,
        "storage_offset": t.storage_offset, "storage": t.storage,
        "location": t.location, "nbytes": t.nbytes, "requires_grad": t.requires_grad,
        "is_parameter": t.is_parameter, "layout": t.layout, "subclass": t.subclass,
        **({"nnz": t.nnz, "parts": [tensor_dict(p) for p in t.parts]} if t.parts else {}),
        **({"file": t.file} if t.file is not None else {}),
        **({"chunks": [chunk_dict(c) for c in t.chunks]} if t.chunks else {}),
    }


def chunk_dict(c: Chunk) -> dict[str, Any]:
    return {"file": c.file, "rank": c.rank, "offsets": list(c.offsets), "sizes": list(c.sizes),
            "byte_offset": c.byte_offset, "byte_length": c.byte_length,
            **({"transforms": list(c.transforms)} if c.transforms else {}),
            **({"flat": True} if c.flat else {}),
            **({"dtype": c.dtype} if c.dtype else {})}


def storage_dict(s: StorageInfo) -> dict[str, Any]:
    return {"id": s.id, "dtype": s.dtype, "location": s.location, "nbytes": s.nbytes,
            "record": s.record, "tensors": list(s.tensors),
            **({"file": s.file} if s.file is not None else {})}


def inspect_json(ckpt: Checkpoint, pattern: str | None = None) -> dict[str, Any]:
    """``inspect_dict``, its tensors and storages already JSON text (the
    same text: ``json_lines``)."""
    data = inspect_dict(ckpt, pattern, lists=False)
    data["tensors"] = json_lines.tensor_lines(matching(ckpt.tensors, pattern), tensor_dict)
    data["storages"] = json_lines.storage_lines(ckpt.storages.values(), storage_dict)
    return data


def file_dict(f: FileInfo) -> dict[str, Any]:
    return {"path": f.path, "role": f.role, "format": f.format, "size": f.size,
            "num_tensors": f.num_tensors, "num_values": f.num_values, "rank": f.rank}


def inspect_dict(ckpt: Checkpoint, pattern: str | None = None,
                 lists: bool = True) -> dict[str, Any]:
    """The ``--json`` report; without ``lists``, its tensors and storages are
    left empty (``inspect_json`` writes them)."""
    sd = ckpt.main_state_dict
    return {
        "schema_version": SCHEMA_VERSION,
        "path": ckpt.path,
        "format": ckpt.format,
        "file_size": ckpt.file_size,
        "num_tensors": len(ckpt.tensors),
        "num_storages": len(ckpt.storages),
        "total_bytes": ckpt.total_bytes,
        "bytes_by_dtype": ckpt.bytes_by_dtype,
        "bytes_by_location": ckpt.bytes_by_location,
        "tensors_by_location": ckpt.tensors_by_location,
        "main_state_dict": None if sd is None else {
            "path": sd.path, "kind": sd.kind, "prefix": sd.prefix,
            "common_prefix": sd.common_prefix, "num_tensors": sd.num_tensors,
            "num_parameters": sd.num_parameters, "num_buffers": sd.num_buffers,
            "nbytes": sd.nbytes,
        },
        "tensors": [tensor_dict(t) for t in matching(ckpt.tensors, pattern)] if lists else [],
        "storages": [storage_dict(s) for s in ckpt.storages.values()] if lists else [],
        "entries": [
            {"key": e.key, "type": e.type, "summary": e.summary, "value": e.value}
            for e in ckpt.entries
        ],
        "globals": [
            {"name": g.name, "category": g.category, "reason": g.reason, "count": g.count,
             "uses": list(g.uses), "where": list(g.where)}
            for g in ckpt.globals
        ],
        "unsafe_globals": ckpt.unsafe_globals,
        "metadata": ckpt.metadata,
        "warnings": ckpt.warnings,
        "framework": ckpt.framework.as_dict() if ckpt.framework is not None else None,
        **_folder_contents(ckpt),
        **({"directory": ckpt.directory, "files": [file_dict(f) for f in ckpt.files]}
           if ckpt.is_multifile else {}),
    }


def _folder_contents(ckpt: Checkpoint) -> dict[str, Any]:
    """A framework folder's subfolders and the custom code its configs name
    (the text report's ``folders`` and ``code`` rows)."""
    fw = ckpt.framework
    if fw is None:
        return {"subfolders": [], "remote_code": []}
    from ckptool.read.layouts import contents  # (a framework folder's only)

    return {
        "subfolders": [{"name": s.name, "role": s.role, "files": len(s.files), "size": s.size,
                        "checkpoints": list(s.checkpoints)}
                       for s in contents.subfolders(fw.directory)],
        "remote_code": [{"config": c.config, "auto": c.auto, "reference": c.reference,
                         "file": c.file, "repo": c.repo, "present": c.present}
                        for c in contents.remote_code(fw.directory)],
    }
