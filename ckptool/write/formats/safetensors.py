"""The layout of a safetensors file: an 8-byte header length, the JSON
header (``dtype``, ``shape``, ``data_offsets`` per tensor, ``__metadata__``),
padded so the data starts 8-byte aligned, then every tensor's bytes back to
back, in the order given, with no gaps (the format forbids them).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ckptool import dtypes
from ckptool.model import TensorInfo
from ckptool.read.tensor_data import TensorData
from ckptool.read.ties import recorded_aliases
from ckptool.write.layout import Data, Layout, Segment, tensor_segment

ST_CODES = {v: k for k, v in dtypes.SAFETENSORS_DTYPES.items()}
Item = tuple[str, TensorInfo, str]  # (name to write it under, tensor, dtype to write it as)
# a tensor's bytes as a dtype, written at an offset: (tensor, dtype, at, name) -> segments
SegmentsAt = Callable[[TensorInfo, str, int, str], list[Segment]]


def of_file(reader: TensorData) -> SegmentsAt:
    """Tensor segments from one file's reader."""
    return lambda t, dtype, at, name: [tensor_segment(reader, t, dtype, at, name)]


def lay_out(items: list[Item], meta: dict[str, str],
            segments_at: SegmentsAt) -> tuple[Layout, dict[str, int]]:
    """The file holding ``items`` and ``meta``; and where each tensor's bytes
    start (``segments_at`` gives them: ``of_file``, or ``TensorSource.segments``)."""
    header: dict[str, Any] = {}
    offset = 0
    for name, t, dtype in items:
        size = t.numel * dtypes.itemsize(dtype)
        shape = list(t.shape)
        if dtype == "float4_e2m1fn_x2" and shape:  # safetensors counts the 4-bit elements
            shape[-1] *= 2
        header[name] = {"dtype": ST_CODES[dtype], "shape": shape,
                        "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = meta
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-byte aligned
    layout = Layout([Data(0, len(raw).to_bytes(8, "little") + raw, "the safetensors header")])
    base = 8 + len(raw)
    starts = {}
    for name, t, dtype in items:
        at = base + header[name]["data_offsets"][0]
        for segment in segments_at(t, dtype, at, f"tensor {name}"):
            layout.add(segment)
        starts[name] = at
    return layout, starts


def carry_ties(meta: dict[str, str], after: dict[str, str],
               rename: Callable[[str], str] | None) -> tuple[dict[str, str], dict[str, str],
                                                             list[str]]:
    """A rewritten file's ``__metadata__`` with the ties it records (dropped
    name -> kept name, huggingface_hub's form, or ``convert``'s
    ``ckptool.aliases``) following the tensors: ``after`` maps each stored
    name the output keeps to its new name, ``rename`` renames the tied names
    as the keys were. Returns (the metadata, the ties it now records, notes
    on ties left out)."""
    ties, _ = recorded_aliases(meta, set(after))
    if not ties:
        return meta, {}, []
    out = dict(meta)
    ours = "ckptool.aliases" in out
    for alias in ties:
        out.pop(alias, None)
    out.pop("ckptool.aliases", None)
    carried: dict[str, str] = {}
    lost = []
    taken = set(after.values())
    for alias, kept in ties.items():
        new = rename(alias) if rename is not None else alias
        if kept in after and new not in taken:
            carried[new] = after[kept]
            taken.add(new)
        else:
            lost.append(alias)
    if ours and carried:
        out["ckptool.aliases"] = json.dumps(carried)
    elif carried:
        out.update(carried)
    notes = [f"{len(lost)} tied name(s) the file recorded are left out with the tensor "
             f"they share, or clash with a new name: {', '.join(lost[:3])}"] if lost else []
    return out, carried, notes
