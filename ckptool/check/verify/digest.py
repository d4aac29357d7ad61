"""A tensor's digest: the sha256 of its logical bytes, whatever the layout.

``tensor_digest(values)`` is ``"sha256:<hex>"`` of the tensor's elements in
C order, little-endian, as its own dtype, with no header: the bytes a
safetensors file or a contiguous ``torch.save`` record holds for it. So the
digest of one tensor is the same whether it was read from a torch zip, a
legacy file, a safetensors shard, a DCP directory (made whole from its
chunks) or a ZeRO partition, and two checkpoints of different layouts can
be compared tensor by tensor (``ckptool diff`` with manifests).

A 0-element tensor's digest is the sha256 of no bytes; a scalar's is that of
its one element. Sub-byte dtypes (``uint4``, ``float4_e2m1fn_x2``...) hash
their bytes as stored (packed). Values are assumed to be held in the
little-endian order of every platform torch ships for (ckptool's readers
byte-swap a big-endian file's values when they read them).

A tensor that is not contiguous is hashed a block of rows at a time, so the
copy this takes is a few MiB, not the tensor again. ``digest_ranges`` hashes
bytes where they lie in files (a tensor stored densely, as it is), through
one buffer: no copy of the tensor at all. ``hashlib`` releases the
GIL while it hashes, so digests run alongside other threads.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from ckptool.errors import CorruptCheckpointError

if TYPE_CHECKING:
    import torch

PREFIX = "sha256:"
BLOCK = 8 << 20  # bytes hashed per call (and copied, for a tensor that is not contiguous)


def tensor_digest(values: torch.Tensor) -> str:
    """``"sha256:<hex>"`` of ``values``' logical bytes (a dense tensor)."""
    return digest_bytes(logical_bytes(values))


def digest_bytes(chunks: Iterable[bytes | bytearray | memoryview]) -> str:
    """``"sha256:<hex>"`` of the bytes of ``chunks``, one after the other."""
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return PREFIX + h.hexdigest()


def digest_ranges(ranges: Iterable[tuple[int, int, int]], what: str = "a tensor") -> str:
    """``"sha256:<hex>"`` of the byte ranges ``(fd, offset, length)`` of open
    files, one after the other: a tensor whose bytes lie in its file as they
    are, hashed through one buffer (memory: ``BLOCK``, not the tensor)."""
    h = hashlib.sha256()
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    for fd, offset, length in ranges:
        done = 0
        while done < length:
            want = min(BLOCK, length - done)
            n = os.preadv(fd, [view[:want]], offset + done)
            if n <= 0:
                raise CorruptCheckpointError(
                    f"the bytes of {what} end at byte {offset + done} of their file, "
                    f"{length - done} bytes early", "the file is truncated")
            h.update(view[:n])
            done += n
    return PREFIX + h.hexdigest()


def logical_bytes(values: torch.Tensor) -> Iterator[memoryview]:
    """``values``' elements in C order as raw bytes, ``BLOCK`` at a time."""
    import torch

    if values.layout != torch.strided:
        raise TypeError(f"a digest is of a dense tensor, not a {values.layout} one")
    if values.device.type != "cpu":
        values = values.cpu()
    values = values.resolve_conj().resolve_neg()
    if values.numel() == 0:
        return
    if values.is_contiguous():
        yield from _blocks(values)
        return
    if values.dim() == 1:  # a strided vector: one element per row (a view)
        values = values.unsqueeze(1)
    per_row = max(1, values[0].numel() * values.element_size())
    rows = max(1, BLOCK // per_row)
    for start in range(0, values.shape[0], rows):
        yield from _blocks(values[start:start + rows].contiguous())


def _blocks(values: torch.Tensor) -> Iterator[memoryview]:
    import torch

    raw = values.reshape(-1).view(torch.uint8).numpy().data
    for start in range(0, len(raw), BLOCK):
        yield raw[start:start + BLOCK]


def is_digest(text: object) -> bool:
    """True for a string shaped like a digest (``sha256:`` and 64 hex digits)."""
    if not isinstance(text, str) or not text.startswith(PREFIX):
        return False
    hexpart = text[len(PREFIX):]
    return len(hexpart) == 64 and all(c in "0123456789abcdef" for c in hexpart)
