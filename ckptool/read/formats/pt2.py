"""``torch.export.save`` archives (``.pt2``): a zip whose ``archive_format``
record says ``pt2``, holding the exported program's weights and constants as
raw records (``data/weights/weight_0``...) described by JSON
(``data/weights/model_weights_config.json``, ``data/constants/
model_constants_config.json``: each tensor's record, dtype, sizes, strides,
storage offset, device, whether it is a parameter), and the program itself
as JSON (``models/model.json``), never run here.

The weights (parameters and buffers, by the exported module's names) are
the state dict; the constants are listed under ``<constants>``. Names that
share a record share its storage (a tied embedding and head). A tensor the
export pickled (``use_pickle``) is listed as a value, not read; the sample
inputs (a ``torch.save`` archive inside) are read as any pickle is, for the
globals they name.
"""

from __future__ import annotations

import io
import json
import math
from typing import Any

from ckptool.dtypes import ITEMSIZE
from ckptool.errors import CkptoolError, CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.read.formats.base import RawRead
from ckptool.read.seen import GlobalsSeen
from ckptool.read.tensors import StorageRef, TensorRecord
from ckptool.read.ziparchive import ZipArchive, ZipError

PT2 = "torch-export"
BROKEN = ("the archive does not match what torch.export.save writes: it was damaged or "
          "rewritten")
MAX_JSON = 256 << 20
MAX_SAMPLE = 64 << 20  # a program's sample inputs: small tensors
# torch._export.serde.schema.ScalarType
DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float16",
          7: "float32", 8: "float64", 9: "complex32", 10: "complex64", 11: "complex128",
          12: "bool", 13: "bfloat16", 28: "uint16", 29: "float8_e4m3fn", 30: "float8_e5m2",
          31: "float8_e4m3fnuz", 32: "float8_e5m2fnuz", 33: "float8_e8m0fnu", 34: "uint32",
          35: "uint64"}
STRIDED = 7  # schema.Layout.Strided
MAX_INT64 = 2**63 - 1


def is_pt2(members: dict[str, Any], prefix: str) -> bool:
    return f"{prefix}archive_format" in members


def read_archive(zf: Any, prefix: str, read_record: Any, read_zip: Any) -> RawRead:
    """The weights and constants of a ``.pt2`` archive (``zf`` its open
    directory, ``read_record(zf, name)`` a record's bytes, ``read_zip(zf)``
    the torch zip reader, for the sample inputs)."""
    members = zf.members
    fmt = read_record(zf, f"{prefix}archive_format").decode("ascii", "replace").strip()
    if fmt != "pt2":
        raise CorruptCheckpointError(f"archive_format says {fmt!r:.40}, not pt2", BROKEN)
    storages: dict[str, StorageRef] = {}
    pickled: list[str] = []  # records torch.export.load reads with torch.load
    weights = _tensors(zf, members, prefix, "weights", "model_weights_config.json", storages,
                       read_record, pickled)
    constants = _tensors(zf, members, prefix, "constants", "model_constants_config.json",
                         storages, read_record, pickled)
    seen = GlobalsSeen()
    warnings: list[str] = []
    for name in pickled:  # unpickled with weights_only=False: read, or refused
        problem = (f"{members[name].size} bytes, more than ckptool reads"
                   if members[name].size > MAX_SAMPLE else None)
        problem = problem or next(iter(_scan(read_record(zf, name), name, seen, read_zip)), None)
        if problem is not None:
            raise UnsupportedCheckpointError(
                f"{name}: a pickled tensor torch.export.load unpickles with "
                f"weights_only=False, which ckptool cannot read ({problem})",
                "do not load this archive with torch unless you wrote it")
    extra: dict[str, Any] = {"constants": constants} if constants else {}
    for name in sorted(members):
        if name.startswith(f"{prefix}data/sample_inputs/") and name.endswith(".pt"):
            if members[name].size > MAX_SAMPLE:
                warnings.append(f"{name} is {members[name].size} bytes: not scanned "
                                f"(ckptool reads sample inputs up to {MAX_SAMPLE >> 20} MiB)")
                continue
            warnings += _scan(read_record(zf, name), name, seen, read_zip)
    meta: dict[str, Any] = {"archive_root": prefix.rstrip("/"), "archive_format": "pt2"}
    if f"{prefix}archive_version" in members:
        meta["version"] = read_record(zf, f"{prefix}archive_version").decode(
            "ascii", "replace").strip()
    models = sorted(n[len(prefix) + len("models/"):] for n in members
                    if n.startswith(f"{prefix}models/") and n.endswith(".json"))
    meta["programs"] = models
    return RawRead(PT2, weights, storages, seen, meta, extra, warnings)


def _tensors(zf: Any, members: dict[str, Any], prefix: str, folder: str, config: str,
             storages: dict[str, StorageRef], read_record: Any,
             pickled: list[str]) -> dict[str, Any]:
    path = f"{prefix}data/{folder}/{config}"
    if path not in members:
        return {}
    if members[path].size > MAX_JSON:
        raise CorruptCheckpointError(f"{path} is {members[path].size} bytes of JSON", BROKEN)
    try:
        entries = json.loads(read_record(zf, path)).get("config")
    except (ValueError, AttributeError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{path} is not the JSON torch.export writes", BROKEN) \
            from exc
    if not isinstance(entries, dict):
        raise CorruptCheckpointError(f"{path} has no config object", BROKEN)
    out: dict[str, Any] = {}
    for fqn, entry in entries.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("path_name"), str):
            raise CorruptCheckpointError(f"{path}: {fqn!r:.80} names no record", BROKEN)
        record = f"{prefix}data/{folder}/{entry['path_name']}"
        if record not in members:
            raise CorruptCheckpointError(f"{record} is missing (named by {path})", BROKEN)
        if entry.get("use_pickle"):
            out[fqn] = f"<a tensor torch.export pickled: {entry['path_name']} (read for the " \
                "globals it names)>"
            pickled.append(record)
            continue
        out[fqn] = _tensor(fqn, entry.get("tensor_meta"), record, members[record].size,
                           storages, path, bool(entry.get("is_param")))
    return out


def _tensor(fqn: str, meta: Any, record: str, size: int, storages: dict[str, StorageRef],
            named_by: str, is_param: bool) -> TensorRecord:
    if not isinstance(meta, dict):
        raise CorruptCheckpointError(f"{named_by}: {fqn!r:.80} has no tensor_meta", BROKEN)
    code = meta.get("dtype")
    dtype = DTYPES.get(code) if type(code) is int else None
    shape, stride = _ints(meta.get("sizes")), _ints(meta.get("strides"))
    offset = _ints([meta.get("storage_offset")])
    if dtype is None or shape is None or stride is None or offset is None \
            or len(shape) != len(stride) or meta.get("layout", STRIDED) != STRIDED:
        raise CorruptCheckpointError(
            f"{named_by}: {fqn!r:.80} is no strided tensor of a known dtype", BROKEN)
    if math.prod(shape) > MAX_INT64:
        raise CorruptCheckpointError(f"{named_by}: {fqn!r:.80} has more elements than torch "
                                     "can index", BROKEN)
    itemsize = ITEMSIZE.get(dtype, 1)
    ref = storages.get(record)
    if ref is None:
        device = meta.get("device")
        kind, index = (device.get("type", "cpu"), device.get("index")) \
            if isinstance(device, dict) else ("cpu", None)
        if not (isinstance(kind, str) and kind.isidentifier() and len(kind) <= 32) or not (
                index is None or (type(index) is int and 0 <= index < 1 << 16)):
            raise CorruptCheckpointError(f"{named_by}: {fqn!r:.80} names no device",
                                         BROKEN)
        location = f"{kind}:{index}" if index is not None else kind
        ref = storages[record] = StorageRef(record, dtype, location, size // itemsize, record)
    numel = math.prod(shape)
    last = offset[0] + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) \
        if numel else 0
    if numel and (last + 1) * itemsize > size:
        raise CorruptCheckpointError(f"{fqn!r:.80} reaches past its record {record}", BROKEN)
    return TensorRecord(shape, dtype, stride, offset[0], ref, ref.location,
                        bool(meta.get("requires_grad")), is_param)


def _ints(items: Any) -> tuple[int, ...] | None:
    """``[{"as_int": 3}, ...]`` -> (3, ...); None for symbolic or bad sizes."""
    if not isinstance(items, list):
        return None
    out = []
    for item in items:
        value = item.get("as_int") if isinstance(item, dict) else None
        if type(value) is not int or not 0 <= value <= MAX_INT64:
            return None
        out.append(value)
    return tuple(out)


def _scan(data: bytes, name: str, seen: GlobalsSeen, read_zip: Any) -> list[str]:
    """The sample inputs' ``torch.save`` archive, read for the globals it names
    (``torch.export.load`` unpickles it); its tensors are not listed."""
    try:
        inner = ZipArchive(io.BytesIO(data), len(data))
        names = list(inner.members)
        if names and is_pt2(inner.members, names[0].split("/", 1)[0] + "/"):
            return [f"{name} is itself a .pt2 archive, not the torch.save archive "
                    "torch.export writes there: not read"]
        raw = read_zip(inner)
    except (ZipError, CkptoolError) as exc:
        return [f"{name} is not a readable torch.save archive ({exc}); not scanned"]
    seen.merge(raw.seen, name)
    return []
