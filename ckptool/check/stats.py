"""Statistics of one tensor's values, on request: ``tensor_stats``.

For a detail pane that asks for one tensor at a time (on a worker thread,
never up front). The tensor's bytes are read through ``TensorData`` one
piece at a time: the tensor is cut into views of at most ``chunk_elems``
elements whose byte span is bounded too, each piece is read with
``TensorData.values`` on a sub-view (so byte order, bool bytes and every
unreadable layout are handled exactly as there), converted to float64 and
folded into running totals; means and variances of pieces are combined
with Chan's parallel formula. Peak extra memory is a few times
``chunk_elems`` float64 values, whatever the tensor's size: a 1 GB bf16
tensor never becomes 4 GB of float64. A checkpoint of many files
(``checkpoint_stats``) is the exception: its tensor is read whole once
(``ckptool.read.tensor_source``), so memory is that tensor plus the pieces.

Element order does not matter for statistics, so a non-contiguous view
(transposed, sliced, with a storage offset) is read in storage order: its
dimensions are sorted by stride and merged where contiguous, and a stride-0
(expanded) dimension is read once and counted as many times as its size.

torch is imported inside the functions that compute, never at import time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ckptool import dtypes
from ckptool.errors import UnsupportedCheckpointError
from ckptool.model import Checkpoint, TensorInfo
from ckptool.read.tensor_data import TensorData
from ckptool.read.tensor_source import ValueSource, WholeTensors, contiguous

if TYPE_CHECKING:
    import torch

CHUNK_ELEMS = 1 << 22

_INTEGER = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                      "uint64"})
_NO_STATS = frozenset({"float4_e2m1fn_x2"})  # packed pairs torch cannot convert
_HINT = "metadata (inspect, diff --no-values) is still available for this tensor"

Dims = tuple[tuple[int, int], ...]  # (size, stride) per dimension, outermost first


class StatsCancelled(Exception):
    """``cancelled()`` returned True between two chunks: the statistics were dropped."""


@dataclass(frozen=True)
class TensorStats:
    """Statistics of one tensor's values.

    ``min``, ``max``, ``mean`` and ``std`` are over the finite values only
    (``finite`` of them); NaN and +/-Inf are counted, not folded in. They
    are None when there is no finite value; ``std`` is also None with a
    single finite value. ``std`` is the sample standard deviation (Bessel's
    correction, divisor n - 1), torch's default ``Tensor.std()``. ``mean``
    and ``std`` are computed in float64. ``min`` and ``max`` are exact
    Python ints for integer and bool tensors (bool: 0/1), floats otherwise.
    Complex tensors report statistics of the magnitude ``|z|`` (as
    ``torch.abs`` computes it in complex128: a NaN part gives NaN unless the
    other part is infinite). ``zeros`` counts elements equal to zero (-0.0
    included). ``numel`` is the tensor's element count; an expanded tensor
    (a stride-0 dimension) counts every repeated element, as torch does.
    """

    numel: int
    finite: int
    min: float | int | None
    max: float | int | None
    mean: float | None
    std: float | None
    nan: int
    inf: int  # posinf + neginf
    posinf: int
    neginf: int
    zeros: int
    note: str | None = None  # "bool: 12 true of 40", "complex: ...", "empty tensor"...


def checkpoint_stats(ckpt: Checkpoint, tensor: TensorInfo,
                     cancelled: Callable[[], bool] | None = None) -> TensorStats:
    """``tensor_stats`` of one of ``ckpt``'s tensors, whatever its layout: a
    single file in pieces through ``TensorData``; a checkpoint of many files
    read whole once (its shard, or its chunks made whole), then in pieces."""
    if not ckpt.is_multifile:
        with TensorData(ckpt) as data:
            return tensor_stats(data, tensor, cancelled=cancelled)
    return tensor_stats(WholeTensors(ckpt), contiguous(tensor), cancelled=cancelled)


def tensor_stats(data: ValueSource, tensor: TensorInfo, chunk_elems: int = CHUNK_ELEMS,
                 cancelled: Callable[[], bool] | None = None) -> TensorStats:
    """Statistics of ``tensor``'s values, read from ``data`` ``chunk_elems`` at a time.

    ``cancelled`` is called before each chunk is read; when it returns True
    ``StatsCancelled`` is raised. Tensors whose values ``TensorData`` cannot
    read raise its ``UnsupportedCheckpointError`` / ``CorruptCheckpointError``;
    dtypes torch cannot convert to float (packed float4, bits*) raise
    ``UnsupportedCheckpointError``.
    """
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems must be positive, not {chunk_elems}")
    stored_values = next((p for p in tensor.parts if p.key.endswith("/values")), None)
    if stored_values is not None:  # a sparse tensor: its stored values (no dense copy)
        stats = tensor_stats(data, stored_values, chunk_elems, cancelled)
        stored = f"the {stored_values.numel:,} stored values of a {tensor.layout} tensor"
        return replace(stats, note=f"{stored}; {stats.note}" if stats.note else stored)
    dtype = tensor.dtype
    if tensor.storage is None or tensor.stride is None or tensor.numel == 0:
        # TensorData raises its own error for what it cannot read; else the tensor is empty
        data.values(tensor)
        return _empty(tensor)
    bool_ = dtype == "bool"
    if not (bool_ or dtype in _INTEGER or dtype in dtypes.COMPLEX
            or (dtype in dtypes.FLOATING and dtype not in _NO_STATS)):
        data.values(replace(tensor, shape=(0,), stride=(1,), nbytes=0))  # layout errors first
        raise UnsupportedCheckpointError(
            f"{tensor.key}: statistics of {dtype} values are not supported", _HINT)

    acc = _Totals()
    weight, dims = _layout(tensor.shape, tensor.stride)
    if any(s < 0 for _, s in dims):  # torch never saves these; let TensorData judge
        pieces: Iterator[tuple[tuple[int, ...], tuple[int, ...], int]] = iter(
            [(tensor.shape, tensor.stride, tensor.storage_offset)])
        weight = 1
    else:
        itemsize = dtypes.itemsize(dtype)
        budget = max(chunk_elems, chunk_elems * 8 // itemsize)  # raw bytes <= float64 chunk
        pieces = _pieces(dims, tensor.storage_offset, chunk_elems, budget)
    for shape, stride, offset in pieces:
        if cancelled is not None and cancelled():
            raise StatsCancelled(tensor.key)
        piece = replace(tensor, shape=shape, stride=stride, storage_offset=offset,
                        nbytes=math.prod(shape) * dtypes.itemsize(dtype))
        values = data.values(piece).reshape(-1)
        _fold(acc, values, tensor, weight)
        del values

    note = None
    if bool_:
        note = f"bool: {acc.true} true of {tensor.numel}"
    elif dtype in dtypes.COMPLEX:
        note = "complex: statistics of the magnitude |z|"
    elif acc.n == 0:
        note = "no finite value"
    return TensorStats(
        numel=tensor.numel, finite=acc.n,
        min=acc.lo, max=acc.hi,
        mean=acc.mean if acc.n else None,
        std=math.sqrt(acc.m2 / (acc.n - 1)) if acc.n > 1 else None,
        nan=acc.nan, inf=acc.posinf + acc.neginf, posinf=acc.posinf, neginf=acc.neginf,
        zeros=acc.zeros, note=note)


def _empty(tensor: TensorInfo) -> TensorStats:
    return TensorStats(numel=0, finite=0, min=None, max=None, mean=None, std=None, nan=0,
                       inf=0, posinf=0, neginf=0, zeros=0, note="empty tensor")


class _Totals:
    """Running counts, extremes, and (count, mean, M2) of the finite values."""

    def __init__(self) -> None:
        self.n = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.lo: float | int | None = None
        self.hi: float | int | None = None
        self.nan = self.posinf = self.neginf = self.zeros = self.true = 0

    def add(self, n: int, mean: float, m2: float) -> None:
        """Chan et al.'s pairwise update with a part of ``n`` values."""
        if n == 0:
            return
        if self.n == 0:
            self.n, self.mean, self.m2 = n, mean, m2
            return
        total = self.n + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * (self.n * n / total)
        self.n = total

    def extremes(self, lo: float | int, hi: float | int) -> None:
        self.lo = lo if self.lo is None else min(self.lo, lo)
        self.hi = hi if self.hi is None else max(self.hi, hi)


def _fold(acc: _Totals, values: torch.Tensor, tensor: TensorInfo, weight: int) -> None:
    """Add one piece (a flat tensor), each element counted ``weight`` times."""
    import torch

    dtype = tensor.dtype
    if values.numel() == 0:
        return
    try:
        if dtype in dtypes.COMPLEX:
            wide = values.to(torch.complex128).abs()
        elif dtype in dtypes.FLOATING and dtypes.itemsize(dtype) == 1:
            wide = values.to(torch.float32).to(torch.float64)  # float8 kinds
        else:
            wide = values.to(torch.float64)
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        raise UnsupportedCheckpointError(
            f"{tensor.key}: cannot convert {dtype} values to float64: {exc}", _HINT) from exc

    if dtype == "bool" or dtype in _INTEGER:
        lo, hi = _int_range(values, dtype)
        acc.extremes(lo, hi)
        acc.zeros += int((values == 0).sum()) * weight
        if dtype == "bool":
            acc.true += int(values.sum()) * weight
        finite = wide
    else:
        nan = int(wide.isnan().sum())
        posinf = int((wide == math.inf).sum())
        neginf = int((wide == -math.inf).sum())
        acc.nan += nan * weight
        acc.posinf += posinf * weight
        acc.neginf += neginf * weight
        acc.zeros += int((wide == 0).sum()) * weight
        finite = wide[wide.isfinite()] if nan or posinf or neginf else wide
        if finite.numel():
            acc.extremes(float(finite.min()), float(finite.max()))
    n = finite.numel()
    if n:
        mean = float(finite.mean())
        m2 = float((finite - mean).square_().sum())
        acc.add(n * weight, mean, m2 * weight)


def _int_range(values: torch.Tensor, dtype: str) -> tuple[int, int]:
    """Exact min and max of an integer or bool piece."""
    import torch

    if dtype == "uint64":  # no min/max kernels; as int64, values >= 2**63 are negative
        signed = values.view(torch.int64)
        low, high = signed[signed >= 0], signed[signed < 0]
        lo = int(low.min()) if low.numel() else int(high.min()) + (1 << 64)
        hi = int(high.max()) + (1 << 64) if high.numel() else int(low.max())
        return lo, hi
    if dtype in ("bool", "uint16", "uint32"):
        values = values.to(torch.int64)
    return int(values.min()), int(values.max())


def _layout(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, Dims]:
    """(repeat count, dimensions in storage order with contiguous runs merged).

    Size-1 dimensions are dropped; stride-0 dimensions are dropped and their
    sizes multiplied into the repeat count.
    """
    weight = 1
    dims: list[tuple[int, int]] = []
    for n, s in zip(shape, stride, strict=True):
        if n == 1:
            continue
        if s == 0:
            weight *= n
            continue
        dims.append((n, s))
    dims.sort(key=lambda d: -d[1])
    merged: list[tuple[int, int]] = []
    for n, s in dims:
        if merged and merged[-1][1] == n * s:
            outer, _ = merged.pop()
            merged.append((outer * n, s))
        else:
            merged.append((n, s))
    return weight, tuple(merged)


def _pieces(dims: Dims, offset: int, chunk: int,
            budget: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Sub-views (shape, stride, storage offset) covering ``dims`` once, each of
    at most ``chunk`` elements spanning at most ``budget`` elements of storage
    (a single element always fits)."""
    if not dims:
        yield (), (), offset
        return
    (n0, s0), inner = dims[0], dims[1:]
    inner_numel = math.prod(n for n, _ in inner)
    inner_span = sum((n - 1) * s for n, s in inner) + 1
    if inner_numel > chunk or inner_span > budget:
        for i in range(n0):
            yield from _pieces(inner, offset + i * s0, chunk, budget)
        return
    rows = max(1, min(n0, chunk // inner_numel, (budget - inner_span) // s0 + 1))
    shape = tuple(n for n, _ in inner)
    stride = tuple(s for _, s in inner)
    for i in range(0, n0, rows):
        yield (min(rows, n0 - i), *shape), (s0, *stride), offset + i * s0
