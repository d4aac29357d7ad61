"""Where a rank's piece of a distributed tensor lies in the whole, from
what its pickle says (nothing of torch.distributed is imported or run):

- a DTensor (``_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor,
  ...)``): its global shape, its local tensor, and its spec's device mesh
  (shape from its layout's axes, or its ``mesh`` tensor in torch <= 2.8; the
  rank's coordinate; its global rank) and placements, placed as torch
  places ``Shard(d)`` (``torch.chunk`` splits, mesh dimensions in order or as
  ``shard_order`` says) and ``Replicate()``;
- an FSDP1 ShardedTensor: its local shards, each with the offsets and sizes
  its metadata records, and the rank and world size of its process group.

``ckptool.read.layouts.per_rank`` joins the ranks' pieces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.read.layouts.base import BROKEN_HINT
from ckptool.read.tensors import TensorRecord
from ckptool.read.values import StandIn, brief


def is_dtensor(rec: TensorRecord) -> bool:
    name = rec.subclass or ""
    return name.startswith("torch.distributed.") and name.rsplit(".", 1)[-1] == "DTensor"


def is_sharded_tensor(rec: TensorRecord) -> bool:
    name = rec.subclass or ""
    return name.startswith("torch.distributed.") and name.rsplit(".", 1)[-1] == "ShardedTensor"


@dataclass(frozen=True)
class Piece:
    """One rank's piece of a tensor: its box in the whole, and its values."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local: TensorRecord


def pieces(key: str, rec: TensorRecord, name: str) -> list[Piece]:
    """The pieces of ``rec`` this rank's file holds: a DTensor's local
    tensor where its placements put it; a ShardedTensor's local shards where
    their metadata says."""
    if is_dtensor(rec):
        offsets, sizes = dtensor_box(key, rec, name)
        return [Piece(offsets, sizes, dtensor_parts(rec)[0])]
    out = []
    for local, offsets, sizes in _shards(rec):
        if len(offsets) != len(rec.shape) or local.shape != sizes:
            raise CorruptCheckpointError(
                f"{key} in {name}: a shard of {list(local.shape)} described as {list(sizes)} "
                f"at {list(offsets)} of {list(rec.shape)}", BROKEN_HINT)
        out.append(Piece(offsets, sizes, local))
    return out


def _state_dict_of(obj: Any) -> dict[str, Any]:
    """A stand-in's BUILD state as a dict: ``{...}`` or ``(None, {...})``."""
    state = obj.state if isinstance(obj, StandIn) else None
    if isinstance(state, tuple) and len(state) == 2:
        state = state[1]
    return state if isinstance(state, dict) else {}


def _shards(rec: TensorRecord) -> list[tuple[TensorRecord, tuple[int, ...], tuple[int, ...]]]:
    """A ShardedTensor's local shards: (tensor, offsets, sizes) each, from its
    pickled state (local shards, metadata, process group state, spec)."""
    state = (rec.extra or {}).get("state")
    shards = state[0] if isinstance(state, tuple) and state else None
    if not isinstance(shards, list):
        raise CorruptCheckpointError("a ShardedTensor without its local shards", BROKEN_HINT)
    out = []
    for shard in shards:
        fields = _state_dict_of(shard)
        local, meta = fields.get("tensor"), _state_dict_of(fields.get("metadata"))
        offsets, sizes = meta.get("shard_offsets"), meta.get("shard_sizes")
        if not (isinstance(local, TensorRecord) and isinstance(offsets, (list, tuple))
                and isinstance(sizes, (list, tuple)) and _ints(offsets) and _ints(sizes)):
            raise CorruptCheckpointError("a ShardedTensor shard without its tensor, offsets "
                                         "and sizes", BROKEN_HINT)
        out.append((local, tuple(offsets), tuple(sizes)))
    return out


def _ints(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(type(v) is int and v >= 0 for v in value)


def rank_of(rec: TensorRecord) -> tuple[int, int]:
    """(the rank whose file holds ``rec``'s pieces, of how many ranks)."""
    if is_dtensor(rec):
        mesh = mesh_of(dtensor_parts(rec)[1])
        return (mesh.rank if mesh.rank is not None else mesh.flat), math.prod(mesh.shape)
    state = (rec.extra or {}).get("state")
    group = state[2] if isinstance(state, tuple) and len(state) > 2 else None
    fields = _state_dict_of(group)
    rank, world = fields.get("global_rank"), fields.get("global_world_size")
    if type(rank) is not int or type(world) is not int or not 0 <= rank < world:
        raise CorruptCheckpointError("a ShardedTensor without its rank and world size",
                                     BROKEN_HINT)
    return rank, world


def dtensor_parts(rec: TensorRecord) -> tuple[TensorRecord, dict[str, Any]]:
    """A DTensor's local tensor and its spec's state."""
    state = (rec.extra or {}).get("state")
    slots = state[1] if isinstance(state, tuple) and len(state) == 2 else state
    local = slots.get("_local_tensor") if isinstance(slots, dict) else None
    spec = slots.get("_spec") if isinstance(slots, dict) else None
    if not isinstance(local, TensorRecord) or not isinstance(spec, StandIn) \
            or not isinstance(spec.state, dict):
        raise CorruptCheckpointError("a DTensor without its local tensor and spec", BROKEN_HINT)
    return local, spec.state


@dataclass(frozen=True)
class Mesh:
    """What a DTensor's pickled DeviceMesh says: its shape, this rank's
    coordinate on it, and this rank's global number where it is recorded."""

    shape: tuple[int, ...]
    coord: tuple[int, ...]
    rank: int | None

    @property
    def flat(self) -> int:
        """The coordinate as a row-major index (DeviceMesh's default layout)."""
        flat = 0
        for c, n in zip(self.coord, self.shape, strict=True):
            flat = flat * n + c
        return flat


def mesh_of(spec: dict[str, Any]) -> Mesh:
    """A DTensor's mesh: from its layout's axes (torch >= 2.9), or from the
    shape of its ``mesh`` tensor of ranks (earlier torch)."""
    mesh = spec.get("mesh")
    state = mesh.state if isinstance(mesh, StandIn) and isinstance(mesh.state, dict) else {}
    coord = state.get("_coordinate_on_dim")
    layout = state.get("_layout")
    axes = layout.state.get("axes") if isinstance(layout, StandIn) and isinstance(
        layout.state, dict) else None
    shape: list[int] = []
    if isinstance(axes, tuple):
        for axis in axes:
            size = axis.state.get("shape") if isinstance(axis, StandIn) and isinstance(
                axis.state, dict) else None
            if not (isinstance(size, tuple) and all(type(s) is int and s > 0 for s in size)):
                raise CorruptCheckpointError("a DTensor's mesh has a bad shape", BROKEN_HINT)
            shape.append(math.prod(size))
    elif isinstance(state.get("mesh"), TensorRecord):
        shape = list(state["mesh"].shape)
    if not shape or not (isinstance(coord, (tuple, list)) and len(coord) == len(shape) and all(
            type(c) is int and 0 <= c < n for c, n in zip(coord, shape, strict=True))):
        raise CorruptCheckpointError("a DTensor's mesh coordinate does not fit its mesh",
                                     BROKEN_HINT)
    rank = state.get("_rank")
    return Mesh(tuple(shape), tuple(coord), rank if type(rank) is int else None)


def placements(rec: TensorRecord) -> list[str]:
    if not is_dtensor(rec):
        return ["ShardedTensor (offsets in its metadata)"]
    out = []
    for p in dtensor_parts(rec)[1].get("placements") or ():
        name = p.qualname.rsplit(".", 1)[-1] if isinstance(p, StandIn) else repr(p)
        dim = p.state.get("dim") if isinstance(p, StandIn) and isinstance(p.state, dict) else None
        out.append(f"{name}({dim})" if dim is not None else f"{name}()")
    return out


def dtensor_box(key: str, rec: TensorRecord, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where this rank's local tensor lies in the global one, as torch places it."""
    local, spec = dtensor_parts(rec)
    mesh = mesh_of(spec)
    shape, coord = mesh.shape, mesh.coord
    placements = spec.get("placements")
    if not isinstance(placements, tuple) or len(placements) != len(shape):
        raise CorruptCheckpointError(f"{key} in {name}: its placements do not match its mesh",
                                     BROKEN_HINT)
    order: dict[int, list[int]] = {}  # tensor dim -> the mesh dims splitting it, in order
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, StandIn):
            raise CorruptCheckpointError(f"{key} in {name}: a placement that is no placement "
                                         f"({brief(p)})", BROKEN_HINT)
        kind = p.qualname.rsplit(".", 1)[-1]
        if kind == "Replicate":
            continue
        dim = p.state.get("dim") if isinstance(p.state, dict) else None
        if kind != "Shard" or type(dim) is not int:
            raise UnsupportedCheckpointError(
                f"{key} in {name} is placed {kind} on mesh dimension {mesh_dim}: "
                "ckptool joins Shard(d) and Replicate() placements only",
                "gather it with torch (full_tensor()) and save that")
        if not 0 <= dim < len(rec.shape):
            raise CorruptCheckpointError(f"{key} in {name} is sharded on dimension {dim} of a "
                                         f"{len(rec.shape)}-d tensor", BROKEN_HINT)
        order.setdefault(dim, []).append(mesh_dim)
    entries = spec.get("shard_order")
    for entry in entries if isinstance(entries, (tuple, list)) else ():
        args = entry.args if isinstance(entry, StandIn) else ()  # (tensor_dim, mesh_dims)
        if len(args) == 2 and type(args[0]) is int and args[0] in order \
                and isinstance(args[1], (tuple, list)) \
                and all(type(m) is int for m in args[1]) \
                and sorted(args[1]) == sorted(order[args[0]]):
            order[args[0]] = list(args[1])
    offsets, sizes = [0] * len(rec.shape), list(rec.shape)
    for dim, mesh_dims in order.items():
        for mesh_dim in mesh_dims:
            piece = -(-sizes[dim] // shape[mesh_dim])  # torch.chunk: ceil(n / k)
            start = min(coord[mesh_dim] * piece, sizes[dim])
            offsets[dim] += start
            sizes[dim] = max(0, min(piece, sizes[dim] - start))
    if tuple(sizes) != local.shape:
        raise CorruptCheckpointError(
            f"{key} in {name}: its local tensor is {list(local.shape)}, but its placements "
            f"give this rank {sizes} of {list(rec.shape)}", BROKEN_HINT)
    return tuple(offsets), tuple(sizes)
