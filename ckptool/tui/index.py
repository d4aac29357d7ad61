"""The browser's view model: the rows of the tensor list, flat or as a
module tree, filtered and sorted. Pure Python, no Textual: the app renders
what this computes, and tests and ``bench/`` drive it on its own.

Keys split into tree levels on ``/`` (containers) and ``.`` (state-dict
names): ``state_dict/module.fc.weight`` sits under ``state_dict`` >
``module`` > ``fc``. A ``/`` escaped inside a name (``a\\/b``, the key of
``{"a/b": t}``: ``ckptool.keys``) splits nothing, so that key is one leaf
beside ``a`` > ``b``. Every module node carries its tensor count, parameter
count (elements of floating tensors, a tied weight once, buffers not), bytes
and saved locations. An optimizer's state (``optimizer/state/0/exp_avg``,
DCP's ``optim.state.fc.weight.exp_avg``: ``ckptool.read.optim.holder``) is
counted apart, as such: its moments are no parameters.

Cost model, for 100,000 tensors: ``Index.extend`` is a few microseconds
per tensor (done as batches arrive); a filter pass is one list
comprehension over the keys and C-level passes over its matches; the tree
is flattened only through expanded nodes, so a collapsed tree costs
nothing however large the file, and a filtered tree only where it is
looked at (``ckptool.tui.rows``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import compress
from operator import attrgetter
from typing import cast

from ckptool.keys import Filter, pieces
from ckptool.model import NO_LOCATION, TensorInfo
from ckptool.read.params import ParameterCount
from ckptool.tui.rows import TENSOR_KEYS, FilteredTree, FlatRows, Layout, Node, natural, walk_tree

__all__ = ["SORTS", "Filter", "FilteredTree", "Index", "Node", "Rows", "leaf_name", "natural"]

SORTS = ("file", "name", "size", "device")  # the order `o` cycles through


Item = "Node | TensorInfo"  # a row of the list: a module node or a tensor


def leaf_name(t: TensorInfo) -> str:
    """A tensor's label in the tree: its key's last part."""
    parts = pieces(t.key, dots=True)
    return parts[-1] if parts[-1] else t.key


Rows = Sequence["Node | TensorInfo"]


class Index:
    """Every tensor of a checkpoint, as a tree and a flat list."""

    def __init__(self, tensors: Iterable[TensorInfo] = (),
                 optimizer: Callable[[TensorInfo], bool] | None = None) -> None:
        """``optimizer``: whether a tensor is an optimizer's state (known once
        the file is read: ``ckptool.read.optim.holder``)."""
        self.root = Node("", "", -1, None, 0)
        self._optimizer = optimizer
        self._optim: set[int] = set()  # id() of the tensors that are optimizer state
        self.tensors: list[TensorInfo] = []
        self._parent: dict[int, Node] = {}  # id(tensor) -> the node it sits under
        self._sorted: dict[str, tuple[list[TensorInfo], list[str], list[str]]] = {}
        self._layouts: dict[str, Layout] = {}
        self._by_key: dict[str, TensorInfo | list[TensorInfo]] | None = None
        self._params = ParameterCount()
        self.extend(tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def extend(self, tensors: Iterable[TensorInfo]) -> None:
        """Add tensors (a loading batch): O(depth) each."""
        root, optimizer = self.root, self._optimizer
        for t in tensors:
            self.tensors.append(t)
            parts = pieces(t.key, dots=True)
            optim = optimizer is not None and optimizer(t)
            if optim:  # counted apart: its elements are no parameters
                self._optim.add(id(t))
                params = t.numel
            else:
                params = self._params.add(t)[0]  # a tied weight once, buffers not
            loc = t.location or NO_LOCATION
            node = root
            self._count(node, t.nbytes, params, loc, optim)
            end = len(parts) - 1
            pos = 0
            for part in parts[:end]:
                pos += len(part) + 1
                child = node.children.get(part)
                if child is None:
                    child = Node(part, t.key[: pos - 1], node.depth + 1, node,
                                 len(node.children))
                    node.children[part] = child
                node = child
                self._count(node, t.nbytes, params, loc, optim)
            node.tensors.append(t)
            self._parent[id(t)] = node
        self._sorted.clear()
        self._layouts.clear()
        self._by_key = None

    @staticmethod
    def _count(node: Node, nbytes: int, params: int, loc: str, optim: bool) -> None:
        """``optim``: ``params`` are elements of an optimizer's state."""
        node.count += 1
        if optim:
            node.optim += 1
            node.optim_elements += params
        else:
            node.params += params
        node.nbytes += nbytes
        node.locations[loc] = node.locations.get(loc, 0) + nbytes

    def is_optimizer(self, t: TensorInfo) -> bool:
        """Whether ``t`` is an optimizer's state (not a model's tensor)."""
        return id(t) in self._optim

    # -- lookups -------------------------------------------------------------
    def node(self, path: str) -> Node | None:
        node = self.root
        if not path:
            return node
        for part in pieces(path, dots=True):
            nxt = node.children.get(part)
            if nxt is None:
                return None
            node = nxt
        return node if node.path == path else None

    def ancestors(self, key: str) -> list[str]:
        """Paths of the nodes above tensor ``key``, outermost first."""
        parts = pieces(key, dots=True)
        out, pos = [], 0
        for part in parts[:-1]:
            pos += len(part) + 1
            out.append(key[: pos - 1])
        return out

    def default_expanded(self, rows: int = 30) -> set[str]:
        """Paths to open at start, breadth first, until the open tree fills
        about ``rows`` rows: single-child chains always open, and the first
        wide level opens even if it overflows (the list is virtual), so the
        first screen is full of the file's structure."""
        expanded: set[str] = set()
        frontier = [self.root]
        shown = 0
        while frontier:
            node = frontier.pop(0)
            kids = len(node.children) + len(node.tensors)
            if node is not self.root and shown >= rows and kids > 1:
                continue
            if node is not self.root:
                expanded.add(node.path)
            shown += kids
            frontier.extend(node.children.values())
        return expanded

    # -- rows ----------------------------------------------------------------
    def depth(self, item: Node | TensorInfo, tree: bool) -> int:
        if isinstance(item, Node):
            return item.depth
        return self._parent[id(item)].depth + 1 if tree else 0

    def sorted_tensors(self, sort: str) -> tuple[list[TensorInfo], list[str], list[str]]:
        """Tensors in ``sort`` order, with their keys and lower-cased keys aligned."""
        cached = self._sorted.get(sort)
        if cached is None:
            ts = self.tensors if sort == "file" else sorted(self.tensors, key=TENSOR_KEYS[sort])
            keys = [t.key for t in ts]
            cached = (ts, keys, [k.lower() for k in keys])
            self._sorted[sort] = cached
        return cached

    def flat(self, sort: str, filt: Filter | None = None) -> Rows:
        ts, keys, lower = self.sorted_tensors(sort)
        if not filt:
            return FlatRows(ts, keys)
        mask = filt.mask(lower if filt.fold else keys)
        return FlatRows(list(compress(ts, mask)), list(compress(keys, mask)))

    def tree(self, expanded: set[str], sort: str, filt: Filter | None = None,
             closed: set[str] | None = None) -> Rows:
        """Rows of the tree through ``expanded`` modules; with a filter, every
        module that holds a match, open unless in ``closed``."""
        if not filt:
            return list(walk_tree(self.root, sort, expanded))
        _, keys, lower = self.sorted_tensors("file")
        return FilteredTree(self.layout(sort), filt.mask(lower if filt.fold else keys),
                            closed or set(), self.lookup)

    def layout(self, sort: str) -> Layout:
        """Every row a filter could show, in ``sort`` order (made once per sort)."""
        found = self._layouts.get(sort)
        if found is None:
            found = self._layouts[sort] = Layout(self.root, self.tensors, sort)
        return found

    def lookup(self, key: str) -> list[Node | TensorInfo]:
        """The tensors with key ``key`` and the module with path ``key``."""
        if self._by_key is None:
            # keys are one tensor's each: a dict of them, made in C (not a list
            # per key: 100,000 more objects for the cycle collector to walk
            # in the middle of a keystroke); a list only for a key shared
            by_key: dict[str, TensorInfo | list[TensorInfo]] = dict(
                zip(map(attrgetter("key"), self.tensors), self.tensors, strict=True))
            if len(by_key) < len(self.tensors):
                for k in by_key:
                    by_key[k] = []
                for t in self.tensors:
                    cast(list[TensorInfo], by_key[t.key]).append(t)
            self._by_key = by_key
        found = self._by_key.get(key, [])
        node = self.node(key) if key else None
        return [*(found if isinstance(found, list) else [found]),
                *([node] if node is not None else [])]
