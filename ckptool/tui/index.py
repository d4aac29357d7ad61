"""The browser's view model: the rows of the tensor list, flat or as a
module tree, filtered and sorted. Pure Python, no Textual: the app renders
what this computes, and tests and ``bench/`` drive it on its own.

Keys split into tree levels on ``/`` (containers) and ``.`` (state-dict
names): ``state_dict/module.fc.weight`` sits under ``state_dict`` >
``module`` > ``fc``. Every module node carries its tensor count, parameter
count (elements of floating tensors), bytes and saved locations.

Cost model, for 100,000 tensors: ``Index.add`` is a few microseconds per
tensor (done on the loading thread); a filter pass is one list
comprehension over the keys; the tree is flattened only through expanded
nodes, so a collapsed tree costs nothing however large the file.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import compress
from typing import Any

from ckptool.model import NO_LOCATION, TensorInfo

SORTS = ("file", "name", "size", "device")  # the order `o` cycles through
_SPLIT = re.compile(r"[/.]")
_DIGITS = re.compile(r"(\d+)")
GLOB_CHARS = frozenset("*?[")


@dataclass(eq=False, slots=True)
class Node:
    """A module (or container) in the key tree."""

    name: str  # its own label: "fc"
    path: str  # the key prefix it stands for: "state_dict/module.fc"
    depth: int
    parent: Node | None
    order: int  # position among its siblings in file order
    children: dict[str, Node] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)  # leaves right under it
    count: int = 0  # tensors anywhere below
    params: int = 0
    nbytes: int = 0
    locations: dict[str, int] = field(default_factory=dict)  # tag -> bytes below

    @property
    def main_location(self) -> str:
        if not self.locations:
            return ""
        return max(self.locations.items(), key=lambda kv: (kv[1], kv[0]))[0]


Item = "Node | TensorInfo"  # a row of the list: a module node or a tensor


def leaf_name(t: TensorInfo) -> str:
    """A tensor's label in the tree: its key's last part."""
    parts = _SPLIT.split(t.key)
    return parts[-1] if parts[-1] else t.key


def natural(text: str) -> tuple[object, ...]:
    """Sort key that puts ``layers.2`` before ``layers.10``."""
    return tuple(int(p) if p.isdigit() else p for p in _DIGITS.split(text))


class Filter:
    """What the filter box holds, compiled once per keystroke.

    Without ``* ? [`` the pattern is a substring; with them, a glob that must
    match the whole key or the part after its last ``/`` (``*.bias``,
    ``layer1.*``). Either way matching ignores case unless the pattern has a
    capital letter."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern = pattern.strip()
        self.fold = pattern == pattern.lower()
        self.glob = not GLOB_CHARS.isdisjoint(pattern)
        # the whole key, or what follows a "/" in it (a state-dict name)
        self._rx = (re.compile(r"(?:.*/)?" + fnmatch.translate(pattern),
                               re.IGNORECASE | re.DOTALL if self.fold else re.DOTALL)
                    if self.glob else None)

    def __bool__(self) -> bool:
        return bool(self.pattern)

    def mask(self, keys: list[str]) -> list[bool]:
        """Which of ``keys`` (lower-cased when ``fold``) match."""
        if self._rx is not None:
            match = self._rx.match
            return [match(k) is not None for k in keys]
        p = self.pattern
        return [p in k for k in keys]

    def test(self, key: str) -> bool:
        return self.mask([key.lower() if self.fold else key])[0]


class LazyRows(Sequence["Node | TensorInfo"]):
    """Rows of a filtered tree: the count is known at once, the rows are
    made as far as the view asks, so a keystroke never flattens 100k rows."""

    def __init__(self, rows: Iterator[Node | TensorInfo], total: int) -> None:
        self._rows = rows
        self._made: list[Node | TensorInfo] = []
        self._total = total

    def __len__(self) -> int:
        return self._total

    def __getitem__(self, i: int) -> Node | TensorInfo:  # type: ignore[override]
        if i < 0:
            i += self._total
        made = self._made
        while len(made) <= i:
            made.append(next(self._rows))
        return made[i]

    def __iter__(self) -> Iterator[Node | TensorInfo]:
        for i in range(self._total):
            yield self[i]


Rows = Sequence["Node | TensorInfo"]


class Index:
    """Every tensor of a checkpoint, as a tree and a flat list."""

    def __init__(self, tensors: Iterable[TensorInfo] = ()) -> None:
        self.root = Node("", "", -1, None, 0)
        self.tensors: list[TensorInfo] = []
        self._parent: dict[int, Node] = {}  # id(tensor) -> the node it sits under
        self._parents: list[Node] = []  # the same, aligned with self.tensors
        self._sorted: dict[str, tuple[list[TensorInfo], list[str], list[str]]] = {}
        self.extend(tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def extend(self, tensors: Iterable[TensorInfo]) -> None:
        """Add tensors (a loading batch): O(depth) each."""
        root = self.root
        for t in tensors:
            self.tensors.append(t)
            parts = _SPLIT.split(t.key)
            params = t.numel if t.is_floating else 0
            loc = t.location or NO_LOCATION
            node = root
            self._count(node, t.nbytes, params, loc)
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
                self._count(node, t.nbytes, params, loc)
            node.tensors.append(t)
            self._parent[id(t)] = node
            self._parents.append(node)
        self._sorted.clear()

    @staticmethod
    def _count(node: Node, nbytes: int, params: int, loc: str) -> None:
        node.count += 1
        node.params += params
        node.nbytes += nbytes
        node.locations[loc] = node.locations.get(loc, 0) + nbytes

    # -- lookups -------------------------------------------------------------
    def node(self, path: str) -> Node | None:
        node = self.root
        if not path:
            return node
        for part in _SPLIT.split(path):
            nxt = node.children.get(part)
            if nxt is None:
                return None
            node = nxt
        return node if node.path == path else None

    def ancestors(self, key: str) -> list[str]:
        """Paths of the nodes above tensor ``key``, outermost first."""
        parts = _SPLIT.split(key)
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
            ts = self.tensors if sort == "file" else sorted(self.tensors, key=_TENSOR_KEYS[sort])
            keys = [t.key for t in ts]
            cached = (ts, keys, [k.lower() for k in keys])
            self._sorted[sort] = cached
        return cached

    def matching(self, sort: str, filt: Filter) -> list[TensorInfo]:
        ts, keys, lower = self.sorted_tensors(sort)
        return list(compress(ts, filt.mask(lower if filt.fold else keys)))

    def flat(self, sort: str, filt: Filter | None = None) -> Rows:
        if not filt:
            return self.sorted_tensors(sort)[0]
        return self.matching(sort, filt)

    def tree(self, expanded: set[str], sort: str, filt: Filter | None = None) -> Rows:
        """Rows of the tree through ``expanded`` nodes; with a filter, every
        node that holds a match, all open, made lazily."""
        if not filt:
            return list(self._walk(sort, expanded, None, None))
        _, keys, lower = self.sorted_tensors("file")
        mask = filt.mask(lower if filt.fold else keys)
        # C-level passes: the nodes right above a match, then their ancestors
        keep: set[Node] = set(compress(self._parents, mask))
        for node in list(keep):
            up = node.parent
            while up is not None and up not in keep:
                keep.add(up)
                up = up.parent
        total = sum(mask) + len(keep) - (self.root in keep)
        return LazyRows(self._walk(sort, expanded, keep, filt), total)

    def _walk(self, sort: str, expanded: set[str], keep: set[Node] | None,
              filt: Filter | None) -> Iterator[Node | TensorInfo]:
        node_key, tensor_key = _NODE_KEYS[sort], _TENSOR_KEYS[sort]
        stack: list[Node | TensorInfo] = [self.root]
        while stack:
            item = stack.pop()
            if not isinstance(item, Node):
                yield item
                continue
            node = item
            if node is not self.root:
                yield node
                if keep is None and node.path not in expanded:
                    continue
            kids: list[Node] = list(node.children.values())
            leaves = node.tensors
            if keep is not None and filt is not None:
                kids = [k for k in kids if k in keep]
                leaves = [t for t in leaves if filt.test(t.key)]
            if sort != "file":
                kids.sort(key=node_key)
                leaves = sorted(leaves, key=tensor_key)
            # a module's own tensors first, then its submodules, as torch lists them
            stack.extend(reversed(kids))
            stack.extend(reversed(leaves))

    def position(self, rows: Rows, key: str) -> int | None:
        """Row index of tensor ``key`` (or node path) in ``rows``."""
        for i, item in enumerate(rows):
            if (item.path if isinstance(item, Node) else item.key) == key:
                return i
        return None


def _size_desc(t: TensorInfo) -> int:
    return -t.nbytes  # ties keep file order: sorts are stable


def _device(t: TensorInfo) -> str:
    return t.location or NO_LOCATION


_TENSOR_KEYS: dict[str, Callable[[TensorInfo], Any]] = {
    "file": lambda t: 0,
    "name": lambda t: natural(t.key),
    "size": _size_desc,
    "device": _device,
}
_NODE_KEYS: dict[str, Callable[[Node], Any]] = {
    "file": lambda n: n.order,
    "name": lambda n: natural(n.name),
    "size": lambda n: -n.nbytes,
    "device": lambda n: n.main_location,
}
