"""The tensor list: a virtual table that draws only the rows on screen;
and ``Pane``, the scrolling text panes beside it (details, findings).

Textual's DataTable and Tree build a widget row per entry; at 100,000
tensors that alone takes seconds. This widget holds a sequence of rows
(``index.Rows``, possibly lazy) and renders the visible lines on demand, so
replacing the rows on a filter keystroke costs nothing here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from ckptool.describe import human_bytes, human_count, shown, tensor_shape
from ckptool.model import NO_LOCATION, TensorInfo
from ckptool.tui.index import Index, Node, Rows, leaf_name
from ckptool.tui.rows import position

SHAPE_W, DTYPE_W, DEVICE_W, SIZE_W = 14, 11, 7, 9
_ANY = object()  # no item in particular


@dataclass(frozen=True)
class Columns:
    name: int
    shape: int
    dtype: int
    device: int
    size: int

    @classmethod
    def fit(cls, width: int) -> Columns:
        shape, dtype = SHAPE_W, DTYPE_W
        if width - (SHAPE_W + DTYPE_W + DEVICE_W + SIZE_W + 5) < 28:
            shape, dtype = 10, 9  # a narrow pane: give the key what room there is
        name = max(8, width - (shape + dtype + DEVICE_W + SIZE_W + 5))
        return cls(name, shape, dtype, DEVICE_W, SIZE_W)


def _cell(text: str, width: int, right: bool = False, keep_end: bool = False) -> str:
    if len(text) > width:
        if width <= 1:
            return text[:width]
        text = "…" + text[-(width - 1):] if keep_end else text[: width - 1] + "…"
    return text.rjust(width) if right else text.ljust(width)


def _device(location: str | None) -> str:
    # safetensors record no device: a dash, not a word cut to "unreco…"
    return "-" if location in (None, "", NO_LOCATION) else location


def _fitting(width: int, *choices: str) -> str:
    """The first of ``choices`` that fits ``width`` (the last one otherwise)."""
    return next((c for c in choices if len(c) <= width), choices[-1])


def tensor_cells(t: TensorInfo) -> tuple[str, str, str, str]:
    return (tensor_shape(t), shown(t.dtype), shown(_device(t.location)),
            human_bytes(t.nbytes))


def node_cells(n: Node, cols: Columns) -> tuple[str, str, str, str]:
    full, short = f"{n.count:,}", human_count(n.count)
    plural = "s" if n.count != 1 else ""
    count = _fitting(cols.shape, f"{full} tensor{plural}", f"{short} tensor{plural}",
                     f"{short} tens.", short)
    where = shown(_device(n.main_location)) + ("+" if len(n.locations) > 1 else "")
    if n.optim and n.optim == n.count:  # an optimizer's state: no parameter of the model
        params = "optimizer"
    else:
        params = human_count(n.params)
        params = _fitting(cols.dtype, f"{params} params", f"{params} par.", params)
    return (count, params, where, human_bytes(n.nbytes))


class TensorTable(ScrollView, can_focus=True):
    """Rows of tensors and module nodes, one line each, with a cursor."""

    COMPONENT_CLASSES = {
        "tensor-table--header", "tensor-table--cursor", "tensor-table--node",
        "tensor-table--dim",
    }
    DEFAULT_CSS = """
    TensorTable { height: 1fr; overflow-x: hidden; }
    TensorTable > .tensor-table--header { text-style: bold; background: $panel; }
    TensorTable > .tensor-table--cursor { background: $block-cursor-blurred-background; }
    TensorTable:focus > .tensor-table--cursor {
        background: $block-cursor-background; color: $block-cursor-foreground;
        text-style: bold;
    }
    TensorTable > .tensor-table--node { text-style: bold; }
    TensorTable > .tensor-table--dim { color: $text-muted; }
    """
    BINDINGS = [
        Binding("up,k", "move(-1)", "Up", show=False),
        Binding("down,j", "move(1)", "Down", show=False),
        Binding("pageup", "page(-1)", "Page up", show=False),
        Binding("pagedown", "page(1)", "Page down", show=False),
        Binding("home", "edge(0)", "First", show=False),
        Binding("end", "edge(1)", "Last", show=False),
        Binding("enter,space", "toggle_node", "Open/close", show=False),
        Binding("right,l", "open", "Open", show=False),
        Binding("left,h", "close", "Close", show=False),
    ]

    class Highlighted(Message):
        """The cursor moved onto ``item`` (None when the list is empty)."""

        def __init__(self, item: Node | TensorInfo | None) -> None:
            super().__init__()
            self.item = item

    class Toggle(Message):
        """Open (True), close (False) or flip (None) a module node."""

        def __init__(self, node: Node, open_: bool | None) -> None:
            super().__init__()
            self.node = node
            self.open = open_

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.rows: Rows = []
        self.index: Index | None = None
        self.tree_mode = True
        self.opened: Callable[[Node], bool] = lambda node: False
        self.cursor = 0
        self.empty_text = ""

    # -- data ------------------------------------------------------------------
    def set_rows(self, rows: Rows, index: Index, tree: bool, opened: Callable[[Node], bool],
                 keep: str | None = None) -> None:
        """Show ``rows``, where ``opened`` says which modules are open; put
        the cursor back on the key or path ``keep``. ``Highlighted`` is posted
        only when the cursor ends on another item: typing a filter that keeps
        the cursor's row redraws the list, not the details beside it."""
        before = self.current
        self.rows, self.index, self.tree_mode, self.opened = rows, index, tree, opened
        cursor = 0
        if keep is not None and len(rows):
            found = position(rows, keep)
            cursor = found if found is not None else min(self.cursor, len(rows) - 1)
        self.virtual_size = Size(self.size.width, len(rows) + 1)
        self._move_to(cursor, force=True, before=before)

    @property
    def current(self) -> Node | TensorInfo | None:
        if 0 <= self.cursor < len(self.rows):
            return self.rows[self.cursor]
        return None

    def select(self, key: str) -> bool:
        found = position(self.rows, key)
        if found is None:
            return False
        self._move_to(found, force=True, center=True)
        return True

    # -- cursor ----------------------------------------------------------------
    def _move_to(self, row: int, force: bool = False, center: bool = False,
                 before: object = _ANY) -> None:
        """Put the cursor on ``row`` and redraw if it moved (or ``force``);
        say so (``Highlighted``) if it did, or, given the item that was under
        it ``before``, if the item under it now is another."""
        n = len(self.rows)
        row = max(0, min(row, n - 1)) if n else 0
        changed = row != self.cursor
        self.cursor = row
        self._scroll_to_cursor(center)
        if changed or force:
            self.refresh()
            if before is _ANY or self.current is not before:
                self.post_message(self.Highlighted(self.current))

    def _scroll_to_cursor(self, center: bool = False) -> None:
        visible = max(1, self.size.height - 1)  # the header takes a line
        top = int(self.scroll_offset.y)
        if center and not top <= self.cursor < top + visible:
            top = max(0, self.cursor - visible // 2)
        elif self.cursor < top:
            top = self.cursor
        elif self.cursor >= top + visible:
            top = self.cursor - visible + 1
        if top != int(self.scroll_offset.y):
            self.scroll_to(y=top, animate=False, immediate=True)

    def action_move(self, step: int) -> None:
        self._move_to(self.cursor + step)

    def action_page(self, step: int) -> None:
        self._move_to(self.cursor + step * max(1, self.size.height - 2))

    def action_edge(self, end: int) -> None:
        self._move_to(len(self.rows) - 1 if end else 0)

    def action_toggle_node(self) -> None:
        if isinstance(self.current, Node):
            self.post_message(self.Toggle(self.current, None))

    def action_open(self) -> None:
        item = self.current
        if isinstance(item, Node) and self.tree_mode and not self.opened(item):
            self.post_message(self.Toggle(item, True))
        elif self.tree_mode:
            self.action_move(1)

    def action_close(self) -> None:
        item = self.current
        if not self.tree_mode:
            return
        if isinstance(item, Node) and self.opened(item):
            self.post_message(self.Toggle(item, False))
            return
        parent = item.parent if isinstance(item, Node) else (
            self.index.node(self.index.ancestors(item.key)[-1])
            if self.index and item is not None and self.index.ancestors(item.key) else None)
        if parent is not None and parent.path:
            self.select(parent.path)

    def on_click(self, event: events.Click) -> None:
        row = int(self.scroll_offset.y) + event.y - 1
        if event.y == 0 or not 0 <= row < len(self.rows):
            return
        if row == self.cursor and isinstance(self.current, Node):
            self.action_toggle_node()
        self._move_to(row)

    def on_resize(self, event: events.Resize) -> None:
        self.virtual_size = Size(event.size.width, len(self.rows) + 1)
        self._scroll_to_cursor()

    # -- drawing ---------------------------------------------------------------
    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        cols = Columns.fit(width)
        base = self.rich_style
        if y == 0:
            text = " ".join((
                _cell("module / key" if self.tree_mode else "key", cols.name),
                _cell("shape", cols.shape), _cell("dtype", cols.dtype),
                _cell("device", cols.device), _cell("size", cols.size, right=True)))
            style = base + self.get_component_rich_style("tensor-table--header")
            return Strip([Segment(_cell(text, width), style)], width)
        row = int(self.scroll_offset.y) + y - 1
        if not 0 <= row < len(self.rows):
            if row == 0 and self.empty_text:
                return Strip([Segment(_cell(" " + self.empty_text, width), base)], width)
            return Strip.blank(width, base)
        item = self.rows[row]
        segments = self._row_segments(item, cols, base)
        if row == self.cursor:
            cursor = self.get_component_rich_style("tensor-table--cursor")
            segments = [Segment(s.text, (s.style or base) + cursor) for s in segments]
        # the cells add up to one column less than the width: pad to it, so
        # that what is beside the list (the wide layout) lines up
        return Strip(segments).adjust_cell_length(width, base)

    def _row_segments(self, item: Node | TensorInfo, cols: Columns, base: Style
                      ) -> list[Segment]:
        dim = base + self.get_component_rich_style("tensor-table--dim")
        if isinstance(item, Node):
            depth = item.depth if self.tree_mode else 0
            mark = "▾ " if self.opened(item) else "▸ "
            name = "  " * depth + mark + shown(item.name)
            cells = node_cells(item, cols)
            style = base + self.get_component_rich_style("tensor-table--node")
        else:
            if self.tree_mode and self.index is not None:
                name = "  " * self.index.depth(item, True) + "  " + shown(leaf_name(item))
            else:
                name = shown(item.key)
            cells = tensor_cells(item)
            style = base
        shape, dtype, device, size = cells
        return [
            Segment(_cell(name, cols.name, keep_end=not self.tree_mode) + " ", style),
            Segment(_cell(shape, cols.shape) + " ", dim if isinstance(item, Node) else base),
            Segment(_cell(dtype, cols.dtype) + " ", dim),
            Segment(_cell(device, cols.device) + " ", base),
            Segment(_cell(size, cols.size, right=True), dim if isinstance(item, Node) else base),
        ]



class Pane(VerticalScroll, can_focus=True):
    """A text pane that ↑ ↓ (j k) scroll by a line and PgUp PgDn by a page,
    at once: held down, an animated scroll would lag behind the keys."""

    BINDINGS = [
        Binding("up,k", "lines(-1)", "Up", show=False),
        Binding("down,j", "lines(1)", "Down", show=False),
        Binding("pageup", "lines(-0.5)", "Page up", show=False),
        Binding("pagedown", "lines(0.5)", "Page down", show=False),
        Binding("home", "lines(-1e9)", "Top", show=False),
        Binding("end", "lines(1e9)", "Bottom", show=False),
    ]

    def action_lines(self, step: float) -> None:
        """Scroll ``step`` lines; a fraction is that many pages (±0.5: one)."""
        page = max(1, self.scrollable_content_region.height - 1)
        lines = step if abs(step) >= 1 else (page if step > 0 else -page)
        y = max(0, min(self.max_scroll_y, int(self.scroll_y + lines)))
        self.scroll_to(y=y, animate=False, immediate=True)
