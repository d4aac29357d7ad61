"""The row sequences the tensor list shows, made by ``ckptool.tui.index``:
the flat list (with its keys, to find one in C), the open tree, and the
filtered tree, whose rows are found, not walked.

A filtered tree of 100,000 tensors is never flattened. The whole tree is
laid out once per sort (``Layout``: every row a filter could show, in
order); a filter keystroke then marks which tensors match and which
modules hold a match, in two byte maps made by C-level passes, and counts
of those marks (in C, from the nearest block) give the row of any key, and
the key of any row, by bisection. Keeping the cursor on a row deep in the
tree costs no more than on the first. Pure Python, no Textual.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain, compress, repeat
from operator import add, ge, itemgetter
from typing import Any

from ckptool.model import NO_LOCATION, TensorInfo


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
    params: int = 0  # the model's: an optimizer's moments are none (``optim``)
    optim: int = 0  # tensors below that are an optimizer's state
    optim_elements: int = 0  # ... and their elements
    nbytes: int = 0
    locations: dict[str, int] = field(default_factory=dict)  # tag -> bytes below

    @property
    def main_location(self) -> str:
        if not self.locations:
            return ""
        return max(self.locations.items(), key=lambda kv: (kv[1], kv[0]))[0]


_DIGITS = re.compile(r"(\d+)")


def natural(text: str) -> tuple[object, ...]:
    """Sort key that puts ``layers.2`` before ``layers.10``."""
    return tuple(int(p) if p.isdigit() else p for p in _DIGITS.split(text))


TENSOR_KEYS: dict[str, Callable[[TensorInfo], Any]] = {
    "file": lambda t: 0,
    "name": lambda t: natural(t.key),
    "size": lambda t: -t.nbytes,  # ties keep file order: sorts are stable
    "device": lambda t: t.location or NO_LOCATION,
}
NODE_KEYS: dict[str, Callable[[Node], Any]] = {
    "file": lambda n: n.order,
    "name": lambda n: natural(n.name),
    "size": lambda n: -n.nbytes,
    "device": lambda n: n.main_location,
}


def key_of(item: Node | TensorInfo) -> str:
    """A row's key: a tensor's key or a module's path."""
    return item.key if isinstance(item, TensorInfo) else item.path


def position(rows: Sequence[Node | TensorInfo], key: str) -> int | None:
    """Row index of the first row with key (or path) ``key``."""
    finder = getattr(rows, "index_of", None)
    if finder is not None:
        found: int | None = finder(key)
        return found
    for i, item in enumerate(rows):
        if key_of(item) == key:
            return i
    return None


class FlatRows(Sequence["Node | TensorInfo"]):
    """Tensors in list order, with their keys aligned."""

    def __init__(self, tensors: list[TensorInfo], keys: list[str]) -> None:
        self._tensors, self._keys = tensors, keys

    def __len__(self) -> int:
        return len(self._tensors)

    def __getitem__(self, i: int) -> TensorInfo:  # type: ignore[override]
        return self._tensors[i]

    def index_of(self, key: str) -> int | None:
        try:
            return self._keys.index(key)
        except ValueError:
            return None


def walk_tree(root: Node, sort: str, expanded: set[str]) -> Iterator[Node | TensorInfo]:
    """Rows of the tree through the modules in ``expanded``, depth first: a
    module's own tensors come first, then its submodules, as torch lists them."""
    node_key, tensor_key = NODE_KEYS[sort], TENSOR_KEYS[sort]
    stack: list[Node | TensorInfo] = [root]
    while stack:
        item = stack.pop()
        if isinstance(item, TensorInfo):
            yield item
            continue
        node = item
        if node.parent is not None:  # the root is no row
            yield node
            if node.path not in expanded:
                continue
        kids, leaves = list(node.children.values()), node.tensors
        if sort != "file":
            kids.sort(key=node_key)
            leaves = sorted(leaves, key=tensor_key)
        stack.extend(reversed(kids))
        stack.extend(reversed(leaves))


class Layout:
    """The whole tree in one sort, every module open: all rows a filter can
    show, depth first, made once per sort. A filter then only says which of
    them show (``FilteredTree``).

    Depth first, each module comes right before its own tensors, then its
    submodules: the rows are module 0 (the root, never shown), its tensors,
    module 1, its tensors... So a module is known by its number ``j`` in
    ``modules``, a tensor by its rank ``r`` in ``tensors`` (this order), and
    module j's own tensors are ranks ``own[j]`` to ``own[j + 1]``; its
    subtree is modules ``j`` to ``end[j]`` and ranks ``own[j]`` to
    ``own[end[j]]``. ``order`` gives each rank's place in the file."""

    def __init__(self, root: Node, tensors: list[TensorInfo], sort: str) -> None:
        node_key, tensor_key = NODE_KEYS[sort], TENSOR_KEYS[sort]
        file_index = {id(t): i for i, t in enumerate(tensors)}
        self.number: dict[int, int] = {}  # id(module) -> j
        self.modules: list[Node] = []
        self.tensors: list[TensorInfo] = []
        self.own: list[int] = []  # per module, then len(tensors)
        self.end: list[int] = []  # per module: the first module after its subtree
        stack: list[tuple[Node, bool]] = [(root, False)]
        while stack:
            node, done = stack.pop()
            if done:  # its subtree ends here
                self.end[self.number[id(node)]] = len(self.modules)
                continue
            self.number[id(node)] = len(self.modules)
            self.modules.append(node)
            self.own.append(len(self.tensors))
            self.end.append(0)
            kids: list[Node] = list(node.children.values())
            leaves = node.tensors
            if sort != "file":
                kids.sort(key=node_key)
                leaves = sorted(leaves, key=tensor_key)
            self.tensors += leaves
            stack.append((node, True))
            stack.extend((k, False) for k in reversed(kids))
        self.own.append(len(self.tensors))
        self.rank = {id(t): r for r, t in enumerate(self.tensors)}
        self.order = [file_index[id(t)] for t in self.tensors]
        self.take = None if self.order == list(range(len(self.order))) else _getter(self.order)
        self.ends = [self.own[e] for e in self.end]  # per module: its subtree's last rank + 1

    def module_of(self, r: int) -> int:
        """The module whose own tensors hold rank ``r``."""
        return bisect_right(self.own, r, 0, len(self.modules)) - 1

    def flags(self, mask: list[bool]) -> tuple[bytearray, bytearray]:
        """Under a filter whose matches (in file order) are ``mask``: which
        tensors match (by rank) and which modules hold a match (by number;
        the root never shows), in C: one search of the matches per module."""
        matched = bytearray(mask if self.take is None else self.take(mask))
        found = map(matched.find, repeat(1), self.own, self.ends)
        holds = bytearray(map(ge, found, repeat(0)))
        holds[0] = 0
        return matched, holds


def _getter(indices: list[int]) -> Callable[[Sequence[Any]], list[Any]]:
    """``lambda seq: [seq[i] for i in indices]``, at C speed."""
    if len(indices) > 1:
        pick = itemgetter(*indices)
        return lambda seq: list(pick(seq))
    return lambda seq: [seq[i] for i in indices]


BLOCK = 256  # modules counted together (FilteredTree._before)


class FilteredTree(Sequence["Node | TensorInfo"]):
    """Rows of a tree under a filter: every module that holds a match, open
    unless in ``closed``, with its matching tensors. Random access: the
    rows before a module are the modules shown before it and the tensors
    shown before its own (two counts in C, from the nearest block of
    ``BLOCK`` modules), so row i is found by bisection, and a key's row
    directly, however deep."""

    def __init__(self, layout: Layout, mask: list[bool], closed: set[str],
                 lookup: Callable[[str], list[Node | TensorInfo]]) -> None:
        self.layout, self.closed, self._lookup = layout, closed, lookup
        matched, holds = layout.flags(mask)
        self.matches = matched.count(1)  # tensors that match
        for path in closed:  # a closed module hides what is below it
            for item in lookup(path):
                j = layout.number.get(id(item))
                if j is not None and holds[j]:
                    end = layout.end[j]
                    holds[j + 1:end] = bytes(end - j - 1)
                    lo, hi = layout.own[j], layout.ends[j]
                    matched[lo:hi] = bytes(hi - lo)
        self._matched, self._holds = matched, holds
        n = len(layout.modules)
        starts = range(0, n + BLOCK, BLOCK)  # the last block starts at or after n
        per_block = map(add, map(holds.count, repeat(1), starts, starts[1:]),
                        map(matched.count, repeat(1), [layout.own[min(j, n)] for j in starts],
                            [layout.own[min(j, n)] for j in starts[1:]]))
        self._blocks = [0, *accumulate(per_block)]  # rows before each block
        self.made = 0  # rows looked up (tests count them)

    def _before(self, j: int) -> int:
        """Rows before module ``j`` (``len(self)`` for ``j`` past the last)."""
        b, lo = divmod(j, BLOCK)
        first = j - lo
        own = self.layout.own
        return (self._blocks[b] + self._holds.count(1, first, j)
                + self._matched.count(1, own[first], own[j]))

    def __len__(self) -> int:
        return self._blocks[-1]

    def __getitem__(self, i: int) -> Node | TensorInfo:  # type: ignore[override]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        self.made += 1
        # the last module with no more than i rows before it holds row i
        b = bisect_right(self._blocks, i) - 1
        lo, hi = b * BLOCK, min((b + 1) * BLOCK, len(self.layout.modules)) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._before(mid) <= i:
                lo = mid
            else:
                hi = mid - 1
        j, left = lo, i - self._before(lo)
        if self._holds[j]:
            if not left:
                return self.layout.modules[j]
            left -= 1
        # its own tensor with ``left`` matches before it
        first, r, last = self.layout.own[j], self.layout.own[j], self.layout.own[j + 1] - 1
        while r < last:
            mid = (r + last) // 2
            if self._matched.count(1, first, mid + 1) > left:
                last = mid
            else:
                r = mid + 1
        return self.layout.tensors[r]

    def __iter__(self) -> Iterator[Node | TensorInfo]:
        layout, matched = self.layout, self._matched
        # the root is no row, but its own tensors (keys with no / or .) are
        for j in chain((0,), compress(range(1, len(layout.modules)), self._holds[1:])):
            if j:
                yield layout.modules[j]
            lo, hi = layout.own[j], layout.own[j + 1]
            yield from compress(layout.tensors[lo:hi], matched[lo:hi])

    def is_open(self, node: Node) -> bool:
        return node.path not in self.closed

    def index_of(self, key: str) -> int | None:
        """Row of the tensor ``key`` or module path ``key``, if shown."""
        layout, rows = self.layout, []
        for item in self._lookup(key):
            j = layout.number.get(id(item))
            if j is not None:
                if self._holds[j]:
                    rows.append(self._before(j))
                continue
            r = layout.rank.get(id(item))
            if r is not None and self._matched[r]:
                j = layout.module_of(r)
                rows.append(self._before(j) + self._holds[j]
                            + self._matched.count(1, layout.own[j], r))
        return min(rows, default=None)
