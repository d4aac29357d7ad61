"""torch's ``HuggingFaceStorageWriter`` output (torch >= 2.8; transformers 5's
``save_pretrained(distributed_checkpoint=True)``, torchtitan's HF format):
``shard-0000R-model-0000K-of-0000N.safetensors`` files, one set per rank,
each tensor in them a rank's piece of a global tensor whose place the
file's ``__metadata__`` records: ``DCP_SHARDING_INFO``, JSON of
``{fqn: {"saved_offsets": [...]}}``. No index joins them.

Read as one checkpoint, as torch's ``HuggingFaceStorageReader`` reads it:
each tensor's global shape is the furthest any piece reaches along each
dimension (``offset + size``), its pieces are its chunks (raw row-major
boxes in a safetensors file, ``Chunk.raw``), and they must cover it exactly
once. Reading stays metadata-only: headers, never tensor bytes.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from ckptool.describe import plural, shell_word
from ckptool.errors import CorruptCheckpointError
from ckptool.model import Chunk, FileInfo
from ckptool.read import dispatch, fs
from ckptool.read.formats.base import RawRead
from ckptool.read.layouts.base import BROKEN_HINT, MultiRead, contiguous
from ckptool.read.layouts.recognise import HF_STORAGE_SHARD, Layout
from ckptool.read.seen import GlobalsSeen
from ckptool.read.tensors import StorageRef, TensorRecord

HF_STORAGE = "hf-storage"
SHARDING_INFO = "DCP_SHARDING_INFO"


def read(layout: Layout) -> MultiRead:
    # (here, not at the top: a single safetensors file's read imports this
    # module for SHARDING_INFO alone)
    from ckptool.read.layouts import dcp_metadata

    names = list(layout.metadata)
    seen = GlobalsSeen()
    pieces: dict[str, list[tuple[str, int | None, TensorRecord, tuple[int, ...]]]] = {}
    files: list[FileInfo] = []
    for name in names:
        path = os.path.join(layout.directory, name)
        raw = dispatch.read(path)
        offsets = sharding_info(raw.metadata, name)
        if not offsets and raw.root:
            raise CorruptCheckpointError(
                f"{name} is named as a HuggingFaceStorageWriter shard but records no "
                f"{SHARDING_INFO}: nothing says where its tensors go",
                "name the file to read it alone")
        rank = _rank(name)
        for fqn, rec in raw.root.items():
            at = offsets.get(fqn)
            if at is None or len(at) != len(rec.shape):
                raise CorruptCheckpointError(
                    f"{name}: {SHARDING_INFO} gives no offsets of {len(rec.shape)} "
                    f"dimension(s) for {fqn!r:.80}", BROKEN_HINT)
            pieces.setdefault(fqn, []).append((name, rank, rec, at))
        files.append(FileInfo(name, "shard", raw.format, fs.getsize(path),
                               len(raw.root), rank=rank))
    ranks = {f.rank for f in files if f.rank is not None}
    if ranks and ranks != set(range(max(ranks) + 1)):
        missing = sorted(set(range(max(ranks) + 1)) - ranks)
        raise CorruptCheckpointError(
            f"{layout.path} lacks the shards of rank {', '.join(map(str, missing))} "
            f"(shard-{missing[0] + 1:05d}-model-*.safetensors): its tensors are not whole",
            "copy every rank's shard files")
    root: dict[str, Any] = {}
    storages: dict[str, StorageRef] = {}
    chunks: dict[str, tuple[Chunk, ...]] = {}
    for fqn, found in pieces.items():
        dtype = found[0][2].dtype
        # as HuggingFaceStorageReader: the furthest any piece reaches
        ends = [tuple(o + s for o, s in zip(at, rec.shape, strict=True))
                for _, _, rec, at in found]
        shape = tuple(max(col) for col in zip(*ends, strict=True))
        boxes: dict[tuple[tuple[int, ...], tuple[int, ...]], Chunk] = {}
        for name, rank, rec, at in found:
            if rec.dtype != dtype:
                raise CorruptCheckpointError(f"{fqn!r:.80} is {dtype} in {found[0][0]} and "
                                             f"{rec.dtype} in {name}", BROKEN_HINT)
            assert rec.storage is not None and rec.storage.record is not None
            start = int(rec.storage.record[1:])  # "@<absolute offset>"
            boxes.setdefault((at, rec.shape), Chunk(name, at, rec.shape, start, rec.nbytes,
                                                    rank, raw=True))
        problem = dcp_metadata.check_cover(shape, list(boxes))
        if problem:
            raise CorruptCheckpointError(f"{fqn} is not whole: {problem}", BROKEN_HINT)
        ref = StorageRef(f"{HF_STORAGE}:{fqn}", dtype, None, math.prod(shape))
        storages[ref.key] = ref
        root[fqn] = TensorRecord(shape, dtype, contiguous(shape), 0, ref, None)
        chunks[fqn] = tuple(boxes.values())
    meta: dict[str, Any] = {"ranks": len(ranks), "files": len(files)}
    return MultiRead(RawRead(HF_STORAGE, root, storages, seen, meta), layout.directory,
                     files, {}, chunks, notes=list(layout.notes))


def sharding_info(metadata: dict[str, Any], name: str) -> dict[str, tuple[int, ...]]:
    """A safetensors file's ``DCP_SHARDING_INFO`` (``metadata`` is its read's):
    each tensor's offsets in its global tensor ({} where it records none)."""
    text = (metadata.get("metadata") or {}).get(SHARDING_INFO)
    if text is None:
        return {}
    try:
        info = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{name}: {SHARDING_INFO} is not JSON", BROKEN_HINT) \
            from exc
    out = {}
    for fqn, entry in info.items() if isinstance(info, dict) else ():
        at = entry.get("saved_offsets") if isinstance(entry, dict) else None
        if not (isinstance(at, list) and all(type(o) is int and o >= 0 for o in at)):
            raise CorruptCheckpointError(f"{name}: {SHARDING_INFO} of {fqn!r:.80} has no "
                                         "saved_offsets list", BROKEN_HINT)
        out[fqn] = tuple(at)
    return out


def one_piece(path: str, metadata: dict[str, Any]) -> str | None:
    """What a single file of them is, in a note; None for any other."""
    try:
        info = sharding_info(metadata, os.path.basename(path))
    except CorruptCheckpointError:
        return None
    placed = sum(1 for at in info.values() if any(at))
    if not info:
        return None
    folder = os.path.dirname(path) or "."
    return (f"this file is one of torch's HuggingFaceStorageWriter shards ({SHARDING_INFO}): "
            f"its {plural(len(info), 'tensor')} are pieces of larger ones "
            f"({placed} placed away from the origin), shown with their own shapes; read "
            f"the folder holding every shard to get them whole: ckptool inspect "
            f"{shell_word(folder)}")


def _rank(name: str) -> int | None:
    """The rank that wrote shard file ``name`` (torch numbers them from 1)."""
    m = HF_STORAGE_SHARD.match(name)
    if m is None:
        return None
    if int(m.group(1)) == 0:
        raise CorruptCheckpointError(f"{name}: torch numbers the ranks' shard files from "
                                     "shard-00001", BROKEN_HINT)
    return int(m.group(1)) - 1
