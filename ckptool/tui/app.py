"""``ckptool browse``: the Textual app.

The app paints at once and reads the file on a worker thread. While the
pickle is read, tensors arrive in batches (``open_checkpoint(on_tensors=)``)
and are listed as they come; when the read ends, the full ``Checkpoint``
replaces them and a second worker diagnoses it (``ckptool.check.diagnosis``).
Statistics, fix planning and writing run on workers too. Everything shown
comes from the core; the app only keeps view state (cursor, open modules,
filter, sort).
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable
from typing import Any

from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.events import Resize
from textual.widgets import Footer, Input, Static
from textual.worker import get_current_worker

from ckptool.check.diagnosis import Diagnosis
from ckptool.check.gpus import Machine
from ckptool.check.modelspec import ModelKeys
from ckptool.check.stats import TensorStats
from ckptool.errors import CkptoolError, InputError
from ckptool.model import Checkpoint, TensorInfo
from ckptool.tui import panes
from ckptool.tui.findings import findings
from ckptool.tui.fixscreen import FixDefaults, FixScreen
from ckptool.tui.index import Index, Node
from ckptool.tui.rows import key_of
from ckptool.tui.screens import HelpScreen, JumpScreen
from ckptool.tui.table import Pane, TensorTable
from ckptool.tui.view import ViewState
from ckptool.write.preview import Previewer

WIDE = 120  # columns from which the details sit beside the list
ModelLoader = Callable[[Checkpoint], ModelKeys | None]


class BrowseApp(App[int]):
    """Browse one checkpoint. ``return_code`` is 0, or the exit code of the
    error that stopped the read (kept in ``error``)."""

    CSS_PATH = "browse.tcss"
    TITLE = "ckptool browse"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("slash", "filter", "Filter"),
        Binding("g", "jump", "Jump"),
        Binding("o", "sort", "Sort"),
        Binding("t", "toggle_view", "Tree"),
        Binding("s", "stats", "Stats"),
        Binding("c", "copy", "Copy"),
        Binding("x", "fix", "Fix"),
        Binding("f", "findings", "Findings", show=False),
        Binding("tab", "focus_next", "Next pane", show=False),
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, path: str, *, machine: Machine | None = None,
                 model: ModelLoader | None = None) -> None:
        super().__init__()
        self.path = path
        self.machine = machine  # None: probe this machine (nvidia-smi), on a worker
        self.model_loader = model
        self.ckpt: Checkpoint | None = None
        self.index = Index()
        self.diagnosis: Diagnosis | None = None
        self.findings_error: str | None = None
        self.error: CkptoolError | None = None
        self.view = ViewState()
        self.stats: dict[str, TensorStats | str] = {}  # a result, or why there is none
        self.computing: set[str] = set()  # keys whose statistics are being computed
        self.previewer: Previewer | None = None
        self._anchor: str | None = None  # the row a filter being typed keeps
        self._partial: list[list[TensorInfo]] = []  # batches from the reading thread
        self._taken = 0
        self._opened_defaults = False
        self.loaded = threading.Event()  # set once the full read is shown

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
        self._drain_timer = self.set_interval(0.1, self._drain)
        self._load()

    def on_resize(self, event: Resize) -> None:
        # the event's size: ``self.size`` is still the old one when it comes
        self._layout(event.size.width)

    def _layout(self, width: int) -> None:
        self.query_one("#main").set_class(width >= WIDE, "-wide")

    # -- loading -----------------------------------------------------------------
    @work(thread=True, exclusive=True, group="load")
    def _load(self) -> None:
        from ckptool.read.reader import open_checkpoint

        try:
            ckpt = open_checkpoint(self.path, on_tensors=self._partial.append)
        except CkptoolError as exc:
            self.call_from_thread(self._failed, exc)
            return
        except OSError as exc:  # the system refused a read midway
            self.call_from_thread(self._failed, InputError(
                f"{self.path}: {exc.strerror or exc}", "check the file and try again"))
            return
        # the batches were a preview; when they hold exactly the final keys
        # (the usual case) the tree built from them stays, else it is rebuilt
        sent = [t.key for batch in self._partial for t in batch]
        same = sent == [t.key for t in ckpt.tensors]
        index = None if same else Index(ckpt.tensors)
        self.call_from_thread(self._loaded, ckpt, index)
        # made before they are asked for: the one slow sort (natural order of
        # names), and what a filter keystroke in the tree needs
        ready = self.index
        ready.sorted_tensors("name")
        ready.layout("file")
        ready.lookup("")

    def _drain(self) -> None:
        """Show the batches the reader has passed on so far."""
        if self.ckpt is not None:
            return
        batches = self._partial[self._taken:]
        if not batches:
            return
        self._taken += len(batches)
        for batch in batches:
            self.index.extend(batch)
        first = not self._opened_defaults
        self._open_defaults()
        self.query_one("#summary", Static).update(
            panes.summary_loading(self.path, len(self.index)))
        self._refresh_rows()
        if first:  # the screen is full: later batches can come in bigger steps,
            # which leaves the reading thread more of the interpreter
            self._drain_timer.stop()
            self._drain_timer = self.set_interval(0.5, self._drain)

    def _open_defaults(self) -> None:
        if not self._opened_defaults and len(self.index):
            self._opened_defaults = True
            self.view.expanded = self.index.default_expanded(max(20, self.size.height - 8))

    def _loaded(self, ckpt: Checkpoint, index: Index | None) -> None:
        self._drain()
        self._drain_timer.stop()
        self.ckpt = ckpt
        if index is not None:
            self.index = index
        self._open_defaults()
        self.query_one("#summary", Static).update(panes.summary(ckpt))
        self._refresh_rows()
        self.loaded.set()
        # the index and checkpoint live as long as the app: keep the cyclic
        # collector from walking their million objects again and again (a
        # full collection mid-keystroke cost 300+ ms on 100,000 tensors)
        gc.freeze()
        self._diagnose(ckpt)

    def _failed(self, exc: CkptoolError) -> None:
        self.error = exc
        self.exit(exc.exit_code, return_code=exc.exit_code)

    @work(thread=True, exclusive=True, group="diagnose")
    def _diagnose(self, ckpt: Checkpoint) -> None:
        from ckptool.check.diagnosis import diagnose
        from ckptool.check.gpus import probe

        try:
            machine = self.machine or probe()
            model = self.model_loader(ckpt) if self.model_loader else None
            result = diagnose(ckpt, machine, model)
        except CkptoolError as exc:
            hint = f"\nhint: {exc.hint}" if exc.hint else ""
            self.call_from_thread(self._diagnosed, None, f"{exc.message}{hint}")
            return
        except OSError as exc:  # the file went away since it was read
            self.call_from_thread(self._diagnosed, None,
                                  f"cannot diagnose: {exc.strerror or exc}")
            return
        self.call_from_thread(self._diagnosed, result, None)

    def _diagnosed(self, result: Diagnosis | None, error: str | None) -> None:
        self.diagnosis, self.findings_error = result, error
        self.query_one("#findings", Static).update(findings(result, error))
        box = self.query_one("#findings-box")
        box.border_title = (f"findings ({len(result.findings)})" if result is not None
                            else "findings")
        self._status()
        self._show_detail()

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
        self.query_one("#status", Static).update(Text(self.view.status(
            self.index, self.query_one(TensorTable).rows, self.ckpt is not None, findings),
            style="dim"))

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
            detail.update(panes.tensor_detail(self.ckpt, item, loads, stats))

    # -- filter --------------------------------------------------------------------
    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        box.focus()
        # while typing, the cursor goes back to this row whenever it shows:
        # a pattern that hides it for a keystroke ("*." on the way to "*.bias")
        # does not lose it
        self._anchor = _key_of(self.query_one(TensorTable).current)

    @on(Input.Changed, "#filter")
    def filter_changed(self, event: Input.Changed) -> None:
        self.view.set_filter(event.value)
        self._refresh_rows(keep=self._anchor)

    @on(Input.Submitted, "#filter")
    def filter_done(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = bool(box.value)
        self.query_one(TensorTable).focus()

    def on_key(self, event: Any) -> None:
        box = self.query_one("#filter", Input)
        if event.key == "escape" and (box.has_focus or box.value):
            event.stop()
            box.value = ""
            box.display = False
            self.view.set_filter("")
            self.query_one(TensorTable).focus()
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
            self.notify(f"{key}\n(sent to the terminal's clipboard by OSC 52; if it does "
                        "not paste, select it here)", title="copy", timeout=8)

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
        from ckptool.check.stats import StatsCancelled, tensor_stats
        from ckptool.read.tensor_data import TensorData

        worker = get_current_worker()
        result: TensorStats | str
        try:
            with TensorData(ckpt) as data:
                result = tensor_stats(data, tensor, cancelled=lambda: worker.is_cancelled)
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
