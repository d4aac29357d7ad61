"""Per-rank ``torch.save`` of DTensor state dicts (FSDP2, tensor parallel):
what veRL and many RL trainers write, one file per rank
(``model_world_size_2_rank_0.pt`` ...), read as one checkpoint; and FSDP1's
``SHARDED_STATE_DICT`` saved the same way, whose ShardedTensors record each
local shard's offsets and sizes and the rank's number.

A DTensor pickles as its global shape (``_rebuild_wrapper_subclass``), its
rank's local tensor and its spec: the device mesh (its shape, this rank's
coordinate on each of its dimensions) and one placement per mesh dimension
(``Shard(d)``, ``Replicate()``). No offset is stored: each rank's box in the
global tensor is computed as torch places it, every ``Shard(d)`` splitting
what the earlier mesh dimensions left along ``d`` as ``torch.chunk`` does
(the first pieces ``ceil(n/k)`` long, the last shorter or empty), in the
order the spec's ``shard_order`` gives. The box must have the local tensor's
shape; every tensor must be covered exactly once (replicated boxes keep the
lowest rank's copy).

Each DTensor becomes a logical tensor of its global shape whose chunks are
the ranks' local tensors: row-major runs of raw elements inside a storage
record of a rank's zip (``Chunk.raw``), read in place one tensor at a time
(FSDP2 pads its local storages: only the local tensor's own elements are
read). Plain tensors (an optimizer's ``step``) and other values are rank 0's.
The tree is rank 0's: ``{"model": ..., "optimizer": ...}`` stays nested.

A joined tensor's saved location is rank 0's piece's: the location tag its
storage record carries (``cuda:0``), where ``torch.load`` of rank 0's file
puts it (the DTensor records only its mesh's device type). Ranks that saved
on different devices (each on its own GPU) are said in a note.
"""

from __future__ import annotations

import math
import os
from typing import Any

from ckptool import dtypes
from ckptool.describe import plural, shell_word
from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.model import Checkpoint, Chunk, FileInfo, StorageInfo
from ckptool.read import dispatch, fs
from ckptool.read.formats.base import RawRead
from ckptool.read.layouts import dcp_metadata, shards
from ckptool.read.layouts.base import BROKEN_HINT, MultiRead, contiguous
from ckptool.read.layouts.recognise import Layout
from ckptool.read.seen import GlobalsSeen
from ckptool.read.tensor_data import TensorData
from ckptool.read.tensors import StorageRef, TensorRecord

PER_RANK = "dtensor-ranks"
MAX_DEPTH = 8  # {"model": {...}, "optimizer": {"state": {0: {"exp_avg": ...}}}}
Path = tuple[Any, ...]


def read(layout: Layout) -> MultiRead:
    names = list(layout.metadata)  # the ranks' files, rank 0 first
    seen = GlobalsSeen()
    reads: list[RawRead] = []
    files: list[FileInfo] = []
    for rank, name in enumerate(names):
        full = os.path.join(layout.directory, name)
        raw = dispatch.read(full)
        seen.merge(raw.seen, name)
        reads.append(raw)
        files.append(FileInfo(name, "rank", raw.format, fs.getsize(full), rank=rank))
    found = [_dtensors(raw.root) for raw in reads]
    if not found[0]:
        raise UnsupportedCheckpointError(
            f"{layout.path} holds {plural(len(names), 'file')} named by rank "
            f"({names[0]} ...) but no DTensor in {names[0]}: nothing says how they join",
            f"name one file to read it alone: ckptool inspect "
            f"{shell_word(os.path.join(layout.path, names[0]))}")
    for rank, (name, each) in enumerate(zip(names, found, strict=True)):
        if each.keys() != found[0].keys():
            raise CorruptCheckpointError(
                f"{name} holds other DTensors than {names[0]} (ranks save the same state "
                "dict)", BROKEN_HINT)
        _check_rank(name, rank, len(names), each)
    chunks: dict[str, tuple[Chunk, ...]] = {}
    root = reads[0].root
    devices: dict[int, dict[str, None]] = {}  # rank -> where its pieces were saved
    with StorageOffsets(layout.directory, names, reads) as offsets_of:
        for path, first in found[0].items():
            shape, dtype = first.shape, first.dtype
            boxes: dict[tuple[tuple[int, ...], tuple[int, ...]], Chunk] = {}
            location: str | None = None  # rank 0's piece's: where torch.load puts it
            for rank, (name, each) in enumerate(zip(names, found, strict=True)):
                rec = each[path]
                if (rec.shape, rec.dtype) != (shape, dtype):
                    raise CorruptCheckpointError(
                        f"{_key(path)} is {list(shape)} {dtype} on rank 0 and "
                        f"{list(rec.shape)} {rec.dtype} in {name}", BROKEN_HINT)
                for piece in shards.pieces(_key(path), rec, name):
                    saved = _saved_on(piece.local) or rec.location
                    location = location or saved
                    if saved:
                        devices.setdefault(rank, {})[saved] = None
                    box = (piece.offsets, piece.sizes)
                    if box not in boxes:  # replicated: the lowest rank's copy
                        boxes[box] = _chunk(name, rank, rec.dtype, piece, offsets_of)
            problem = dcp_metadata.check_cover(shape, list(boxes))
            if problem:
                raise CorruptCheckpointError(f"{_key(path)}: the ranks' shards do not make "
                                             f"it whole: {problem}", BROKEN_HINT)
            chunks[_key(path)] = tuple(boxes.values())
            location = location or first.location
            ref = StorageRef(f"{PER_RANK}:{_key(path)}", dtype, location, math.prod(shape))
            root = _replace(root, path, TensorRecord(
                shape, dtype, contiguous(shape), 0, ref, location, first.requires_grad,
                first.is_parameter))
    rank0 = {id(ref) for ref in reads[0].storages.values()}
    storage_files = {}
    for ref in _storages(root):  # rank 0's plain tensors (a step count), read in its file
        if id(ref) in rank0:
            ref.key = f"{names[0]}:{ref.key}"
            storage_files[ref.key] = names[0]
    storages = {ref.key: ref for ref in _storages(root)}
    first = next(iter(found[0].values()))
    mesh = shards.mesh_of(shards.dtensor_parts(first)[1]).shape if shards.is_dtensor(first) else ()
    meta: dict[str, Any] = {"ranks": len(names), "world_size": len(names),
                            "mesh": list(mesh) if mesh else None,
                            "placements": {_key(p): shards.placements(r)
                                           for p, r in found[0].items()}}
    raw_all = RawRead(PER_RANK, root, storages, seen, meta,
                      warnings=[f"{n}: {w}" for n, raw in zip(names, reads, strict=True)
                                for w in raw.warnings])
    return MultiRead(raw_all, layout.directory, files, storage_files, chunks,
                     notes=list(layout.notes) + _devices_note(devices), chunk_keys=True)


def _saved_on(local: TensorRecord) -> str | None:
    """Where a rank's local tensor was saved: its storage's location tag
    (``cuda:1``), which ``torch.load`` restores it to; the DTensor around it
    records its mesh's device type only."""
    return local.storage.location if local.storage is not None else local.location


def _devices_note(devices: dict[int, dict[str, None]]) -> list[str]:
    """A note where the ranks saved their pieces on different devices (each
    on its own GPU): a joined tensor is shown where rank 0's piece was."""
    if len({d for saved in devices.values() for d in saved}) < 2:
        return []
    each = ", ".join(f"rank {rank} on {' and '.join(saved)}" for rank, saved in
                     sorted(devices.items())[:4]) + (", …" if len(devices) > 4 else "")
    return [f"the ranks saved their pieces on different devices ({each}): each tensor is "
            "shown where rank 0's piece was saved, and ckptool.load puts it there unless "
            "map_location says otherwise"]


def one_rank(path: str, root: Any) -> str | None:
    """What a single rank's file of DTensors is, in a note; None without DTensors."""
    found = _dtensors(root)
    if not found:
        return None
    try:
        here, world = shards.rank_of(next(iter(found.values())))
    except CorruptCheckpointError:
        return None
    folder = os.path.dirname(path) or "."
    kind = "DTensor" if shards.is_dtensor(next(iter(found.values()))) else "ShardedTensor"
    are = f"is a {kind}" if len(found) == 1 else f"are {kind}s"
    ranks = plural(world, "rank")
    return (f"{plural(len(found), 'tensor')} here {are}: this file holds rank {here}'s shards "
            f"of them (of {ranks}); read the folder holding every rank's file to get them "
            f"whole: ckptool inspect {shell_word(folder)}")


def _dtensors(root: Any) -> dict[Path, TensorRecord]:
    """Every DTensor (or FSDP1 ShardedTensor) record in a rank's tree, by its
    path from the root."""
    out: dict[Path, TensorRecord] = {}
    stack: list[tuple[Path, Any]] = [((), root)]
    while stack:
        path, obj = stack.pop()
        if isinstance(obj, TensorRecord):
            if shards.is_dtensor(obj) or shards.is_sharded_tensor(obj):
                out[path] = obj
        elif len(path) < MAX_DEPTH and isinstance(obj, dict):
            stack += [((*path, k), v) for k, v in obj.items() if isinstance(k, (str, int))]
        elif len(path) < MAX_DEPTH and isinstance(obj, (list, tuple)):
            stack += [((*path, i), v) for i, v in enumerate(obj)]
    return dict(sorted(out.items(), key=lambda kv: [str(p) for p in kv[0]]))


def _check_rank(name: str, rank: int, count: int, found: dict[Path, TensorRecord]) -> None:
    """The file named rank ``rank`` of ``count`` holds that rank's pieces:
    every DTensor's mesh (a submesh too: a data-parallel norm beside tensor
    parallel weights) fits ``count`` ranks and, where the mesh records this
    rank's number, names ``rank``; a mesh of all the ranks places it there. A
    ShardedTensor records its rank and world size."""
    for rec in found.values():
        if shards.is_dtensor(rec):
            mesh = shards.mesh_of(shards.dtensor_parts(rec)[1])
            size = math.prod(mesh.shape)
            here = mesh.rank if mesh.rank is not None else (
                mesh.flat if size == count else rank)
        else:
            here, size = shards.rank_of(rec)
        if size > count or count % size:
            raise CorruptCheckpointError(
                f"{name} holds pieces of tensors over {size} ranks, and the directory holds "
                f"{plural(count, 'rank file')}", "copy every rank's file, and only those")
        if here != rank:
            raise CorruptCheckpointError(f"{name} holds rank {here}'s shards, not rank {rank}'s",
                                         "a file was renamed or copied from another checkpoint")


class StorageOffsets:
    """Where each rank's storages start in its zip: one open directory per
    rank file for the whole read (a directory per tensor would cost the
    square of the tensors)."""

    def __init__(self, directory: str, names: list[str], reads: list[RawRead]) -> None:
        self.directory, self.names, self.reads = directory, names, reads
        self.data: dict[str, TensorData] = {}

    def __enter__(self) -> StorageOffsets:
        return self

    def __exit__(self, *exc: object) -> None:
        for data in self.data.values():
            data.close()

    def start(self, name: str, ref: StorageRef) -> int:
        data = self.data.get(name)
        if data is None:
            raw = self.reads[self.names.index(name)]
            path = os.path.join(self.directory, name)
            view = Checkpoint(path=path, format=raw.format, file_size=fs.getsize(path),
                              tensors=[], storages={
                                  r.key: StorageInfo(r.key, r.dtype, r.location, r.nbytes,
                                                     r.record, ())
                                  for r in raw.storages.values()},
                              entries=[], globals=[], main_state_dict=None,
                              metadata=raw.metadata)
            data = self.data[name] = TensorData(view)
        return data.storage_offset(ref.key)


def _chunk(name: str, rank: int, dtype: str, piece: shards.Piece,
           offsets_of: StorageOffsets) -> Chunk:
    local, sizes = piece.local, piece.sizes
    itemsize = dtypes.itemsize(dtype)
    length = math.prod(sizes) * itemsize
    if local.dtype != dtype:
        raise CorruptCheckpointError(f"a piece in {name} is {local.dtype}, its tensor {dtype}",
                                     BROKEN_HINT)
    if length == 0:
        return Chunk(name, piece.offsets, sizes, 0, 0, rank, raw=True)
    ref = local.storage
    if ref is None or local.stride is None or any(
            s != c for n, s, c in zip(sizes, local.stride, contiguous(sizes), strict=True)
            if n > 1):
        raise UnsupportedCheckpointError(
            f"a local shard in {name} is not row-major: ckptool does not join it yet",
            "gather it with torch (full_tensor()) and save that")
    if local.storage_offset * itemsize + length > ref.nbytes:
        raise CorruptCheckpointError(f"a local tensor in {name} runs past its storage",
                                     BROKEN_HINT)
    start = offsets_of.start(name, ref) + local.storage_offset * itemsize
    return Chunk(name, piece.offsets, sizes, start, length, rank, raw=True)


def _replace(root: Any, path: Path, value: Any) -> Any:
    if not path:
        return value
    node = root
    for step in path[:-1]:
        node = node[step]
    if isinstance(node, tuple):
        raise UnsupportedCheckpointError("a DTensor inside a tuple: ckptool joins DTensors in "
                                         "dicts and lists", BROKEN_HINT)
    node[path[-1]] = value
    return root


def _storages(root: Any) -> list[StorageRef]:
    """The storages the tensors of ``root`` view (depth-bounded)."""
    out: dict[str, StorageRef] = {}
    stack: list[tuple[int, Any]] = [(0, root)]
    while stack:
        depth, obj = stack.pop()
        if isinstance(obj, TensorRecord):
            if obj.storage is not None:
                out[obj.storage.key] = obj.storage
        elif depth < MAX_DEPTH and isinstance(obj, dict):
            stack += [(depth + 1, v) for v in obj.values()]
        elif depth < MAX_DEPTH and isinstance(obj, (list, tuple)):
            stack += [(depth + 1, v) for v in obj]
    return list(out.values())


def _key(path: Path) -> str:
    from ckptool.keys import escape

    return "/".join(escape(str(p)) for p in path)

