"""safetensors files, read from the JSON header alone.

Layout: 8-byte little-endian header length N, N bytes of JSON, then data.
Every entry is validated as the safetensors library validates it (dtype,
shape, a size that matches shape x dtype, no key named twice, and byte
ranges that cover the data exactly: no overlap, no gap, nothing after the
last tensor), so that a file the library would refuse is an error here,
not a file that ckptool reads differently. safetensors records no device and no
sharing: each tensor is its own storage with no location.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

from ckptool import dtypes
from ckptool.errors import CorruptCheckpointError
from ckptool.read import fs
from ckptool.read.formats.base import RawRead
from ckptool.read.tensors import StorageRef, TensorRecord
from ckptool.read.values import brief

SAFETENSORS = "safetensors"
MAX_HEADER = 100_000_000  # the safetensors library's own limit
MAX_INT64 = 2**63 - 1
HINT = ("the header does not match the safetensors format; the file is damaged "
        "or was not written by safetensors")
TRUNCATED_HINT = "the file was probably cut short while copying or downloading"


def sniff(head: bytes) -> bool:
    if len(head) < 10:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= MAX_HEADER and head[8:9] == b"{"


def read(path: str) -> RawRead:
    with fs.open_binary(path) as f:
        size = fs.size_of(f)
        (n,) = struct.unpack("<Q", f.read(8))
        if 8 + n > size:
            raise CorruptCheckpointError(
                "safetensors header is longer than the file (truncated)", TRUNCATED_HINT)
        raw = f.read(n)
    try:
        header = json.loads(raw, object_pairs_hook=_no_repeats)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"safetensors header is not valid JSON: {exc}",
                                     HINT) from exc
    except RecursionError as exc:  # [[[[... nested past the interpreter's limit
        raise CorruptCheckpointError("safetensors header nests too deeply", HINT) from exc
    if not isinstance(header, dict):
        raise CorruptCheckpointError("safetensors header is not a JSON object", HINT)
    metadata = header.pop("__metadata__", None) or {}
    # the format (and the safetensors library) allows only strings here
    if not isinstance(metadata, dict) or not all(
        isinstance(v, str) for v in metadata.values()
    ):
        raise CorruptCheckpointError("safetensors __metadata__ is not a map of strings", HINT)
    data_start = 8 + n
    root: dict[str, TensorRecord] = {}
    storages: dict[str, StorageRef] = {}
    for name, entry in header.items():
        rec = _tensor(name, entry, data_start, size)
        root[name] = rec
        if rec.storage is not None:
            storages[name] = rec.storage
    _check_coverage(header, size - data_start)
    meta: dict[str, Any] = {"header_bytes": n, "metadata": metadata}
    return RawRead(SAFETENSORS, root, storages, metadata=meta)


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused when it names a key twice (json keeps the last,
    and two readers of one file could then see two different tensors)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise CorruptCheckpointError(
                f"safetensors header names {key!r:.80} twice (the safetensors library "
                "refuses this file)", HINT)
        out[key] = value
    return out


def _check_coverage(header: dict[str, Any], data_size: int) -> None:
    """As the safetensors library checks: the tensors' byte ranges, in order,
    cover the data from its first byte to its last, each right after the one
    before: no overlap, no gap, nothing after the last."""
    ranges = sorted((e["data_offsets"][0], e["data_offsets"][1], name)
                    for name, e in header.items())
    at, last = 0, None
    for begin, end, name in ranges:
        if begin != at:
            what = (f"overlaps {last!r:.80}" if begin < at else
                    f"leaves {begin - at} bytes before it that no tensor covers")
            raise CorruptCheckpointError(
                f"safetensors data of {name!r:.80} (bytes {begin}..{end}) {what} "
                "(the safetensors library refuses this file)", HINT)
        at, last = end, name
    if at != data_size:
        raise CorruptCheckpointError(
            f"{data_size - at} bytes follow the last safetensors tensor that no tensor covers "
            "(the safetensors library refuses this file)", HINT)


def _tensor(name: str, entry: Any, data_start: int, size: int) -> TensorRecord:
    if not isinstance(entry, dict):
        raise CorruptCheckpointError(f"safetensors entry {name!r:.80} is not an object", HINT)
    code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    dtype = dtypes.SAFETENSORS_DTYPES.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise CorruptCheckpointError(
            f"safetensors entry {name!r:.80} has unknown dtype {brief(code)}", HINT)
    if not (isinstance(shape, list) and all(_size(d) for d in shape)
            and math.prod(shape) <= MAX_INT64):
        raise CorruptCheckpointError(f"safetensors entry {name!r:.80} has a bad shape", HINT)
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(_size(o) for o in offsets) and offsets[0] <= offsets[1]):
        raise CorruptCheckpointError(f"safetensors entry {name!r:.80} has bad data_offsets",
                                     HINT)
    begin, end = offsets
    numel = math.prod(shape)
    expected = (numel + 1) // 2 if code == "F4" else numel * dtypes.itemsize(dtype)
    if end - begin != expected:
        raise CorruptCheckpointError(
            f"safetensors entry {name!r:.80} spans {end - begin} bytes, {expected} expected",
            HINT)
    if data_start + end > size:
        raise CorruptCheckpointError(
            f"safetensors data for {name!r:.80} lies past the end of the file (truncated)",
            TRUNCATED_HINT)
    if code == "F4":  # counted in 4-bit elements; torch's float4_e2m1fn_x2 packs two a byte
        if not shape or shape[-1] % 2:
            raise CorruptCheckpointError(
                f"safetensors entry {name!r:.80} is F4 with an odd last dimension: torch "
                "reads F4 as float4_e2m1fn_x2, two elements a byte", HINT)
        shape = [*shape[:-1], shape[-1] // 2]
    ref = StorageRef(name, dtype, None, expected // dtypes.itemsize(dtype),
                     f"@{data_start + begin}")
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return TensorRecord(tuple(shape), dtype, stride, 0, ref, None)


def _size(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_INT64
