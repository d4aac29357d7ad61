"""A ``torch.distributed.checkpoint`` ``.metadata`` file, read safely and
checked into plain records.

torch reads this pickle with plain ``pickle.load``; ckptool reads it with its
own unpickler (``ckptool.read.pickles``), which imports and calls nothing:
DCP's dataclasses (``Metadata``, ``TensorStorageMetadata``, ``MetadataIndex``,
``_StorageInfo``...) come back as inert stand-ins whose ``BUILD`` state is
read here field by field, every field checked (a dataclass field left out
of the pickle takes its default, as it does in torch). Every global is
recorded in the checkpoint's ``GlobalsSeen``, so a hostile ``.metadata`` is
reported like any unsafe pickle. A large one (``dcp_fast.FAST_FROM``) is
read the fast way first (``dcp_fast``: CPython's C unpickler behind a
grammar, then the same checks field by field): the same records, recorded
the same way; in any doubt, this read.

``check_cover`` says whether a tensor's chunks fill it exactly, without
gaps or overlaps.
"""

from __future__ import annotations

import io
import itertools
import math
import os
from typing import Any

from ckptool.errors import CorruptCheckpointError
from ckptool.read import fs, pickles
from ckptool.read.formats.torch_legacy import read_bytes
from ckptool.read.layouts import dcp_fast
from ckptool.read.layouts.base import BROKEN_HINT
from ckptool.read.layouts.dcp_records import MODULES, Item, Metadata, TensorMeta
from ckptool.read.seen import GlobalsSeen
from ckptool.read.tensors import MAX_INT64
from ckptool.read.values import StandIn, TorchDtype, brief

HINT = ("the .metadata file is not what torch.distributed.checkpoint writes; it is damaged, "
        "or was made to look like one")
# Megatron-core's Metadata (up to 0.15: torch's fields and ``mcore_data``, a
# dict of each tensor's original shape): read as torch's, ``mcore_data`` unused
MCORE_METADATA = "megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata"
MAX_PAIRS = 1 << 22  # pairs of chunks sharing a slice, checked for overlap
MAX_GAP_GRID = 1 << 12  # cells searched for the element a gap leaves out


def parse(directory: str, name: str, seen: GlobalsSeen) -> Metadata:
    """Read ``directory/name``; item files are relative to ``directory``."""
    with fs.open_binary(os.path.join(directory, name)) as f:
        data = f.read()
    seen.part = name
    stream = io.BytesIO(data)
    fast = dcp_fast.read(data, os.path.dirname(name), seen)
    if fast is not None:  # the C unpickler's read, checked (layouts.dcp_fast)
        stream.seek(fast[1])
        with seen.naming_unsafe():
            pickles.scan_rest(stream, len(data), seen, name, read_bytes)
        return fast[0]
    with seen.naming_unsafe():
        # an embedded torch file (torch.storage._load_from_bytes) is read for
        # what it names, and so is every pickle after this one's STOP
        obj = pickles.load(stream, None, seen, {}, read_bytes)
        pickles.scan_rest(stream, len(data), seen, name, read_bytes)
        if not (_is(obj, "metadata.Metadata") or (
                isinstance(obj, StandIn) and obj.qualname == MCORE_METADATA)):
            return Metadata(other=obj)
        return _metadata(obj, os.path.dirname(name), name)


def _is(obj: Any, suffix: str) -> bool:
    return isinstance(obj, StandIn) and any(obj.qualname == m + suffix for m in MODULES)


def _state(obj: Any, what: str, shown: str) -> dict[str, Any]:
    if not isinstance(obj, StandIn):
        raise CorruptCheckpointError(f"{shown}: {what} is {brief(obj)}, not a DCP record", HINT)
    return obj.state_dict_view()


def _metadata(obj: StandIn, sub: str, shown: str) -> Metadata:
    state = _state(obj, "Metadata", shown)
    sdm, storage = state.get("state_dict_metadata"), state.get("storage_data")
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        raise CorruptCheckpointError(f"{shown} has no state_dict_metadata and storage_data "
                                     "dicts", HINT)
    items = _items(storage, sub, shown)
    out = Metadata(version=state.get("version") if isinstance(state.get("version"), str)
                   else None)
    planner = state.get("planner_data")
    if isinstance(planner, dict):
        out.planner = {k: v for k, v in planner.items()
                       if isinstance(k, str) and isinstance(v, tuple)}
    for fqn, md in sdm.items():
        if not isinstance(fqn, str):
            raise CorruptCheckpointError(f"{shown} names an entry {brief(fqn)}", HINT)
        if _is(md, "metadata.BytesStorageMetadata"):
            item = items.get((fqn, None))
            if item is None:
                raise CorruptCheckpointError(f"{shown}: value {fqn} has no storage record",
                                             BROKEN_HINT)
            out.values[fqn] = item
        elif _is(md, "metadata.TensorStorageMetadata"):
            out.tensors[fqn] = _tensor(fqn, md, items, shown)
        else:
            raise CorruptCheckpointError(f"{shown}: entry {fqn} is {brief(md)}", HINT)
    return out


def _items(storage: dict[Any, Any], sub: str, shown: str) -> dict[tuple[str, Any], Item]:
    out: dict[tuple[str, Any], Item] = {}
    for index, info in storage.items():
        key = _state(index, "a storage index", shown)
        fqn, offset = key.get("fqn"), key.get("offset")
        st = _state(info, "a storage record", shown)
        path, start, length = st.get("relative_path"), st.get("offset", -1), st.get("length", -1)
        transforms = st.get("transform_descriptors") or ()
        if not (isinstance(fqn, str) and isinstance(path, str) and _size(start)
                and _size(length) and isinstance(transforms, (list, tuple))
                and all(isinstance(t, str) for t in transforms)):
            raise CorruptCheckpointError(f"{shown}: a storage record is malformed: "
                                         f"{brief(st, 120)}", HINT)
        where = (fqn, None if offset is None else _dims(offset, f"{fqn}'s offset", shown))
        out.setdefault(where, Item(os.path.join(sub, path) if sub else path, int(start),
                                   int(length), tuple(transforms)))
    return out


def _tensor(fqn: str, md: StandIn, items: dict[tuple[str, Any], Item],
            shown: str) -> TensorMeta:
    state = _state(md, f"{fqn}'s metadata", shown)
    shape = _dims(state.get("size"), f"{fqn}'s size", shown)
    if math.prod(shape) > MAX_INT64:
        raise CorruptCheckpointError(f"{shown}: {fqn} claims {brief(shape)} elements", HINT)
    props = state.get("properties")
    pstate = props.state if isinstance(props, StandIn) else None
    if isinstance(pstate, tuple) and pstate:  # TensorProperties.__getstate__: a tuple
        dtype, grad = pstate[0], pstate[2] if len(pstate) > 2 else False
    elif isinstance(pstate, dict):
        dtype, grad = pstate.get("dtype"), pstate.get("requires_grad", False)
    else:
        dtype, grad = None, False
    if not isinstance(dtype, TorchDtype):
        raise CorruptCheckpointError(f"{shown}: {fqn} has no dtype ({brief(props)})", HINT)
    chunks = state.get("chunks")
    if not isinstance(chunks, list):
        raise CorruptCheckpointError(f"{shown}: {fqn} lists no chunks", HINT)
    out = TensorMeta(fqn, shape, str(dtype), grad is True)
    for chunk in chunks:
        cs = _state(chunk, f"a chunk of {fqn}", shown)
        offsets = _dims(cs.get("offsets"), f"a chunk of {fqn}'s offsets", shown)
        sizes = _dims(cs.get("sizes"), f"a chunk of {fqn}'s sizes", shown)
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
            raise CorruptCheckpointError(
                f"{shown}: a chunk of {fqn} (offsets {list(offsets)}, sizes {list(sizes)}) "
                f"lies outside its shape {list(shape)}", BROKEN_HINT)
        item = items.get((fqn, offsets))
        if item is None:
            raise CorruptCheckpointError(
                f"{shown}: the chunk of {fqn} at offsets {list(offsets)} has no storage "
                "record", BROKEN_HINT)
        out.boxes.append((offsets, sizes, item))
    return out


def _dims(value: Any, what: str, shown: str) -> tuple[int, ...]:
    if isinstance(value, (tuple, list)) and all(_size(v) for v in value):
        return tuple(value)
    raise CorruptCheckpointError(f"{shown}: {what} is {brief(value)}, not a list of sizes", HINT)


def _size(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_INT64


def check_cover(shape: tuple[int, ...],
                boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str | None:
    """None when ``boxes`` (offsets, sizes) fill ``shape`` exactly; else what
    is wrong: a chunk outside the tensor, two chunks holding one element, or
    elements no chunk holds. Boxes inside the tensor that do not overlap and
    whose volumes add up to the tensor's fill it exactly; overlaps are found
    by a sweep along the dimension the chunks are cut in most, so the cost is
    the number of chunks (times those sharing a slice of that dimension),
    never the tensor's size."""
    total = math.prod(shape)
    full = [(o, s) for o, s in boxes if math.prod(s) > 0]
    for offsets, sizes in full:
        if any(o < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape, strict=True)):
            return f"a chunk at {list(offsets)} of shape {list(sizes)} lies outside it"
    if total == 0 or (len(full) == 1 and full[0][1] == shape):
        return None
    if shape:
        dim = max(range(len(shape)), key=lambda i: len({o[i] for o, _ in full}))
        full.sort(key=lambda b: b[0][dim])
        checks = 0
        for i, (oa, sa) in enumerate(full):
            end = oa[dim] + sa[dim]
            for ob, sb in full[i + 1:]:
                if ob[dim] >= end:
                    break
                checks += 1
                if checks > MAX_PAIRS:
                    return f"its {len(full)} chunks overlap too much to be checked"
                if all(x < y + m and y < x + n for x, n, y, m in zip(oa, sa, ob, sb, strict=True)):
                    start = [max(x, y) for x, y in zip(oa, ob, strict=True)]
                    return f"two of its chunks both hold the element at {start}"
    held = sum(math.prod(s) for _, s in full)
    if held == total:
        return None
    gap = _first_gap(shape, full)
    return (f"no chunk holds the element at {gap}" if gap is not None
            else f"its chunks hold {held} of its {total} elements")


def _first_gap(shape: tuple[int, ...],
               boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[int] | None:
    """The first element no box holds, on the grid the boxes' edges cut
    (when that grid is small: it only names the gap in the error)."""
    cuts = [sorted({0, d, *(o[i] for o, _ in boxes), *(o[i] + s[i] for o, s in boxes)})
            for i, d in enumerate(shape)]
    if math.prod(len(c) - 1 for c in cuts) > MAX_GAP_GRID:
        return None
    for cell in itertools.product(*(range(len(c) - 1) for c in cuts)):
        start = [c[i] for c, i in zip(cuts, cell, strict=True)]
        if not any(all(o <= x < o + n for x, o, n in zip(start, offs, sizes, strict=True))
                   for offs, sizes in boxes):
            return start
    return None
