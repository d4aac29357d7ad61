"""Human output of ``ckptool inspect`` (rich): a summary and a tensor table,
or tensors grouped by prefix.

Imported only when text is printed; it owns every colour and column choice.
Rich honours ``NO_COLOR`` and the terminal width by itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ckptool.cli.common import fold_key, key_width
from ckptool.cli.inspect_format import many_files_format, megatron_line
from ckptool.describe import (
    framework_line,
    human_bytes,
    human_count,
    own_prefix_text,
    parameters_text,
    plural,
    shell_word,
    tensor_shape,
)
from ckptool.describe import shown as shown_text
from ckptool.keys import pieces
from ckptool.model import NO_LOCATION, Checkpoint, Companion, Framework, TensorInfo
from ckptool.read import optim

if TYPE_CHECKING:
    from ckptool.read.layouts import contents


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
    if ckpt.is_multifile:
        fmt = many_files_format(ckpt)
    grid.add_row("format", fmt)
    for i, line in enumerate(files_lines(ckpt)):
        grid.add_row("files" if i == 0 else "", line)
    if ckpt.metadata.get("megatron"):
        grid.add_row("megatron", megatron_line(ckpt.metadata["megatron"]))
    if ckpt.metadata.get("nemo"):
        grid.add_row("nemo", str(ckpt.metadata["nemo"].get("description")))
    fw = ckpt.framework
    if fw is not None:
        grid.add_row("folder", framework_line(fw))
        if fw.adapter:
            grid.add_row("adapter", adapter_line(fw.adapter))
        for i, line in enumerate(adapters_lines(fw)):
            grid.add_row("adapters" if i == 0 else "", line)
    grid.add_row("tensors", f"{len(ckpt.tensors):,} in {plural(len(ckpt.storages), 'storage')} · "
                 f"{human_bytes(ckpt.total_bytes)}")
    sd = ckpt.main_state_dict
    optimizers = ckpt.metadata.get("optimizer_states") or []
    if sd is None:
        grid.add_row("state dict", Text(
            "none: the file is an optimizer's state, not a model's weights" if optimizers
            else "none found", style="yellow"))
    else:
        where = f"'{sd.path}'" if sd.path else "the whole file"
        if ckpt.is_multifile and not sd.path:
            entry = ckpt.metadata.get("state_dict_entry")
            where = f"the '{entry}' entry" if entry else "the whole checkpoint"
        if ckpt.format == "deepspeed" and not sd.path:
            where = ("the module's weights (ZeRO 0 keeps no partitions)"
                     if ckpt.metadata.get("zero_stage") == 0 else
                     "the fp32 master weights, consolidated from the ranks' partitions")
        if sd.kind == "module":
            where += (", a TorchScript module" if ckpt.format == "torchscript"
                      else ", a pickled nn.Module")
        prefix = f" · prefix '{sd.prefix}'" if sd.prefix else ""
        if fw is not None and fw.own_prefix and sd.prefix.endswith(fw.own_prefix):
            prefix += f" ({own_prefix_text(fw)})"
        grid.add_row("state dict", f"{where}{prefix} · {plural(sd.num_tensors, 'tensor')}")
        grid.add_row("parameters", parameters_text(sd))
    for i, state in enumerate(optimizers):
        grid.add_row("optimizer" if i == 0 else "", optimizer_line(state))
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
        for g in ckpt.globals:  # what loading does with it, and where
            if g.category == "unsafe" and g.reason:
                grid.add_row("", Text(f"{g.name}: {g.reason}", style="red"))
    custom = [g for g in ckpt.globals if g.category == "custom"]
    if custom:
        names = ", ".join(g.name for g in custom[:6]) + (
            f", … +{len(custom) - 6}" if len(custom) > 6 else "")
        runs = ", and runs their code" if any(g.uses for g in custom) else ""
        grid.add_row("classes", Text(f"{names} (torch imports these to load the file{runs})",
                                     style="yellow"))
    if fw is not None:
        from ckptool.read.layouts import contents  # (a framework folder's only)

        for i, c in enumerate(fw.companions):
            grid.add_row("beside" if i == 0 else "", companion_text(c))
        for i, sub in enumerate(contents.subfolders(fw.directory)):
            grid.add_row("folders" if i == 0 else "", subfolder_text(sub))
        for i, line in enumerate(contents.code_lines(contents.remote_code(fw.directory))):
            grid.add_row(Text("code", style="yellow") if i == 0 else "",
                         Text(line, style="yellow"))
    for warning in ckpt.warnings:
        grid.add_row(Text("warning", style="yellow"), Text(warning, style="yellow"))
    for note in ckpt.metadata.get("notes", ()):
        grid.add_row("note", note)
    if not unsafe and not custom:
        grid.add_row("globals", Text("only tensor and plain-data types", style="green"))
    console.print(grid)


FILES_SHOWN = 6


def adapters_lines(fw: Framework) -> list[str]:
    """Every adapter of a PEFT folder holding more than one, and how each loads."""
    if len(fw.adapters) < 2:
        return []
    lines = [" · ".join([a["name"], a["peft_type"] + (f" r {a['r']}" if a.get("r") else ""),
                         a["path"]]) for a in fw.adapters]
    other = next(a["name"] for a in fw.adapters if a["name"] != "default")
    folder = shell_word(fw.directory)
    return [*lines, f"PeftModel.from_pretrained(base, {folder}) loads default; each other "
            f"one: peft_model.load_adapter({folder}/{other}, adapter_name={other!r})"]


def adapter_line(adapter: dict[str, Any]) -> str:
    """``LORA · r 4 · alpha 8 · targets q_proj, v_proj · base model tiny-llama``."""
    said = [str(adapter.get("peft_type", "?"))]
    for key, name in (("r", "r"), ("lora_alpha", "alpha")):
        if key in adapter:
            said.append(f"{name} {adapter[key]}")
    targets = adapter.get("target_modules")
    if targets:
        said.append("targets " + (", ".join(targets) if isinstance(targets, list)
                                  else str(targets)))
    said.append(f"base model {adapter.get('base_model') or 'not named'}")
    return " · ".join(said)


def optimizer_line(state: dict[str, Any]) -> str:
    """One optimizer state: ``'optimizer' · Adam/AdamW: exp_avg, exp_avg_sq,
    step for 9 parameters, 1 param group``."""
    where = f"'{state['path']}'" if state["path"] else "the whole file"
    return f"{where} · {optim.summary(optim.OptimizerState.from_dict(state))}"


def companion_text(c: Companion) -> Text:
    """A file beside the model: its role, and what reading it found."""
    said = [c.path, human_bytes(c.size), c.role]
    if c.detail:
        said.append(c.detail)
    text = Text(" · ".join(said))
    if c.error:
        text.append(f" · unreadable: {c.error}", style="yellow")
    elif c.unsafe:
        text.append(f" · UNSAFE: {', '.join(c.unsafe)} (torch.load(weights_only=False) "
                    "would call them)", style="bold red")
    elif c.custom:
        text.append(f" · classes {', '.join(c.custom[:3])}"
                    f"{' …' if len(c.custom) > 3 else ''} (loading imports and runs them)",
                    style="yellow")
    return text


def subfolder_text(sub: contents.Subfolder) -> str:
    """A folder inside the framework folder: its files, their size, what it is."""
    count = f"{'more than ' if sub.more else ''}{plural(len(sub.files), 'file')}"
    return f"{sub.name}/ · {count} · {human_bytes(sub.size)} · {sub.role}"


def files_lines(ckpt: Checkpoint) -> list[str]:
    """One line per file of a checkpoint of many files (a few, then a count)."""
    lines = []
    for info in ckpt.files[:FILES_SHOWN]:
        what = [human_bytes(info.size)]
        if info.rank is not None:
            what.append(f"rank {info.rank}")
        if info.role == "data":
            what.append(plural(info.num_tensors, "chunk"))
        elif info.role == "shard":
            what.append(plural(info.num_tensors, "tensor"))
        elif info.role not in ("data", "rank"):
            what.append(info.role)
        if info.num_values:
            what.append(plural(info.num_values, "value"))
        lines.append(f"{info.path} · {' · '.join(what)}")
    if len(ckpt.files) > FILES_SHOWN:
        lines.append(f"… {len(ckpt.files) - FILES_SHOWN} more (see --json)")
    return lines


def where_text(t: TensorInfo) -> str:
    """Where a tensor of many files lives: its shard, or its chunks."""
    if len(t.chunks) == 1:
        return t.chunks[0].file
    if t.chunks:
        ranks = sorted({c.rank for c in t.chunks if c.rank is not None})
        on = f" · {'ranks' if len(ranks) > 1 else 'rank'} {_runs(ranks)}" if ranks else ""
        return f"{len(t.chunks)} {'runs' if t.chunks[0].flat else 'chunks'}{on}"
    return t.file or ""


def _runs(numbers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs)


def _fit_where(cells: list[list[str]], headers: list[str], width: int, keys: int) -> None:
    """Shorten the last column (where) so that the others keep their width and
    the keys keep up to ``KEY_MIN``: long file names keep their ends."""
    others = sum(max([len(h), *(len(row[i]) for row in cells)])
                 for i, h in enumerate(headers[:-1]))
    budget = max(len(headers[-1]) + 4,
                 width - others - 3 * len(headers) - min(keys, KEY_MIN))
    for row in cells:
        row[-1] = _shorten(row[-1], budget)


_SHARD = re.compile(r"^.*?(-0*(\d+)-of-0*(\d+)\.[A-Za-z0-9]+)$")


def _shorten(text: str, budget: int) -> str:
    """``text`` in at most ``budget`` characters: an HF shard name keeps its
    number (``…-00001-of-00004.bin``, then ``shard 1/4``), anything else its end."""
    if len(text) <= budget:
        return text
    shard = _SHARD.match(text)
    if shard:
        for short in (f"…{shard.group(1)}", f"shard {shard.group(2)}/{shard.group(3)}"):
            if len(short) <= budget:
                return short
    return "…" + text[-(budget - 1):]


KEY_MIN = 24


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


def render_tensors(console: Console, tensors: Iterable[TensorInfo], limit: int,
                   where: bool = False) -> None:
    rows = list(tensors)
    labels = sharing_labels(rows)
    shown = rows if limit <= 0 else rows[:limit]
    cells = []
    for t in shown:
        shares = labels.get(t.storage or "", "")
        if shares and t.storage_offset:
            shares += f" @{t.storage_offset}"
        cells.append([tensor_shape(t), shown_text(t.dtype), shown_text(t.location or "-"),
                      human_bytes(t.nbytes), shares]
                     + ([shown_text(where_text(t))] if where else []))
    headers = ["shape", "dtype", "device", "size", "shares"] + (["where"] if where else [])
    if where:  # many files: the columns they leave empty make room for where
        keep = [i for i, h in enumerate(headers) if not (
            (h == "device" and all(t.location is None for t in shown))
            or (h == "shares" and not labels))]
        headers = [headers[i] for i in keep]
        cells = [[row[i] for i in keep] for row in cells]
        _fit_where(cells, headers, console.width, max((len(t.key) for t in shown), default=0))
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
        render_tensors(console, tensors, limit, where=ckpt.is_multifile)
