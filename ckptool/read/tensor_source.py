"""Tensor values of any checkpoint, one tensor at a time, whatever its layout.

Views that read values (``diff``, the browser's statistics) take a
``Checkpoint`` and should not care how many files it is:

- ``TensorValues(ckpt).values(t)``: ``t``'s values as its file holds them.
  A single file is read through one open ``TensorData``, a shard through
  one per shard (``reader``, kept open until ``close``: the writers copy
  from them too), and a DCP tensor made whole from its chunks
  (``layouts.tensor_bytes.read_tensor``), so memory follows that one tensor.
- ``WholeTensors(ckpt)`` with ``contiguous(t)``: for code that reads a
  tensor in pieces (``ckptool.check.stats``): on a checkpoint of many files
  the logical tensor is read once, whole, and the pieces are views into it,
  addressed as if it were saved contiguous from offset 0. Only the last
  tensor read is kept.

A sparse tensor's parts carry no file of their own; they live where their
storage does. torch is imported by the functions that make tensors.
"""

from __future__ import annotations

import math
from dataclasses import replace
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

from ckptool.errors import UnsupportedCheckpointError
from ckptool.model import Checkpoint, TensorInfo
from ckptool.read.layouts.tensor_bytes import file_view, read_tensor
from ckptool.read.tensor_data import TensorData

if TYPE_CHECKING:
    import torch


class ValueSource(Protocol):
    """What reads values by ``TensorInfo``: ``TensorData``, ``WholeTensors``."""

    def values(self, tensor: TensorInfo) -> torch.Tensor: ...


class TensorValues:
    """Values of ``ckpt``'s tensors, read on demand; a context manager.

    A single file is opened on first use (its ``UnsupportedCheckpointError``
    is raised then, and again for every later tensor)."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self._readers: dict[str | None, TensorData] = {}  # by file (None: the one file)
        self._errors: dict[str | None, UnsupportedCheckpointError] = {}
        # a view of derived tensors: the source's values, the last one read kept
        # (the layers of one stacked tensor are made one after the other)
        made = ckpt.derived_from
        self._source = TensorValues(made.source) if made is not None else None
        self._last: tuple[str, torch.Tensor] | None = None

    def __enter__(self) -> TensorValues:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        if self._source is not None:
            self._source.close()
        self._last = None

    def reader(self, tensor: TensorInfo) -> TensorData:
        """The reader of the one file, or of the shard, that holds ``tensor``
        (not a DCP tensor's: it has chunks), opened on first use."""
        key = located(self.ckpt, tensor).file if self.ckpt.is_multifile else None
        if key in self._errors:
            raise self._errors[key]
        if key not in self._readers:
            try:
                self._readers[key] = TensorData(
                    self.ckpt if key is None else file_view(self.ckpt, key))
            except UnsupportedCheckpointError as exc:
                self._errors[key] = exc
                raise
        return self._readers[key]

    def values(self, tensor: TensorInfo, checked: bool = False) -> torch.Tensor:
        """``tensor``'s values as a CPU tensor of its shape (``checked``: a
        zip record's bytes against its CRC, ``TensorData.values``)."""
        if self._source is not None:
            return self._derived(tensor, checked)
        if tensor.chunks or (self.ckpt.is_multifile and located(self.ckpt, tensor).file
                             is None):  # read_tensor makes it whole, or says why not
            return read_tensor(self.ckpt, tensor)
        return self.reader(tensor).values(tensor, checked)


    def _derived(self, tensor: TensorInfo, checked: bool) -> torch.Tensor:
        """A derived tensor's values, made from its source tensor's."""
        assert self._source is not None
        made = self.ckpt.derived_from
        plan = made.plans[tensor.key]
        if self._last is None or self._last[0] != plan.source:
            self._last = None  # the last source goes before the next is read
            self._last = (plan.source, self._source.values(made.by_key[plan.source], checked))
        return plan.apply(self._last[1])


def located(ckpt: Checkpoint, tensor: TensorInfo) -> TensorInfo:
    """``tensor`` with the file that holds it (a sparse tensor's part: its storage's)."""
    if tensor.file is not None or tensor.chunks or tensor.storage is None:
        return tensor
    storage = ckpt.storages.get(tensor.storage)
    return replace(tensor, file=storage.file) if storage is not None else tensor


def contiguous(tensor: TensorInfo) -> TensorInfo:
    """``tensor`` (and its parts) as if saved contiguous from offset 0: how
    ``WholeTensors`` addresses the pieces of a tensor of many files."""
    if tensor.stride is None:
        return replace(tensor, parts=tuple(contiguous(p) for p in tensor.parts))
    shape = tensor.shape
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return replace(tensor, stride=stride, storage_offset=0,
                   parts=tuple(contiguous(p) for p in tensor.parts))


class WholeTensors:
    """A ``ValueSource`` over a checkpoint of many files for readers of pieces:
    ``values(piece)`` of a tensor addressed by ``contiguous`` reads that
    tensor whole (once) and returns the piece as a view of it."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.source = TensorValues(ckpt)
        self.by_key = {t.key: t for top in ckpt.tensors for t in (top, *top.parts)}
        self._key: str | None = None
        self._flat: torch.Tensor | None = None

    def values(self, tensor: TensorInfo) -> torch.Tensor:
        original = self.by_key.get(tensor.key)
        if original is None:
            raise UnsupportedCheckpointError(f"{tensor.key} is no tensor of "
                                             f"{self.source.ckpt.path}")
        if tensor.stride is None or tensor.storage is None:
            return self.source.values(original)  # read_tensor says what it cannot read
        if self._key != tensor.key or self._flat is None:
            self._flat = None  # the last tensor goes before the next is read
            self._flat = self.source.values(original).reshape(-1)
            self._key = tensor.key
        return self._flat.as_strided(tensor.shape, tensor.stride, tensor.storage_offset)
