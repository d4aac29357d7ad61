"""Inert values that stand in for objects named by a pickle.

``StandIn`` is what every unknown global becomes: a class per dotted name
whose instances only record what the pickle did to them (call arguments,
``BUILD`` state, appended items, set items). A few well-known data types get
richer stand-ins so that they read well: numpy arrays and scalars, torch
dtypes and devices. Nothing here imports the module a name points to.

Everything here runs on values a hostile file controls, so nothing may cost
more than the file's size: ``check_key`` bounds what hashing a dict key or
set item costs (a nested tuple's hash recurses in C with no depth limit, and
a tuple that reuses itself through the pickle memo costs 2**depth), and
``brief`` is a bounded ``repr`` for messages and names.
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
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    state: Any
    items: list[Any]
    dictitems: dict[Any, Any]
    reduced: bool

    def __new__(cls, *args: Any, **kwargs: Any) -> StandIn:
        self = object.__new__(cls)
        self.args = args
        self.kwargs = kwargs
        self.state = None
        self.items = []
        self.dictitems = {}
        self.reduced = False
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # REDUCE calls cls(*args), NEWOBJ only cls.__new__: __new__ recorded
        # the arguments, and this says which opcode made the object
        self.reduced = True

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def append(self, item: Any) -> None:
        self.items.append(item)

    def extend(self, items: Any) -> None:
        self.items.extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        check_key(key)
        self.dictitems[key] = value

    def __call__(self, *args: Any, **kwargs: Any) -> StandIn:
        # calling the result again keeps the name "x()": a chain of n calls
        # must not build names (and classes) of length n each
        name = self.qualname if self.qualname.endswith("()") else f"{self.qualname}()"
        return standin_class(name, self.category)(*args, **kwargs)

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


MAX_KEY_DEPTH = 100  # tuples nested in one dict key or set item
MAX_KEY_WORK = 100_000  # items hashing one key visits, repeats counted


def check_key(key: Any) -> None:
    """Refuse a dict key or set item whose hash (or repr) would not be bounded.

    ``hash()`` of a tuple nested ~100k deep overflows the C stack (a crash,
    not an exception), and a tuple holding the same sub-tuple twice at every
    level (the pickle memo makes that a few bytes per level) costs 2**depth.
    """
    if isinstance(key, (tuple, frozenset, slice)):
        _key_work(key, 0, {})


def _key_work(obj: Any, depth: int, done: dict[int, int]) -> int:
    if not isinstance(obj, (tuple, frozenset, slice)):
        return 1
    known = done.get(id(obj))
    if known is not None:
        return known
    if depth >= MAX_KEY_DEPTH:
        raise ValueError(f"a dict key or set item nests more than {MAX_KEY_DEPTH} levels deep")
    parts = (obj.start, obj.stop, obj.step) if isinstance(obj, slice) else obj
    work = 1
    for part in parts:
        work += _key_work(part, depth + 1, done)
        if work > MAX_KEY_WORK:
            raise ValueError("a dict key or set item is too large to hash "
                             "(it repeats itself through the pickle memo)")
    done[id(obj)] = work
    return work


def brief(obj: Any, limit: int = 80) -> str:
    """A ``repr`` of a value from the file that costs at most ``limit`` items."""
    text = _brief(obj, 2)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _brief(obj: Any, depth: int) -> str:
    if obj is None or isinstance(obj, (bool, float, complex)):
        return repr(obj)
    if isinstance(obj, int):
        return repr(obj) if obj.bit_length() <= 256 else f"<int of {obj.bit_length()} bits>"
    if isinstance(obj, (str, bytes, bytearray)):
        return repr(obj[:60])
    if isinstance(obj, (tuple, list, set, frozenset, dict)):
        if depth <= 0:
            return f"<{type(obj).__name__} of {len(obj)}>"
        items = list(obj.items() if isinstance(obj, dict) else obj)[:4]
        inner = ", ".join(_brief(i, depth - 1) for i in items)
        return f"{type(obj).__name__}({inner}{', …' if len(obj) > 4 else ''})"
    if isinstance(obj, StandIn):
        return f"<{obj.qualname}>"
    return f"<{type(obj).__name__}>"


def name_of(obj: Any) -> str:
    """A name a file gave (a dtype, a device...): the string, or a bounded repr."""
    return obj if isinstance(obj, str) else brief(obj, 40)


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
        return TorchDevice(f"{kind}:{brief(index)}")
    return TorchDevice(name_of(kind))


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
                self.shape = tuple(s for s in shape if type(s) is int and 0 <= s < 2**63)
            self.dtype = name_of(dtype) if dtype is not None else "?"
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


def safe_set(items: Any = ()) -> set[Any]:
    return set(_hashed(items))


def safe_frozenset(items: Any = ()) -> frozenset[Any]:
    return frozenset(_hashed(items))


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


def safe_dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    return dict(*_pairs(args), **kwargs)


def ordered_dict(*args: Any, **kwargs: Any) -> OrderedDict[Any, Any]:
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
    "builtins.list": list, "builtins.dict": safe_dict, "builtins.tuple": tuple,
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
