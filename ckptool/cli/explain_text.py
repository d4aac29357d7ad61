"""Human output of ``ckptool explain`` (rich): the error it explains, the
checkpoint and target it was checked on, what the error means with its
fixes, what else the checkpoint has, and the one command that fixes it.

Imported only when text is printed.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ckptool.check.explain.findings import PLACEHOLDER
from ckptool.check.explain.run import Explanation
from ckptool.check.gpus.machine import describe_target
from ckptool.cli.diagnose_text import render_finding, render_fix_command
from ckptool.describe import human_bytes, plural, shell_word

_LONGEST = 200  # characters of the error line shown


def render_explain(console: Console, exp: Explanation, checkpoint: str | None) -> None:
    if exp.error is None:
        console.print("no checkpoint, key or GPU error recognised in the text: paste the whole "
                      "traceback, from 'Traceback (most recent call last):' to its last line, "
                      "or name the log with --file"
                      + (f"; `ckptool diagnose {shell_word(checkpoint)}` checks the checkpoint "
                         "itself" if checkpoint else ""))
        return
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    line = exp.error.line
    if len(line) > _LONGEST:  # a joined log's line can hold every key: cut at a word
        cut = line.rfind(" ", _LONGEST // 2, _LONGEST)
        line = line[:cut if cut > 0 else _LONGEST] + " …"
    grid.add_row("error", line)
    if len(exp.errors) > 1:
        grid.add_row("", f"(the last of {plural(len(exp.errors), 'error')} in the text)")
    d = exp.diagnosis
    if d is not None:
        ckpt = d.checkpoint
        grid.add_row("file", f"{ckpt.path} · {ckpt.format} · {human_bytes(ckpt.file_size)}")
        grid.add_row("target", describe_target(d.machine))
        if exp.against:
            grid.add_row("keys", f"compared with {exp.against}")
    console.print(grid)
    console.print()
    if not exp.findings:  # findings_for always says something; never print nothing here
        console.print(f"recognised as {exp.error.kind}, but the text does not say enough to "
                      "explain it: paste the whole message, with the traceback above it")
    for f in exp.findings:
        render_finding(console, f)
    if exp.also:
        console.print()
        console.print("the checkpoint also has:")
        for f in exp.also:
            render_finding(console, f)
    for note in exp.notes:
        console.print(Text(note, style="yellow"))
    _footer(console, exp)


def _footer(console: Console, exp: Explanation) -> None:
    """The one command, or what stands in for it."""
    d = exp.diagnosis
    if d is None:
        if any(f.fix and PLACEHOLDER in f.fix.split() for f in exp.findings):
            console.print()
            console.print(f"{PLACEHOLDER} stands for the checkpoint: give --checkpoint "
                          f"{PLACEHOLDER} for the one command that fixes it")
        return
    console.print()
    if render_fix_command(console, d, exp.remaining):
        return
    if any(f.fix for f in exp.findings):
        console.print("the checkpoint needs no ckptool fix for this error: the fixes above are "
                      "changes to the code or the environment")
    else:
        console.print("no ckptool fix command repairs this checkpoint")


