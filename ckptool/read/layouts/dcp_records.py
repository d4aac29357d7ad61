"""What a ``torch.distributed.checkpoint`` ``.metadata`` says, as plain
records: each tensor's shape, dtype and chunks, each value's bytes, and where
they lie. ``dcp_metadata`` reads them from the pickle (``dcp_fast`` the fast
way); the DCP layout and ``verify`` use them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

MODULES = ("torch.distributed.checkpoint.", "torch.distributed._shard.checkpoint.")


class Item(NamedTuple):
    """Where one saved item's bytes lie. (A named tuple: a million of them are
    made in C, ``tuple.__new__(Item, fields)``, when a large ``.metadata`` is read.)"""

    file: str  # relative to the checkpoint's directory
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


@dataclass
class TensorMeta:
    fqn: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool
    boxes: list[tuple[tuple[int, ...], tuple[int, ...], Item]] = field(default_factory=list)


@dataclass
class Metadata:
    tensors: dict[str, TensorMeta] = field(default_factory=dict)
    values: dict[str, Item] = field(default_factory=dict)  # BYTE_IO items
    planner: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    version: str | None = None
    other: Any = None  # what the pickle held, when it is no DCP Metadata
