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
from ckptool.errors import CkptoolError, CorruptCheckpointError
from ckptool.read import pickles
from ckptool.read.formats.base import RawRead
from ckptool.read.formats.torch_legacy import read_bytes
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
    seen = GlobalsSeen()
    warnings: list[str] = []
    storages: dict[str, StorageRef] = {}
    programs = sorted(n[len(prefix) + len("models/"):-len(".json")] for n in members
                      if n.startswith(f"{prefix}models/") and n.endswith(".json"))
    # torch.export.load loads every program; the first named "model" (or the
    # first) gives the state dict, the others are listed apart
    main = "model" if "model" in programs else (programs[0] if programs else "model")
    roots: dict[str, Any] = {}
    for program in [main, *(p for p in programs if p != main)]:
        roots[program] = _program(zf, members, prefix, program, storages, read_record,
                                  read_zip, seen, warnings)
    weights, constants = roots.pop(main)
    extra: dict[str, Any] = {"constants": constants} if constants else {}
    for program, (more, more_constants) in roots.items():
        extra[f"program {program}"] = {"weights": more, "constants": more_constants}
    meta: dict[str, Any] = {"archive_root": prefix.rstrip("/"), "archive_format": "pt2"}
    if f"{prefix}archive_version" in members:
        meta["version"] = read_record(zf, f"{prefix}archive_version").decode(
            "ascii", "replace").strip()
    meta["programs"] = [f"{p}.json" for p in programs]
    return RawRead(PT2, weights, storages, seen, meta, extra, warnings)


def _program(zf: Any, members: dict[str, Any], prefix: str, program: str,
             storages: dict[str, StorageRef], read_record: Any, read_zip: Any,
             seen: GlobalsSeen, warnings: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One program's weights and constants, as torch.export.load reads them:
    a legacy ``data/weights/<program>.pt`` (or ``data/constants/...``) wins
    over the config; pickled tensors and objects, the sample inputs and the
    legacy files are all unpickled by torch, so each is read and judged here
    (``_judge``), or the archive is flagged."""
    pickled: list[str] = []  # records torch.export.load reads with torch.load
    found: list[dict[str, Any]] = []
    for folder in ("weights", "constants"):
        legacy = f"{prefix}data/{folder}/{program}.pt"
        if legacy in members:
            _judge(zf, members, legacy, read_record, read_zip, seen)
            warnings.append(f"{legacy}: legacy {folder}, which torch.export.load prefers and "
                            "loads with torch.load; read for the globals it names")
            found.append({})
            continue
        found.append(_tensors(zf, members, prefix, folder, f"{program}_{folder}_config.json",
                              storages, read_record, pickled))
    for name in pickled:
        _judge(zf, members, name, read_record, read_zip, seen)
    sample = f"{prefix}data/sample_inputs/{program}.pt"
    if sample in members:
        _judge(zf, members, sample, read_record, read_zip, seen)
    return found[0], found[1]


UNREAD = "torch.export.<a pickled record ckptool cannot read>"


def _judge(zf: Any, members: dict[str, Any], name: str, read_record: Any, read_zip: Any,
           seen: GlobalsSeen) -> None:
    """A record torch.export.load unpickles (with ``weights_only=False``, or
    falling back to it when ``weights_only=True`` refuses): its globals are
    the archive's, or, unread, it is unsafe."""
    problem: str | None = None
    if members[name].size > MAX_SAMPLE:
        problem = f"{members[name].size} bytes, more than ckptool reads"
    else:
        problem = _read_pickled(read_record(zf, name), name, seen, read_zip)
    if problem is not None:
        seen.flag(UNREAD, f"{name}: torch.export.load unpickles it (falling back to "
                  f"weights_only=False), and ckptool cannot read it ({problem})", name)


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
        # torch.export.load unpickles these by their name's prefix alone
        # (pickle.loads, the TorchScript pickler), whatever use_pickle says
        by_prefix = folder == "constants" and entry["path_name"].startswith(
            ("custom_obj_", "opaque_obj_"))
        if entry.get("use_pickle") or by_prefix:
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


def _read_pickled(data: bytes, name: str, seen: GlobalsSeen, read_zip: Any) -> str | None:
    """Read a record torch.load would read: a torch.save archive, a legacy
    torch file, an object pickle (``opaque_obj_``); its globals merged into
    ``seen``. Returns why it could not be read, or None."""
    try:
        inner = ZipArchive(io.BytesIO(data), len(data))
    except ZipError:
        inner = None
    try:
        if inner is not None:
            names = list(inner.members)
            if names and is_pt2(inner.members, names[0].split("/", 1)[0] + "/"):
                return "a .pt2 archive inside, not what torch.export writes there"
            raw = read_zip(inner)
        else:
            try:
                raw = read_bytes(data, f"{name}/")
            except CkptoolError:
                raw = None
            if raw is None:  # an object pickle (opaque_obj_), read for what it names
                inner_seen = GlobalsSeen()
                with inner_seen.naming_unsafe():
                    pickles.load(data, None, inner_seen)
                seen.merge(inner_seen, name)
                return None
    except (ZipError, CkptoolError) as exc:
        return str(exc)
    seen.merge(raw.seen, name)
    return None
