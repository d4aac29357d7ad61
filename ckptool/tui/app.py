"""``ckptool browse``: the Textual app, its screen and its keys.

The app paints at once; the file is read on a worker thread
(``ckptool.tui.loading``). Statistics, fix planning and writing run on
workers too. Everything shown comes from the core; the app only keeps view
state (cursor, open modules, filter, sort).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from typing import Any

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.events import Resize
from textual.widgets import Footer, Input, Static
from textual.worker import get_current_worker

from ckptool.check.gpus.machine import Machine
from ckptool.check.stats import TensorStats
from ckptool.describe import shown
from ckptool.errors import CkptoolError
from ckptool.model import Checkpoint, TensorInfo
from ckptool.tui import panes
from ckptool.tui.findings import findings
from ckptool.tui.fixscreen import FixDefaults, FixScreen
from ckptool.tui.index import Node
from ckptool.tui.loading import LoadingApp, ModelLoader
from ckptool.tui.rows import key_of
from ckptool.tui.screens import HelpScreen, JumpScreen
from ckptool.tui.table import Pane, TensorTable
from ckptool.write.fix.preview import Previewer

WIDE = 120  # columns from which the details sit beside the list


class BrowseApp(LoadingApp):
    """Browse one checkpoint. ``return_code`` is 0, or the exit code of the
    error that stopped the read (kept in ``error``)."""

    CSS_PATH = "browse.tcss"
    TITLE = "ckptool browse"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        # priority: taken in the order keys come, before any later key is
        # handed to the widget with the focus (see check_action)
        Binding("slash", "filter", "Filter", priority=True),
        Binding("g", "jump", "Jump", priority=True),
        Binding("enter", "filter_done", show=False, priority=True),
        Binding("o", "sort", "Sort"),
        Binding("t", "toggle_view", "Tree"),
        Binding("s", "stats", "Stats"),
        Binding("c", "copy", "Copy"),
        Binding("x", "fix", "Fix"),
        Binding("f", "findings", "Findings", show=False),
        Binding("tab", "focus_next", "Next pane", show=False),
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit", "Quit"),
        Binding("ctrl+c", "interrupt", "Quit", show=False, priority=True),
    ]

    def __init__(self, path: str, *, machine: Machine | None = None,
                 model: ModelLoader | None = None) -> None:
        super().__init__(path, machine=machine, model=model)
        self.stats: dict[str, TensorStats | str] = {}  # a result, or why there is none
        self.computing: set[str] = set()  # keys whose statistics are being computed
        self.previewer: Previewer | None = None
        self._anchor: str | None = None  # the row a filter being typed keeps

    # -- layout ------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Static(panes.summary_loading(self.path, 0), id="summary")
        with Horizontal(id="main"):
            with Vertical(id="list"):
                yield TensorTable(id="table")
                yield Input(placeholder="filter: a substring, or a glob like *.bias "
                            "(Enter keeps it, Esc clears)", id="filter")
                yield Static("", id="status")
            with Vertical(id="side"):
                with Pane(id="detail-box"):
                    yield Static("", id="detail")
                with Pane(id="findings-box"):
                    yield Static(findings(None), id="findings")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one("#filter").display = False
        self.query_one("#detail-box").border_title = "details"
        self.query_one("#findings-box").border_title = "findings"
        self.query_one(TensorTable).empty_text = "reading…"
        self.query_one(TensorTable).focus()
        self._layout(self.size.width)
        self.start_loading()
        # a SIGINT from outside (kill -INT; the terminal's own Ctrl-C is a key
        # here) quits as that key does; the loop wakes for it
        # (none where the loop cannot take one: not the main thread, not Unix)
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGINT,
                                                          self.action_interrupt)

    def on_resize(self, event: Resize) -> None:
        # the event's size: ``self.size`` is still the old one when it comes
        self._layout(event.size.width)

    def _layout(self, width: int) -> None:
        self.query_one("#main").set_class(width >= WIDE, "-wide")

    # -- rows --------------------------------------------------------------------
    def _refresh_rows(self, keep: str | None = None) -> None:
        table = self.query_one(TensorTable)
        if keep is None:
            keep = _key_of(table.current)
        rows = self.view.rows(self.index)
        table.empty_text = self.view.empty_text(self.index, rows, self.ckpt is not None)
        table.set_rows(rows, self.index, self.view.tree, self.view.opened(rows), keep)
        self._status()

    def _status(self) -> None:
        findings = len(self.diagnosis.findings) if self.diagnosis is not None else None
        # one line, always (browse.tcss): its size never changes, so no layout
        # pass over the whole screen on each keystroke of a filter
        self.query_one("#status", Static).update(Text(shown(self.view.status(
            self.index, self.query_one(TensorTable).rows, self.ckpt is not None, findings)),
            style="dim"), layout=False)

    @on(TensorTable.Toggle)
    def toggled(self, event: TensorTable.Toggle) -> None:
        is_open = self.query_one(TensorTable).opened(event.node)
        if self.view.toggle(event.node, is_open, event.open):
            self._refresh_rows(keep=event.node.path)

    @on(TensorTable.Highlighted)
    def highlighted(self) -> None:
        self._show_detail()

    def _show_detail(self) -> None:
        item = self.query_one(TensorTable).current
        detail = self.query_one("#detail", Static)
        if item is None:
            detail.update("")
        elif isinstance(item, Node):
            detail.update(panes.node_detail(item))
        else:
            loads = ({t.location: t for t in self.diagnosis.tags}
                     if self.diagnosis is not None else None)
            stats = "computing…" if item.key in self.computing else self.stats.get(item.key)
            detail.update(panes.tensor_detail(self.ckpt, item, loads, stats,
                                              self.index.is_optimizer(item)))

    # -- filter --------------------------------------------------------------------
    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        # now, not once the queue is through (Widget.focus): keys typed or pasted
        # right after "/" are in that queue, and belong to the filter
        self.screen.set_focus(box)
        # while typing, the cursor goes back to this row whenever it shows:
        # a pattern that hides it for a keystroke ("*." on the way to "*.bias")
        # does not lose it
        self._anchor = _key_of(self.query_one(TensorTable).current)

    @on(Input.Changed, "#filter")
    def filter_changed(self, event: Input.Changed) -> None:
        self.view.set_filter(event.value)
        self._refresh_rows(keep=self._anchor)

    def action_filter_done(self) -> None:
        """Enter keeps the filter and gives the list its keys back, before a
        key typed after Enter is handed on."""
        box = self.query_one("#filter", Input)
        box.display = bool(box.value)
        self.screen.set_focus(self.query_one(TensorTable))

    def on_key(self, event: Any) -> None:
        box = self.query_one("#filter", Input)
        if event.key == "escape" and (box.has_focus or box.value):
            event.stop()
            box.value = ""
            box.display = False
            self.view.set_filter("")
            self.screen.set_focus(self.query_one(TensorTable))
            self._refresh_rows()

    # -- actions -------------------------------------------------------------------
    def action_sort(self) -> None:
        self.view.next_sort()
        self._refresh_rows()

    def action_toggle_view(self) -> None:
        self.view.tree = not self.view.tree
        self._refresh_rows()

    def action_copy(self) -> None:
        """OSC 52 asks the terminal to take the text: there is no telling
        whether it did (tmux needs ``set-clipboard on``), so the text is
        shown too, to select by hand."""
        key = _key_of(self.query_one(TensorTable).current)
        if key:
            self.copy_to_clipboard(key)
            self.notify(f"{shown(key)}\n(sent to the terminal's clipboard by OSC 52; if it "
                        "does not paste, select it here)", title="copy", timeout=8,
                        markup=False)

    def action_jump(self) -> None:
        def jump(key: str | None) -> None:
            if key:
                self.jump_to(key)

        self.push_screen(JumpScreen([t.key for t in self.index.tensors]), jump)

    def jump_to(self, key: str) -> None:
        """Put the cursor on ``key``: clear a filter that hides it and open
        the modules above it."""
        table = self.query_one(TensorTable)
        if self.view.filter:
            box = self.query_one("#filter", Input)
            with box.prevent(Input.Changed):
                box.value = ""
            box.display = False
            self.view.set_filter("")
        if self.view.tree:
            self.view.expanded.update(self.index.ancestors(key))
        self._refresh_rows(keep=key)
        table.select(key)
        table.focus()

    def action_stats(self) -> None:
        item = self.query_one(TensorTable).current
        if not isinstance(item, TensorInfo):
            self.notify("select a tensor to compute its statistics", severity="warning")
            return
        if self.ckpt is None:
            self.notify("statistics need the full read: a moment", severity="warning")
            return
        if item.key in self.computing or isinstance(self.stats.get(item.key), TensorStats):
            return  # under way, or done; an error is tried again
        self.stats.pop(item.key, None)
        self.computing.add(item.key)
        self._show_detail()
        self._compute_stats(self.ckpt, item)

    @work(thread=True, group="stats")
    def _compute_stats(self, ckpt: Checkpoint, tensor: TensorInfo) -> None:
        from ckptool.check.stats import StatsCancelled, checkpoint_stats

        worker = get_current_worker()
        result: TensorStats | str
        try:
            result = checkpoint_stats(ckpt, tensor, cancelled=lambda: worker.is_cancelled)
        except StatsCancelled:
            return
        except CkptoolError as exc:
            result = f"cannot compute: {exc.message}"
        except OSError as exc:
            result = f"cannot read: {exc.strerror or exc}"
        self.call_from_thread(self._stats_done, tensor.key, result)

    def _stats_done(self, key: str, result: TensorStats | str) -> None:
        self.computing.discard(key)
        self.stats[key] = result
        self._show_detail()

    def action_findings(self) -> None:
        """Wide: focus the findings. Narrow: show them in place of the
        details and focus them; again, back to the details and the list."""
        main = self.query_one("#main")
        if not main.has_class("-wide") and main.has_class("-findings"):
            main.remove_class("-findings")
            self.query_one(TensorTable).focus()
            return
        main.add_class("-findings")
        self.query_one("#findings-box").focus()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """"/" and "g" open their input only from the list: typed into an
        input (a key may hold a slash) or over a dialog, they are text."""
        if action in ("filter", "jump"):
            return not (isinstance(self.focused, Input) or self.screen is not self.screen_stack[0])
        if action == "filter_done":  # Enter in the filter; anywhere else, its usual work
            return self.focused is self.query_one("#filter", Input)
        return True

    def action_interrupt(self) -> None:
        """Ctrl-C quits, as in any terminal tool (exit 130, as ckptool's other
        commands when interrupted)."""
        self.exit(130, return_code=130)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_fix(self) -> None:
        if self.ckpt is None:
            self.notify("a fix needs the full read: a moment", severity="warning")
            return
        if self.previewer is None:  # kept: what it learns of the file serves every preview
            self.previewer = Previewer(self.ckpt)
        self.push_screen(FixScreen(self.previewer, self.fix_defaults()))

    def fix_defaults(self) -> FixDefaults:
        assert self.ckpt is not None
        return FixDefaults.suggested(self.ckpt, self.diagnosis)


def _key_of(item: Node | TensorInfo | None) -> str | None:
    return None if item is None else key_of(item)


def make_app(path: str | os.PathLike[str], *, machine: Machine | None = None,
             model: ModelLoader | None = None) -> BrowseApp:
    """The browser for ``path``: what ``ckptool browse`` runs and tests drive."""
    return BrowseApp(os.fspath(path), machine=machine, model=model)
