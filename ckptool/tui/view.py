"""How the tensor list is looked at: tree or flat, the sort, the filter,
which modules are open; the rows that makes, and the status line under
them. Plain state the app changes on keys and renders; no Textual, no rich.

In the tree, a module is open when it is in ``expanded``. Under a filter
every module that holds a match opens instead, and the ones closed there
(Enter, ←) are kept in ``closed`` until the filter changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ckptool.describe import plural
from ckptool.keys import Filter
from ckptool.tui.index import SORTS, FilteredTree, Index, Node, Rows


@dataclass
class ViewState:
    tree: bool = True  # the module tree; False: the flat list of keys
    sort: str = "file"
    filter: Filter = field(default_factory=lambda: Filter(""))
    expanded: set[str] = field(default_factory=set)  # modules open in the tree
    closed: set[str] = field(default_factory=set)  # modules closed under the filter

    def rows(self, index: Index) -> Rows:
        if self.tree:
            return index.tree(self.expanded, self.sort, self.filter, self.closed)
        return index.flat(self.sort, self.filter)

    def opened(self, rows: Rows) -> Callable[[Node], bool]:
        """Whether a module of ``rows`` shows open."""
        if isinstance(rows, FilteredTree):
            return rows.is_open
        expanded = self.expanded
        return lambda node: node.path in expanded

    def set_filter(self, pattern: str) -> None:
        self.filter = Filter(pattern)
        self.closed = set()

    def next_sort(self) -> None:
        self.sort = SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)]

    def toggle(self, node: Node, is_open: bool, want: bool | None) -> bool:
        """Open (``want`` True), close or flip ``node``; whether that changed it."""
        want = (not is_open) if want is None else want
        if want == is_open:
            return False
        if self.filter and self.tree:
            (self.closed.discard if want else self.closed.add)(node.path)
        else:
            (self.expanded.add if want else self.expanded.discard)(node.path)
        return True

    def empty_text(self, index: Index, rows: Rows, loaded: bool) -> str:
        """What the list says when it has no row."""
        if not loaded:
            return "reading…"
        if self.filter and not len(rows):
            return f"no tensor matches {self.filter.pattern!r}"
        return "" if len(index) else "no tensors in this file"

    def status(self, index: Index, rows: Rows, loaded: bool, findings: int | None) -> str:
        """The line under the list: the view, what the filter matches (tensors,
        not rows: the tree adds their modules), reading, findings."""
        parts = [f"{'tree' if self.tree else 'flat'} · sorted by {self.sort}"]
        total = len(index)
        if self.filter:
            matches = rows.matches if isinstance(rows, FilteredTree) else len(rows)
            said = ("no tensor matches" if not matches else
                    f"{matches:,} of {total:,} tensor{'s' if total != 1 else ''} "
                    f"match{'es' if matches == 1 else ''}")
            parts.append(f"filter {self.filter.pattern!r}: {said}")
        else:
            parts.append(plural(total, "tensor"))
        if not loaded:
            parts.append("reading…")
        elif findings:
            parts.append(f"{findings} finding{'s' if findings != 1 else ''} (f)")
        return " · ".join(parts)
