"""The ``--json`` schema of ``ckptool inspect``, built from a Checkpoint.

Pure data in, plain dicts out (no rich, no click), so the schema is one
function that tests and the README document. ``SCHEMA_VERSION`` changes
only when a field changes meaning or goes away; new fields may be added.
"""

from __future__ import annotations

import fnmatch
import json
from typing import Any

from ckptool.model import Checkpoint, TensorInfo

SCHEMA_VERSION = 1


def matches(key: str, pattern: str | None) -> bool:
    """Glob match on the key; a pattern without wildcards matches substrings."""
    if not pattern:
        return True
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(key, pattern)
    return pattern in key


def tensor_dict(t: TensorInfo) -> dict[str, Any]:
    return {
        "key": t.key, "shape": list(t.shape), "dtype": t.dtype,
        "stride": list(t.stride) if t.stride is not None else None,
        "storage_offset": t.storage_offset, "storage": t.storage,
        "location": t.location, "nbytes": t.nbytes, "requires_grad": t.requires_grad,
        "is_parameter": t.is_parameter, "layout": t.layout, "subclass": t.subclass,
    }


def inspect_dict(ckpt: Checkpoint, pattern: str | None = None) -> dict[str, Any]:
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
            "num_parameters": sd.num_parameters, "nbytes": sd.nbytes,
        },
        "tensors": [tensor_dict(t) for t in ckpt.tensors if matches(t.key, pattern)],
        "storages": [
            {"id": s.id, "dtype": s.dtype, "location": s.location, "nbytes": s.nbytes,
             "record": s.record, "tensors": list(s.tensors)}
            for s in ckpt.storages.values()
        ],
        "entries": [
            {"key": e.key, "type": e.type, "summary": e.summary, "value": e.value}
            for e in ckpt.entries
        ],
        "globals": [
            {"name": g.name, "category": g.category, "reason": g.reason, "count": g.count}
            for g in ckpt.globals
        ],
        "unsafe_globals": ckpt.unsafe_globals,
        "metadata": ckpt.metadata,
    }


def dumps(data: dict[str, Any]) -> str:
    """JSON text: one line per top-level field and per list item.

    ``json.dumps(indent=...)`` falls back to the pure-Python encoder, which
    cost more than reading a 2,000-tensor file; this keeps the C encoder and
    still gives one tensor per line for grep and diff.
    """
    encode = json.JSONEncoder(default=repr).encode  # one encoder, not one per item
    fields = []
    for key, value in data.items():
        name = encode(key)
        if isinstance(value, list) and value:
            items = ",\n    ".join(map(encode, value))
            fields.append(f"  {name}: [\n    {items}\n  ]")
        else:
            fields.append(f"  {name}: {encode(value)}")
    return "{\n" + ",\n".join(fields) + "\n}\n"


def fix_groups(result: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Device moves and casts, grouped as (from, to, number of storages)."""
    plan, storages = result.plan, result.source.storages
    moves: dict[tuple[str, str], int] = {}
    for sid, tag in plan.retargets.items():
        old = storages[sid].location if sid in storages else None
        moves[(old or "unrecorded", tag)] = moves.get((old or "unrecorded", tag), 0) + 1
    casts: dict[tuple[str, str], int] = {}
    for pair in plan.casts.values():
        casts[pair] = casts.get(pair, 0) + 1
    return ([{"from": a, "to": b, "storages": n} for (a, b), n in moves.items()],
            [{"from": a, "to": b, "storages": n} for (a, b), n in casts.items()])


def fix_dict(result: Any) -> dict[str, Any]:
    """The ``fix --json`` schema (a FixResult from ckptool.write.rewrite)."""
    plan = result.plan
    devices, casts = fix_groups(result)
    return {
        "schema_version": SCHEMA_VERSION,
        "input": result.source.path,
        "format": result.source.format,
        "output": result.target,
        "dry_run": result.output is None,
        "renamed": [{"from": a, "to": b} for a, b in plan.renames],
        "dropped": plan.dropped,
        "extracted": plan.extracted,
        "devices": devices,
        "casts": casts,
        "metadata_only": result.metadata_only,
        "bytes_written": result.bytes_written,
        "verified_storages": result.verified_storages,
        "notes": plan.notes,
    }


def convert_dict(result: Any) -> dict[str, Any]:
    """The ``convert --json`` schema (a ConvertResult from ckptool.write.conversion)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "input": result.source.path,
        "input_format": result.source.format,
        "output": result.output,
        "output_format": "safetensors" if result.direction == "safetensors" else "torch-zip",
        "tensors": result.tensors,
        "aliases": result.aliases,
        "copied_views": result.copied_views,
        "kept_entries": result.kept_entries,
        "left_out": result.left_out,
        "bytes_written": result.bytes_written,
    }
