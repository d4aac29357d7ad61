"""Inert values that stand in for objects named by a pickle.

``StandIn`` is what every unknown global becomes: a class per dotted name
whose instances only record what the pickle did to them (call arguments,
``BUILD`` state, appended items, set items). A few well-known data types get
richer stand-ins so that they read well: numpy arrays and scalars, torch
dtypes and devices. Nothing here imports the module a name points to.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from typing import Any, ClassVar

from ckptool import dtypes


class StandIn:
    """An inert instance of a global that was not imported.

    Absorbs ``REDUCE``/``NEWOBJ`` (constructor arguments), ``BUILD``
    (``__setstate__``), ``APPEND(S)`` and ``SETITEM(S)``; calling it (a
    ``REDUCE`` whose callable is itself a stand-in instance) records a call.
    """

    qualname: ClassVar[str] = "?"
    category: ClassVar[str] = "custom"

    def __new__(cls, *args: Any, **kwargs: Any) -> StandIn:
        self = object.__new__(cls)
        self.args = args
        self.kwargs = kwargs
        self.state: Any = None
        self.items: list[Any] = []
        self.dictitems: dict[Any, Any] = {}
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # REDUCE calls cls(*args): __new__ already recorded them
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def append(self, item: Any) -> None:
        self.items.append(item)

    def extend(self, items: Any) -> None:
        self.items.extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.dictitems[key] = value

    def __call__(self, *args: Any, **kwargs: Any) -> StandIn:
        return standin_class(f"{self.qualname}()", self.category)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<{self.qualname}>"

    def state_dict_view(self) -> dict[str, Any]:
        """Named attributes from BUILD state (dict, or (dict, slots) pair)."""
        state = self.state
        merged: dict[str, Any] = {}
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
        for part in parts:
            if isinstance(part, dict):
                merged.update({str(k): v for k, v in part.items()})
        return merged


_CLASSES: dict[tuple[str, str], type[StandIn]] = {}


def standin_class(qualname: str, category: str) -> type[StandIn]:
    """One stand-in class per dotted name (cached, so isinstance works)."""
    key = (qualname, category)
    cls = _CLASSES.get(key)
    if cls is None:
        module, _, name = qualname.rpartition(".")
        cls = type(name or qualname, (StandIn,), {
            "qualname": qualname, "category": category,
            "__module__": f"ckptool.standin.{module}" if module else "ckptool.standin",
        })
        _CLASSES[key] = cls
    return cls


class TorchDtype(str):
    """``torch.float32`` as named in a pickle; the str value is the canonical name."""

    def __repr__(self) -> str:
        return f"torch.{self}"


class TorchDevice(str):
    """``torch.device(...)`` as named in a pickle; the str value is the device."""

    def __repr__(self) -> str:
        return f"device('{self}')"


def make_device(kind: Any = "cpu", index: Any = None) -> TorchDevice:
    if isinstance(index, int) and isinstance(kind, str) and ":" not in kind:
        return TorchDevice(f"{kind}:{index}")
    return TorchDevice(str(kind))


class TorchConstant(str):
    """A torch constant such as a layout or qscheme (``torch.sparse_coo``)."""

    def __repr__(self) -> str:
        return f"torch.{self}"


class NDArray:
    """A numpy array's shape and dtype; its bytes are kept only as a length."""

    def __init__(self, *args: Any) -> None:
        self.shape: tuple[int, ...] = ()
        self.dtype = "?"
        self.nbytes = 0
        self.values: list[Any] | None = None  # object arrays keep their items

    def __setstate__(self, state: Any) -> None:
        # (version, shape, dtype, is_fortran, rawdata)
        if isinstance(state, tuple) and len(state) == 5:
            _, shape, dtype, _, raw = state
            if isinstance(shape, tuple):
                self.shape = tuple(int(s) for s in shape if isinstance(s, int))
            self.dtype = str(dtype) if dtype is not None else "?"
            if isinstance(raw, (bytes, bytearray)):
                self.nbytes = len(raw)
            elif isinstance(raw, list):
                self.values = raw

    def __repr__(self) -> str:
        shape = "x".join(str(s) for s in self.shape) or "scalar"
        return f"ndarray({shape}, {self.dtype})"


class NumpyDtype(str):
    """A numpy dtype; the str value is its code (``f8``, ``i4``...)."""

    def __new__(cls, code: Any = "?", *args: Any) -> NumpyDtype:
        return super().__new__(cls, str(code))

    def __setstate__(self, state: Any) -> None:
        # (version, byteorder, subarray, names, fields, elsize, align, flags)
        self.byteorder = state[1] if isinstance(state, tuple) and len(state) > 1 else "|"


_NUMPY_CODES = {
    "f8": "d", "f4": "f", "f2": "e", "i8": "q", "i4": "i", "i2": "h", "i1": "b",
    "u8": "Q", "u4": "I", "u2": "H", "u1": "B", "b1": "?",
}


def numpy_reconstruct(cls: Any = None, shape: Any = (0,), dtype_code: Any = b"b") -> NDArray:
    return NDArray()


def numpy_scalar(dtype: Any, raw: Any = None) -> Any:
    """Decode a numpy scalar (``np.int64(12)`` -> 12) from its raw bytes."""
    code = _NUMPY_CODES.get(str(dtype))
    if code and isinstance(raw, (bytes, bytearray)) and len(raw) == struct.calcsize(code):
        order = "<" if getattr(dtype, "byteorder", "<") in ("<", "=", "|") else ">"
        return struct.unpack(order + code, bytes(raw))[0]
    return standin_class("numpy.generic", "data")(dtype)


def codecs_encode(text: Any, encoding: Any = "utf-8", errors: Any = "strict") -> bytes:
    """``_codecs.encode`` as protocol-2 pickles use it to spell bytes."""
    if not isinstance(text, str) or str(encoding).lower().replace("-", "") not in (
        "latin1", "utf8", "ascii",
    ):
        raise ValueError("unexpected _codecs.encode arguments")
    return text.encode(str(encoding), str(errors))


def safe_bytearray(source: Any = b"", *args: Any) -> bytearray:
    if isinstance(source, (bytes, bytearray, str)):
        return bytearray(source.encode("latin1") if isinstance(source, str) else source)
    raise ValueError("bytearray from a non-bytes value")


class DefaultDict(dict):  # type: ignore[type-arg]
    """``collections.defaultdict`` without its factory (never called)."""

    def __init__(self, factory: Any = None, *args: Any) -> None:
        super().__init__()
        self.factory = factory


def reconstructor(cls: Any, base: Any, state: Any = None) -> Any:
    """``copyreg._reconstructor`` (protocol 0/1 objects) for stand-ins only."""
    if isinstance(cls, type) and issubclass(cls, StandIn):
        return cls()
    if cls is OrderedDict:
        return OrderedDict()
    raise ValueError("copyreg._reconstructor of a real class")


def newobj(cls: Any, *args: Any) -> Any:
    """``copyreg.__newobj__`` for stand-ins only."""
    if isinstance(cls, type) and issubclass(cls, StandIn):
        return cls(*args)
    raise ValueError("copyreg.__newobj__ of a real class")


_SAFE_CALLABLES: dict[str, Any] = {
    "collections.OrderedDict": OrderedDict,
    "collections.defaultdict": DefaultDict,
    "builtins.set": set, "builtins.frozenset": frozenset, "builtins.slice": slice,
    "builtins.complex": complex, "builtins.bytearray": safe_bytearray,
    "builtins.list": list, "builtins.dict": dict, "builtins.tuple": tuple,
    "_codecs.encode": codecs_encode, "codecs.encode": codecs_encode,
    "copyreg._reconstructor": reconstructor, "copyreg.__newobj__": newobj,
    "numpy.core.multiarray._reconstruct": numpy_reconstruct,
    "numpy._core.multiarray._reconstruct": numpy_reconstruct,
    "numpy.core.multiarray.scalar": numpy_scalar,
    "numpy._core.multiarray.scalar": numpy_scalar,
    "numpy.ndarray": NDArray, "numpy.dtype": NumpyDtype,
}


def safe_callable(dotted: str) -> Any | None:
    """A safe implementation of a benign global, or None."""
    return _SAFE_CALLABLES.get(dotted)


def torch_value(name: str) -> Any | None:
    """``torch.<name>`` for dtypes, devices, ``Size`` and constants."""
    canon = dtypes.canonical(name)
    if canon is not None:
        return TorchDtype(canon)
    if name == "device":
        return make_device
    if name == "Size":
        return _torch_size
    if name in _TORCH_CONSTANTS:
        return TorchConstant(name)
    return None


def _torch_size(dims: Any = ()) -> tuple[Any, ...]:
    return tuple(dims)


_TORCH_CONSTANTS = frozenset({
    "strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc",
    "_mkldnn", "jagged", "per_tensor_affine", "per_channel_affine",
    "per_tensor_symmetric", "per_channel_symmetric", "per_channel_affine_float_qparams",
    "contiguous_format", "channels_last", "channels_last_3d", "preserve_format",
})
