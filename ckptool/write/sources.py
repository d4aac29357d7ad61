"""Where a writer gets a tensor's bytes, for a checkpoint of one file or many.

``TensorSource(ckpt)`` gives the segments (``ckptool.write.layout``) that
write one tensor of ``ckpt``, C-contiguous and little-endian, as a dtype:

- one file: ``tensor_segment`` on the file (a ``Span`` of it when the bytes
  lie as they are, else made through torch);
- Hugging Face shards: the same, on the shard that holds the tensor (each
  shard is opened once, and kept open until ``close``);
- a DeepSpeed checkpoint: its partitions' runs of elements, as ``Span``\\ s
  of the ranks' files, where they are stored as the dtype written; else
  made whole (a cast);
- a DCP directory: where every chunk of the tensor is a run of whole rows
  (``Shard(0)``, or the tensor whole), saved densely and as the tensor's
  dtype, the chunks' bytes are ``Span``\\ s of their ``.distcp`` files, one
  after the other in row order: nothing passes through memory. Anything else
  (column-sharded chunks, a cast) is made whole when its turn comes
  (``ckptool.read.layouts.tensor_bytes``): memory is that tensor and one chunk.

``values(t)`` gives the tensor itself (for the DCP writer), ``single(...)``
one segment whose CRC is the record's (a zip record needs one).
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

from ckptool import dtypes
from ckptool.model import Checkpoint, Chunk, TensorInfo
from ckptool.read import fs
from ckptool.read.layouts import embedded
from ckptool.read.tensor_data import TensorData
from ckptool.read.tensor_source import TensorValues
from ckptool.read.tensors import TensorRecord
from ckptool.write.layout import Made, Segment, Source, input_segment, tensor_segment

if TYPE_CHECKING:
    import torch


class TensorSource:
    """The bytes of ``ckpt``'s tensors, for the writers; use as a context manager."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self._values = TensorValues(ckpt)
        self._fds: dict[str, int] = {}  # the .distcp files whole-row chunks are copied from
        self._remote: dict[str, Any] = {}  # ... or those of a remote checkpoint

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._values.close()
        for fd in self._fds.values():
            os.close(fd)
        for f in self._remote.values():
            f.close()
        self._remote.clear()
        self._fds.clear()

    def reader(self, t: TensorInfo) -> TensorData:
        """The single-file reader of the file that holds ``t`` (not DCP)."""
        return self._values.reader(t)

    def segments(self, t: TensorInfo, dtype: str, at: int, name: str) -> list[Segment]:
        """``t``'s bytes as ``dtype`` written at ``at``: one segment, or for a
        row-sharded DCP tensor one ``Span`` per chunk."""
        if self.ckpt.derived_from is not None:  # made from another tensor's values
            return [self._made(t, dtype, at, name)]
        if t.chunks:
            spans = self._row_spans(t, dtype, at, name)
            return spans if spans is not None else [self._made(t, dtype, at, name)]
        return [tensor_segment(self.reader(t), t, dtype, at, name)]

    def single(self, t: TensorInfo, dtype: str, at: int, name: str) -> Segment:
        """``t``'s bytes as one segment (a zip record's CRC is one segment's)."""
        if self.ckpt.derived_from is not None:
            return self._made(t, dtype, at, name)
        if t.chunks:
            spans = self._row_spans(t, dtype, at, name)
            return spans[0] if spans is not None and len(spans) == 1 else \
                self._made(t, dtype, at, name)
        return tensor_segment(self.reader(t), t, dtype, at, name)

    def values(self, t: TensorInfo) -> torch.Tensor:
        """``t`` as one contiguous CPU tensor."""
        return self._values.values(t, checked=True).contiguous()

    def _made(self, t: TensorInfo, dtype: str, at: int, name: str) -> Made:
        size = t.numel * dtypes.itemsize(dtype)

        def make() -> bytes | memoryview:
            import torch

            values = self.values(t).reshape(-1)
            if dtype != t.dtype:  # cast in one step, into memory of its own
                values = values.to(getattr(torch, dtype))
            return values.view(torch.uint8).numpy().data  # written as it is

        return Made(at, size, name, make)

    def _row_spans(self, t: TensorInfo, dtype: str, at: int, name: str) -> list[Segment] | None:
        """Spans of the ``.distcp`` files, when each chunk is whole rows laid
        out densely as ``t``'s dtype (or of DeepSpeed's partitions, runs of
        raw elements stored as ``t``'s dtype); None when it must be made."""
        if dtype != t.dtype or self.ckpt.directory is None:
            return None
        if t.chunks[0].flat:
            return self._flat_spans(t, at, name)
        if not t.shape:
            return None
        chunks = sorted((c for c in t.chunks if math.prod(c.sizes)), key=lambda c: c.offsets)
        itemsize = dtypes.itemsize(t.dtype)
        row = math.prod(t.shape[1:]) * itemsize
        spans: list[Segment] = []
        expect = 0
        for c in chunks:
            if c.offsets[0] != expect or tuple(c.offsets[1:]) != (0,) * (len(t.shape) - 1) or \
                    tuple(c.sizes[1:]) != tuple(t.shape[1:]) or c.transforms:
                return None
            src = self._chunk_data(t, c)
            if src is None:
                return None
            spans.append(input_segment(self._source(c.file), at + c.offsets[0] * row, src,
                                       c.sizes[0] * row, f"{name} [rows {c.offsets[0]}..]"))
            expect += c.sizes[0]
        if expect != t.shape[0] or not spans:
            return None
        return spans

    def _flat_spans(self, t: TensorInfo, at: int, name: str) -> list[Segment] | None:
        itemsize = dtypes.itemsize(t.dtype)
        spans: list[Segment] = []
        expect = 0
        for c in sorted((c for c in t.chunks if c.sizes[0]), key=lambda c: c.offsets):
            if c.offsets[0] != expect or c.dtype is not None or \
                    c.byte_length != c.sizes[0] * itemsize:
                return None
            spans.append(input_segment(self._source(c.file), at + expect * itemsize,
                                       c.byte_offset, c.byte_length,
                                       f"{name} [elements {expect}..]"))
            expect += c.sizes[0]
        return spans if expect == t.numel and spans else None

    def _chunk_data(self, t: TensorInfo, c: Chunk) -> int | None:
        """Where a chunk's elements start in its file, when they lie there
        densely, little-endian, as the tensor's dtype; else None."""
        assert self.ckpt.directory is not None
        if c.raw:  # a box of raw elements where the chunk says (checked when read)
            return c.byte_offset if c.byte_length == math.prod(c.sizes) * dtypes.itemsize(
                t.dtype) else None
        path = os.path.join(self.ckpt.directory, c.file)
        raw, offsets = embedded.read_item(path, f"{c.file} (chunk of {t.key})",
                                          c.byte_offset, c.byte_length)
        rec = raw.root
        if not (isinstance(rec, TensorRecord) and rec.storage is not None
                and rec.dtype == t.dtype and rec.shape == c.sizes
                and rec.stride == tuple(math.prod(c.sizes[i + 1:]) for i in range(len(c.sizes)))
                and raw.metadata.get("byteorder", "little") == "little"):
            return None
        start = offsets[rec.storage.key] + rec.storage_offset * dtypes.itemsize(t.dtype)
        if start + math.prod(c.sizes) * dtypes.itemsize(t.dtype) > \
                c.byte_offset + c.byte_length:
            return None
        return start

    def _source(self, name: str) -> Source:
        """The input file ``name`` of the checkpoint's folder: a descriptor,
        or a remote file read by ranges."""
        assert self.ckpt.directory is not None
        path = fs.join(self.ckpt.directory, name)
        if fs.is_remote(path):
            if name not in self._remote:
                self._remote[name] = fs.open_binary(path)
            return self._remote[name]
        if name not in self._fds:
            self._fds[name] = os.open(path, os.O_RDONLY)
        return self._fds[name]
