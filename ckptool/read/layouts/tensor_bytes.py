"""One logical tensor's values from a checkpoint of many files: read from its
shard, or reassembled from its chunks.

- An HF shard's tensor (``TensorInfo.file``) is read as in a single file, by
  ``TensorData`` on a view of the checkpoint that is that shard alone (its
  storage records, its format and byte order).
- A DCP tensor (``TensorInfo.chunks``) is made whole: an empty tensor of its
  global shape, then each chunk's ``torch.save`` archive is opened in place
  (``embedded``), its pickle read with ckptool's unpickler, checked (one
  tensor of the chunk's shape and the tensor's dtype, whose bytes lie inside
  the item), its bytes read and copied into the chunk's box. Row- and
  column-sharded chunks, replicated and empty ones, and several per rank
  are all boxes.

Memory is the tensor plus one chunk (a tensor saved whole, in one chunk, is
that chunk); nothing else of the checkpoint is read.
torch is imported by the functions that make tensors, never at import time.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import TYPE_CHECKING

from ckptool import dtypes
from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.model import Checkpoint, Chunk, FileInfo, StorageInfo, TensorInfo
from ckptool.read import fs
from ckptool.read.layouts import embedded
from ckptool.read.layouts.base import BROKEN_HINT
from ckptool.read.tensor_data import TensorData
from ckptool.read.tensors import TensorRecord

if TYPE_CHECKING:
    import torch

HINT = "metadata (inspect) is still available for this checkpoint"


def read_tensor(ckpt: Checkpoint, tensor: TensorInfo) -> torch.Tensor:
    """``tensor``'s values as one contiguous CPU tensor of its global shape."""
    if ckpt.directory is None:
        raise UnsupportedCheckpointError(f"{ckpt.path} is a single file: use TensorData")
    if tensor.chunks:
        return _assemble(ckpt, tensor)
    if tensor.file is None or tensor.storage is None:
        raise UnsupportedCheckpointError(
            f"{tensor.key} has no bytes in {ckpt.path}", HINT)
    with TensorData(file_view(ckpt, tensor.file)) as data:
        return data.values(tensor).contiguous()


def tensor_bytes(ckpt: Checkpoint, tensor: TensorInfo) -> bytes:
    """``tensor``'s bytes, row-major and little-endian, as one file would hold them."""
    import torch

    values = read_tensor(ckpt, tensor)
    return values.reshape(-1).view(torch.uint8).numpy().tobytes()


def file_view(ckpt: Checkpoint, name: str) -> Checkpoint:
    """``ckpt`` as if it were only its file ``name`` (for ``TensorData``)."""
    info = _file_info(ckpt, name)
    assert ckpt.directory is not None
    order = ckpt.metadata.get("byteorder", {})
    big = isinstance(order, dict) and order.get(name) == "big"
    return replace(ckpt, path=os.path.join(ckpt.directory, name),
                   format=info.format or "torch-zip", file_size=info.size,
                   metadata={"byteorder": "big" if big else "little"},
                   directory=None, files=[])


def _file_info(ckpt: Checkpoint, name: str) -> FileInfo:
    for info in ckpt.files:
        if info.path == name:
            return info
    raise CorruptCheckpointError(f"{name} is not one of {ckpt.path}'s files", BROKEN_HINT)


def _assemble(ckpt: Checkpoint, tensor: TensorInfo) -> torch.Tensor:
    import torch

    dtype = getattr(torch, tensor.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedCheckpointError(f"this torch has no dtype {tensor.dtype}",
                                         "upgrade torch to read these values")
    if tensor.chunks[0].flat:
        return _assemble_flat(ckpt, tensor, dtype)
    filled = [c for c in tensor.chunks if math.prod(c.sizes)]
    if len(filled) == 1 and filled[0].sizes == tensor.shape:  # saved whole: no second copy
        return _read_chunk(ckpt, tensor, filled[0]).contiguous()
    out = torch.empty(tensor.shape, dtype=dtype)
    for chunk in tensor.chunks:
        if math.prod(chunk.sizes) == 0:
            continue
        part = _read_chunk(ckpt, tensor, chunk)
        box = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
        out[box] = part
    return out


def _assemble_flat(ckpt: Checkpoint, tensor: TensorInfo, dtype: torch.dtype) -> torch.Tensor:
    """A tensor made of runs of raw elements (DeepSpeed's partitions): each
    run read straight into its place (or read, then cast, where it is
    stored as another dtype)."""
    import torch

    assert ckpt.directory is not None
    out = torch.empty(tensor.numel, dtype=dtype)
    whole = memoryview(out.view(torch.uint8).numpy().data) if tensor.numel else None
    itemsize = out.element_size()
    for chunk in tensor.chunks:
        (at,), (count,) = chunk.offsets, chunk.sizes
        if not chunk.flat or at < 0 or count < 0 or at + count > tensor.numel:
            raise CorruptCheckpointError(f"{tensor.key}: a run at {at} of {count} elements "
                                         "lies outside it", BROKEN_HINT)
        if count == 0:
            continue
        with fs.open_binary(os.path.join(ckpt.directory, chunk.file)) as f:
            f.seek(chunk.byte_offset)
            if chunk.dtype is None and whole is not None:
                view = whole[at * itemsize:(at + count) * itemsize]
                got = f.readinto(view)
                data = None
            else:
                data = bytearray(chunk.byte_length)
                got = f.readinto(data)
        if got != chunk.byte_length:
            raise CorruptCheckpointError(
                f"{chunk.file} ends before the bytes of {tensor.key} (truncated)", BROKEN_HINT)
        if data is not None:
            stored = getattr(torch, chunk.dtype or tensor.dtype)
            out[at:at + count] = torch.frombuffer(data, dtype=stored).to(dtype)
    return out.view(tensor.shape)


def _read_raw(ckpt: Checkpoint, tensor: TensorInfo, chunk: Chunk) -> torch.Tensor:
    """A box of raw little-endian elements, row-major, at its byte offset."""
    import torch

    assert ckpt.directory is not None
    need = math.prod(chunk.sizes) * dtypes.itemsize(tensor.dtype)
    if chunk.byte_length != need:
        raise CorruptCheckpointError(f"{tensor.key}: its chunk in {chunk.file} is "
                                     f"{chunk.byte_length} bytes, {need} expected", BROKEN_HINT)
    data = bytearray(need)
    with fs.open_binary(os.path.join(ckpt.directory, chunk.file)) as f:
        f.seek(chunk.byte_offset)
        got = f.readinto(data)
    if got != need:
        raise CorruptCheckpointError(
            f"{chunk.file} ends before the bytes of {tensor.key} (truncated)", BROKEN_HINT)
    return torch.frombuffer(data, dtype=getattr(torch, tensor.dtype)).view(chunk.sizes)


def _read_chunk(ckpt: Checkpoint, tensor: TensorInfo, chunk: Chunk) -> torch.Tensor:
    if chunk.raw:
        return _read_raw(ckpt, tensor, chunk)
    assert ckpt.directory is not None
    path = os.path.join(ckpt.directory, chunk.file)
    shown = f"{chunk.file} (chunk of {tensor.key} at {list(chunk.offsets)})"
    raw, offsets = embedded.read_item(path, shown, chunk.byte_offset, chunk.byte_length,
                                      chunk.transforms)
    rec = raw.root
    unsafe = raw.seen.unsafe()
    if unsafe:  # read with ckptool's unpickler: nothing ran; said as what it is
        raise UnsupportedCheckpointError(
            f"{shown} names unsafe globals ({', '.join(unsafe)}), not a plain tensor",
            "the checkpoint was tampered with: do not load it with torch")
    if not (isinstance(rec, TensorRecord) and rec.storage is not None
            and rec.stride is not None and rec.layout == "strided"):
        raise CorruptCheckpointError(f"{shown} is not a plain tensor", BROKEN_HINT)
    if rec.shape != chunk.sizes or rec.dtype != tensor.dtype:
        raise CorruptCheckpointError(
            f"{shown} holds a {list(rec.shape)} {rec.dtype} tensor; .metadata says "
            f"{list(chunk.sizes)} {tensor.dtype}", BROKEN_HINT)
    ref = rec.storage
    start = offsets[ref.key]
    if start + ref.nbytes > chunk.byte_offset + chunk.byte_length:
        raise CorruptCheckpointError(f"{shown}: its bytes run past the item", BROKEN_HINT)
    sid = "chunk"
    view = Checkpoint(
        path=path, format="torch-zip", file_size=fs.getsize(path), tensors=[],
        storages={sid: StorageInfo(sid, ref.dtype, ref.location, ref.nbytes, f"@{start}", ())},
        entries=[], globals=[], main_state_dict=None,
        metadata={"byteorder": raw.metadata.get("byteorder", "little")})
    info = TensorInfo(tensor.key, rec.shape, rec.dtype, rec.stride, rec.storage_offset, sid,
                      None, rec.nbytes)
    with TensorData(view) as data:
        return data.values(info)
