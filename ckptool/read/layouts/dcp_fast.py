"""A large ``.metadata`` read the fast way (``read.fastrecords``, CPython's C
unpickler behind a grammar) and checked into the records ``dcp_metadata``
makes, field by field.

Every record of the tree must be the DCP record its place calls for, with
the fields torch writes and values of the types torch writes (a string, a
size, a list of sizes...); every record given state must be in the tree
once; the result is then what ``dcp_metadata`` makes of the ordinary read.
Any doubt, and ``read`` returns None: the caller reads the file the
ordinary way, whose result or error is the one that counts.
"""

from __future__ import annotations

import gc
import itertools
import math
import operator
import os
from typing import Any

from ckptool.read import fastrecords
from ckptool.read.fastrecords import CALLED, CONSTANT, RECORD, SIZE, TUPLE_RECORD, NotFast
from ckptool.read.layouts.dcp_records import MODULES, Item, Metadata, TensorMeta
from ckptool.read.seen import GlobalsSeen
from ckptool.read.tensors import MAX_INT64

FAST_FROM = 1 << 20  # bytes of .metadata from which this path is worth its grammar
TUPLE_KEY = "planner_data"  # the one dict whose values are tuples (of keys)
_PATHS = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path")

NAMES: dict[str, str] = {
    **{f"{m}metadata.{n}": RECORD for m in MODULES for n in (
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
        "MetadataIndex", "StorageMeta")},
    **{f"{m}metadata.TensorProperties": TUPLE_RECORD for m in MODULES},
    **{f"{m}metadata._MEM_FORMAT_ENCODING": CALLED for m in MODULES},
    **{f"{m}filesystem._StorageInfo": RECORD for m in MODULES},
    **{f"{m}.{n}": CALLED for m in ("pathlib", "pathlib._local") for n in _PATHS},
    "torch.Size": SIZE,
    "torch.serialization._get_layout": CONSTANT,
}

# the fields torch writes of each record (a missing one takes its default)
_FIELDS = {
    "Metadata": {"state_dict_metadata", "planner_data", "storage_data", "storage_meta",
                 "version"},
    "TensorStorageMetadata": {"properties", "size", "chunks"},
    "TensorProperties": {"dtype", "layout", "requires_grad", "memory_format", "pin_memory"},
    "ChunkStorageMetadata": {"offsets", "sizes"},
    "MetadataIndex": {"fqn", "offset", "index"},
    "_StorageInfo": {"relative_path", "offset", "length", "transform_descriptors"},
    "StorageMeta": {"checkpoint_id", "save_id", "load_id", "modules"},
}
_PROPERTY_TYPES = (fastrecords.Dtype, fastrecords.Constant, bool, fastrecords.Made, bool)


def read(data: bytes, sub: str, seen: GlobalsSeen) -> tuple[Metadata, int] | None:
    """The metadata of ``data`` (item files relative to ``sub``) and where its
    pickle ends, recorded into ``seen``; or None (``seen`` untouched)."""
    if len(data) < FAST_FROM:
        return None
    # millions of objects and no cycles: the collector's passes over them
    # would cost more than the read. It is back on once the tree is gone,
    # what was made meanwhile (the records kept, a million) moved to its
    # oldest generation first (freeze, unfreeze): they are long-lived, and
    # its next pass over the young would otherwise walk them all
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        found = _read(data, sub)
    finally:
        if gc_was_enabled:
            gc.freeze()
            gc.unfreeze()
            gc.enable()
    if found is None:
        return None
    md, end, loaded = found
    loaded.record(seen)
    return md, end


def _read(data: bytes, sub: str) -> tuple[Metadata, int, fastrecords.Loaded] | None:
    """The tree read and checked; returned without it (freed on return)."""
    loaded = fastrecords.read(data, 0, NAMES, TUPLE_KEY)
    if loaded is None:
        return None
    try:
        md = _Convert(loaded, sub).metadata(loaded.root)
    except NotFast:
        return None
    loaded.root = None
    return md, loaded.end, loaded


class _Convert:
    def __init__(self, loaded: fastrecords.Loaded, sub: str) -> None:
        self.sub = sub
        self.loaded = loaded
        self.classes: dict[str, tuple[type, ...]] = {}
        for dotted, cls in loaded.classes.items():
            kind = dotted.rpartition(".")[2]
            self.classes[kind] = (*self.classes.get(kind, ()), cls)
        self.built = 0
        self.sizes: list[Any] = []  # every tuple (or list) of sizes read, checked at the end

    def state(self, rec: Any, kind: str) -> dict[str, Any]:
        """The state of a record of ``kind`` with torch's fields only."""
        if type(rec) not in self.classes.get(kind, ()):
            raise NotFast(f"{kind} expected")
        state = rec.state  # (a record never given state has none: AttributeError)
        if type(state) is not dict or not state.keys() <= _FIELDS[kind]:
            raise NotFast(f"{kind} with other fields")
        self.built += 1
        return state

    def metadata(self, root: Any) -> Metadata:
        try:
            state = self.state(root, "Metadata")
            sdm, storage = state.get("state_dict_metadata"), state.get("storage_data")
            planner, version = state.get("planner_data"), state.get("version")
            if type(sdm) is not dict or type(storage) is not dict or (
                    planner is not None and type(planner) is not dict) or (
                    version is not None and type(version) is not str):
                raise NotFast("Metadata's fields")
            items = self.items(storage)
            out = Metadata(version=version, planner=self.planner(planner or {}))
            self.meta(state.get("storage_meta"))
            self.entries(sdm, items, out)
        except (AttributeError, KeyError, TypeError) as exc:  # (no state, a field missing,
            # a size that is no number)
            raise NotFast(str(exc)) from exc
        _sizes(self.sizes)
        if self.built != self.loaded.built:
            raise NotFast("a record given state is not in the tree (or is twice)")
        return out

    @staticmethod
    def planner(planner: dict[Any, Any]) -> dict[str, tuple[Any, ...]]:
        paths = planner.values()
        if not (set(map(type, planner)) <= {str} and set(map(type, paths)) <= {tuple}
                and set(map(type, itertools.chain.from_iterable(paths))) <= {str, int}):
            raise NotFast("planner_data")
        return planner

    def meta(self, meta: Any) -> None:
        if meta is None:
            return
        state = self.state(meta, "StorageMeta")
        cid, modules = state.get("checkpoint_id"), state.get("modules", [])
        if not (cid is None or type(cid) is str or (
                type(cid) is fastrecords.Made and cid.name.startswith("pathlib."))) or any(
                not (state.get(k) is None or type(state.get(k)) is str)
                for k in ("save_id", "load_id")) or type(modules) is not list or not all(
                type(m) is str for m in modules):
            raise NotFast("StorageMeta's fields")

    def items(self, storage: dict[Any, Any]) -> dict[tuple[str, Any], Item]:
        """Where each (fqn, offsets) lies: the first record of it wins. Field
        by field over all records at once (``map`` runs in C): a million
        records are checked in well under a second."""
        indexes, infos = list(storage), list(storage.values())
        keys = _states(indexes, self.kind("MetadataIndex"), {2, 3})
        states = _states(infos, self.kind("_StorageInfo"), {3, 4})
        fqns = _column(keys, "fqn", str)
        _column(keys, "index", int, None)  # (a hint torch ignores when it reads: checked only)
        # (MetadataIndex.__init__ sets no offset for a value: it takes the default)
        offsets = (_column(keys, "offset", tuple, None) if _lengths(keys) == {3}
                   else [k.get("offset") for k in keys])
        paths, starts = _column(states, "relative_path", str), _column(states, "offset", int)
        lengths = _column(states, "length", int)
        transforms: list[Any] = [()] * len(states)
        if _lengths(states) != {3}:
            transforms = [s.get("transform_descriptors", ()) for s in states]
            if not set(map(type, transforms)) <= {list, tuple} or not set(map(
                    type, itertools.chain.from_iterable(transforms))) <= {str} or any(
                    len(s) - (t != ()) != 3 for s, t in zip(states, transforms, strict=True)):
                raise NotFast("a storage record's transforms")
            transforms = list(map(tuple, transforms))
        if not set(map(type, offsets)) <= {tuple, type(None)}:
            raise NotFast("an offset")
        self.sizes += filter(None, offsets)
        self.sizes += (starts, lengths)
        sub = self.sub
        files = [os.path.join(sub, p) for p in paths] if sub else paths
        made = list(map(tuple.__new__, itertools.repeat(Item),
                        zip(files, starts, lengths, transforms, strict=True)))
        wheres = list(zip(fqns, offsets, strict=True))
        self.built += 2 * len(storage)
        # the first record of each (fqn, offsets) wins: set them last
        return dict(zip(reversed(wheres), reversed(made), strict=True))

    def kind(self, name: str) -> type | None:
        """The one class of records ``name`` this read handed out (a file that
        names it under both of torch's modules is read the ordinary way)."""
        found = self.classes.get(name, ())
        if len(found) > 1:
            raise NotFast(f"{name} under two names")
        return found[0] if found else None

    def entries(self, sdm: dict[Any, Any], items: dict[tuple[str, Any], Item],
                out: Metadata) -> None:
        props_seen: set[int] = set()
        values = self.classes.get("BytesStorageMetadata", ())
        tensors: list[tuple[str, tuple[int, ...], list[Any], str, bool]] = []
        for fqn, md in sdm.items():
            if type(fqn) is not str:
                raise NotFast("an entry not named by a string")
            if type(md) in values:
                if hasattr(md, "state") or (fqn, None) not in items:
                    raise NotFast("a value")
                out.values[fqn] = items[(fqn, None)]
                continue
            state = self.state(md, "TensorStorageMetadata")
            shape, chunks = state["size"], state["chunks"]
            if type(shape) is not tuple or type(chunks) is not list:
                raise NotFast("a tensor's size or chunks")
            self.sizes.append(shape)
            if math.prod(shape) > MAX_INT64:
                raise NotFast("a tensor too large")
            tensors.append((fqn, shape, chunks, *self.properties(state["properties"],
                                                                 props_seen)))
        boxes = self.boxes(tensors, items)
        at = 0
        for fqn, shape, chunks, dtype, grad in tensors:
            out.tensors[fqn] = TensorMeta(fqn, shape, dtype, grad, boxes[at:at + len(chunks)])
            at += len(chunks)

    def boxes(self, tensors: list[tuple[str, tuple[int, ...], list[Any], str, bool]],
              items: dict[tuple[str, Any], Item]) -> list[tuple[Any, Any, Item]]:
        """Every tensor's chunks, in order: (offsets, sizes, item), all at once."""
        counts = [len(t[2]) for t in tensors]
        chunks = list(itertools.chain.from_iterable(t[2] for t in tensors))
        states = _states(chunks, self.kind("ChunkStorageMetadata"), {2})
        offsets, lengths = _column(states, "offsets", tuple), _column(states, "sizes", tuple)
        shapes = list(itertools.chain.from_iterable(
            itertools.repeat(t[1], n) for t, n in zip(tensors, counts, strict=True)))
        ndims = list(map(len, shapes))
        if list(map(len, offsets)) != ndims or list(map(len, lengths)) != ndims:
            raise NotFast("a chunk's offsets or sizes")
        self.sizes += offsets
        self.sizes += lengths
        ends = map(operator.add, itertools.chain.from_iterable(offsets),
                   itertools.chain.from_iterable(lengths))
        if any(map(operator.gt, ends, itertools.chain.from_iterable(shapes))):
            raise NotFast("a chunk outside its tensor")  # (or a TypeError: not numbers)
        fqns = itertools.chain.from_iterable(
            itertools.repeat(t[0], n) for t, n in zip(tensors, counts, strict=True))
        found = list(map(items.get, zip(fqns, offsets, strict=True)))
        if any(map(operator.is_, found, itertools.repeat(None))):
            raise NotFast("a chunk without storage")
        self.built += len(chunks)
        return list(zip(offsets, lengths, found, strict=True))  # type: ignore[arg-type]

    def properties(self, props: Any, props_seen: set[int]) -> tuple[str, bool]:
        if id(props) not in props_seen:  # one object may serve many tensors
            if type(props) not in self.classes.get("TensorProperties", ()):
                raise NotFast("TensorProperties expected")
            pstate = props.state
            if type(pstate) is dict:
                if not pstate.keys() <= _FIELDS["TensorProperties"] or any(
                        type(pstate.get(k)) not in (fastrecords.Constant, fastrecords.Made,
                                                    bool, type(None))
                        for k in ("layout", "requires_grad", "memory_format", "pin_memory")):
                    raise NotFast("TensorProperties' fields")
            elif len(pstate) != len(_PROPERTY_TYPES) or not all(
                    type(v) is t for v, t in zip(pstate, _PROPERTY_TYPES, strict=True)):
                raise NotFast("TensorProperties' state")
            self.built += 1
            props_seen.add(id(props))
        pstate = props.state
        if type(pstate) is dict:
            dtype, grad = pstate.get("dtype"), pstate.get("requires_grad", False)
        else:
            dtype, grad = pstate[0], pstate[2]
        if type(dtype) is not fastrecords.Dtype:
            raise NotFast("a dtype")
        return str(dtype), grad is True


def _states(records: list[Any], kind: type | None, lengths: set[int]) -> list[dict[str, Any]]:
    """The states of ``records``, each of the class ``kind`` and a dict of
    one of ``lengths`` fields (which ones: ``_column`` says)."""
    if records and set(map(type, records)) != {kind}:
        raise NotFast("a record of another kind")
    states = list(map(operator.attrgetter("state"), records))  # AttributeError: no state
    if states and (set(map(type, states)) != {dict} or not _lengths(states) <= lengths):
        raise NotFast("a record's fields")
    return states


def _lengths(states: list[dict[str, Any]]) -> set[int]:
    return set(map(len, states))


def _column(states: list[dict[str, Any]], name: str, *kinds: type | None) -> list[Any]:
    """Field ``name`` of every state (KeyError: missing), each of ``kinds``
    (None: NoneType)."""
    values = list(map(operator.itemgetter(name), states))
    allowed = {type(None) if k is None else k for k in kinds}
    if not set(map(type, values)) <= allowed:
        raise NotFast(f"a {name} of another type")
    return values


def _sizes(sizes: list[Any]) -> None:
    """Every item of every tuple (or list) in ``sizes`` a non-negative int (in
    C: ``map`` and ``min``; the grammar reads no int past 8 bytes, so none is
    past ``MAX_INT64``)."""
    numbers = itertools.chain.from_iterable
    if not set(map(type, numbers(sizes))) <= {int} or min(numbers(sizes), default=0) < 0:
        raise NotFast("not a list of sizes")
