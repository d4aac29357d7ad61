"""Tensors made from another tensor by selecting and joining parts of it:
one layer of a stack (``[L, ...]`` -> ``[...]``), one expert, the query rows
of a fused QKV weight, the gate half of a fused SwiGLU weight, a vocabulary
without its padding, a transposed weight. What ``convert --unstack-layers``
and ``--map`` write.

A ``Derived`` names its source tensor and the steps, applied in order:

1. ``index``: leading positions selected (``(3,)``: layer 3; ``(3, 1)``:
   layer 3's expert 1);
2. ``rows``: runs of the first remaining dimension, joined in order
   (``((0, 64), (96, 160))``); empty: every row;
3. ``transpose``: the two dimensions of a matrix swapped (GPT-2's Conv1D
   weights are stored ``[in, out]``).

Its ``shape`` is computed from the source's here, so a plan is checked
before any byte is read; ``apply`` makes its values from the source's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptool.errors import UnsupportedCheckpointError
from ckptool.model import Checkpoint, TensorInfo

if TYPE_CHECKING:
    import torch

DERIVED = "derived"  # the format of a view of derived tensors


@dataclass(frozen=True)
class Derived:
    key: str  # the name written
    source: str  # the key of the tensor it is made from
    index: tuple[int, ...] = ()
    rows: tuple[tuple[int, int], ...] = ()
    transpose: bool = False

    def shape(self, source_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape made from a source of ``source_shape``; an error naming
        the tensor where the steps do not fit it."""
        if len(self.index) > len(source_shape) or any(
                not 0 <= i < n for i, n in zip(self.index, source_shape, strict=False)):
            raise self._unfit(source_shape, f"no position {list(self.index)}")
        shape = list(source_shape[len(self.index):])
        if self.rows:
            if not shape or any(not 0 <= a <= b <= shape[0] for a, b in self.rows):
                raise self._unfit(source_shape, f"no rows {list(self.rows)}")
            shape[0] = sum(b - a for a, b in self.rows)
        if self.transpose:
            if len(shape) != 2:
                raise self._unfit(source_shape, "not a matrix to transpose")
            shape.reverse()
        return tuple(shape)

    def _unfit(self, source_shape: tuple[int, ...], why: str) -> UnsupportedCheckpointError:
        return UnsupportedCheckpointError(
            f"{self.key} is made from {self.source}, which is {list(source_shape)}: {why}",
            "the mapping does not fit this model: check its sizes (or the rules file)")

    def nbytes(self, source_shape: tuple[int, ...], itemsize: int) -> int:
        return math.prod(self.shape(source_shape)) * itemsize

    def apply(self, source: torch.Tensor) -> torch.Tensor:
        """Its values, made from the source tensor's (contiguous)."""
        import torch

        t = source[self.index] if self.index else source
        if self.rows:
            parts = [t[a:b] for a, b in self.rows]
            t = parts[0] if len(parts) == 1 else torch.cat(parts)
        if self.transpose:
            t = t.t()
        return t.contiguous()


@dataclass
class Made:
    """What a view of derived tensors is made from: the checkpoint read, and
    each tensor's ``Derived`` by its key (``Checkpoint.derived_from``)."""

    source: Checkpoint
    plans: dict[str, Derived]
    by_key: dict[str, TensorInfo]  # the source's tensors


def view(source: Checkpoint, plans: list[Derived], notes: list[str] | None = None,
         metadata: dict[str, Any] | None = None) -> Checkpoint:
    """A checkpoint holding exactly the tensors ``plans`` make from
    ``source``'s, one state dict of them; no byte is read. Their order is
    ``plans``', with the tensors made from one source brought together (at
    the first one's place): the writers take them in this order, and each
    source is read once (``TensorValues`` keeps the last one read)."""
    from ckptool.read.formats.base import RawRead
    from ckptool.read.reader import assemble
    from ckptool.read.seen import GlobalsSeen
    from ckptool.read.tensors import StorageRef, TensorRecord

    by_key = {t.key: t for t in source.tensors}
    grouped: dict[str, list[Derived]] = {}
    for d in plans:
        grouped.setdefault(d.source, []).append(d)
    plans = [d for same in grouped.values() for d in same]
    root: dict[str, TensorRecord] = {}
    storages: dict[str, StorageRef] = {}
    for d in plans:
        src = by_key.get(d.source)
        if src is None:
            raise UnsupportedCheckpointError(f"{d.key} is made from {d.source}, which "
                                             f"{source.path} does not hold",
                                             "the mapping does not fit this checkpoint")
        if d.key in root:
            raise UnsupportedCheckpointError(f"the mapping writes {d.key} twice",
                                             "each name is written once: check the rules")
        shape = d.shape(src.shape)
        ref = StorageRef(f"{DERIVED}:{d.key}", src.dtype, src.location, math.prod(shape))
        storages[ref.key] = ref
        root[d.key] = TensorRecord(shape, src.dtype, contiguous(shape), 0, ref, src.location)
    meta = {**(metadata or {}), "notes": list(notes or [])}
    ckpt = assemble(source.path, RawRead(DERIVED, root, storages, GlobalsSeen(), meta),
                    source.file_size)
    ckpt.globals = source.globals  # (what the files name, judged when they were read)
    ckpt.derived_from = Made(source, {d.key: d for d in plans}, by_key)
    return ckpt


def contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
