"""Human output of ``ckptool diff``: what was compared, a summary line, and
a table of the differences (rich).

Imported only when text is printed. Rich honours ``NO_COLOR`` and the
terminal width.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ckptool.check.diff import ALL, Change, DiffReport, Side
from ckptool.check.tensor_compare import EQUAL, NOT_COMPARED
from ckptool.cli.common import fold_key, key_width
from ckptool.describe import shown as shown_text
from ckptool.describe import tensor_shape
from ckptool.model import TensorInfo


def _what(side: Side, mode: str) -> str:
    if mode == ALL:
        return f"{side.path} · all tensors"
    if side.state_dict:
        scope = f"state dict '{side.state_dict}'"
    elif side.entry:  # DCP: its keys carry the entry's name ("model.")
        scope = f"state dict: the '{side.entry}' entry"
    else:
        scope = f"state dict: the whole {'checkpoint' if side.directory else 'file'}"
    prefix = f", prefix '{side.prefix}'" if side.prefix else ""
    return f"{side.path} · {scope}{prefix}"


def _matched(report: DiffReport) -> str:
    noun = "keys" if report.mode == ALL else "names"
    stripped = [f"'{s.prefix}' ({label})" for s, label in ((report.a, "A"), (report.b, "B"))
                if s.prefix]
    how = f" after taking off {' and '.join(stripped)}" if stripped else ""
    values = "values compared" if report.values_compared else "values not read (--no-values)"
    if report.values_by_digest:
        values = "values compared by manifest digests"
    return f"{report.num_matched} {noun}{how} · {values}"


def render_summary(console: Console, report: DiffReport) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    grid.add_row("A", _what(report.a, report.mode))
    grid.add_row("B", _what(report.b, report.mode))
    grid.add_row("matched", _matched(report))
    counts = (f"{len(report.changed)} changed · {report.num_identical} identical · "
              f"{len(report.only_in_a)} only in A · {len(report.only_in_b)} only in B")
    if report.has_differences:
        grid.add_row("result", Text(f"differences: {counts}", style="yellow"))
    else:
        grid.add_row("result", Text(f"no differences: {counts}", style="green"))
    if report.not_compared:
        name, reason = report.not_compared[0]
        more = f" (and {len(report.not_compared) - 1} more)" if len(report.not_compared) > 1 else ""
        grid.add_row("unread", Text(f"values of {name}{more} not compared: {reason}",
                                    style="yellow"))
    for i, note in enumerate(report.notes):
        grid.add_row("" if i else "paired", note)
    for i, note in enumerate(report.manifest_notes):
        grid.add_row("" if i else "manifests", note)
    console.print(grid)


def _brief(t: TensorInfo) -> str:
    return f"{tensor_shape(t)} {t.dtype}"


def _changed(t: TensorInfo, changes: tuple[str, ...]) -> str:
    shown = {"shape": tensor_shape(t), "dtype": t.dtype,
             "location": t.location or "-", "layout": t.layout}
    return " ".join(shown[c] for c in changes if c in shown)


def _values_cells(c: Change, report: DiffReport) -> tuple[str, str]:
    """(values, max |Δ|) cells of a changed row."""
    v = c.values
    if v is None:
        return ("" if "shape" in c.changes or report.values_compared else "not read"), ""
    if v.status == EQUAL:
        return "equal", ""
    if v.status == NOT_COMPARED:
        return "not compared", ""
    if v.num_different is None:  # told by digests: how many is not known
        return "differ (digest)", ""
    text = f"{v.num_different}/{v.numel} differ"
    if v.nan_mismatch:
        text += f" ({v.nan_mismatch} NaN vs number)"
    top = "" if v.max_abs_diff is None else f"{v.max_abs_diff:.3g}"
    return text, top


def render_table(console: Console, report: DiffReport, limit: int) -> None:
    rows: list[tuple[str, ...]] = []
    for c in report.changed:
        # the change column names metadata changes; the values columns tell the rest
        meta = [x for x in c.changes if x != "values"] or ["values"]
        rows.append((c.name, ", ".join(meta), _changed(c.a, c.changes),
                     _changed(c.b, c.changes), *_values_cells(c, report)))
    rows += [(n, "only in A", _brief(t), "-", "", "") for n, t in report.only_in_a]
    rows += [(n, "only in B", "-", _brief(t), "", "") for n, t in report.only_in_b]
    shown = rows if limit <= 0 else rows[:limit]
    headers = ["change", "A", "B", "values", "max |Δ|"]
    # the other columns are short words: the names fold at their dots
    width = key_width(console, [[shown_text(c) for c in row[1:]] for row in shown], headers)
    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    table.add_column("name", no_wrap=True)
    for title in headers[:-1]:
        table.add_column(title, overflow="fold", no_wrap=title in ("change", "values"))
    table.add_column("max |Δ|", justify="right", no_wrap=True)
    for name, *cells in shown:
        table.add_row(Text(fold_key(shown_text(name), width)), *cells)
    console.print(table)
    if len(shown) < len(rows):
        console.print(f"… {len(rows) - len(shown)} more differences (--limit 0 shows all; "
                      "--json lists every one)", style="dim")


def render_diff(console: Console, report: DiffReport, limit: int) -> None:
    render_summary(console, report)
    if report.has_differences:
        console.print()
        render_table(console, report, limit)
