"""Hugging Face sharded checkpoints: an index (``model.safetensors.index.json``,
``pytorch_model.bin.index.json``) whose ``weight_map`` names each tensor's
shard, and the shards, each read by the single-file reader its bytes call
for (safetensors, torch zip, legacy torch).

The shards' tensors become one flat dict in the index's order; storage ids are
made unique across shards (``<shard>:<id>``) and remember their shard. The
index and the shards must agree: every shard it names exists, every tensor
is where it says, none is stored twice, and no shard holds a tensor it does
not list; anything else is an error naming the file and the key. Names the
index's ``metadata`` records as tied to a stored one (huggingface_hub drops
them from safetensors shards) are its aliases: listed as tensors sharing the
stored one's storage (``base.list_ties``).

An in-place fix of the directory that a crash cut short is settled first,
as its journal says (``journal``: finished, or rolled back), and a note and
a warning say so.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ckptool.describe import human_bytes, plural
from ckptool.errors import CorruptCheckpointError, InputError
from ckptool.model import FileInfo
from ckptool.read import dispatch, fs
from ckptool.read.formats.base import RawRead
from ckptool.read.formats.safetensors_fmt import SAFETENSORS
from ckptool.read.layouts import dirlock, journal
from ckptool.read.layouts.base import BROKEN_HINT, MultiRead, file_size, member
from ckptool.read.layouts.recognise import Layout
from ckptool.read.seen import GlobalsSeen
from ckptool.read.tensors import CompositeTensor, StorageRef, TensorRecord

HF_SAFETENSORS, HF_BIN = "hf-safetensors", "hf-bin"
SHOWN = 5
INDEX_HINT = ("the index is not what huggingface_hub or transformers write: an object "
              "with a \"weight_map\" of tensor names to shard file names")


def read(layout: Layout) -> MultiRead:
    """The checkpoint the index and its shards hold; an interrupted in-place
    fix is settled first, and they are read under the directory's shared
    lock (``dirlock.shared``): never while a fix commits."""
    directory = layout.directory
    if fs.is_remote(directory):  # no lock to take, no fix of ckptool's running there
        if fs.listable(directory) and fs.exists(fs.join(directory, journal.JOURNAL)):
            raise InputError(f"{directory} holds the journal of an in-place fix that was "
                             "stopped before it finished",
                             "run any ckptool command on a local copy to settle it, then "
                             "upload that copy")
        return _read(layout, None)
    if dirlock.is_held(directory):  # this thread's own fix, reading what it fixes
        return _read(layout, journal.settle(directory))
    settled = None
    for _ in range(3):  # (a fix killed while this waited for its lock left its journal)
        settled = journal.settle(directory) or settled
        with dirlock.shared(directory, lambda: journal.holder(directory)):
            if not os.path.lexists(os.path.join(directory, journal.JOURNAL)):
                return _read(layout, settled)
    raise InputError(f"{directory} keeps being fixed in place by {journal.holder(directory)}",
                     "wait for it to finish, then run this command again")


def _read(layout: Layout, settled: journal.Settled | None) -> MultiRead:
    assert layout.index is not None
    index_path = os.path.join(layout.directory, layout.index)
    index = _load_index(index_path, layout.index)
    weight_map: dict[str, str] = index["weight_map"]
    root: dict[str, Any] = {}
    storages: dict[str, StorageRef] = {}
    storage_files: dict[str, str] = {}
    seen = GlobalsSeen()
    holder: dict[str, str] = {}  # tensor name -> the shard it was found in
    files = [FileInfo(layout.index, "index", None, fs.getsize(index_path))]
    warnings: list[str] = []
    shard_formats: set[str] = set()
    byteorder: dict[str, str] = {}
    shards = sorted(set(weight_map.values()))
    fs.prefetch([fs.join(layout.directory, s) for s in shards if "/" not in s])
    for shard in shards:
        path = member(layout.directory, shard, layout.index)
        size = file_size(path, path, layout.index)
        raw = dispatch.read(path)
        tensors = _tensors_of(raw, shard)
        _check_shard(tensors, weight_map, holder, shard, layout.index)
        for key, ref in raw.storages.items():
            ref.key = f"{shard}:{key}"
            storages[ref.key] = ref
            storage_files[ref.key] = shard
        root.update(raw.root)
        seen.merge(raw.seen, shard)
        warnings += [f"{shard}: {w}" for w in raw.warnings]
        shard_formats.add(raw.format)
        if _big_endian(raw):
            byteorder[shard] = "big"
        files.append(FileInfo(shard, "shard", raw.format, size, len(tensors)))
    _check_index(weight_map, holder, layout.index)
    # the model's order, as the index lists it (shards are read by file name)
    root = {**{k: root[k] for k in weight_map if k in root}, **root}
    metadata = index.get("metadata")
    aliases = _aliases(metadata, weight_map)
    total = sum(ref.nbytes for ref in storages.values())
    stated = metadata.get("total_size") if isinstance(metadata, dict) else None
    if type(stated) is int and stated != total:
        warnings.append(f"{layout.index} gives total_size {stated} ({human_bytes(stated)}); "
                        f"the shards hold {total} bytes of storage ({human_bytes(total)})")
    fmt = HF_SAFETENSORS if shard_formats <= {SAFETENSORS} else HF_BIN
    meta: dict[str, Any] = {"index": layout.index, "index_metadata": metadata}
    if byteorder:
        meta["byteorder"] = byteorder
    raw_all = RawRead(fmt, root, storages, seen, meta, warnings=warnings)
    return MultiRead(raw_all, layout.directory, files, storage_files, aliases=aliases,
                     notes=([settled.note] if settled else []) + list(layout.notes))


def _load_index(path: str, name: str) -> dict[str, Any]:
    try:
        with fs.open_binary(path) as f:
            data = json.loads(f.read(), object_pairs_hook=_no_repeats(name))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{name} is not valid JSON: {exc}", INDEX_HINT) from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()):
        raise CorruptCheckpointError(f"{name} has no weight_map of tensor names to shard "
                                     "file names", INDEX_HINT)
    if not weight_map:
        raise CorruptCheckpointError(f"{name} names no tensors: its weight_map is empty",
                                     INDEX_HINT)
    return data


def _no_repeats(name: str) -> Any:
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise CorruptCheckpointError(
                    f"{name} names {key!r:.80} twice, in {out[key]!r:.60} and {value!r:.60}",
                    BROKEN_HINT)
            out[key] = value
        return out
    return pairs


def _tensors_of(raw: RawRead, shard: str) -> list[str]:
    if not isinstance(raw.root, dict):
        raise CorruptCheckpointError(
            f"shard {shard} is not a state dict: it holds {type(raw.root).__name__}",
            BROKEN_HINT)
    return [k for k, v in raw.root.items()
            if isinstance(k, str) and isinstance(v, (TensorRecord, StorageRef, CompositeTensor))]


def _check_shard(tensors: list[str], weight_map: dict[str, str], holder: dict[str, str],
                 shard: str, index: str) -> None:
    unlisted = [k for k in tensors if k not in weight_map]
    if unlisted:
        raise CorruptCheckpointError(
            f"shard {shard} holds {plural(len(unlisted), 'tensor')} that {index} does not list: "
            f"{', '.join(unlisted[:SHOWN])}{' …' if len(unlisted) > SHOWN else ''}",
            BROKEN_HINT)
    for key in tensors:
        if key in holder:
            raise CorruptCheckpointError(
                f"{key} is stored in two shards, {holder[key]} and {shard}", BROKEN_HINT)
        holder[key] = shard


def _check_index(weight_map: dict[str, str], holder: dict[str, str], index: str) -> None:
    absent = [(k, f) for k, f in weight_map.items() if holder.get(k) != f]
    if not absent:
        return
    key, shard = absent[0]
    where = f" (it is in {holder[key]})" if key in holder else ""
    more = f"; and {plural(len(absent) - 1, 'other')}" if len(absent) > 1 else ""
    raise CorruptCheckpointError(
        f"{index} puts {key} in {shard}, which does not hold it{where}{more}", BROKEN_HINT)


def _aliases(metadata: Any, weight_map: dict[str, str]) -> dict[str, str]:
    """Names huggingface_hub dropped as tied to a stored tensor: string values
    of the index's metadata that name a stored tensor."""
    if not isinstance(metadata, dict):
        return {}
    return {k: v for k, v in metadata.items()
            if isinstance(v, str) and v in weight_map and k not in weight_map}


def _big_endian(raw: RawRead) -> bool:
    if raw.metadata.get("byteorder") == "big":
        return True
    sys_info = raw.metadata.get("sys_info")
    return isinstance(sys_info, dict) and sys_info.get("little_endian") is False
