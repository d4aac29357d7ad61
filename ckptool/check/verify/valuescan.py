"""One tensor's values looked at for ``verify --values`` (``values.py``):
NaN and Inf counted, all-zero, one value throughout, and a fingerprint.

``scan(source, tensor, fingerprint)`` reads the tensor once:

- a tensor that lies in one file, contiguous, little-endian (a torch file's
  or a safetensors shard's, nearly every tensor) is read a slice at a time
  (``SLICE`` bytes, into one buffer per thread, reused): each slice is
  looked at while it is in the cache, so a tensor costs about what ``cat``
  does, and memory is the buffer, whatever the tensor's size;
- any other (a DCP or ZeRO tensor in chunks, a view, a big-endian file, a
  bool) through ``TensorValues``, whole: memory is that tensor.

The look is one ``aminmax`` per slice: NaN propagates into it and an Inf is
its end, so counting (``isnan``, ``isinf``) runs only where it found
something; zero and one value throughout are ``min == max``. float8 has no
``aminmax`` on the CPU: its slices are cast first. Integers and bools are
looked at as their bits (no NaN). The fingerprint hashes the bytes at
``WINDOWS`` evenly spaced places (all of a small tensor): equal tensors have
equal fingerprints, whichever way they were read.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckptool import dtypes
from ckptool.errors import CorruptCheckpointError, InputError, UnsupportedCheckpointError
from ckptool.model import TensorInfo
from ckptool.read.tensor_source import TensorValues, located

if TYPE_CHECKING:
    import torch

SLICE = 8 << 20  # bytes read and looked at at a time
WINDOW, WINDOWS = 4096, 64  # the fingerprint: bytes at WINDOWS places
CAST = 1 << 22  # float8 elements cast to float32 at a time
_HALF = ("float64", "float32", "float16", "bfloat16")  # aminmax as they are
_buffers = threading.local()


@dataclass
class Found:
    """What reading one tensor found."""

    numel: int = 0
    nbytes: int = 0
    nan: int = 0
    inf: int = 0
    inf_neg: int = 0
    zero: bool = False
    constant: bool = False
    fingerprint: bytes | None = None
    files: list[str] = field(default_factory=list)  # chunk files holding NaN/Inf
    skipped: str | None = None
    error: str | None = None


class Look:
    """NaN, Inf, the least and greatest value of a tensor, slice by slice."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self.lo: float = math.inf
        self.hi: float = -math.inf
        self.nan = self.inf = self.inf_neg = 0

    def add(self, part: torch.Tensor) -> None:
        import torch

        if self.dtype in dtypes.COMPLEX:
            a, b = (float(v) for v in torch.aminmax(torch.view_as_real(part)))
            if not (math.isfinite(a) and math.isfinite(b)):
                self.nan += int(torch.isnan(part).sum())
                self.inf += int(torch.isinf(part).sum())
        elif self.dtype not in dtypes.FLOATING or self.dtype == "float4_e2m1fn_x2":
            bits = part.view(getattr(torch, f"int{8 * part.element_size()}"))
            a, b = (float(v) for v in torch.aminmax(bits))  # no NaN in bits
        elif self.dtype not in _HALF:  # float8: cast a slice at a time
            for piece in part.reshape(-1).split(CAST):
                self._floats(piece.float())
            return
        else:
            self._floats(part)
            return
        self.lo, self.hi = min(self.lo, a), max(self.hi, b)

    def _floats(self, part: torch.Tensor) -> None:
        import torch

        a, b = (float(v) for v in torch.aminmax(part))
        if a != a or b != b or a == -math.inf or b == math.inf:
            self.nan += int(torch.isnan(part).sum())
            neg = int((part == -math.inf).sum())
            self.inf += neg + int((part == math.inf).sum())
            self.inf_neg += neg
        self.lo, self.hi = min(self.lo, a), max(self.hi, b)

    def into(self, got: Found) -> None:
        got.nan, got.inf, got.inf_neg = self.nan, self.inf, self.inf_neg
        got.constant = not self.nan and self.lo == self.hi
        got.zero = got.constant and self.lo == 0


class Print:
    """The fingerprint of ``total`` bytes fed in order, a piece at a time."""

    def __init__(self, total: int) -> None:
        self.hash = hashlib.blake2b(total.to_bytes(8, "little"), digest_size=16)
        if total <= WINDOW * WINDOWS:
            self.spans = [(0, total)]
        else:
            step = (total - WINDOW) // (WINDOWS - 1)
            self.spans = [(i * step, i * step + WINDOW) for i in range(WINDOWS)]

    def feed(self, at: int, data: memoryview) -> None:
        """``data`` is bytes ``at`` to ``at + len(data)`` of the whole."""
        end = at + len(data)
        for start, stop in self.spans:
            lo, hi = max(start, at), min(stop, end)
            if lo < hi:
                self.hash.update(data[lo - at:hi - at])

    def digest(self) -> bytes:
        return self.hash.digest()


def scan(source: TensorValues, t: TensorInfo, fingerprint: bool) -> Found:
    """Read ``t`` and look at its values; never raises on damage (an
    ``error``), nor on what cannot be read here (``skipped``)."""
    try:
        direct = _direct(source, t)
        if direct is not None:
            return _streamed(t, *direct, fingerprint)
        values = source.values(t)
    except UnsupportedCheckpointError as exc:
        return Found(skipped=str(exc))
    except (InputError, OSError) as exc:  # truncated, not what .metadata says...
        return Found(error=str(exc))
    got = Found(numel=values.numel(), nbytes=values.numel() * values.element_size())
    if not got.numel:
        return got
    look = Look(t.dtype)
    try:
        look.add(values)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        return _unchecked(got, t, exc)
    look.into(got)
    if (got.nan or got.inf) and t.chunks:
        got.files = _bad_files(t, values)
    if fingerprint and not got.constant:
        import torch

        raw = values.contiguous().reshape(-1).view(torch.uint8).numpy().data
        mark = Print(len(raw))
        mark.feed(0, raw)
        got.fingerprint = mark.digest()
    return got


def _unchecked(got: Found, t: TensorInfo, exc: Exception) -> Found:
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return Found(numel=got.numel, nbytes=got.nbytes,
                 skipped=f"its {t.dtype} values cannot be checked by this torch ({reason})")


def _direct(source: TensorValues, t: TensorInfo) -> tuple[int, int, torch.dtype] | None:
    """(file descriptor, offset, dtype) where ``t``'s bytes lie as they are,
    contiguous and little-endian, in one file; else None."""
    import torch

    dtype = getattr(torch, t.dtype, None)
    if t.chunks or t.layout != "strided" or t.storage is None or t.stride is None \
            or not isinstance(dtype, torch.dtype) or dtype == torch.bool or not t.numel \
            or t.dtype in dtypes.QUANTIZED or t.stride != _contiguous(t.shape):
        return None
    if source.ckpt.is_multifile and located(source.ckpt, t).file is None:
        return None
    data = source.reader(t)
    if data.byteswap:
        return None
    start = t.storage_offset * dtype.itemsize
    if start < 0 or start + t.numel * dtype.itemsize > data.storage(t.storage).nbytes:
        raise CorruptCheckpointError(f"{t.key} lies outside its storage {t.storage}")
    return data.fileno(), data.storage_offset(t.storage) + start, dtype


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def _streamed(t: TensorInfo, fd: int, offset: int, dtype: torch.dtype,
              fingerprint: bool) -> Found:
    """``t``'s bytes read a slice at a time into this thread's buffer."""
    import torch

    buf = getattr(_buffers, "buf", None)
    if buf is None:
        buf = _buffers.buf = bytearray(SLICE)
    view = memoryview(buf)
    total = t.numel * dtype.itemsize
    got = Found(numel=t.numel, nbytes=total)
    look, mark = Look(t.dtype), Print(total) if fingerprint else None
    for at in range(0, total, SLICE):
        n = min(SLICE, total - at)
        _pread(fd, view[:n], offset + at, t)
        try:
            look.add(torch.frombuffer(buf, dtype=torch.uint8, count=n).view(dtype))
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            return _unchecked(got, t, exc)
        if mark is not None:
            mark.feed(at, view[:n])
    look.into(got)
    if mark is not None and not got.constant:
        got.fingerprint = mark.digest()
    return got


def _pread(fd: int, into: memoryview, offset: int, t: TensorInfo) -> None:
    done = 0
    while done < len(into):
        n = os.preadv(fd, [into[done:]], offset + done)
        if not n:
            raise CorruptCheckpointError(f"the file ends inside the bytes of {t.key} "
                                         "(truncated?)")
        done += n


def _bad_files(t: TensorInfo, values: torch.Tensor) -> list[str]:
    """The files of ``t``'s chunks whose box holds a NaN or an Inf."""
    import torch

    bad = set()
    flat = values.reshape(-1) if t.chunks[0].flat else None
    for c in t.chunks:
        if not all(c.sizes):
            continue
        if flat is not None:
            box = flat[c.offsets[0]:c.offsets[0] + c.sizes[0]]
        else:
            box = values[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes,
                                                               strict=True))]
        if dtypes.is_floating(t.dtype) and t.dtype not in _HALF and \
                t.dtype not in dtypes.COMPLEX:
            box = box.float()
        if not bool(torch.isfinite(box).all()):
            bad.add(c.file)
    return sorted(bad)
