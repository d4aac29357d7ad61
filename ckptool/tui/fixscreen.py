"""The fix dialog: choose a fix, see every key before and after, then write
it through the same core as ``ckptool fix``.

The preview comes from the checkpoint the browser has read
(``ckptool.write.fix.preview``): no second read of the file. Edits to the prefix and
device fields are planned ~250 ms after the last keystroke, one preview at
a time (a newer request waits for the running one, and only the latest is
made); the output name only changes the command shown. Writing calls
``ckptool.write.fix.run.fix`` on a worker, as ``ckptool fix`` does: it reads the
file again, faithfully, then copies the bytes with a progress bar.

A checkpoint of many files (Hugging Face shards, a DCP directory) is fixed
the same way into a new directory beside it (``ckptool fix DIR -o OUT``):
the preview is that fix's dry run, the write that fix.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.events import Resize
from textual.screen import ModalScreen
from textual.timer import Timer
from textual.widgets import Button, Checkbox, Input, Label, Log, ProgressBar, Static

from ckptool.check import manyfiles
from ckptool.check.diagnosis import Diagnosis
from ckptool.check.fixcommand import fix_command_line
from ckptool.describe import human_bytes, plural, shown
from ckptool.errors import CkptoolError
from ckptool.model import Checkpoint
from ckptool.tui.screens import ConfirmScreen
from ckptool.write.fix.plan import FixOptions, parse_device
from ckptool.write.fix.preview import FixPreview, Previewer
from ckptool.write.fix.run import FixResult, fresh_output
from ckptool.write.flagged import flagged

DEBOUNCE_S = 0.25
SHORT = 20  # rows below which the dialog drops its title and shortens its summary
WRITE_KEYS = "ctrl+s,f2"  # neither is a key of a text Input (ctrl+w deletes a word)


@dataclass(frozen=True)
class FixDefaults:
    """What the dialog opens with: the diagnosis's fix when there is one."""

    strip: bool
    prefix: str
    move: bool
    device: str
    extract: bool
    salvage: bool = False  # a flagged file: write its tensors and plain values only

    @classmethod
    def suggested(cls, ckpt: Checkpoint, diagnosis: Diagnosis | None) -> FixDefaults:
        """The diagnosis's fix when it has one, else the file's own prefix
        (not a DCP entry's name: ``model.`` is how it loads, and stays)."""
        sd = ckpt.main_state_dict
        prefix = sd.prefix if sd is not None else ""
        prefix = prefix.removeprefix(manyfiles.entry_prefix(ckpt))
        opts = diagnosis.fix_options if diagnosis is not None else None
        if opts is None:
            return cls(bool(prefix), prefix, False, "cpu", False)
        device = opts.to or (opts.maps[0][1] if opts.maps else "cpu")
        strip = bool(opts.strip_module or opts.strip_prefixes)
        if opts.strip_prefixes:
            prefix = opts.strip_prefixes[0]
        return cls(strip, prefix, bool(opts.to or opts.maps), device, opts.extract is not None,
                   opts.salvage)


class FixScreen(ModalScreen[str | None]):
    """Dismisses with the path written, or None."""

    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding(WRITE_KEYS, "write", "Write…", priority=True),
    ]
    SHOWN = 5000  # preview lines; the summary counts them all

    def __init__(self, previewer: Previewer, defaults: FixDefaults) -> None:
        super().__init__()
        self.previewer = previewer
        self.path = previewer.ckpt.path
        self.many = previewer.ckpt.is_multifile  # a directory: written as a new one
        self.kind = "directory" if self.many else "file"  # of the output
        # the input's name: a directory given as "dir/" too, or by its index file
        self._where = os.path.normpath(previewer.ckpt.directory or self.path
                                       if self.many else self.path)
        self.defaults = defaults
        # a file whose verdict is unsafe is written from only when salvaging
        self.flagged = bool(flagged(previewer.ckpt))
        self.opts: FixOptions | None = None  # what the fields ask for now
        self.preview: FixPreview | None = None  # the preview of ``opts``, once made
        self.refused: CkptoolError | None = None  # why ``opts`` cannot be written
        self.planning = False  # a preview is being made on a worker
        self.previews = 0  # previews made (tests count them)
        self.writing = False
        self.written: str | None = None
        self.closed = False  # dismissed: a plan that ends now has nowhere to go
        self._debounce: Timer | None = None
        self._clock: Timer | None = None
        self._progressed = False

    def compose(self) -> ComposeResult:
        d = self.defaults
        with Vertical(id="fix-body", classes="dialog"):
            yield Label(Text(f"Fix {shown(os.path.basename(self._where))}"), id="fix-title")
            with Horizontal(classes="fix-row"):
                yield Checkbox("strip prefix", d.strip, id="fix-strip")
                yield Input(d.prefix, placeholder="prefix to strip, e.g. module.",
                            id="fix-prefix")
            with Horizontal(classes="fix-row"):
                yield Checkbox("move to", d.move, id="fix-move")
                yield Input(d.device, placeholder="a device, e.g. cpu or cuda:0",
                            id="fix-device")
            with Horizontal(classes="fix-row"):
                yield Checkbox("extract the state dict", d.extract, id="fix-extract")
            if self.flagged:
                with Horizontal(classes="fix-row"):
                    yield Checkbox("salvage: the file is flagged; write only its tensors and "
                                   "plain values", d.salvage, id="fix-salvage")
            with Horizontal(classes="fix-row"):
                yield Label("output", classes="fix-label")
                yield Input(os.path.basename(fresh_output(self._where)),
                            placeholder=f"the output {self.kind}'s name", id="fix-output")
            yield Static("planning…", id="fix-summary")
            yield Log(id="fix-preview", auto_scroll=False)
            yield ProgressBar(id="fix-progress", show_eta=False)
            with Horizontal(id="fix-buttons"):
                yield Button("Write… (ctrl+s)", variant="warning", id="fix-write",
                             compact=True)
                yield Button("Close (esc)", id="fix-close", compact=True)

    def on_mount(self) -> None:
        self.query_one("#fix-progress").display = False
        self._fit(self.app.size.height)
        self.replan()

    def on_resize(self, event: Resize) -> None:
        self._fit(event.size.height)

    def _fit(self, height: int) -> None:
        """A short terminal: the preview keeps rows, the title and summary give way."""
        self.set_class(height < SHORT, "-short")

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
            salvage=self.flagged and self.query_one("#fix-salvage", Checkbox).value,
        )

    def _output(self) -> str:
        name = self.query_one("#fix-output", Input).value.strip()
        return os.path.join(os.path.dirname(self._where), name) if name else ""

    @on(Input.Changed, "#fix-prefix, #fix-device")
    def typed(self) -> None:
        """Plan once the typing pauses."""
        if self._debounce is not None:
            self._debounce.stop()
        self._debounce = self.set_timer(DEBOUNCE_S, self.replan)

    @on(Input.Changed, "#fix-output")
    def renamed_output(self) -> None:
        if self.preview is not None and not self.writing:
            self._show_summary()  # the command line names it; the plan is the same

    @on(Checkbox.Changed)
    def replan(self) -> None:
        if self.writing:
            return
        if self._debounce is not None:
            self._debounce.stop()
            self._debounce = None
        try:
            opts = self._options()
        except CkptoolError as exc:
            self.opts = self.preview = None
            self.refused = exc
            self._show_error(exc)
            return
        if opts == self.opts and self.refused is not None:  # planned already, and refused
            self._show_error(self.refused)
            return
        if opts == self.opts and self.preview is not None:
            self._show_summary()
            return
        self.opts, self.preview, self.refused = opts, None, None
        self.query_one("#fix-summary", Static).update(Text("planning…", style="italic"))
        if not self.planning:
            self.planning = True
            self._plan(opts)
        # else: the running preview's end starts this one (only the latest)

    @work(thread=True, group="plan")
    def _plan(self, opts: FixOptions) -> None:
        try:
            preview = self.previewer.preview(opts)
        except CkptoolError as exc:
            self.app.call_from_thread(self._planned, opts, None, exc)
            return
        self.app.call_from_thread(self._planned, opts, preview, None)

    def _planned(self, opts: FixOptions, preview: FixPreview | None,
                 error: CkptoolError | None) -> None:
        self.planning = False
        self.previews += 1
        if self.closed or not self.is_attached:
            return  # closed while it was planned (its widgets may be gone already)
        if opts != self.opts:  # the fields changed meanwhile
            if self.opts is not None:  # plan what they say now (else they show an error)
                self.planning = True
                self._plan(self.opts)
            return
        if error is not None or preview is None:
            self.refused = error or CkptoolError("no plan")
            self._show_error(self.refused)
            return
        self.preview = preview
        self._show_summary()
        lines = []
        for c in preview.changes[: self.SHOWN]:
            after = c.after if c.after is not None else "(left out)"
            where = (f"{c.before_loc} → {c.after_loc}" if c.after_loc != c.before_loc
                     else c.before_loc)
            lines.append(shown(f"{c.before}  ⇒  {after}   [{where}]"))
        if len(preview.changes) > self.SHOWN:
            lines.append(f"… {len(preview.changes) - self.SHOWN:,} more")
        log = self.query_one("#fix-preview", Log)
        log.clear()
        log.write_lines(lines)
        log.scroll_home(animate=False)

    def _show_summary(self) -> None:
        preview, opts = self.preview, self.opts
        if preview is None or opts is None:
            return
        if preview.plan.empty:
            text = Text("nothing to change with these options", style="yellow")
        else:
            text = Text(shown(preview.summary()), style="bold")
        strip = self.query_one("#fix-strip", Checkbox).value
        if strip and not self.query_one("#fix-prefix", Input).value:
            text.append("\nstrip prefix is ticked but the prefix is empty: nothing is stripped",
                        style="yellow")
        out = self._output()
        if out:
            text.append("\nsame as: " + shown(self.command(opts, out)), style="cyan")
        else:
            text.append(f"\nname the output {self.kind}", style="red")
        self.query_one("#fix-summary", Static).update(text)

    def _show_error(self, exc: CkptoolError) -> None:
        text = Text(shown(exc.message), style="bold red")
        if exc.hint:
            text.append(f"\nhint: {shown(exc.hint)}", style="red")
        self.query_one("#fix-summary", Static).update(text)
        self.query_one("#fix-preview", Log).clear()

    def command(self, opts: FixOptions, out: str) -> str:
        return fix_command_line(self.path, opts, out)

    # -- writing -------------------------------------------------------------
    @on(Button.Pressed, "#fix-write")
    def action_write(self) -> None:
        if self.writing:
            return
        if self._debounce is not None:
            self.replan()  # typed just now: what the fields say now counts
        preview, opts = self.preview, self.opts
        if preview is None or opts is None:
            if self.refused is not None:  # it says why, and what to do instead
                self.notify(f"nothing to write: {shown(self.refused.message)}",
                            severity="warning", markup=False)
            else:
                self.notify("the preview of these options is not ready yet",
                            severity="warning")
            return
        if preview.plan.empty:
            self.notify("nothing to change with these options", severity="warning")
            return
        out = self._output()
        if not out:
            self.notify(f"name the output {self.kind}", severity="warning")
            return
        exists = os.path.exists(out)
        question = (f"Write {os.path.basename(out)} ({plural(preview.tensors, 'tensor')}, about "
                    f"{human_bytes(preview.nbytes)})?\nIt is verified before it is put in "
                    "place; the input is not touched.")
        if exists:
            question += f"\n{os.path.basename(out)} exists and will be replaced."

        def answered(yes: bool | None) -> None:
            if yes:
                self._start_write(opts, out, exists)

        self.app.push_screen(ConfirmScreen(question), answered)

    def _start_write(self, opts: FixOptions, out: str, force: bool) -> None:
        self.writing = True
        for widget in self.query("Input, Checkbox, #fix-write"):
            widget.disabled = True
        # no bar while the file is read again: it could only say "--%"
        self.query_one("#fix-progress", ProgressBar).update(total=None, progress=0)
        started = time.monotonic()
        self._progressed = False

        how = "" if self.many else ", faithfully,"

        def tick() -> None:
            if not self._progressed:
                self.query_one("#fix-summary", Static).update(Text(
                    f"writing {out}\nreading {os.path.basename(self._where)} again{how} "
                    f"before its bytes are copied… {time.monotonic() - started:.0f} s",
                    style="italic"))

        tick()
        self._clock = self.set_interval(1, tick)
        self._write(opts, out, force)

    @work(thread=True, exclusive=True, group="write")
    def _write(self, opts: FixOptions, out: str, force: bool) -> None:
        from ckptool.write.fix.run import fix

        last = [-1.0]

        def progress(done: int, total: int) -> None:
            # called from whichever thread copies (the core may copy on its own):
            # call_from_thread works from any thread but the app's
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
        bar = self.query_one("#fix-progress", ProgressBar)
        if not self._progressed:
            self._progressed = True
            bar.display = True
            self.query_one("#fix-summary", Static).update(
                Text(f"writing {shown(self._output())}: copying tensor bytes…", style="italic"))
        bar.update(total=total, progress=done)

    def _stop_writing(self) -> None:
        self.writing = False
        if self._clock is not None:
            self._clock.stop()
        for widget in self.query("Input, Checkbox, #fix-write"):
            widget.disabled = False

    def _write_failed(self, exc: CkptoolError) -> None:
        self._stop_writing()
        self.query_one("#fix-progress").display = False
        self._show_error(exc)

    def _written(self, result: FixResult) -> None:
        self._stop_writing()
        bar = self.query_one("#fix-progress", ProgressBar)
        bar.display = True
        bar.update(total=1, progress=1)
        text = Text(f"wrote {shown(result.output or '')}", style="bold green")
        what = plural(result.verified_storages, "tensor" if self.many else "storage")
        text.append(f"\n{human_bytes(result.bytes_written)}, {what} verified. Esc closes.")
        self.query_one("#fix-summary", Static).update(text)
        self.written = result.output
        self.notify(f"wrote {shown(result.output or '')}", markup=False)

    @on(Button.Pressed, "#fix-close")
    def action_close(self) -> None:
        if self.writing:
            self.notify("still writing; it stops safely only when done", severity="warning")
            return
        self.closed = True
        self.dismiss(self.written)
