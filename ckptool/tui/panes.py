"""What the browser's text panes say: the summary header and the detail of
the selected tensor or module (the findings: ``ckptool.tui.findings``).
Functions from core objects to rich ``Text``; the app only places them."""

from __future__ import annotations

import os

from rich.text import Text

from ckptool.check import manyfiles
from ckptool.check.loadcheck import TagLoad
from ckptool.check.stats import TensorStats
from ckptool.describe import human_bytes, human_count, parameters_text, plural, shown, tensor_shape
from ckptool.model import NO_LOCATION, Checkpoint, TensorInfo
from ckptool.tui.index import Node

SHOWN_SHARERS = 6


def _tally(tally: dict[str, int], most: int = 3) -> str:
    parts = [f"{shown(name)} {human_bytes(n)}" for name, n in list(tally.items())[:most]]
    if len(tally) > most:
        parts.append(f"+{len(tally) - most} more")
    return ", ".join(parts) or "none"


def summary_loading(path: str, tensors_so_far: int) -> Text:
    size = os.path.getsize(path) if os.path.exists(path) else 0
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(shown(os.path.basename(path)), style="bold")
    text.append(f" · {human_bytes(size)}\n")
    so_far = f"{tensors_so_far:,} tensors so far" if tensors_so_far else "starting"
    text.append(f"reading… {so_far}", style="italic")
    text.append("\n ")  # three lines, as the header of the file read
    return text


def summary(ckpt: Checkpoint) -> Text:
    """The header, one line each (cut, never wrapped): a warning naming the
    unsafe globals when there are any, always first so no width hides it;
    the file; bytes by dtype and by saved device; the main state dict."""
    text = Text(no_wrap=True, overflow="ellipsis")
    unsafe = ckpt.unsafe_globals
    if unsafe:
        names = "s" if len(unsafe) != 1 else ""
        text.append(f"⚠ {len(unsafe)} unsafe global{names}: {shown(', '.join(unsafe))}",
                    style="bold red")
        text.append(" · torch.load(weights_only=False) would run code from this file\n",
                    style="red")
    text.append(shown(os.path.basename(ckpt.path)), style="bold")
    where = f"in {plural(len(ckpt.files), 'file')}" if ckpt.is_multifile else "in the file"
    text.append(f" · {ckpt.format} · {human_bytes(ckpt.file_size)} · "
                f"{plural(len(ckpt.tensors), 'tensor')} {where}\n")
    text.append("dtypes ", style="bold")
    text.append(_tally(ckpt.bytes_by_dtype))
    text.append("  saved on ", style="bold")
    text.append(_tally(ckpt.bytes_by_location) + "\n")
    sd = ckpt.main_state_dict
    text.append("state dict ", style="bold")
    if sd is None:  # as inspect says it
        text.append("none: the file is an optimizer's state, not a model's weights"
                    if ckpt.metadata.get("optimizer_states") else "none found", style="yellow")
    else:
        where = shown(manyfiles.state_dict_place(ckpt, "the whole file"))
        if sd.kind == "module":
            where += " (a whole module)"
        text.append(where)
        if sd.prefix and sd.prefix != manyfiles.entry_prefix(ckpt):  # before the counts:
            # a narrow header cuts those first
            text.append(" · prefix ")
            text.append(shown(sd.prefix), style="bold yellow")
        # the model's parameters: the optimizer's moments are no parameters
        text.append(f" · {plural(sd.num_tensors, 'tensor')} · {parameters_text(sd, short=True)}")
    return text


# -- detail pane ---------------------------------------------------------------

def _row(text: Text, label: str, value: str | Text, style: str = "") -> None:
    text.append(f"{label:<9} ", style="bold")
    if isinstance(value, Text):
        text.append_text(value)
    else:
        text.append(value, style=style)
    text.append("\n")


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...] | None) -> bool:
    if stride is None:
        return False
    expect = 1
    for size, step in zip(reversed(shape), reversed(stride), strict=True):
        if size != 1 and step != expect:
            return False
        expect *= size
    return True


def tensor_detail(ckpt: Checkpoint | None, t: TensorInfo, loads: dict[str, TagLoad] | None,
                  stats: TensorStats | str | None, optimizer: bool = False) -> Text:
    """Everything about one tensor, densest first so that 80x24 shows it:
    shape and dtype, its statistics once asked for, layout, storage and
    sharing, where it was saved and where it lands here. ``optimizer``: it
    is an optimizer's state, not a model's tensor."""
    text = Text()
    text.append(shown(t.key) + "\n", style="bold")
    kind = [tensor_shape(t), shown(t.dtype), plural(t.numel, "element"), human_bytes(t.nbytes)]
    if optimizer:
        kind.append("optimizer state")
    if t.is_parameter:
        kind.append("parameter")
    if t.requires_grad:
        kind.append("requires_grad")
    if t.layout not in ("strided", "storage"):
        kind.append(t.layout)
    if t.subclass:
        kind.append(shown(t.subclass))
    _row(text, "tensor", " · ".join(kind))
    _stats(text, stats)  # high up: at 80x24 the pane shows 8 lines
    stride = "unrecorded" if t.stride is None else str(tuple(t.stride))
    layout = "contiguous" if _contiguous(t.shape, t.stride) else "not contiguous"
    _row(text, "stride", f"{stride} · offset {t.storage_offset} · {layout}")
    _storage(text, ckpt, t)
    if t.file is not None or t.chunks:
        _row(text, "file", _where(t))
    loc = t.location or NO_LOCATION
    landing = Text(f"{shown(loc)} → ")
    landing.append_text(_landing(ckpt, t, loads))
    _row(text, "saved on", landing)
    return text


def _where(t: TensorInfo) -> str:
    """The shard that holds a tensor of many files, or its chunks."""
    if t.file is not None:
        return shown(t.file)
    files = list(dict.fromkeys(c.file for c in t.chunks))
    ranks = sorted({c.rank for c in t.chunks if c.rank is not None})
    kind = "run" if t.chunks and t.chunks[0].flat else "chunk"
    said = f"{plural(len(t.chunks), kind)} in {shown(', '.join(files[:3]))}"
    said += f" +{len(files) - 3} more" if len(files) > 3 else ""
    if ranks:
        said += f" · rank{'s' if len(ranks) > 1 else ''} " + (
            f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0]))
    return said


def _storage(text: Text, ckpt: Checkpoint | None, t: TensorInfo) -> None:
    if t.storage is None:
        _row(text, "storage", "none recorded")
        return
    info = ckpt.storages.get(t.storage) if ckpt is not None else None
    if info is None:
        _row(text, "storage", f"{shown(t.storage)} (details once the file is read)")
        return
    line = Text(f"{shown(info.id)} · {human_bytes(info.nbytes)} · {shown(info.dtype)} · ")
    others = [k for k in info.tensors if k != t.key]
    if not others:
        line.append("not shared")
    else:
        sharers = shown(", ".join(others[:SHOWN_SHARERS]))
        more = f" +{len(others) - SHOWN_SHARERS} more" if len(others) > SHOWN_SHARERS else ""
        line.append(f"shared with {sharers}{more}", style="yellow")
    _row(text, "storage", line)


def _landing(ckpt: Checkpoint | None, t: TensorInfo, loads: dict[str, TagLoad] | None) -> Text:
    loc = t.location or NO_LOCATION
    fmt = ckpt.format if ckpt is not None else None
    if fmt == "dcp":
        return Text("DCP records no device: dcp.load puts it where the state dict you pass "
                    "has it")
    if fmt == "deepspeed" and t.chunks:
        return Text("consolidated from the ranks' partitions: ckptool convert writes it into "
                    "a file that records no device")
    if loads is None:
        return Text("checking this machine…", style="italic")
    load = loads.get(loc)
    if loc == NO_LOCATION:
        if fmt == "hf-safetensors":
            return Text("safetensors shard: the loader picks (map_location=...)")
        return Text("safetensors: the loader picks (load_file(..., device=...))")
    if load is None:
        return Text("unknown")
    if load.lands:
        where = f"plain torch.load{' of its shard' if t.file else ''} puts it on {load.lands}"
        if load.physical is not None:
            where += f" (physical GPU {load.physical})"
        return Text(where, style="green")
    first = (load.error or "").split(". ")[0].rstrip(".")
    return Text(f"torch.load fails here: {shown(first)}", style="red")


def _stats(text: Text, stats: TensorStats | str | None) -> None:
    """Two lines once computed: the values, then the counts."""
    if stats is None:
        _row(text, "stats", "press s to compute (reads this tensor only)", "italic")
        return
    if isinstance(stats, str):
        _row(text, "stats", shown(stats), "italic")
        return
    if stats.min is None:
        _row(text, "stats", "no finite value")
    else:
        std = f"{stats.std:.6g}" if stats.std is not None else "-"
        _row(text, "stats", f"min {stats.min:.6g} · max {stats.max:.6g} · "
             f"mean {stats.mean:.6g} · std {std}")
    bad = f"{stats.nan:,} NaN · {stats.inf:,} Inf · {stats.zeros:,} zeros"
    _row(text, "counts", bad, "red" if stats.nan or stats.inf else "")
    if stats.note:
        _row(text, "note", stats.note)


def node_detail(n: Node) -> Text:
    text = Text()
    text.append(shown(n.path or "(root)") + "\n", style="bold")
    _row(text, "tensors", f"{n.count:,}")
    if n.optim and n.optim == n.count:
        _row(text, "params", "none: an optimizer's state, not the model's parameters")
    else:
        short = human_count(n.params)
        _row(text, "params", f"{n.params:,}" + (f" ({short})" if short != str(n.params) else ""))
    if n.optim:
        short = human_count(n.optim_elements)
        elements = f"{n.optim_elements:,}" + (
            f" ({short})" if short != str(n.optim_elements) else "")
        _row(text, "optimizer", f"{plural(n.optim, 'tensor')} of its state · {elements} elements")
    _row(text, "size", human_bytes(n.nbytes))
    _row(text, "saved on", _tally(dict(sorted(n.locations.items(),
                                              key=lambda kv: (-kv[1], kv[0]))), most=4))
    kids, here = len(n.children), len(n.tensors)
    _row(text, "children", f"{kids:,} module{'s' if kids != 1 else ''} · "
         f"{here:,} tensor{'s' if here != 1 else ''} here")
    return text
