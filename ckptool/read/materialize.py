"""``ckptool.load``: a checkpoint's object tree with real tensors, as
``torch.load(weights_only=False)`` gives it for a benign file, built from
ckptool's own safe read: nothing from the file is imported or run.

- The file is read as ``ckptool.open`` reads it (its unpickler never imports
  or calls what the file names). A file that names unsafe globals (those
  ``inspect`` reports) is refused with a ``CkptoolError`` naming them.
- Each storage becomes one ``torch.UntypedStorage``: with ``mmap`` (the
  default) a slice of the file mapped privately, as ``torch.load(mmap=True)``
  maps it; else read into memory. Tensors are views of it with their saved
  dtype, shape, stride and offset, so views and tied weights share storage
  as in the file; ``nn.Parameter`` where the file has one.
- ``map_location`` as torch takes it: a device (string or ``torch.device``),
  a dict of saved tag to tag, or a callable ``(storage, tag) -> storage``.
  With None, storages go where they were saved when this machine has that
  device, else a ``CkptoolError`` says which is missing and how to map it.
- Plain data comes back as itself; ``argparse.Namespace`` and numpy arrays
  as real ones; every other class as its inert stand-in (dotted name and
  state, never imported). Sparse COO/CSR tensors are rebuilt from their parts.
- A checkpoint of many files gives, one tensor at a time from wherever it
  lies: for DCP, everything it holds nested as saved (what ``torch.load`` of
  ``dcp_to_torch_save``'s file gives); for Hugging Face shards and DeepSpeed,
  the main state dict, the names an index or DeepSpeed records as tied
  sharing one tensor.

torch (and numpy) are imported here, on use: ``ckptool.open`` stays light.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.keys import split_key, unescape
from ckptool.model import Checkpoint
from ckptool.read import fs
from ckptool.read.constructors import NDArray
from ckptool.read.layouts.dcp import DCP, nest
from ckptool.read.layouts.per_rank import PER_RANK
from ckptool.read.placement import LoadError, MapLocation, Placement, view
from ckptool.read.reader import no_cycle_collection, open_checkpoint
from ckptool.read.tensor_data import TensorData
from ckptool.read.tensor_source import TensorValues
from ckptool.read.tensors import CompositeTensor, StorageRef, TensorRecord
from ckptool.read.values import StandIn, is_plain, name_of
from ckptool.read.walk import key_text as walk_key
from ckptool.read.walk import walk

if TYPE_CHECKING:
    import torch

MAX_DEPTH = 200
_MISSING = object()


def load(path: str | os.PathLike[str], map_location: MapLocation = None, *,
         mmap: bool = True) -> Any:
    """The object tree of the checkpoint at ``path``, with real tensors."""
    path = os.fspath(path)
    ckpt = open_checkpoint(path)
    unsafe = ckpt.unsafe_globals
    if unsafe:
        raise LoadError(
            f"{path} names globals that run code when torch loads it: {', '.join(unsafe)}; "
            "ckptool.load builds nothing from such a file",
            "ckptool.load_state_dict(path) takes only its weights, which run nothing; "
            "`ckptool inspect` shows where the globals are")
    if ckpt.is_multifile:
        return _state_dict_of_many(ckpt, map_location)
    with no_cycle_collection():  # millions of small objects: see reader
        return Builder(ckpt, map_location, mmap).build(ckpt.root)


def _state_dict_of_many(ckpt: Checkpoint, map_location: MapLocation) -> Any:
    if ckpt.format == DCP:
        return _dcp_tree(ckpt, map_location)
    if ckpt.format == PER_RANK:
        return _whole_tree(ckpt, map_location)
    out: dict[str, Any] = {}
    place = Placement(map_location)
    with TensorValues(ckpt) as values:
        for name, t in ckpt.state_dict().items():
            out[name] = place.tensor(values.values(t), t.location or "cpu")
    for alias, kept in ckpt.aliases.items():
        if kept in out:
            out[alias] = out[kept]
    return out


def _dcp_tree(ckpt: Checkpoint, map_location: MapLocation) -> dict[str, Any]:
    """Everything a DCP checkpoint holds, nested as it was saved: what
    ``torch.load`` of ``dcp_to_torch_save``'s file gives."""
    place = Placement(map_location)
    items: dict[str, Any] = {}
    root = ckpt.root if isinstance(ckpt.root, dict) else {}
    with TensorValues(ckpt) as values:
        for t in ckpt.tensors:
            if t.chunks:
                items[unescape(t.key)] = place.tensor(values.values(t), "cpu")
    for fqn, value in root.items():
        if isinstance(fqn, str) and fqn not in items:
            if not is_plain(value):
                raise UnsupportedCheckpointError(
                    f"{fqn} is {type(value).__name__}, not plain data: ckptool.load does not "
                    "build DCP values of that kind yet", "ckptool.open lists it")
            items[fqn] = value
    return nest(items, {fqn: ckpt.tree_paths.get(fqn, (fqn,)) for fqn in items})


def pick(tree: Any, key: str) -> Any:
    """The object at ``key`` (a tensor's key, as ``ckptool.open`` keys it)
    in a tree ``Builder`` built from a file's."""
    obj = tree
    for name in split_key(key):
        if isinstance(obj, dict):
            found = obj.get(name, _MISSING) if name in obj else next(
                (v for k, v in obj.items() if walk_key(k) == name), _MISSING)
        elif isinstance(obj, (list, tuple)) and name.isdigit() and int(name) < len(obj):
            found = obj[int(name)]
        else:
            found = _MISSING
        if found is _MISSING:
            raise UnsupportedCheckpointError(f"{key}: not found in the built tree",
                                             "ckptool.load(path) builds the whole file")
        obj = found
    return obj


def _whole_tree(ckpt: Checkpoint, map_location: MapLocation) -> Any:
    """Everything a checkpoint saved per rank holds, nested as each rank saved
    it, every DTensor whole (what ``torch.load`` of a file of the gathered
    state dict gives)."""
    with TensorValues(ckpt) as values:
        return _JoinedBuilder(ckpt, map_location, values).build(ckpt.root)


class Builder:
    """Real objects for ``ckpt``'s inert tree, each storage made once."""

    def __init__(self, ckpt: Checkpoint, map_location: MapLocation, mmap: bool) -> None:
        self.ckpt = ckpt
        self.place = Placement(map_location)
        self.mmap = mmap
        self._storages: dict[str, torch.UntypedStorage] = {}
        self._done: dict[int, Any] = {}  # id of an inert object -> what it became
        self._whole: torch.UntypedStorage | None = None
        self._data: TensorData | None = None

    def build(self, root: Any) -> Any:
        try:
            return self._value(root, 0)
        finally:
            if self._data is not None:
                self._data.close()

    def _value(self, obj: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise LoadError("the object tree nests deeper than ckptool builds", "")
        key = id(obj)
        if key in self._done:
            return self._done[key]
        out = self._make(obj, depth + 1)
        if not isinstance(obj, (str, bytes, int, float, bool, type(None))):
            self._done[key] = out
        return out

    def _make(self, obj: Any, depth: int) -> Any:
        if isinstance(obj, TensorRecord):
            return self._tensor(obj)
        if isinstance(obj, StorageRef):
            return self._storage(obj)
        if isinstance(obj, CompositeTensor):
            return self._composite(obj, depth)
        if isinstance(obj, NDArray):
            return _numpy(obj)
        if isinstance(obj, dict):
            made = type(obj)() if type(obj) is not dict else {}
            self._done[id(obj)] = made  # a dict may hold itself
            for k, v in obj.items():
                made[k] = self._value(v, depth)
            meta = getattr(obj, "_metadata", None)
            if meta is not None:
                made._metadata = meta  # type: ignore[attr-defined]
            return made
        if isinstance(obj, list):
            made_list: list[Any] = []
            self._done[id(obj)] = made_list
            made_list.extend(self._value(v, depth) for v in obj)
            return made_list
        if isinstance(obj, tuple):
            return tuple(self._value(v, depth) for v in obj)
        if isinstance(obj, (set, frozenset)):
            return type(obj)(self._value(v, depth) for v in obj)
        if isinstance(obj, StandIn):
            return self._standin(obj, depth)
        return obj

    def _standin(self, obj: StandIn, depth: int) -> Any:
        if obj.qualname == "argparse.Namespace" and isinstance(obj.state, dict):
            import argparse

            return argparse.Namespace(**{str(k): self._value(v, depth)
                                         for k, v in obj.state.items()})
        # inert, but holding real values: its state, arguments and items built
        obj.args = tuple(self._value(v, depth) for v in obj.args)
        obj.kwargs = {k: self._value(v, depth) for k, v in obj.kwargs.items()}
        obj.state = self._value(obj.state, depth)
        obj.items = [self._value(v, depth) for v in obj.items]
        obj.dictitems = {k: self._value(v, depth) for k, v in obj.dictitems.items()}
        return obj

    # -- tensors -----------------------------------------------------------
    def _reader(self) -> TensorData:
        if self._data is None:
            self._data = TensorData(self.ckpt)
        return self._data

    def _storage(self, ref: StorageRef) -> torch.UntypedStorage:
        made = self._storages.get(ref.key)
        if made is not None:
            return made
        import torch

        data = self._reader()
        big = self.ckpt.metadata.get("byteorder") == "big"
        if ref.nbytes == 0:
            storage = torch.UntypedStorage(0)
        elif self.mmap and not big and not fs.is_remote(self.ckpt.path):
            start = data.storage_offset(ref.key)
            if self._whole is None:  # the file mapped privately once, as torch.load(mmap=True)
                self._whole = torch.UntypedStorage.from_file(  # type: ignore[assignment]
                    self.ckpt.path, False, self.ckpt.file_size)
            assert self._whole is not None
            storage = self._whole[start:start + ref.nbytes]
        else:
            values = data.values(_whole_storage(ref))  # byte order fixed there
            storage = values.untyped_storage()
        storage = self.place.storage(storage, ref.location or "cpu")
        self._storages[ref.key] = storage
        return storage

    def _tensor(self, rec: TensorRecord) -> torch.Tensor:
        import torch

        if rec.layout == "quantized" and rec.storage is not None and rec.stride is not None:
            return self._quantized(rec)
        if rec.storage is None or rec.stride is None or rec.layout != "strided":
            raise UnsupportedCheckpointError(
                f"a {rec.layout} tensor ckptool.load does not build yet",
                "ckptool.open lists it; torch.load rebuilds it")
        dtype = getattr(torch, rec.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise UnsupportedCheckpointError(f"this torch has no dtype {rec.dtype}",
                                             "upgrade torch to load these values")
        storage = self._storage(rec.storage)
        t = view(storage, dtype, rec.shape, rec.stride, rec.storage_offset)
        if rec.is_parameter:
            return torch.nn.Parameter(t, requires_grad=rec.requires_grad)
        if rec.requires_grad and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        return t

    def _quantized(self, rec: TensorRecord) -> torch.Tensor:
        """A quantized tensor, as torch's own ``_rebuild_qtensor`` makes it
        from the storage and the quantizer's numbers (its scheme a torch
        constant, its per-channel scales tensors ckptool built)."""
        import torch

        params = (rec.extra or {}).get("quantizer")
        if not isinstance(params, tuple) or not params:
            params = ("?",)
        scheme = getattr(torch, name_of(params[0]).removeprefix("torch."), None)
        if not isinstance(scheme, torch.qscheme):
            raise UnsupportedCheckpointError(
                f"a quantized tensor with an unknown scheme {params!r:.60}",
                "ckptool.open lists it; torch.load rebuilds it")
        dtype = getattr(torch, rec.dtype)
        assert rec.storage is not None
        typed = torch.storage.TypedStorage(wrap_storage=self._storage(rec.storage),
                                           dtype=dtype, _internal=True)
        rest = tuple(self._value(p, 0) for p in params[1:])
        try:
            return torch._utils._rebuild_qtensor(
                typed, rec.storage_offset, rec.shape, rec.stride, (scheme, *rest),
                rec.requires_grad, OrderedDict())
        except (ValueError, TypeError, IndexError, RuntimeError) as exc:
            raise CorruptCheckpointError(
                f"a quantized tensor whose quantizer torch refuses ({str(exc)[:200]})",
                "ckptool.open lists it; the file is damaged") from exc

    def _composite(self, obj: CompositeTensor, depth: int) -> torch.Tensor:

        parts = {k: self._value(v, depth) for k, v in obj.parts.items()}
        try:
            return compose(obj.layout, obj.shape, parts, obj.extra or {})
        except (KeyError, ValueError, TypeError, IndexError, RuntimeError) as exc:
            raise CorruptCheckpointError(
                f"a {obj.layout} tensor whose parts torch refuses ({str(exc)[:200]})",
                "ckptool.open lists it; the file is damaged") from exc


def compose(layout: str, shape: tuple[int, ...], parts: dict[str, Any],
            extra: dict[str, Any]) -> torch.Tensor:
    """A sparse or nested tensor from its parts (real tensors), as torch's
    own rebuild functions make it on load."""
    import torch

    if layout == "sparse_coo":
        return torch.sparse_coo_tensor(parts["indices"], parts["values"], shape)
    compressed = {"sparse_csr": ("crow_indices", "col_indices"),
                  "sparse_csc": ("ccol_indices", "row_indices"),
                  "sparse_bsr": ("crow_indices", "col_indices"),
                  "sparse_bsc": ("ccol_indices", "row_indices")}
    if layout in compressed:
        first, second = compressed[layout]
        return torch.sparse_compressed_tensor(
            parts[first], parts[second], parts["values"], shape,
            layout=getattr(torch, layout))
    if layout == "nested" and {"buffer", "sizes", "strides", "offsets"} <= set(parts):
        return torch._utils._rebuild_nested_tensor(
            parts["buffer"], parts["sizes"], parts["strides"], parts["offsets"])
    if layout == "jagged":
        # torch saves each as a tensor whose first size is the number
        # (nested_tensor._load_val_from_tensor)
        seqlen = {k: parts[k].shape[0] for k in ("min_seqlen", "max_seqlen")
                  if k in parts and parts[k].dim()}
        return torch.nested.nested_tensor_from_jagged(
            parts["values"], parts["offsets"], parts.get("lengths"),
            jagged_dim=extra.get("ragged_idx", 1), **seqlen)
    raise UnsupportedCheckpointError(f"a {layout} tensor ckptool does not build yet",
                                     "ckptool.open lists it; torch.load rebuilds it")


def _whole_storage(ref: StorageRef) -> Any:
    """A TensorInfo covering storage ``ref`` whole, as bytes of its dtype."""
    from ckptool import dtypes
    from ckptool.model import TensorInfo

    if ref.dtype in dtypes.QUANTIZED:  # its bytes as they are: the quantizer reads them
        return TensorInfo(ref.key, (ref.nbytes,), "uint8", (1,), 0, ref.key, ref.location,
                          ref.nbytes)
    return TensorInfo(ref.key, (ref.numel,), ref.dtype, (1,), 0, ref.key, ref.location,
                      ref.nbytes)


def _numpy(arr: NDArray) -> Any:
    try:
        import numpy as np
    except ImportError:
        return arr
    return arr.to_numpy(np)


class _JoinedBuilder(Builder):
    """A Builder whose tensor leaves are the checkpoint's joined tensors (a
    per-rank DTensor's shards made whole), the rest built as Builder builds it."""

    def __init__(self, ckpt: Checkpoint, map_location: MapLocation,
                 values: TensorValues) -> None:
        super().__init__(ckpt, map_location, mmap=False)
        by_key = {t.key: t for t in ckpt.tensors}
        self._joined = {id(record): by_key[key] for key, record in walk(ckpt.root).tensors
                        if key in by_key}
        self._values = values

    def _make(self, obj: Any, depth: int) -> Any:
        t = self._joined.get(id(obj))
        if t is not None:
            return self.place.tensor(self._values.values(t), t.location or "cpu")
        return super()._make(obj, depth)
