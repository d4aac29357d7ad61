"""Short, bounded text for the values a checkpoint holds besides tensors: ``epoch=12``,
``argparse.Namespace(lr=0.1, arch='resnet18')``, ``ndarray(3x4, <f8)``.

Bounded in length and depth, so a hostile or huge value cannot make a
summary slow or enormous. Also yields a JSON-friendly copy of small plain
values for ``--json``.
"""

from __future__ import annotations

from typing import Any

from ckptool.describe import shape_text
from ckptool.read.constructors import NDArray
from ckptool.read.tensors import CompositeTensor, StorageRef, TensorRecord
from ckptool.read.values import StandIn

MAX_ITEMS = 8
MAX_DEPTH = 4


def type_name(obj: Any) -> str:
    if isinstance(obj, StandIn):
        return obj.qualname
    if isinstance(obj, NDArray):
        return "numpy.ndarray"
    if isinstance(obj, TensorRecord):
        return "tensor"
    return type(obj).__name__


def summarize(obj: Any, limit: int = 120) -> str:
    text = _text(obj, MAX_DEPTH)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _text(obj: Any, depth: int) -> str:
    if depth <= 0:
        return "…"
    if isinstance(obj, TensorRecord):
        return f"tensor({shape_text(obj.shape)}, {obj.dtype})"
    if isinstance(obj, StorageRef):
        return f"storage({obj.numel}, {obj.dtype})"
    if isinstance(obj, CompositeTensor):
        return f"{obj.layout} tensor{list(obj.shape)}"
    if isinstance(obj, (str, bytes)):
        r = repr(obj)
        return r if len(r) <= 60 else r[:59] + "…"
    if isinstance(obj, dict):
        parts = [f"{_text(k, 1)}: {_text(v, depth - 1)}" for k, v in _first(obj.items())]
        return "{" + ", ".join(parts) + _more(len(obj)) + "}"
    if isinstance(obj, (list, tuple, set, frozenset)):
        brackets = {list: "[]", tuple: "()"}.get(type(obj), "{}")
        parts = [_text(v, depth - 1) for v in _first(obj)]
        return brackets[0] + ", ".join(parts) + _more(len(obj)) + brackets[1]
    if isinstance(obj, StandIn):
        return _standin(obj, depth)
    if isinstance(obj, type) and issubclass(obj, StandIn):
        return obj.qualname  # a class or function the file names, not called
    return repr(obj)


def _standin(obj: StandIn, depth: int) -> str:
    named = obj.state_dict_view()
    parts = [_text(a, depth - 1) for a in obj.args[:MAX_ITEMS]]
    parts += [f"{k}={_text(v, depth - 1)}" for k, v in _first(named.items())]
    if obj.state is not None and not named:
        parts.append(f"state={_text(obj.state, depth - 1)}")
    if obj.items:
        parts.append(_text(obj.items, depth - 1))
    if obj.dictitems:
        parts.append(_text(obj.dictitems, depth - 1))
    return f"{obj.qualname}({', '.join(parts)}{_more(len(named) + len(obj.args))})"


def _first(items: Any) -> list[Any]:
    out = []
    for i, item in enumerate(items):
        if i >= MAX_ITEMS:
            break
        out.append(item)
    return out


def _more(n: int) -> str:
    return f", …+{n - MAX_ITEMS}" if n > MAX_ITEMS else ""


def plain_value(obj: Any, depth: int = 3) -> Any:
    """A JSON-ready copy of small plain data, or None if it is not plain.

    Gives up after ``MAX_NODES`` values, so an entry whose lists all point at
    one shared list (cheap to pickle) cannot make the copy expensive."""
    budget = [MAX_NODES]
    try:
        return _plain(obj, depth, budget)
    except _TooBig:
        return None


MAX_NODES = 256


class _TooBig(Exception):
    pass


def _plain(obj: Any, depth: int, budget: list[int]) -> Any:
    budget[0] -= 1
    if budget[0] < 0:
        raise _TooBig
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else str(obj)
    if depth <= 0:
        return None
    if isinstance(obj, (list, tuple)) and len(obj) <= 64:
        items = [_plain(v, depth - 1, budget) for v in obj]
        ok = all(i is not None or v is None for i, v in zip(items, obj, strict=True))
        return items if ok else None
    if isinstance(obj, dict) and len(obj) <= 64:
        pairs = {str(k): _plain(v, depth - 1, budget) for k, v in obj.items()}
        ok = all(pairs[str(k)] is not None or v is None for k, v in obj.items())
        return pairs if ok and all(isinstance(k, str) for k in obj) else None
    if isinstance(obj, StandIn) and not obj.args and obj.state is not None:
        named = obj.state_dict_view()
        if named:  # argparse.Namespace, AttributeDict and the like
            return _plain(named, depth, budget)
    return None
