"""Bounds on what a read object tree may be, checked right after a load.

``check_tree`` refuses trees nested deeper than ``MAX_DEPTH`` containers and
integers too long to print, so that everything after the read (walk,
render, JSON) stays bounded whatever the file holds.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

from ckptool.errors import CorruptCheckpointError
from ckptool.read import constructors, tensors, values

MAX_DEPTH = 10_000  # containers nested in one object tree
MAX_INT_BITS = 8_192  # longer integers cannot be printed (sys.get_int_max_str_digits)
HINT = ("the file is truncated, damaged, or not what its name says; "
        "if it was downloaded or copied, fetch it again")


def check_tree(root: Any) -> None:
    """Refuse an object tree nested deeper than MAX_DEPTH, or with huge integers.

    Measures the longest chain of containers, each shared container once
    (a reference back into the chain being walked is not followed), so a
    tree that reuses its parts through the memo costs its size, not more.
    """
    heights: dict[int, int] = {}  # finished containers: longest chain below
    on_path: set[int] = set()
    frames: list[list[Any]] = []  # [container, its children, longest child chain]

    def visit(obj: Any) -> None:
        on_path.add(id(obj))
        frames.append([obj, _children(obj), 0])
        if len(frames) > MAX_DEPTH:
            raise CorruptCheckpointError(
                f"pickle nests containers more than {MAX_DEPTH} levels deep", HINT)

    if not _is_node(root):
        _check_leaf(root)
        return
    visit(root)
    while frames:
        frame = frames[-1]
        for child in frame[1]:
            kind = type(child)
            if kind in _PLAIN:  # most of a tree: no container, no long int, not walked into
                continue
            if kind is int or not _is_node(child):
                _check_leaf(child)
                continue
            known = heights.get(id(child))
            if known is not None:
                frame[2] = max(frame[2], known)
            elif id(child) not in on_path:
                visit(child)
                break
        else:
            frames.pop()
            height = frame[2] + 1
            heights[id(frame[0])] = height
            on_path.discard(id(frame[0]))
            if height > MAX_DEPTH:
                raise CorruptCheckpointError(
                    f"pickle nests containers more than {MAX_DEPTH} levels deep", HINT)
            if frames:
                frames[-1][2] = max(frames[-1][2], height)


_NODES = (dict, list, tuple, set, frozenset, slice, values.StandIn, constructors.NDArray,
          tensors.CompositeTensor)


_PLAIN = frozenset({str, float, bool, bytes, type(None), tensors.TensorRecord,
                    tensors.StorageRef})


def _is_node(obj: Any) -> bool:
    return isinstance(obj, _NODES)


def _children(obj: Any) -> Any:
    if isinstance(obj, dict):
        return chain(chain.from_iterable(obj.items()), vars(obj).values()
                     if hasattr(obj, "__dict__") else ())
    if isinstance(obj, values.StandIn):
        return chain(obj.args, obj.kwargs.values(), (obj.state,), obj.items,
                     chain.from_iterable(obj.dictitems.items()))
    if isinstance(obj, slice):
        return iter((obj.start, obj.stop, obj.step))
    if isinstance(obj, constructors.NDArray):
        return iter(obj.values or ())
    if isinstance(obj, tensors.CompositeTensor):
        return iter(obj.parts.values())
    return iter(obj)


def _check_leaf(obj: Any) -> None:
    if isinstance(obj, int) and obj.bit_length() > MAX_INT_BITS:
        raise CorruptCheckpointError(
            f"pickle holds an integer of {obj.bit_length()} bits, too long to print", HINT)
