"""The row sequences the tensor list shows, made by ``ckptool.tui.index``:
the flat list (with its keys, to find one in C), the open tree, and the
filtered tree, whose rows are found, not walked.

A filtered tree of 100,000 tensors is never flattened. The whole tree is
laid out once per sort (``Layout``: every row a filter could show, in
order); a filter keystroke then marks which of them show, in a few C-level
passes, and a running count of those marks gives the row of any key, and
the key of any row, by bisection. Keeping the cursor on a row deep in the
tree costs no more than on the first. Pure Python, no Textual.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, compress
from operator import gt, itemgetter
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
    params: int = 0
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
    show, depth first (a module, its own tensors, its submodules), made once
    per sort. A filter then only says which of them show (``FilteredTree``).

    ``items[k]`` is the k-th; a module's subtree is ``items[start:end]``
    (``span``), and the tensors in it are ``order[lo:hi]`` (``tensor_span``:
    ``order`` lists the tensors in this order by their place in the file).
    ``pick`` takes each item's flag from the tensors' flags in this order
    followed by the modules' (and a last False, the root's)."""

    def __init__(self, root: Node, tensors: list[TensorInfo], sort: str) -> None:
        node_key, tensor_key = NODE_KEYS[sort], TENSOR_KEYS[sort]
        file_index = {id(t): i for i, t in enumerate(tensors)}
        self.items: list[Node | TensorInfo] = []
        self.where: dict[int, int] = {}  # id(item) -> its k
        self.order: list[int] = []  # file index of each tensor, in this order
        self.span: dict[int, tuple[int, int]] = {}  # id(module) -> (start, end) in items
        self.tensor_span: list[tuple[int, int]] = []  # per module, in module order
        modules: list[Node] = []
        number: dict[int, int] = {}  # id(module) -> its place in ``modules``
        sources: list[int] = []  # per item: tensor rank, or ~module number
        stack: list[tuple[Node | TensorInfo, bool]] = [(root, False)]
        while stack:
            item, done = stack.pop()
            if done:  # the module's subtree ends here
                start, lo = self.span[id(item)]
                self.span[id(item)] = (start, len(self.items))
                self.tensor_span[number[id(item)]] = (lo, len(self.order))
                continue
            self.where[id(item)] = len(self.items)
            self.items.append(item)
            if isinstance(item, TensorInfo):
                sources.append(len(self.order))
                self.order.append(file_index[id(item)])
                continue
            number[id(item)] = len(modules)
            sources.append(~len(modules))
            modules.append(item)
            self.tensor_span.append((0, 0))
            self.span[id(item)] = (len(self.items) - 1, len(self.order))
            kids: list[Node] = list(item.children.values())
            leaves = item.tensors
            if sort != "file":
                kids.sort(key=node_key)
                leaves = sorted(leaves, key=tensor_key)
            stack.append((item, True))
            stack.extend((k, False) for k in reversed(kids))
            stack.extend((t, False) for t in reversed(leaves))
        tensors_n, modules_n = len(self.order), len(modules)
        # module m's flag sits after the tensors'; the root's is the last, False
        at = [r if r >= 0 else tensors_n + ~r for r in sources]
        at[0] = tensors_n + modules_n
        self.pick = _getter(at)
        self.take = _getter(self.order)
        self._lows = _getter([lo for lo, _ in self.tensor_span])
        self._highs = _getter([hi for _, hi in self.tensor_span])

    def shown(self, mask: list[bool]) -> tuple[bytearray, int]:
        """Which items show under a filter whose matches (in file order) are
        ``mask``, every module that holds a match open; and how many match."""
        in_order = self.take(mask)
        counts = [0, *accumulate(in_order)]
        holds = list(map(gt, self._highs(counts), self._lows(counts)))  # a match below
        return bytearray(self.pick([*in_order, *holds, False])), counts[-1]


def _getter(indices: list[int]) -> Callable[[Sequence[Any]], list[Any]]:
    """``lambda seq: [seq[i] for i in indices]``, at C speed."""
    if len(indices) > 1:
        pick = itemgetter(*indices)
        return lambda seq: list(pick(seq))
    return lambda seq: [seq[i] for i in indices]


class FilteredTree(Sequence["Node | TensorInfo"]):
    """Rows of a tree under a filter: every module that holds a match, open
    unless in ``closed``, with its matching tensors. Random access: the
    running count of shown items says which item is row i (a bisection),
    and where a key's row is, however deep."""

    def __init__(self, layout: Layout, mask: list[bool], closed: set[str],
                 lookup: Callable[[str], list[Node | TensorInfo]]) -> None:
        self.layout, self.closed, self._lookup = layout, closed, lookup
        shown, self.matches = layout.shown(mask)  # matches: tensors that match
        for path in closed:  # a closed module hides what is below it
            for item in lookup(path):
                span = layout.span.get(id(item))
                if span is not None and shown[span[0]]:
                    shown[span[0] + 1:span[1]] = bytes(span[1] - span[0] - 1)
        self._shown = shown
        self._count = list(accumulate(shown))  # rows up to and including item k
        self.made = 0  # rows looked up (tests count them)

    def __len__(self) -> int:
        return self._count[-1] if self._count else 0

    def __getitem__(self, i: int) -> Node | TensorInfo:  # type: ignore[override]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        self.made += 1
        return self.layout.items[bisect_left(self._count, i + 1)]

    def __iter__(self) -> Iterator[Node | TensorInfo]:
        return compress(self.layout.items, self._shown)

    def is_open(self, node: Node) -> bool:
        return node.path not in self.closed

    def index_of(self, key: str) -> int | None:
        """Row of the tensor ``key`` or module path ``key``, if shown."""
        rows = []
        for item in self._lookup(key):
            k = self.layout.where.get(id(item))
            if k is not None and self._shown[k]:
                rows.append(self._count[k] - 1)
        return min(rows, default=None)
