"""The browser's dialogs: help, jump to a key, and the fix preview with its
confirmation and progress."""

from __future__ import annotations

import os
from dataclasses import dataclass

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.suggester import Suggester
from textual.widgets import Button, Checkbox, Input, Label, Log, ProgressBar, Static
from textual.worker import get_current_worker

from ckptool.describe import human_bytes
from ckptool.diagnosis import command_flags, shell_name
from ckptool.errors import CkptoolError
from ckptool.plan import FixOptions, parse_device
from ckptool.rewrite import FixResult, default_output

HELP = """\
[b]Moving[/b]
  ↑ ↓ PgUp PgDn Home End   move in the list (also j / k)
  Enter, Space             open or close a module
  → ←                      open / close; ← on a tensor goes to its module
  Tab                      next pane (list, details, findings)

[b]Finding[/b]
  /        filter as you type: a substring (layer1.conv), or a glob
           matched against the whole key or its last part (*.bias)
           Enter keeps the filter, Esc clears it
  g        jump to a key (Tab completes)
  o        sort: file order → name → size → device
  t        tree of modules ↔ flat list of keys

[b]Acting[/b]
  s        statistics of the selected tensor (reads only its bytes)
  c        copy the selected key
  x        preview a fix (strip a prefix, move devices, extract the
           state dict) and write it, as `ckptool fix` does
  f        go to the findings (what `ckptool diagnose` reports)
  ?        this help      q  quit
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-body", classes="dialog"):
            yield Static(Text.from_markup(HELP))
            yield Label("Esc closes this help", classes="dialog-hint")

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss(None)


class KeySuggester(Suggester):
    """Completes a key from its start (case-insensitive), over all keys."""

    def __init__(self, keys: list[str]) -> None:
        super().__init__(use_cache=True, case_sensitive=False)
        self._keys = keys
        self._lower = [k.lower() for k in keys]

    async def get_suggestion(self, value: str) -> str | None:
        for key, low in zip(self._keys, self._lower, strict=True):
            if low.startswith(value):
                return key
        return None


class JumpScreen(ModalScreen[str | None]):
    """Type a key (Tab/→ completes); Enter jumps to it, or to the first key
    containing what was typed."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, keys: list[str]) -> None:
        super().__init__()
        self.keys = keys

    def compose(self) -> ComposeResult:
        with Vertical(id="jump-body", classes="dialog"):
            yield Label("Jump to key")
            yield Input(placeholder="a key, or part of one", id="jump-input",
                        suggester=KeySuggester(self.keys))
            yield Label("", id="jump-error", classes="dialog-error")

    @on(Input.Submitted, "#jump-input")
    def submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            self.dismiss(None)
            return
        if text in self.keys:
            self.dismiss(text)
            return
        low = text.lower()
        found = next((k for k in self.keys if low in k.lower()), None)
        if found is None:
            self.query_one("#jump-error", Label).update(f"no key contains {text!r}")
            return
        self.dismiss(found)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Grid(id="confirm-body", classes="dialog"):
            yield Static(self.question, id="confirm-question")
            yield Button("Write (y)", variant="warning", id="yes")
            yield Button("Cancel (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    @on(Button.Pressed)
    def pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


@dataclass(frozen=True)
class FixDefaults:
    """What the dialog opens with: the diagnosis's fix when there is one."""

    strip: bool
    prefix: str
    move: bool
    device: str
    extract: bool


class FixScreen(ModalScreen[str | None]):
    """Choose a fix, see every key before and after, then write it through
    the same core as ``ckptool fix`` (dry run first, confirm, progress).
    Dismisses with the path written, or None."""

    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("ctrl+w", "write", "Write…"),
    ]
    SHOWN = 5000  # preview lines; the summary counts them all

    def __init__(self, path: str, defaults: FixDefaults) -> None:
        super().__init__()
        self.path = path
        self.defaults = defaults
        self.opts: FixOptions | None = None
        self.result: FixResult | None = None
        self.writing = False
        self.written: str | None = None

    def compose(self) -> ComposeResult:
        d = self.defaults
        with Vertical(id="fix-body", classes="dialog"):
            yield Label(f"Fix {os.path.basename(self.path)}", id="fix-title")
            with Horizontal(classes="fix-row"):
                yield Checkbox("strip prefix", d.strip, id="fix-strip")
                yield Input(d.prefix, placeholder="module.", id="fix-prefix")
            with Horizontal(classes="fix-row"):
                yield Checkbox("move to", d.move, id="fix-move")
                yield Input(d.device, placeholder="cpu, cuda:0", id="fix-device")
            with Horizontal(classes="fix-row"):
                yield Checkbox("extract the state dict", d.extract, id="fix-extract")
            with Horizontal(classes="fix-row"):
                yield Label("output", classes="fix-label")
                yield Input(os.path.basename(default_output(self.path)), id="fix-output")
            yield Static("planning…", id="fix-summary")
            yield Log(id="fix-preview", auto_scroll=False)
            yield ProgressBar(id="fix-progress", show_eta=False)
            with Horizontal(id="fix-buttons"):
                yield Button("Write… (ctrl+w)", variant="warning", id="fix-write",
                             compact=True)
                yield Button("Close (esc)", id="fix-close", compact=True)

    def on_mount(self) -> None:
        self.query_one("#fix-progress").display = False
        self.replan()

    # -- planning ------------------------------------------------------------
    def _options(self) -> FixOptions:
        prefix = self.query_one("#fix-prefix", Input).value
        device = self.query_one("#fix-device", Input).value.strip()
        strip = self.query_one("#fix-strip", Checkbox).value and prefix != ""
        move = self.query_one("#fix-move", Checkbox).value
        return FixOptions(
            strip_prefixes=(prefix,) if strip else (),
            to=parse_device(device) if move else None,
            extract="auto" if self.query_one("#fix-extract", Checkbox).value else None,
        )

    def _output(self) -> str:
        name = self.query_one("#fix-output", Input).value.strip()
        return os.path.join(os.path.dirname(os.path.abspath(self.path)), name) if name else ""

    @on(Checkbox.Changed)
    @on(Input.Changed)
    def replan(self) -> None:
        if self.writing:
            return
        summary = self.query_one("#fix-summary", Static)
        self.result = None
        try:
            opts = self._options()
        except CkptoolError as exc:
            summary.update(Text(f"{exc.message} ({exc.hint})", style="red"))
            return
        if not self._output():
            summary.update(Text("name the output file", style="red"))
            return
        self.opts = opts
        summary.update(Text("planning…", style="italic"))
        self._plan(opts, self._output())

    @work(thread=True, exclusive=True, group="plan")
    def _plan(self, opts: FixOptions, output: str) -> None:
        from ckptool.tui.preview import make_preview

        worker = get_current_worker()
        try:
            preview = make_preview(self.path, opts, output)
        except CkptoolError as exc:
            if not worker.is_cancelled:
                self.app.call_from_thread(self._show_error, exc)
            return
        lines = []
        for c in preview.changes[: self.SHOWN]:
            after = c.after if c.after is not None else "(left out)"
            where = (f"{c.before_loc} → {c.after_loc}" if c.after_loc != c.before_loc
                     else c.before_loc)
            lines.append(f"{c.before}  ⇒  {after}   [{where}]")
        if len(preview.changes) > self.SHOWN:
            lines.append(f"… {len(preview.changes) - self.SHOWN:,} more")
        if not worker.is_cancelled:
            self.app.call_from_thread(self._show_preview, opts, preview, lines)

    def _show_error(self, exc: CkptoolError) -> None:
        text = Text(exc.message, style="bold red")
        if exc.hint:
            text.append(f"\nhint: {exc.hint}", style="red")
        self.query_one("#fix-summary", Static).update(text)
        self.query_one("#fix-preview", Log).clear()

    def _show_preview(self, opts: FixOptions, preview: object, lines: list[str]) -> None:
        from ckptool.tui.preview import Preview

        assert isinstance(preview, Preview)
        if opts != self.opts:
            return  # a newer plan is on its way
        self.result = preview.result
        text = Text(preview.summary(), style="bold")
        if preview.result.plan.empty:
            text = Text("nothing to change with these options", style="yellow")
        text.append("\nsame as: " + self.command(opts), style="cyan")
        self.query_one("#fix-summary", Static).update(text)
        log = self.query_one("#fix-preview", Log)
        log.clear()
        log.write_lines(lines)
        log.scroll_home(animate=False)

    def command(self, opts: FixOptions) -> str:
        out = self._output()
        return " ".join(["ckptool", "fix", shell_name(self.path), *command_flags(opts),
                         "-o", shell_name(out)])

    # -- writing -------------------------------------------------------------
    @on(Button.Pressed, "#fix-write")
    def action_write(self) -> None:
        if self.writing:
            return
        if self.result is None or self.opts is None:
            self.notify("no plan to write yet", severity="warning")
            return
        if self.result.plan.empty:
            self.notify("nothing to change with these options", severity="warning")
            return
        out = self._output()
        exists = os.path.exists(out)
        total = sum(s.nbytes for s in self.result.source.storages.values())
        question = (f"Write {os.path.basename(out)} "
                    f"({len(self.result.source.tensors):,} tensors, about {human_bytes(total)})?"
                    "\nIt is verified before it is put in place; the input is not touched.")
        if exists:
            question += f"\n{os.path.basename(out)} exists and will be replaced."
        opts = self.opts

        def answered(yes: bool | None) -> None:
            if yes:
                self._start_write(opts, out, exists)

        self.app.push_screen(ConfirmScreen(question), answered)

    def _start_write(self, opts: FixOptions, out: str, force: bool) -> None:
        self.writing = True
        bar = self.query_one("#fix-progress", ProgressBar)
        bar.display = True
        bar.update(total=None, progress=0)
        self.query_one("#fix-write", Button).disabled = True
        self.query_one("#fix-summary", Static).update(Text(f"writing {out}…", style="italic"))
        self._write(opts, out, force)

    @work(thread=True, exclusive=True, group="write")
    def _write(self, opts: FixOptions, out: str, force: bool) -> None:
        from ckptool.rewrite import fix

        last = [0.0]

        def progress(done: int, total: int) -> None:
            if total and (done == total or done - last[0] >= total / 100):
                last[0] = done
                self.app.call_from_thread(self._progress, done, total)

        try:
            result = fix(self.path, opts, out, force=force, progress=progress)
        except CkptoolError as exc:
            self.app.call_from_thread(self._write_failed, exc)
            return
        except OSError as exc:
            self.app.call_from_thread(self._write_failed, CkptoolError(
                f"{exc.filename or out}: {exc.strerror or exc}",
                "check free space and permissions; nothing was left half-written"))
            return
        self.app.call_from_thread(self._written, result)

    def _progress(self, done: int, total: int) -> None:
        self.query_one("#fix-progress", ProgressBar).update(total=total, progress=done)

    def _write_failed(self, exc: CkptoolError) -> None:
        self.writing = False
        self.query_one("#fix-progress").display = False
        self.query_one("#fix-write", Button).disabled = False
        self._show_error(exc)

    def _written(self, result: FixResult) -> None:
        self.writing = False
        bar = self.query_one("#fix-progress", ProgressBar)
        bar.update(total=1, progress=1)
        text = Text(f"wrote {result.output}", style="bold green")
        text.append(f"\n{human_bytes(result.bytes_written)}, "
                    f"{result.verified_storages:,} storages verified. Esc closes.")
        self.query_one("#fix-summary", Static).update(text)
        self.written = result.output
        self.notify(f"wrote {result.output}")

    @on(Button.Pressed, "#fix-close")
    def action_close(self) -> None:
        if self.writing:
            self.notify("still writing; it stops safely only when done", severity="warning")
            return
        self.dismiss(self.written)
