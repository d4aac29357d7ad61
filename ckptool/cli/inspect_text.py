"""Human output of ``ckptool inspect`` (rich): a summary and a tensor table,
or tensors grouped by prefix.

Imported only when text is printed; it owns every colour and column choice.
Rich honours ``NO_COLOR`` and the terminal width by itself.
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ckptool.cli.common import fold_key, key_width
from ckptool.describe import human_bytes, human_count, parameters_text, plural, tensor_shape
from ckptool.describe import shown as shown_text
from ckptool.keys import pieces
from ckptool.model import NO_LOCATION, Checkpoint, TensorInfo


def _tally_line(tally: dict[str, int], counts: dict[str, int] | None = None) -> str:
    parts = []
    for name, nbytes in tally.items():
        extra = f" ({plural(counts[name], 'tensor')})" if counts and name in counts else ""
        parts.append(f"{name} {human_bytes(nbytes)}{extra}")
    return " · ".join(parts) or "none"


def render_summary(console: Console, ckpt: Checkpoint) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    root = ckpt.metadata.get("archive_root")
    fmt = ckpt.format + (f" (archive root '{root}')" if root else "")
    grid.add_row("file", f"{ckpt.path} · {human_bytes(ckpt.file_size)}")
    grid.add_row("format", fmt)
    grid.add_row("tensors", f"{len(ckpt.tensors)} in {plural(len(ckpt.storages), 'storage')} · "
                 f"{human_bytes(ckpt.total_bytes)}")
    sd = ckpt.main_state_dict
    if sd is None:
        grid.add_row("state dict", Text("none found", style="yellow"))
    else:
        where = f"'{sd.path}'" if sd.path else "the whole file"
        if sd.kind == "module":
            where += (", a TorchScript module" if ckpt.format == "torchscript"
                      else ", a pickled nn.Module")
        prefix = f" · prefix '{sd.prefix}'" if sd.prefix else ""
        grid.add_row("state dict", f"{where}{prefix} · {plural(sd.num_tensors, 'tensor')}")
        grid.add_row("parameters", parameters_text(sd))
    grid.add_row("by dtype", _tally_line(ckpt.bytes_by_dtype))
    by_loc = _tally_line(ckpt.bytes_by_location, ckpt.tensors_by_location)
    if set(ckpt.bytes_by_location) == {NO_LOCATION}:
        by_loc = "not recorded by this format (loads where you ask)"
    grid.add_row("by device", by_loc)
    for i, entry in enumerate(ckpt.entries[:12]):
        grid.add_row("entries" if i == 0 else "", f"{entry.key or '(root)'} = {entry.summary}")
    if len(ckpt.entries) > 12:
        grid.add_row("", f"… {len(ckpt.entries) - 12} more (see --json)")
    unsafe = ckpt.unsafe_globals
    if unsafe:
        grid.add_row(Text("UNSAFE", style="bold red"), Text(
            f"{', '.join(unsafe)}: torch.load(weights_only=False) would call "
            f"{'these' if len(unsafe) > 1 else 'this'}; do not load it with torch",
            style="red"))
        for g in ckpt.globals:  # where what loading does with it makes it unsafe
            if g.category == "unsafe" and g.reason.startswith("calls"):
                grid.add_row("", Text(g.reason, style="red"))
    custom = [g for g in ckpt.globals if g.category == "custom"]
    if custom:
        names = ", ".join(g.name for g in custom[:6]) + (
            f", … +{len(custom) - 6}" if len(custom) > 6 else "")
        runs = ", and runs their code" if any(g.uses for g in custom) else ""
        grid.add_row("classes", Text(f"{names} (torch imports these to load the file{runs})",
                                     style="yellow"))
    for warning in ckpt.warnings:
        grid.add_row(Text("warning", style="yellow"), Text(warning, style="yellow"))
    if not unsafe and not custom:
        grid.add_row("globals", Text("only tensor and plain-data types", style="green"))
    console.print(grid)


def sharing_labels(tensors: Iterable[TensorInfo]) -> dict[str, str]:
    """'#1', '#2'... for storages viewed by more than one tensor, in key order.

    Storage ids are file-internal (legacy files use pointer values), so the
    table numbers the shared groups instead of printing ids."""
    counts: dict[str, int] = {}
    for t in tensors:
        if t.storage is not None:
            counts[t.storage] = counts.get(t.storage, 0) + 1
    labels: dict[str, str] = {}
    for sid, n in counts.items():
        if n > 1:
            labels[sid] = f"#{len(labels) + 1}"
    return labels


def render_tensors(console: Console, tensors: Iterable[TensorInfo], limit: int) -> None:
    rows = list(tensors)
    labels = sharing_labels(rows)
    shown = rows if limit <= 0 else rows[:limit]
    cells = []
    for t in shown:
        shares = labels.get(t.storage or "", "")
        if shares and t.storage_offset:
            shares += f" @{t.storage_offset}"
        cells.append([tensor_shape(t), shown_text(t.dtype), shown_text(t.location or "-"),
                      human_bytes(t.nbytes), shares])
    headers = ["shape", "dtype", "device", "size", "shares"]
    width = key_width(console, cells, headers)
    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    table.add_column("key", no_wrap=True)
    for header in headers:
        table.add_column(header, no_wrap=True, justify="right" if header == "size" else "left")
    for t, row in zip(shown, cells, strict=True):
        table.add_row(Text(fold_key(shown_text(t.key), width)), *row)
    console.print(table)
    if len(shown) < len(rows):
        console.print(f"… {len(rows) - len(shown)} more tensors "
                      "(--limit 0 shows all; --filter or --depth narrows)", style="dim")


def render_groups(console: Console, tensors: Iterable[TensorInfo], depth: int,
                  limit: int) -> None:
    groups: dict[str, list[TensorInfo]] = {}
    for t in tensors:
        # the first ``depth`` parts (split on / and ., never on an escaped /)
        parts = pieces(t.key, dots=True)
        name = t.key[: sum(map(len, parts[:depth])) + depth - 1] if len(parts) > depth else t.key
        groups.setdefault(name, []).append(t)
    names = list(groups)
    shown = names if limit <= 0 else names[:limit]
    cells = [[str(len(groups[name])), human_count(sum(t.numel for t in groups[name])),
              human_bytes(sum(t.nbytes for t in groups[name])),
              shown_text(",".join(sorted({t.dtype for t in groups[name]}))),
              shown_text(",".join(sorted({t.location or "-" for t in groups[name]})))]
             for name in shown]
    headers = ["tensors", "elements", "size", "dtypes", "devices"]
    width = key_width(console, cells, headers)
    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    table.add_column("prefix", no_wrap=True)
    for header in headers:
        table.add_column(header, no_wrap=True,
                         justify="left" if header in ("dtypes", "devices") else "right")
    for name, row in zip(shown, cells, strict=True):
        table.add_row(Text(fold_key(shown_text(name), width)), *row)
    console.print(table)
    if len(shown) < len(names):
        console.print(f"… {len(names) - len(shown)} more groups "
                      "(--limit 0 shows all; --filter narrows)", style="dim")


def render_inspect(console: Console, ckpt: Checkpoint, tensors: list[TensorInfo],
                   pattern: str | None, depth: int | None, limit: int) -> None:
    """The summary, then ``tensors`` (those matching ``pattern``) as a table,
    or grouped by their first ``depth`` key components."""
    render_summary(console, ckpt)
    if not tensors:
        console.print()
        console.print("no tensors" + (f" match '{pattern}'" if pattern else ""), style="yellow")
        return
    console.print()
    if depth:
        render_groups(console, tensors, depth, limit)
    else:
        render_tensors(console, tensors, limit)
