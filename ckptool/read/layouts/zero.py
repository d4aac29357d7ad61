"""Where each parameter of a DeepSpeed ZeRO checkpoint lies in the ranks'
flat fp32 partitions: pure arithmetic on lengths, no file is read.

It is the reconstruction of ``deepspeed/utils/zero_to_fp32.py``, written as
runs of elements rather than tensors, so that a parameter is read (or copied)
from exactly the bytes that hold it:

- **ZeRO 1 and 2** (and the BF16_Optimizer): per parameter group, each rank
  saves its partition of one flat vector; the ranks' partitions, one after
  the other, are that vector (padding only at its end: DeepSpeed's
  ``torch.cat`` of ``single_partition_of_fp32_groups``). The group's
  parameters lie in it in ``param_shapes`` order, each followed by its
  ``param_alignment_paddings`` entry (DeepSpeed 0.19.8; all 0 unless
  ``parameter_alignment``). What is consumed must match what is there, up to
  the group's alignment to ``2 * world_size`` elements, as DeepSpeed checks.
- **ZeRO 3**: every parameter is split over the ranks, ``ceil(numel / ws)``
  elements each (the last rank's padded); rank r's sub-groups
  (``fp32_flat_groups``), one after the other, hold its part of each
  parameter in ``param_shapes`` order. A parameter's part may cross from one
  sub-group into the next. The ranks' parts in rank order, cut to
  ``numel``, are the parameter.

A ``Piece`` names the source (rank, or rank and sub-group), the run in it,
and where the run goes in the flattened parameter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


class LayoutError(ValueError):
    """The partitions do not hold what the shapes say (the message says how)."""


@dataclass(frozen=True)
class Piece:
    rank: int
    group: int  # the source within the rank: its partition of group g, or sub-group g
    start: int  # first element in that source
    count: int
    at: int  # first element in the flattened parameter


def partitioned(numel: int, world_size: int) -> int:
    """Elements of a ZeRO-3 parameter on each rank: ``ceil(numel / ws)``."""
    return math.ceil(numel / world_size)


def _runs(lengths: Sequence[int], start: int, count: int) -> list[tuple[int, int, int]]:
    """``count`` elements from ``start`` of the concatenation of sources of
    ``lengths``: (source, start in it, elements) per source touched."""
    if start < 0 or count < 0:
        raise LayoutError(f"asks for {count} element(s) at {start}")
    out = []
    base = 0
    for i, length in enumerate(lengths):
        if count <= 0:
            break
        end = base + length
        if start < end:
            take = min(count, end - start)
            out.append((i, start - base, take))
            start += take
            count -= take
        base = end
    if count > 0:
        raise LayoutError(f"needs {count} element(s) past the end of the partitions")
    return out


def stage12(lengths: Sequence[Sequence[int]],
            shapes: Sequence[Sequence[tuple[str, int]]],
            paddings: Sequence[Sequence[int]] | None,
            world_size: int) -> dict[str, list[Piece]]:
    """ZeRO 1/2: ``lengths[r][g]`` is rank r's saved partition of group g,
    ``shapes[g]`` the group's (name, numel) in flat order, ``paddings[g]``
    the alignment padding after each. Pieces come in rank order."""
    groups = len(shapes)
    for r, per_rank in enumerate(lengths):
        if len(per_rank) != groups:
            raise LayoutError(f"rank {r} saved {len(per_rank)} fp32 partition(s) for "
                              f"{groups} parameter group(s)")
    if paddings is not None and len(paddings) != groups:
        raise LayoutError(f"{len(paddings)} lists of alignment paddings for {groups} "
                          "parameter group(s)")
    align = 2 * world_size
    out: dict[str, list[Piece]] = {}
    for g, names in enumerate(shapes):
        sources = [per_rank[g] for per_rank in lengths]
        pads = paddings[g] if paddings is not None else [0] * len(names)
        if len(pads) != len(names):
            raise LayoutError(f"group {g} has {len(names)} parameters but "
                              f"{len(pads)} alignment paddings")
        offset = 0
        for (name, numel), pad in zip(names, pads, strict=True):
            if pad < 0:
                raise LayoutError(f"{name} (group {g}) has a negative alignment padding {pad}")
            try:
                runs = _runs(sources, offset, numel)
            except LayoutError as exc:
                raise LayoutError(f"{name} (group {g}) {exc}") from None
            at = 0
            pieces = []
            for rank, start, count in runs:
                pieces.append(Piece(rank, g, start, count, at))
                at += count
            out[name] = pieces
            offset += numel + pad
        have = sum(sources)
        if math.ceil(offset / align) * align != math.ceil(have / align) * align:
            raise LayoutError(f"group {g}: its parameters take {offset} elements, its "
                              f"partitions hold {have}")
    return out


def stage3(lengths: Sequence[Sequence[int]], shapes: Sequence[tuple[str, int]],
           world_size: int) -> dict[str, list[Piece]]:
    """ZeRO 3: ``lengths[r][k]`` is rank r's sub-group k, ``shapes`` every
    (name, numel) in order (the sub-groups' ``param_shapes`` merged)."""
    first = list(lengths[0])
    for r, per_rank in enumerate(lengths):
        if list(per_rank) != first:
            raise LayoutError(f"rank {r}'s fp32 sub-groups ({list(per_rank)} elements) differ "
                              f"from rank 0's ({first})")
    out: dict[str, list[Piece]] = {}
    offset = 0
    for name, numel in shapes:
        part = partitioned(numel, world_size)
        pieces = []
        for rank in range(world_size):
            take = min(part, numel - rank * part)
            if take <= 0:
                break
            try:
                runs = _runs(lengths[rank], offset, take)
            except LayoutError as exc:
                raise LayoutError(f"{name} (rank {rank}) {exc}") from None
            at = rank * part
            for k, start, count in runs:
                pieces.append(Piece(rank, k, start, count, at))
                at += count
        out[name] = pieces
        offset += part
    if offset != sum(first):
        raise LayoutError(f"the parameters take {offset} elements of each rank, the "
                          f"fp32 sub-groups hold {sum(first)}")
    return out


def frozen3(name: str, numel: int, fragments: Sequence[int]) -> list[Piece]:
    """A frozen ZeRO-3 parameter from each rank's 1-D fragment (``fragments[r]``
    elements, ``ceil(numel / ws)`` each as saved): the first ``numel``
    elements of their concatenation, as DeepSpeed takes them."""
    try:
        runs = _runs(fragments, 0, numel)
    except LayoutError as exc:
        raise LayoutError(f"{name}: its frozen fragments {exc}") from None
    pieces, at = [], 0
    for rank, start, count in runs:
        pieces.append(Piece(rank, 0, start, count, at))
        at += count
    return pieces
