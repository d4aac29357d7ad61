"""Inert values that stand in for objects named by a pickle.

``StandIn`` is what every unknown global becomes: a class per dotted name
whose instances only record what the pickle did to them (call arguments,
``BUILD`` state, appended items, set items). torch dtypes, devices and
constants get small value types of their own; safe replacements for the
data constructors a pickle may call (containers, numpy, codecs) are in
``ckptool.read.constructors``. Nothing here imports the module a name points to.

Everything here runs on values a hostile file controls, so nothing may cost
more than the file's size: ``check_key`` bounds what hashing a dict key or
set item costs (a nested tuple's hash recurses in C with no depth limit, and
a tuple that reuses itself through the pickle memo costs 2**depth), and
``brief`` is a bounded ``repr`` for messages and names.
"""

from __future__ import annotations

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


def is_plain(obj: Any, depth: int = 0) -> bool:
    """Data that ``torch.load(weights_only=True)`` takes: None, numbers,
    strings, bytes, and lists, tuples and dicts of them."""
    if depth > 200:
        return False
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return True
    if isinstance(obj, (list, tuple)):
        return all(is_plain(v, depth + 1) for v in obj)
    if type(obj) is dict:
        return all(isinstance(k, (str, int)) and is_plain(v, depth + 1) for k, v in obj.items())
    return False
