"""The browser's findings pane: what ``ckptool diagnose`` reports
(``ckptool.cli.diagnose_text``), as rich ``Text`` for a narrow pane.

Most telling first, since the pane is small: how the keys compare with the
model (given ``--model`` or ``--reference``), each finding with its fix and
its Python alternative, the one command that fixes everything and what it
leaves to resolve by hand; then the machine it was judged for, what a plain
``torch.load`` does there, and where each saved device lands.
"""

from __future__ import annotations

from rich.text import Text

from ckptool.check import manyfiles
from ckptool.check.diagnosis import ERROR, Diagnosis, describe_keys, library_rows, no_problems
from ckptool.check.gpus.machine import describe_target
from ckptool.check.loadcheck import describe_landing
from ckptool.describe import human_bytes, shown

_LABEL = 11  # width of the labels of the last section


def findings(diag: Diagnosis | None, error: str | None = None) -> Text:
    text = Text()
    if error is not None:
        text.append("\n".join(shown(line) for line in error.split("\n")), style="bold red")
        return text
    if diag is None:
        text.append("diagnosing…", style="italic")
        return text
    _keys(text, diag)
    for label, line in library_rows(diag):
        text.append(f"{label} ", style="bold")
        text.append(shown(line) + "\n\n")
    for note in diag.notes:  # no problem: said before what is
        text.append(f"i {note.code}", style="bold blue")
        text.append(f"  {shown(note.message)}\n")
        if note.snippet:
            text.append("  try: ", style="bold")
            text.append(shown(note.snippet) + "\n", style="cyan")
    if not diag.findings:
        text.append("✓ no findings: ", style="bold green")
        text.append(no_problems(diag).removeprefix("no problems found: ") + "\n")
    for f in diag.findings:
        mark, style = ("✗", "bold red") if f.severity == ERROR else ("!", "bold yellow")
        text.append(f"{mark} {f.code}", style=style)
        text.append(f"  {shown(f.message)}\n")
        if f.fix:
            text.append("  fix: ", style="bold")
            text.append(shown(f.fix) + "\n", style="cyan")
        if f.snippet:
            text.append("  or:  " if f.fix else "  try: ", style="bold")
            text.append(shown(f.snippet) + "\n", style="cyan")
    if diag.fix_command:
        text.append("\nfix everything: ", style="bold")
        text.append(shown(diag.fix_command), style="bold cyan")
        if diag.fix_output:
            text.append(f"\n  writes {shown(diag.fix_output)}; press x to preview it and write "
                        "it from here", style="italic")
        if diag.remaining:
            text.append("\nstill to resolve by hand: ", style="bold yellow")
            text.append(", ".join(diag.remaining), style="yellow")
        text.append("\n")
    elif diag.fix_refused:
        text.append(f"\nno ckptool fix command: {shown(diag.fix_refused)}\n", style="yellow")
    _machine(text, diag)
    return text


def _keys(text: Text, d: Diagnosis) -> None:
    """The key comparison with the model, as ``diagnose`` sums it up."""
    line = describe_keys(d)
    if line is None:
        return
    text.append("keys ", style="bold")
    text.append(shown(line) + "\n\n")


def _row(text: Text, label: str, value: str | Text) -> None:
    text.append(f"{label:<{_LABEL}}", style="bold")
    text.append_text(value if isinstance(value, Text) else Text(value))
    text.append("\n")


def _machine(text: Text, d: Diagnosis) -> None:
    """The target machine, what plain torch.load does there, and per device."""
    text.append("\n")
    _row(text, "target", describe_target(d.machine))
    errors = d.load_errors()
    ckpt = d.checkpoint
    _row(text, manyfiles.load_label(ckpt),
         Text(manyfiles.fails_prefix(ckpt) + shown(errors[0]), style="red") if errors
         else Text(manyfiles.loads_text(ckpt), style="green"))
    for more in errors[1:]:
        _row(text, "", Text("and: " + shown(more), style="red"))
    if not manyfiles.records_devices(ckpt):
        return  # DCP: the row above says it records none
    for i, t in enumerate(d.tags):
        if t.error:
            lands = Text("torch.load fails here", style="red")
        else:
            where = describe_landing(d.machine, t)
            lands = Text("-" if where == "-" else f"lands on {shown(where)}")
        line = Text(f"{shown(t.location)}: {t.tensors:,} tensor{'s' if t.tensors != 1 else ''} · "
                    f"{human_bytes(t.nbytes)} · ")
        line.append_text(lands)
        _row(text, "" if i else "saved on", line)
