"""Human output of ``ckptool diagnose`` (rich): the target machine, what a
plain ``torch.load`` does there, the device plan, the key comparison, the
findings with their fixes, and the one command that fixes everything.

Imported only when text is printed.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from ckptool.check import manyfiles
from ckptool.check.diagnosis import (
    ERROR,
    WARNING,
    Diagnosis,
    describe_keys,
    library_rows,
    no_problems,
)
from ckptool.check.finding import INFO
from ckptool.check.findings import Finding
from ckptool.check.gpus.machine import describe_target
from ckptool.check.loadcheck import describe_landing
from ckptool.describe import framework_line, human_bytes, own_prefix_text, plural

_STYLE = {ERROR: "bold red", WARNING: "yellow", INFO: "cyan"}


def render_diagnose(console: Console, d: Diagnosis) -> None:
    ckpt, machine = d.checkpoint, d.machine
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    if ckpt.is_multifile:
        grid.add_row("checkpoint", f"{ckpt.path} · {ckpt.format} · "
                     f"{plural(len(ckpt.files), 'file')} · {human_bytes(ckpt.file_size)}")
    else:
        grid.add_row("file", f"{ckpt.path} · {ckpt.format} · {human_bytes(ckpt.file_size)}")
    grid.add_row("target", describe_target(machine))
    errors = d.load_errors()
    grid.add_row(manyfiles.load_label(ckpt),
                 Text(manyfiles.fails_prefix(ckpt) + errors[0], style="red") if errors
                 else Text(manyfiles.loads_text(ckpt), style="green"))
    for more in errors[1:]:
        grid.add_row("", Text("and: " + more, style="red"))
    sd = ckpt.main_state_dict
    if sd is not None:
        where = manyfiles.state_dict_place(ckpt)
        prefix = f" · prefix {sd.prefix!r}" if sd.prefix and sd.prefix != manyfiles.entry_prefix(
            ckpt) else ""
        fw = ckpt.framework
        if fw is not None and fw.own_prefix and sd.prefix.endswith(fw.own_prefix):
            prefix += f" ({own_prefix_text(fw)})"
        grid.add_row("state dict", f"{where} · {plural(sd.num_tensors, 'tensor')}{prefix}")
    if ckpt.framework is not None:
        grid.add_row("folder", framework_line(ckpt.framework))
    keys = describe_keys(d)
    if keys is not None:
        grid.add_row("keys", keys)
    for label, line in library_rows(d):
        grid.add_row(label, line)
    console.print(grid)
    _devices(console, d)
    console.print()
    for note in d.notes:  # what is no problem, said before what is
        render_finding(console, note)
    if not d.findings:
        console.print(Text(no_problems(d), style="green"))
        return
    for f in d.findings:
        render_finding(console, f)
    if d.fix_command or d.fix_refused:
        console.print()
        render_fix_command(console, d, d.remaining)


def render_finding(console: Console, f: Finding) -> None:
    """One finding: severity and code, its message, its fix (diagnose and explain)."""
    head = Text(f"{f.severity:<8}", style=_STYLE.get(f.severity, ""))
    head.append(f.code, style="bold")
    console.print(head)
    console.print(Padding(Text(f.message), (0, 0, 0, 8)))
    # commands on one line, wider than the terminal or not: a copied
    # first line must be the whole command
    if f.fix:
        console.print(Text(f"        fix: {f.fix}", style="dim"), soft_wrap=True)
    if f.snippet:
        console.print(Text(f"        {'or:  ' if f.fix else 'try: '}{f.snippet}",
                           style="dim"), soft_wrap=True)


def render_fix_command(console: Console, d: Diagnosis, remaining: Sequence[str]) -> bool:
    """The one fix command, or why there is none; False when neither is said."""
    if d.fix_command:
        console.print(f"fix everything fixable at once (writes {d.fix_output}):")
        console.print(Text(f"  {d.fix_command}", style="bold"), soft_wrap=True)
        if remaining:
            console.print(Text(f"still to resolve by hand: {', '.join(remaining)}",
                               style="yellow"))
    elif d.fix_refused:
        console.print(Text(f"no ckptool fix command: {d.fix_refused}", style="yellow"))
    else:
        return False
    return True


def _devices(console: Console, d: Diagnosis) -> None:
    if not d.tags or not manyfiles.records_devices(d.checkpoint):
        return  # DCP: the load row says it records none
    table = Table(box=None, padding=(0, 2), show_edge=False)
    table.add_column("saved on", style="bold")
    table.add_column("tensors", justify="right")
    table.add_column("bytes", justify="right")
    table.add_column(manyfiles.landing_header(d.checkpoint))
    for t in d.tags:
        lands = (Text("fails", style="red") if t.error
                 else Text(describe_landing(d.machine, t)))
        table.add_row(t.location, str(t.tensors), human_bytes(t.nbytes), lands)
    console.print()
    console.print(table)
