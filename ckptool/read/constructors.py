"""Safe replacements for the constructors a pickle may call.

Builtin containers (checked with ``values.check_key`` before anything is
hashed), ``collections.OrderedDict`` and ``defaultdict`` (its factory never
called), numpy arrays, dtypes and scalars (shape, dtype and small values,
never their bytes as arrays), ``_codecs.encode`` as protocol-2 pickles spell
bytes, and ``copyreg`` reconstruction of stand-ins. ``safe_callable`` maps a
dotted name to one of these; ``BUILDABLE`` lists what ``BUILD`` may touch.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from typing import Any

from ckptool.describe import shape_text
from ckptool.read.values import StandIn, check_key, name_of, standin_class


class NDArray:
    """A numpy array's shape and dtype; its bytes are kept only as a length."""

    def __init__(self, *args: Any) -> None:
        self.shape: tuple[int, ...] = ()
        self.dtype = "?"
        self.nbytes = 0
        self.values: list[Any] | None = None  # object arrays keep their items
        self.raw: bytes | None = None  # the pickle's own bytes object (ckptool.load)
        self.fortran = False
        self.byteorder = "|"

    def __setstate__(self, state: Any) -> None:
        # (version, shape, dtype, is_fortran, rawdata)
        if isinstance(state, tuple) and len(state) == 5:
            _, shape, dtype, fortran, raw = state
            if isinstance(shape, tuple):
                self.shape = tuple(s for s in shape if type(s) is int and 0 <= s < 2**63)
            self.dtype = name_of(dtype) if dtype is not None else "?"
            self.byteorder = str(getattr(dtype, "byteorder", "|"))
            self.fortran = fortran is True
            if isinstance(raw, (bytes, bytearray)):
                self.nbytes = len(raw)
                self.raw = bytes(raw) if isinstance(raw, bytearray) else raw
            elif isinstance(raw, list):
                self.values = raw

    def to_numpy(self, np: Any) -> Any:
        """The real array (``np`` is numpy), or this stand-in where it cannot be made."""
        order = "F" if self.fortran else "C"
        try:
            if self.values is not None:
                return np.array(self.values, dtype=object).reshape(self.shape, order=order)
            if self.raw is None:
                return self
            dtype = np.dtype(self.dtype).newbyteorder(
                self.byteorder if self.byteorder in "<>" else "=")
            return np.frombuffer(self.raw, dtype=dtype).reshape(self.shape, order=order).copy()
        except (TypeError, ValueError):
            return self

    def __repr__(self) -> str:
        shape = shape_text(self.shape)
        return f"ndarray({shape}, {self.dtype})"


class NumpyDtype(str):
    """A numpy dtype; the str value is its code (``f8``, ``i4``...)."""

    def __new__(cls, code: Any = "?", *args: Any) -> NumpyDtype:
        return super().__new__(cls, name_of(code))

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
    code = _NUMPY_CODES.get(dtype) if isinstance(dtype, str) else None
    if code and isinstance(raw, (bytes, bytearray)) and len(raw) == struct.calcsize(code):
        order = "<" if getattr(dtype, "byteorder", "<") in ("<", "=", "|") else ">"
        return struct.unpack(order + code, bytes(raw))[0]
    return standin_class("numpy.generic", "data")(dtype)


def codecs_encode(text: Any, encoding: Any = "utf-8", errors: Any = "strict") -> bytes:
    """``_codecs.encode`` as protocol-2 pickles use it to spell bytes."""
    if not (isinstance(text, str) and isinstance(encoding, str) and errors == "strict"
            and encoding.lower().replace("-", "") in ("latin1", "utf8", "ascii")):
        raise ValueError("unexpected _codecs.encode arguments")
    return text.encode(encoding)


def safe_bytearray(source: Any = b"", *args: Any) -> bytearray:
    if isinstance(source, (bytes, bytearray, str)):
        return bytearray(source.encode("latin1") if isinstance(source, str) else source)
    raise ValueError("bytearray from a non-bytes value")


class DefaultDict(dict[Any, Any]):
    """``collections.defaultdict`` without its factory (never called)."""

    def __init__(self, factory: Any = None, *args: Any) -> None:
        super().__init__()
        self.factory = factory


def safe_bytes(source: Any = b"", *args: Any) -> bytes:
    """``bytes`` as protocol 2 spells ``b""``; never ``bytes(n)`` (n zero bytes)."""
    return bytes(safe_bytearray(source))


def safe_slice(*args: Any) -> Any:
    """A real slice only of plain numbers: ``repr`` of any other would not be bounded."""
    if all(a is None or type(a) in (int, float) for a in args):
        return slice(*args)
    return standin_class("builtins.slice", "data")(*args)


def _hashed(items: Any) -> list[Any]:
    items = list(items)
    for item in items:
        check_key(item)
    return items


def _of_standin(name: str, *args: Any) -> Any:
    """What a container built from an object ckptool did not build (a stand-in:
    what it iterates to is its own code's) becomes: a stand-in of the call."""
    qualname = name if "." in name else f"builtins.{name}"
    return standin_class(f"{qualname}()", "data")(*args)


def safe_set(items: Any = ()) -> Any:
    if isinstance(items, StandIn):
        return _of_standin("set", items)
    return set(_hashed(items))


def safe_frozenset(items: Any = ()) -> Any:
    if isinstance(items, StandIn):
        return _of_standin("frozenset", items)
    return frozenset(_hashed(items))


def safe_list(items: Any = ()) -> Any:
    return _of_standin("list", items) if isinstance(items, StandIn) else list(items)


def safe_tuple(items: Any = ()) -> Any:
    return _of_standin("tuple", items) if isinstance(items, StandIn) else tuple(items)


def _pairs(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``dict(...)``'s positional argument with every key checked before hashing."""
    if len(args) > 1:
        raise TypeError("dict expected at most 1 argument")
    if args and not isinstance(args[0], dict):
        pairs = list(args[0])
        for pair in pairs:
            if isinstance(pair, (tuple, list)) and pair:
                check_key(pair[0])
        return (pairs,)
    return args


def safe_dict(*args: Any, **kwargs: Any) -> Any:
    if args and isinstance(args[0], StandIn):  # a mapping ckptool did not build
        return _of_standin("dict", *args)
    return dict(*_pairs(args), **kwargs)


def ordered_dict(*args: Any, **kwargs: Any) -> Any:
    if args and isinstance(args[0], StandIn):
        return _of_standin("collections.OrderedDict", *args)
    return OrderedDict(*_pairs(args), **kwargs)


def reconstructor(cls: Any, base: Any, state: Any = None) -> Any:
    """``copyreg._reconstructor`` (protocol 0/1 objects) for stand-ins only."""
    if isinstance(cls, type) and issubclass(cls, StandIn):
        return cls()
    if cls is ordered_dict:
        return OrderedDict()
    raise ValueError("copyreg._reconstructor of a real class")


def newobj(cls: Any, *args: Any) -> Any:
    """``copyreg.__newobj__`` for stand-ins only."""
    if isinstance(cls, type) and issubclass(cls, StandIn):
        return cls(*args)
    raise ValueError("copyreg.__newobj__ of a real class")


def _first_arg(value: Any = None, *args: Any) -> Any:
    """TorchScript's list tags (``torch.jit._pickle.build_intlist``...)."""
    return value


# objects BUILD may set state on: ones this read created for the file; never
# a class, a function, or a tensor or storage record already checked
BUILDABLE = (StandIn, NDArray, NumpyDtype, OrderedDict, DefaultDict)

# what a benign global becomes; the ones that hash their arguments check them
_SAFE_CALLABLES: dict[str, Any] = {
    "collections.OrderedDict": ordered_dict,
    "collections.defaultdict": DefaultDict,
    "builtins.set": safe_set, "builtins.frozenset": safe_frozenset,
    "builtins.slice": safe_slice, "builtins.bytes": safe_bytes,
    "builtins.complex": complex, "builtins.bytearray": safe_bytearray,
    "builtins.list": safe_list, "builtins.dict": safe_dict, "builtins.tuple": safe_tuple,
    "_codecs.encode": codecs_encode, "codecs.encode": codecs_encode,
    "copyreg._reconstructor": reconstructor, "copyreg.__newobj__": newobj,
    "numpy.core.multiarray._reconstruct": numpy_reconstruct,
    "numpy._core.multiarray._reconstruct": numpy_reconstruct,
    "numpy.core.multiarray.scalar": numpy_scalar,
    "numpy._core.multiarray.scalar": numpy_scalar,
    "numpy.ndarray": NDArray, "numpy.dtype": NumpyDtype,
    **{f"torch.jit._pickle.{name}": _first_arg for name in (
        "build_intlist", "build_tensorlist", "build_doublelist", "build_boollist",
        "restore_type_tag")},
}


def safe_callable(dotted: str) -> Any | None:
    """A safe implementation of a benign global, or None."""
    return _SAFE_CALLABLES.get(dotted)
