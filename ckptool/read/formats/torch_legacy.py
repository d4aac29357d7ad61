"""torch.save's legacy format (``_use_new_zipfile_serialization=False``, pre-1.6).

Five protocol-2 pickles back to back (magic number, protocol version,
sys_info, the object, the sorted storage keys), then each storage as an
int64 element count followed by its bytes. Storage bytes are skipped with
``seek``: their counts are checked against the pickle, never their contents.
"""

from __future__ import annotations

import io
import struct
from typing import IO, Any

from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.read import fs, pickles
from ckptool.read.formats.base import RawRead, parse_storage_pid
from ckptool.read.seen import GlobalsSeen
from ckptool.read.tensors import StorageRef
from ckptool.read.values import StandIn, brief

TORCH_LEGACY = "torch-legacy"
MAGIC = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001
# pickle.dumps(MAGIC, protocol=2): PROTO 2, LONG1 of 10 bytes, little-endian
MAGIC_PICKLE = b"\x80\x02\x8a\x0a" + MAGIC.to_bytes(10, "little")
TRUNCATED_HINT = "the file was probably cut short while copying or downloading"
# the file's five pickles, as GlobalInfo.where names them
HEADER_PICKLES = ("the magic number", "the protocol version", "sys_info")
OBJECT, KEYS = "the object", "the storage keys"


def sniff(head: bytes) -> bool:
    # the shape of the magic pickle (a 10-byte long), not its value: a
    # damaged magic number is then reported as such, not read as a pickle
    return head.startswith(MAGIC_PICKLE[:4])


def sniff_tar(head: bytes) -> bool:
    """A tar archive, as torch's legacy loader takes one (``tarfile.open``,
    which accepts a header by its checksum: pre-POSIX v7 tars have no
    ``ustar`` magic)."""
    if len(head) >= 262 and head[257:262] == b"ustar":
        return True
    if len(head) < 512:
        return False
    field = head[148:156].rstrip(b" \0").lstrip(b" ")
    try:
        stored = int(field, 8) if field else -1
    except ValueError:
        return False
    unsigned = 256 + sum(head[:148]) + sum(head[156:512])  # the field counted as spaces
    signed = 256 + sum(b - 256 if b > 127 else b for b in head[:148] + head[156:512])
    return stored in (unsigned, signed)


def read(path: str) -> RawRead:
    with fs.open_binary(path) as f:
        return read_stream(f, fs.size_of(f))


def read_stream(f: IO[bytes], size: int, id_prefix: str = "") -> RawRead:
    seen = GlobalsSeen()
    with seen.naming_unsafe():
        return _read_stream(f, size, id_prefix, seen)


def _read_stream(f: IO[bytes], size: int, id_prefix: str, seen: GlobalsSeen) -> RawRead:

    def load(part: str, persistent: pickles.PersistentLoader | None = None) -> Any:
        seen.part = part
        return pickles.load(f, persistent, seen, read_embedded=read_bytes)

    if load(HEADER_PICKLES[0]) != MAGIC:
        raise CorruptCheckpointError("legacy torch file with a bad magic number",
                                     pickles.HINT)
    version = load(HEADER_PICKLES[1])
    if version != PROTOCOL_VERSION:
        raise UnsupportedCheckpointError(
            f"legacy torch file of protocol version {brief(version, 20)}, not {PROTOCOL_VERSION}",
            "load it with the torch version that wrote it and save it again")
    sys_info = load(HEADER_PICKLES[2])
    storages: dict[str, StorageRef] = {}
    views: dict[tuple[str, int, int], StorageRef] = {}

    def persistent(pid: tuple[Any, ...]) -> Any:
        if len(pid) == 4 and pid[0] == "module":
            # a whole nn.Module's class, with its source (torch.save of a model,
            # legacy format): the class the pickle named, an inert stand-in
            if not (type(pid[1]) is type and issubclass(pid[1], StandIn)):
                raise CorruptCheckpointError(f"module id of no class: {brief(pid, 100)}",
                                             pickles.HINT)
            return pid[1]
        stype, key, location, numel = parse_storage_pid(pid, 6)
        sid = id_prefix + key
        ref = storages.get(sid)
        if ref is None:
            ref = storages[sid] = StorageRef(sid, stype.dtype, location, numel, None, pid)
        view = pid[5]
        if view is None:
            return ref
        # very old files (torch < 0.4) pickle storage views: (key, offset, size)
        if not (isinstance(view, tuple) and len(view) == 3
                and all(isinstance(v, int) for v in view[1:])):
            raise CorruptCheckpointError(f"malformed storage view: {brief(view)}",
                                         pickles.HINT)
        _, offset, vsize = view
        vkey = (sid, offset, vsize)
        if vkey not in views:
            views[vkey] = StorageRef(sid, stype.dtype, location, vsize, None)
            views[vkey].record = f"@view:{offset}"
        return views[vkey]

    obj = load(OBJECT, persistent)
    keys = load(KEYS)
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise CorruptCheckpointError("legacy torch file with a malformed storage key list",
                                     pickles.HINT)
    end = _check_records(f, size, keys, storages, id_prefix)
    meta = {"sys_info": _plain(sys_info)}
    f.seek(end)
    rest = pickles.scan_rest(f, size, seen, "the storages", read_bytes)
    return RawRead(TORCH_LEGACY, obj, storages, seen, meta, warnings=[rest] if rest else [])


def _check_records(f: IO[bytes], size: int, keys: list[str],
                   storages: dict[str, StorageRef], id_prefix: str) -> int:
    """Step over the storage records the key list names, checking each
    against the pickle; returns the offset after the last."""
    pos = f.tell()
    for key in keys:
        ref = storages.get(id_prefix + key)
        if ref is None:
            raise CorruptCheckpointError(f"storage {key} is listed but never used",
                                         pickles.HINT)
        f.seek(pos)
        head = f.read(8)
        if len(head) < 8:
            raise CorruptCheckpointError(
                "legacy torch file is truncated (storage data ends early)", TRUNCATED_HINT)
        (count,) = struct.unpack("<q", head)
        if count != ref.numel:
            raise CorruptCheckpointError(
                f"storage {key} holds {count} elements, {ref.numel} expected", pickles.HINT)
        ref.record = f"@{pos + 8}"
        pos += 8 + ref.nbytes
        if pos > size:
            raise CorruptCheckpointError(
                "legacy torch file is truncated (storage data ends early)", TRUNCATED_HINT)
    missing = set(storages) - {id_prefix + k for k in keys}
    if missing:
        raise CorruptCheckpointError(f"storage {sorted(missing)[0]} has no data record",
                                     TRUNCATED_HINT)
    return pos


def _plain(value: Any, depth: int = 3) -> Any:
    """``sys_info`` as JSON-ready data (a small dict of sizes and flags)."""
    if value is None or isinstance(value, (bool, str, float)):
        return value
    if isinstance(value, int):
        return value if value.bit_length() <= 64 else brief(value)
    if isinstance(value, dict) and depth > 0:
        return {brief(k) if not isinstance(k, str) else k: _plain(v, depth - 1)
                for k, v in list(value.items())[:32]}
    return brief(value)


def header_end(f: IO[bytes]) -> int:
    """Offset after the magic number, protocol version and sys_info pickles
    (what a rewrite copies as it is)."""
    seen = GlobalsSeen()
    for _ in range(3):
        pickles.load(f, None, seen, read_embedded=read_bytes)
    return f.tell()


def read_bytes(data: bytes, id_prefix: str, at: int | None = None) -> RawRead:
    """A legacy file held in memory (``torch.storage._load_from_bytes``),
    whose bytes lie as they are from offset ``at`` of the stream its pickle
    is read from. Its storage records (``@offset``) are made offsets into
    that stream; with no ``at`` (a protocol 0-2 pickle spells bytes as text)
    its storages have no record: their bytes lie nowhere as they are."""
    raw = read_stream(io.BytesIO(data), len(data), id_prefix)
    for ref in raw.storages.values():
        if ref.record is not None:  # "@offset" into ``data`` (views are not listed)
            ref.record = None if at is None else f"@{at + int(ref.record[1:])}"
    return raw
