"""The browser's small dialogs: help, jump to a key (with completion), and
the yes/no confirmation (the fix dialog: ``ckptool.tui.fixscreen``)."""

from __future__ import annotations

from itertools import islice

from rich.text import Text
from textual import events, on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.suggester import Suggester
from textual.widgets import Button, Input, Label, Static

from ckptool.describe import shown

# at most 72 columns and 18 lines: the dialog shows it whole at 80x24,
# every entry as written (no line wraps mid-entry)
HELP = """\
[b]Moving[/b]
  ↑ ↓ PgUp PgDn Home End   move in the list (also j k)
  Enter Space              open or close a module (in a filter too)
  → ← (l h)                open / close; ← on a tensor: to its module
  Tab                      next pane (list, details, findings); in a
                           pane ↑ ↓ scroll a line, PgUp PgDn a page
[b]Finding[/b]
  /   filter as you type: a substring (layer1.conv) or a glob (*.bias)
      on the whole key or its last part; Enter keeps it, Esc clears it
  g   jump to a key (Tab or → completes)
  o   sort: file order → name → size → device    t  tree ↔ flat list
[b]Acting[/b]
  s   statistics of the selected tensor (reads only its bytes)
  c   copy the selected key: sent to the terminal's clipboard (OSC 52;
      in tmux: set -g set-clipboard on), and shown to select by hand
  x   preview a fix, then write it (ctrl+s) as `ckptool fix` does
  f   findings: what `ckptool diagnose` reports
  ?   this help (Esc closes it)    q  quit (ctrl+c too)
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-body", classes="dialog"):
            yield Static(Text.from_markup(HELP), id="help-text")

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss(None)


class KeySuggester(Suggester):
    """Completes a key from its start (case-insensitive), over all keys."""

    def __init__(self, keys: list[str], lower: list[str]) -> None:
        super().__init__(use_cache=True, case_sensitive=False)
        self._keys, self._lower = keys, lower

    async def get_suggestion(self, value: str) -> str | None:
        for key, low in zip(self._keys, self._lower, strict=True):
            if low.startswith(value):
                return key
        return None


class JumpScreen(ModalScreen[str | None]):
    """Type a key: Tab completes it as far as the keys that start so agree
    (again: the first of them), → takes the suggestion, and the first few
    candidates show below. Enter jumps to the key, or to the first key
    containing what was typed."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"),
                Binding("tab", "complete", "Complete", priority=True, show=False)]
    SHOWN = 6  # candidates listed under the input

    def __init__(self, keys: list[str]) -> None:
        super().__init__()
        self.keys = keys
        self.lower = [k.lower() for k in keys]

    def compose(self) -> ComposeResult:
        with Vertical(id="jump-body", classes="dialog"):
            yield Label("Jump to key (Tab completes, Enter jumps)")
            yield Input(placeholder="a key, or part of one", id="jump-input",
                        suggester=KeySuggester(self.keys, self.lower))
            yield Static("", id="jump-candidates", classes="dialog-hint")
            yield Label("", id="jump-error", classes="dialog-error")

    def on_mount(self) -> None:
        self.set_focus(self.query_one("#jump-input", Input))

    def on_key(self, event: events.Key) -> None:
        """Keys typed right after "g" reach the screen before its input has
        the focus: they are text for the input all the same."""
        box = self.query_one("#jump-input", Input)
        if not box.has_focus and event.is_printable and event.character:
            event.stop()
            event.prevent_default()
            box.insert_text_at_cursor(event.character)
            self.set_focus(box)

    def starting(self, text: str) -> list[str]:
        low = text.lower()
        return [k for k, lk in zip(self.keys, self.lower, strict=True) if lk.startswith(low)]

    @on(Input.Changed, "#jump-input")
    def changed(self, event: Input.Changed) -> None:
        self.query_one("#jump-error", Label).update("")
        text = event.value.strip()
        box = self.query_one("#jump-candidates", Static)
        if not text:
            box.update("")
            return
        low = text.lower()
        found = list(islice((k for k, lk in zip(self.keys, self.lower, strict=True)
                             if lk.startswith(low)), self.SHOWN + 1))
        how = "start with it"
        if not found:
            found = list(islice((k for k, lk in zip(self.keys, self.lower, strict=True)
                                 if low in lk), self.SHOWN + 1))
            how = "contain it"
        if not found:
            box.update(Text(f"no key contains {shown(repr(text))}", style="italic"))
            return
        more = " (and more)" if len(found) > self.SHOWN else ""
        lines = Text(f"keys that {how}{more}:\n", style="italic")
        lines.append("\n".join(f"  {shown(k)}" for k in found[: self.SHOWN]))
        box.update(lines)

    def action_complete(self) -> None:
        box = self.query_one("#jump-input", Input)
        matches = self.starting(box.value)
        if not matches:
            self.app.bell()
            return
        lows = [m.lower() for m in matches]
        first, last = min(lows), max(lows)  # the others share what these two share
        common = next((i for i, (a, b) in enumerate(zip(first, last, strict=False)) if a != b),
                      min(len(first), len(last)))
        box.value = matches[0][:common] if common > len(box.value) else matches[0]
        box.cursor_position = len(box.value)

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
        found = next((k for k, lk in zip(self.keys, self.lower, strict=True) if low in lk), None)
        if found is None:
            self.query_one("#jump-error", Label).update(
                Text(f"no key contains {shown(repr(text))}"))
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
            yield Static(Text(shown(self.question)), id="confirm-question")
            yield Button("Write (y)", variant="warning", id="yes")
            yield Button("Cancel (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    @on(Button.Pressed)
    def pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)
