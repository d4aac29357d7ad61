"""What every format reader returns, and helpers they share.

A reader turns a file into a ``RawRead``: the inert object tree of the file
(containers, ``StandIn``s, ``TensorRecord``s), the storages it refers to, the
globals it names and a few format facts. Turning that into the user-facing
``Checkpoint`` is ``ckptool.read.reader``'s job, the same for every format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptool.errors import CorruptCheckpointError
from ckptool.read.seen import GlobalsSeen
from ckptool.read.tensors import MAX_INT64, StorageRef, StorageType
from ckptool.read.treecheck import HINT
from ckptool.read.values import brief


@dataclass
class RawRead:
    format: str
    root: Any
    storages: dict[str, StorageRef]
    seen: GlobalsSeen = field(default_factory=GlobalsSeen)
    metadata: dict[str, Any] = field(default_factory=dict)
    # further object trees shown beside the root (TorchScript constants)
    extra_roots: dict[str, Any] = field(default_factory=dict)
    # what the file holds that its format does not (bytes after the end...)
    warnings: list[str] = field(default_factory=list)


def parse_storage_pid(pid: tuple[Any, ...], fields: int) -> tuple[StorageType, str, str, int]:
    """Check a torch ``('storage', type, key, location, numel[, view])`` id."""
    if len(pid) != fields or pid[0] != "storage":
        raise CorruptCheckpointError(f"unexpected persistent id: {brief(pid, 100)}", HINT)
    _, stype, key, location, numel = pid if fields == 5 else pid[:5]
    if not isinstance(stype, StorageType):
        raise CorruptCheckpointError(f"storage of unknown type {brief(stype)}", HINT)
    if not isinstance(key, str) or not isinstance(location, str):
        raise CorruptCheckpointError(f"malformed storage id: {brief(pid, 100)}", HINT)
    if type(numel) is not int or not 0 <= numel <= MAX_INT64:
        raise CorruptCheckpointError(f"storage {key} has a bad size: {brief(numel, 40)}", HINT)
    return stype, key, location, numel
