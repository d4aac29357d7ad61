"""Human output of ``ckptool fix`` and ``ckptool convert`` (rich): what was
written (or, for a dry run, would be), what changed, and what could not be
carried over.

Imported only when text is printed.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ckptool.describe import human_bytes, plural
from ckptool.write.convert.run import ConvertResult
from ckptool.write.fix.run import FixResult


def render_fix(console: Console, result: FixResult, shown: int = 20) -> None:
    """What ``ckptool fix`` did (or, for a dry run, would do)."""
    plan = result.plan
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    kept = result.output == result.source.path and not result.bytes_written  # in place, as is
    if result.output is None:
        grid.add_row("plan", f"{result.source.path} (dry run: nothing written)")
    elif kept:
        grid.add_row("kept", f"{result.output} as it is: nothing written")
    elif result.metadata_only:
        grid.add_row("rewrote", f"{result.output} in place · metadata only: "
                     f"{human_bytes(result.bytes_written)} appended, tensor bytes untouched")
    else:
        grid.add_row("wrote", f"{result.output} · {result.source.format} · "
                     f"{human_bytes(result.bytes_written)} · "
                     f"{plural(result.verified_storages, 'storage')} verified")
    if plan.extracted is not None:
        grid.add_row("extract", f"kept only '{plan.extracted or '(root)'}'")
    for path in plan.dropped:
        grid.add_row("drop", path)
    if plan.renames:
        grid.add_row("keys", f"{len(plan.renames)} renamed")
        for old, new in plan.renames[:shown]:
            grid.add_row("", f"{old} → {new}")
        if len(plan.renames) > shown:
            grid.add_row("", f"… {len(plan.renames) - shown} more (--json lists all)")
    devices, casts = result.moves()
    for move in devices:
        grid.add_row("devices",
                     f"{plural(move['storages'], 'storage')} {move['from']} → {move['to']}")
    for cast in casts:
        grid.add_row("dtype",
                     f"{plural(cast['storages'], 'storage')} {cast['from']} → {cast['to']}")
    for note in plan.notes:
        grid.add_row("note", Text(note, style="yellow"))
    if plan.empty and not kept:
        grid.add_row("", Text("nothing to change: the output is a verified copy", style="dim"))
    if result.output is None:
        grid.add_row("output", f"would write {result.target}")
    console.print(grid)


LEFT_OUT_SHOWN = 6


def render_convert(console: Console, result: ConvertResult) -> None:
    """What ``ckptool convert`` wrote, and what it could not carry over."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    fmt = result.output_format
    files = f" · {plural(len(result.files), 'file')}" if result.files else ""
    grid.add_row("wrote", f"{result.output} · {fmt}{files} · "
                 f"{human_bytes(result.bytes_written)} · "
                 f"{plural(result.tensors, 'tensor')} verified")
    if result.distributed is not None:
        grid.add_row("ranks", _ranks_line(result.distributed))
    if result.aliases:
        pairs = ", ".join(f"{a} = {k}" for a, k in list(result.aliases.items())[:6])
        where = {"safetensors": "kept in __metadata__", "torch-zip": "restored as shared",
                 "hf-bin": "restored as shared", "dcp": "written as copies",
                 "hf-safetensors": "recorded in the index's metadata"
                 if len(result.files) > 1 else "recorded in __metadata__"}[fmt]
        grid.add_row("tied", f"{pairs} ({where})")
    if result.copied_views:
        grid.add_row("copied", f"{', '.join(result.copied_views[:6])} (views of shared "
                     "storage, written as their own tensors)")
    if result.kept_entries:
        where = "in __metadata__ 'ckptool.entries'" if fmt == "safetensors" else "as values"
        more = " …" if len(result.kept_entries) > 4 else ""
        grid.add_row("kept", f"{plural(len(result.kept_entries), 'value')} ({where}): "
                     f"{', '.join(result.kept_entries[:4])}{more}")
    shown = result.left_out if len(result.left_out) <= LEFT_OUT_SHOWN else \
        [*result.left_out[:LEFT_OUT_SHOWN - 1],
         f"… and {len(result.left_out) - LEFT_OUT_SHOWN + 1} more (--json lists them all)"]
    for item in shown:
        grid.add_row("left out", Text(item, style="yellow"))
    for note in result.notes:
        grid.add_row("note", Text(note, style="yellow"))
    console.print(grid)


def _ranks_line(report: dict[str, Any]) -> str:
    """Who wrote a distributed convert's output, and how evenly."""
    per_rank = report["per_rank"]
    nodes = len({r["node"] for r in per_rank})
    busy = [r["bytes_written"] + r["bytes_kept"] for r in per_rank if r["tensors"]]
    slowest = max(per_rank, key=lambda r: r["seconds"])
    least, most = (human_bytes(min(busy)), human_bytes(max(busy))) if busy else ("0 B", "0 B")
    line = f"{plural(report['ranks'], 'process', 'processes')} on {plural(nodes, 'machine')}"
    if len(per_rank) == 1:
        line += f", {most}; took {slowest['seconds']:.1f} s"
    else:
        line += f", {most} each" if least == most else f", {least} to {most} each"
        if len(busy) < len(per_rank):
            line += f" ({len(per_rank) - len(busy)} with no tensor)"
        line += f"; the slowest, rank {slowest['rank']}, took {slowest['seconds']:.1f} s"
    kept = sum(r["bytes_kept"] for r in per_rank)
    if report["resumed"]:
        line += (f"; {human_bytes(kept)} kept from an earlier run, verified again" if kept
                 else "; an earlier run resumed, none of its bytes kept")
    return line
