"""Tensor and storage records built while reading a pickle, and the safe
replacements for torch's ``_rebuild_*`` functions that build them.

A ``StorageRef`` is what a persistent id becomes: the storage's key, dtype,
saved location tag and size. A ``TensorRecord`` is a tensor's metadata
(shape, stride, offset, dtype, storage). Neither holds a tensor byte, and
nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptool import dtypes
from ckptool.dtypes import ITEMSIZE
from ckptool.errors import CorruptCheckpointError, RefusedPickleError
from ckptool.read.values import StandIn, TorchDtype, brief, name_of

# these records are what ckptool's checks made: no pickle sets state on them
# (ckptool.read.fastpickle relies on it; the ordinary read never lets BUILD near)
REFUSE_STATE = "pickle sets state on a tensor or storage record"


@dataclass(frozen=True)
class StorageType:
    """A storage class named in a persistent id (``torch.FloatStorage``)."""

    name: str
    dtype: str

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError(REFUSE_STATE)


@dataclass(slots=True)
class StorageRef:
    key: str
    dtype: str  # element dtype of the storage (uint8 for untyped storages)
    location: str | None  # saved device tag; None where the format records none
    numel: int  # elements of ``dtype``
    record: str | None = None  # where the bytes live (archive record name)
    pid: tuple[Any, ...] | None = None  # the persistent id it was read from

    @property
    def nbytes(self) -> int:
        return self.numel * dtypes.itemsize(self.dtype)

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError(REFUSE_STATE)


@dataclass(slots=True)
class TensorRecord:
    # a tensor is a dict key by identity (an optimizer's state keyed by its
    # parameters), as torch's tensors are
    __hash__ = object.__hash__

    shape: tuple[int, ...]
    dtype: str
    stride: tuple[int, ...] | None
    storage_offset: int
    storage: StorageRef | None
    location: str | None
    requires_grad: bool = False
    is_parameter: bool = False
    layout: str = "strided"
    subclass: str | None = None
    # what else the file gives it (its pickled attributes, a quantizer's
    # scheme); None for the plain tensor, which has nothing (no dict each)
    extra: dict[str, Any] | None = None
    # the rebuild call that made it, as (dotted name, args): kept only when
    # reading for a rewrite (``resolve.faithful``), to write it back as is
    origin: tuple[str, tuple[Any, ...]] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtypes.itemsize(self.dtype)

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError(REFUSE_STATE)


@dataclass
class CompositeTensor:
    """A tensor made of other tensors (sparse, nested): its parts are listed."""

    layout: str
    shape: tuple[int, ...]
    parts: dict[str, Any]
    origin: tuple[str, tuple[Any, ...]] | None = None  # as TensorRecord.origin
    extra: dict[str, Any] | None = None  # what else builds it (a jagged one's ragged dim)


MAX_INT64 = 2**63 - 1  # torch sizes, strides and offsets are int64


def _ints(value: Any, what: str) -> tuple[int, ...]:
    # hot path: runs twice per tensor (a plain loop: no generator per call)
    kind = type(value)
    if kind is tuple or kind is list:
        for v in value:
            if type(v) is not int or v < 0 or v > MAX_INT64:
                break
        else:
            return value if kind is tuple else tuple(value)
    raise CorruptCheckpointError(f"tensor {what} is not a tuple of sizes: {brief(value)}")


def _shape(value: Any) -> tuple[int, ...]:
    """A shape with no storage to check it against: its element count must fit int64."""
    shape = _ints(value, "size")
    if math.prod(shape) > MAX_INT64:
        raise CorruptCheckpointError(f"tensor of shape {brief(shape)} has more elements "
                                     "than torch can index")
    return shape


def _storage(value: Any) -> StorageRef:
    if isinstance(value, StorageRef):
        return value
    raise CorruptCheckpointError(f"tensor rebuilt from a non-storage: {brief(value)}")


def _strided(storage: Any, offset: Any, size: Any, stride: Any, dtype: str | None,
             requires_grad: Any) -> TensorRecord:
    ref = storage if type(storage) is StorageRef else _storage(storage)
    if type(offset) is not int or not 0 <= offset <= MAX_INT64:
        raise CorruptCheckpointError(f"bad tensor storage offset: {brief(offset)}")
    shape, strides = _ints(size, "size"), _ints(stride, "stride")
    if len(shape) != len(strides):
        raise CorruptCheckpointError("tensor size and stride differ in length")
    numel = math.prod(shape)
    if numel > MAX_INT64:  # zero strides let a tiny storage claim any shape
        raise CorruptCheckpointError(f"tensor of shape {brief(shape)} has more elements "
                                     "than torch can index")
    if numel:
        # the last element the view touches must lie inside the storage: at
        # offset + sum((n - 1) * s), every n >= 1 here (sums in C: this runs
        # for every tensor of a read)
        end = offset + sum(map(operator.mul, shape, strides)) - sum(strides) + 1
        if dtype is None or dtype == ref.dtype:
            past = end > ref.numel
        else:  # a typed view of an untyped (byte) storage: compare bytes
            past = end * ITEMSIZE.get(dtype, 1) > ref.numel * ITEMSIZE.get(ref.dtype, 1)
        if past:
            raise CorruptCheckpointError(
                f"tensor of shape {list(shape)} reaches past the end of storage {ref.key}"
            )
    return TensorRecord(shape, dtype or ref.dtype, strides, offset, ref, ref.location,
                        bool(requires_grad))


def rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any) -> TensorRecord:
    return _strided(storage, storage_offset, size, stride, None, False)


def rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any,
                      requires_grad: Any = False, backward_hooks: Any = None,
                      metadata: Any = None) -> TensorRecord:
    return _strided(storage, storage_offset, size, stride, None, requires_grad)


def rebuild_tensor_v3(storage: Any, storage_offset: Any, size: Any, stride: Any,
                      requires_grad: Any, backward_hooks: Any, dtype: Any,
                      metadata: Any = None) -> TensorRecord:
    if not isinstance(dtype, TorchDtype):
        raise CorruptCheckpointError(f"tensor dtype is not a torch dtype: {brief(dtype)}")
    return _strided(storage, storage_offset, size, stride, str(dtype), requires_grad)


def rebuild_qtensor(storage: Any, storage_offset: Any, size: Any, stride: Any,
                    quantizer_params: Any, requires_grad: Any = False,
                    backward_hooks: Any = None) -> TensorRecord:
    rec = _strided(storage, storage_offset, size, stride, None, requires_grad)
    rec.layout = "quantized"
    if isinstance(quantizer_params, tuple) and quantizer_params:
        # the scheme, and its scale and zero point (or per-channel tensors and axis)
        rec.extra = {**(rec.extra or {}), "qscheme": name_of(quantizer_params[0]),
                     "quantizer": quantizer_params}
    return rec


def rebuild_parameter(data: Any, requires_grad: Any = True, backward_hooks: Any = None,
                      state: Any = None) -> Any:
    if isinstance(data, TensorRecord):
        data.is_parameter = True
        data.requires_grad = bool(requires_grad)
        _keep_state(data, state)
    return data


def _keep_state(rec: TensorRecord, state: Any) -> None:
    """A tensor's pickled attributes (``t.foo = ...``) stay with its record:
    what they name (an unsafe global, say) is part of what writing it back
    would write, whichever way the file was read."""
    if state:
        rec.extra = {**(rec.extra or {}), "state": state}


def rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any = None) -> Any:
    known = func in REBUILDERS.values() or hasattr(func, "ckpt_global")
    if not known or not isinstance(args, tuple):
        raise RefusedPickleError("tensor rebuilt by an unknown function")
    result = func(*args)
    if isinstance(result, TensorRecord):
        _keep_state(result, state)
    if isinstance(result, TensorRecord) and isinstance(new_type, type) and issubclass(
        new_type, StandIn
    ):
        result.subclass = new_type.qualname
        if new_type.qualname == "torch.nn.parameter.Parameter":
            result.is_parameter = True
    return result


def rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any = None) -> Any:
    return rebuild_from_type_v2(func, new_type, args, state)


def rebuild_meta_tensor_no_storage(dtype: Any, size: Any, stride: Any,
                                   requires_grad: Any = False) -> TensorRecord:
    return TensorRecord(_shape(size), name_of(dtype), _ints(stride, "stride"), 0,
                        None, "meta", requires_grad=bool(requires_grad))


def rebuild_wrapper_subclass(cls: Any, dtype: Any, size: Any, stride: Any,
                             storage_offset: Any, layout: Any, device: Any,
                             requires_grad: Any = False) -> TensorRecord:
    offset = storage_offset if type(storage_offset) is int else 0
    rec = TensorRecord(_shape(size), name_of(dtype), _ints(stride, "stride"),
                       offset, None, name_of(device), requires_grad=bool(requires_grad))
    rec.subclass = cls.qualname if isinstance(cls, type) and issubclass(cls, StandIn) else None
    return rec


def rebuild_device_tensor_from_numpy(data: Any, dtype: Any, device: Any,
                                     requires_grad: Any = False) -> TensorRecord:
    shape = getattr(data, "shape", ())
    return TensorRecord(_shape(shape), name_of(dtype), None, 0, None,
                        device if isinstance(device, str) else None,
                        requires_grad=bool(requires_grad))


def _layout_name(layout: Any) -> str:
    """``torch.sparse_coo`` as either read gives it: the constant, or (read
    faithfully) the call ``torch.serialization._get_layout('torch.sparse_coo')``."""
    if isinstance(layout, StandIn) and layout.qualname == "torch.serialization._get_layout" \
            and layout.args and isinstance(layout.args[0], str):
        layout = layout.args[0]
    return name_of(layout).removeprefix("torch.")


def rebuild_sparse_tensor(layout: Any, data: Any = (), *more: Any) -> CompositeTensor:
    """``torch._utils._rebuild_sparse_tensor(layout, data)``; TorchScript's
    pickler spells the same call with the parts as arguments of their own."""
    if more:
        data = (data, *more)
    names = {
        "sparse_coo": ("indices", "values", "size"),
        "sparse_csr": ("crow_indices", "col_indices", "values", "size"),
        "sparse_csc": ("ccol_indices", "row_indices", "values", "size"),
        "sparse_bsr": ("crow_indices", "col_indices", "values", "size"),
        "sparse_bsc": ("ccol_indices", "row_indices", "values", "size"),
    }.get(_layout_name(layout), ())
    items = data if isinstance(data, tuple) else ()
    parts = {n: v for n, v in zip(names, items, strict=False) if n != "size"}
    size = next((v for n, v in zip(names, items, strict=False) if n == "size"), ())
    if isinstance(size, StandIn) and size.qualname == "torch.Size" and size.args:
        size = size.args[0]  # read faithfully: the call torch.Size((3, 3))
    shape = _shape(size) if isinstance(size, (tuple, list)) else ()
    return CompositeTensor(_layout_name(layout), shape, parts)


def rebuild_nested_tensor(buffer: Any, sizes: Any, strides: Any, offsets: Any) -> CompositeTensor:
    """A strided nested tensor: its components' sizes, strides and offsets
    into one buffer (each a tensor); its shape is its component count."""
    parts = {"buffer": buffer, "sizes": sizes, "strides": strides, "offsets": offsets}
    count = sizes.shape[0] if isinstance(sizes, TensorRecord) and sizes.shape else 0
    return CompositeTensor("nested", (count,), parts)


def rebuild_njt(kwargs: Any) -> CompositeTensor:
    """A jagged nested tensor (``torch.nested.nested_tensor(..., layout=torch.jagged)``):
    ``values`` packed along its ragged dimension, ``offsets`` (and ``lengths``)
    marking each component; its shape is its component count."""
    if not isinstance(kwargs, dict) or not isinstance(kwargs.get("values"), TensorRecord) \
            or not isinstance(kwargs.get("offsets"), TensorRecord):
        raise CorruptCheckpointError(f"jagged nested tensor without values and offsets: "
                                     f"{brief(kwargs)}")
    parts = {k: kwargs[k] for k in ("values", "offsets", "lengths")
             if isinstance(kwargs.get(k), TensorRecord)}
    cache = kwargs.get("_metadata_cache")
    for name in ("min_seqlen", "max_seqlen"):
        if isinstance(cache, dict) and isinstance(cache.get(name), TensorRecord):
            parts[name] = cache[name]
    ragged = kwargs.get("_ragged_idx", 1)
    offsets = kwargs["offsets"]
    count = max(offsets.shape[0] - 1, 0) if offsets.shape else 0
    return CompositeTensor("jagged", (count,), parts,
                           extra={"ragged_idx": ragged if type(ragged) is int else 1})


REBUILDERS: dict[str, Callable[..., Any]] = {
    "torch._utils._rebuild_tensor": rebuild_tensor,
    "torch._utils._rebuild_tensor_v2": rebuild_tensor_v2,
    "torch._utils._rebuild_tensor_v3": rebuild_tensor_v3,
    "torch._utils._rebuild_qtensor": rebuild_qtensor,
    "torch._utils._rebuild_parameter": rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": rebuild_parameter,
    "torch._utils._rebuild_meta_tensor_no_storage": rebuild_meta_tensor_no_storage,
    "torch._utils._rebuild_wrapper_subclass": rebuild_wrapper_subclass,
    "torch._utils._rebuild_device_tensor_from_numpy": rebuild_device_tensor_from_numpy,
    "torch._utils._rebuild_xla_tensor": rebuild_device_tensor_from_numpy,
    "torch._utils._rebuild_mtia_tensor": rebuild_device_tensor_from_numpy,
    "torch._utils._rebuild_sparse_tensor": rebuild_sparse_tensor,
    "torch._utils._rebuild_nested_tensor": rebuild_nested_tensor,
    "torch.nested._internal.nested_tensor._rebuild_njt": rebuild_njt,
    "torch._tensor._rebuild_from_type_v2": rebuild_from_type_v2,
    "torch._tensor._rebuild_from_type": rebuild_from_type,
}


def storage_type(name: str) -> StorageType | None:
    """``torch.FloatStorage`` -> StorageType('FloatStorage', 'float32')."""
    dtype = dtypes.STORAGE_DTYPES.get(name)
    return StorageType(name, dtype) if dtype else None


_TRACED: dict[str, Callable[..., Any]] = {}


def traced(dotted: str) -> Callable[..., Any]:
    """The rebuild function ``dotted``, recording each result's origin.

    One wrapper per name (so the pickle memo's sharing survives a rewrite);
    a result that is one of its own arguments (a parameter wrapping its
    data) is copied first, so that its origin never contains itself.
    """
    fn = _TRACED.get(dotted)
    if fn is None:
        rebuild = REBUILDERS[dotted]

        def call(*args: Any) -> Any:
            result = rebuild(*args)
            if isinstance(result, (TensorRecord, CompositeTensor)):
                if any(result is a for a in args):  # (its extra is never changed in place)
                    result = dataclasses.replace(result)
                result.origin = (dotted, args)
            return result

        call.ckpt_global = dotted  # type: ignore[attr-defined]
        fn = _TRACED[dotted] = call
    return fn
