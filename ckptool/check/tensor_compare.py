"""Comparing the values of two tensors of one shape: ``compare_values``.

The result is a ``ValueDiff``: equal or not, how many elements differ and,
for floating and complex tensors, the largest absolute difference, computed
in float64 (complex: the modulus of the difference, in complex128). NaN
equals NaN; a NaN facing a number counts as a difference (``nan_mismatch``)
and is left out of the maximum. Integers and bools report how many elements
differ. Work goes in chunks of elements so that float64 copies stay small
whatever the tensor's size. torch is imported when a comparison runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptool import dtypes

if TYPE_CHECKING:
    import torch

EQUAL, DIFFERENT, NOT_COMPARED = "equal", "different", "not_compared"
CHUNK_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class ValueDiff:
    status: str  # equal, different or not_compared
    numel: int = 0
    # elements that differ (NaN facing NaN does not); None: not known (by digest)
    num_different: int | None = 0
    max_abs_diff: float | None = None  # floating/complex only; NaN-free pairs; may be inf
    nan_mismatch: int = 0  # elements where exactly one side is NaN
    reason: str | None = None  # why values were not compared
    by_digest: bool = False  # told by two manifests' digests, no value read


def not_compared(reason: str) -> ValueDiff:
    return ValueDiff(NOT_COMPARED, reason=reason)


def compare_values(a: torch.Tensor, b: torch.Tensor, dtype_a: str, dtype_b: str,
                   chunk: int = CHUNK_ELEMENTS) -> ValueDiff:
    """Compare two tensors of the same shape; ``dtype_*`` are ckptool dtype names."""
    import torch

    if a.shape != b.shape:
        return not_compared("shapes differ")
    numel = a.numel()
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    if a.dtype == b.dtype and torch.equal(_bytes(flat_a), _bytes(flat_b)):
        return ValueDiff(EQUAL, numel, 0, 0.0 if dtypes.is_floating(dtype_a) else None)
    complex_ = dtype_a in dtypes.COMPLEX or dtype_b in dtypes.COMPLEX
    floating = complex_ or dtypes.is_floating(dtype_a) or dtypes.is_floating(dtype_b)
    try:
        if floating:
            return _floating(flat_a, flat_b, complex_, chunk)
        if a.dtype == b.dtype:
            return _bytewise(flat_a, flat_b, chunk)
        return _integers(flat_a, flat_b, chunk)
    except (RuntimeError, TypeError) as exc:  # dtypes torch cannot convert (float4...)
        if a.dtype == b.dtype:
            return _bytewise(flat_a, flat_b, chunk)
        return not_compared(f"cannot compare {dtype_a} with {dtype_b}: {exc}")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The elements' bytes, one row per element."""
    import torch

    t = t.contiguous()
    return t.view(torch.uint8).reshape(t.numel(), t.element_size())


def _result(numel: int, differ: int, max_abs: float | None, nan_mismatch: int) -> ValueDiff:
    return ValueDiff(DIFFERENT if differ else EQUAL, numel, differ, max_abs, nan_mismatch)


def _floating(a: torch.Tensor, b: torch.Tensor, complex_: bool, chunk: int) -> ValueDiff:
    import torch

    wide = torch.complex128 if complex_ else torch.float64
    differ = nan_mismatch = 0
    max_abs = 0.0
    for i in range(0, a.numel(), chunk):
        ca, cb = a[i:i + chunk].to(wide), b[i:i + chunk].to(wide)
        nan_a, nan_b = ca.isnan(), cb.isnan()
        if complex_:
            # part by part: NaN+1j and NaN+2j still differ, inf+1j and inf+2j differ by 1
            ra, rb = torch.view_as_real(ca), torch.view_as_real(cb)
            ne = ((ra != rb) & ~(ra.isnan() & rb.isnan())).any(-1)
            parts = torch.where(ra == rb, 0.0, ra - rb)
            gap = torch.hypot(parts[..., 0], parts[..., 1])
        else:
            ne = (ca != cb) & ~(nan_a & nan_b)
            gap = (ca - cb).abs()
        differ += int(ne.sum())
        nan_mismatch += int((nan_a ^ nan_b).sum())
        both = ne & ~nan_a & ~nan_b
        if bool(both.any()):
            max_abs = max(max_abs, float(gap[both].max()))
    return _result(a.numel(), differ, max_abs, nan_mismatch)


def _bytewise(a: torch.Tensor, b: torch.Tensor, chunk: int) -> ValueDiff:
    differ = 0
    for i in range(0, a.numel(), chunk):
        differ += int((_bytes(a[i:i + chunk]) != _bytes(b[i:i + chunk])).any(1).sum())
    return _result(a.numel(), differ, None, 0)


def _integers(a: torch.Tensor, b: torch.Tensor, chunk: int) -> ValueDiff:
    import torch

    differ = 0
    for i in range(0, a.numel(), chunk):
        differ += int((a[i:i + chunk].to(torch.int64) != b[i:i + chunk].to(torch.int64)).sum())
    return _result(a.numel(), differ, None, 0)
