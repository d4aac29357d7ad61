"""What a reader of many files returns, and the checks they share.

A ``MultiRead`` is a single file's ``RawRead`` (one object tree: a flat dict
of tensor records and values, the storages, the globals every pickle named)
plus what only many files have: the files, where each storage lives, each
tensor's chunks, and names the index records as tied. ``ckptool.read.reader``
assembles it into a ``Checkpoint`` the same way as any file.
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass, field, replace
from typing import Any

from ckptool.errors import CorruptCheckpointError
from ckptool.model import Chunk, FileInfo
from ckptool.read import fs
from ckptool.read.formats.base import RawRead
from ckptool.read.tensors import TensorRecord

MISSING_HINT = ("a file of the checkpoint is missing: copy or download the whole directory "
                "again")
BROKEN_HINT = ("the checkpoint's files do not agree with each other; it was damaged, or "
               "written by an interrupted or buggy save")


@dataclass
class MultiRead:
    raw: RawRead  # the merged tree, storages (ids unique across files), globals
    directory: str
    files: list[FileInfo]
    storage_files: dict[str, str] = field(default_factory=dict)  # storage id -> file
    chunks: dict[str, tuple[Chunk, ...]] = field(default_factory=dict)  # key -> chunks
    aliases: dict[str, str] = field(default_factory=dict)  # name -> the name stored (HF)
    # top-level names of a nested save (DCP's "model", "optim") -> their keys,
    # so that the main state dict is the model's, not the optimizer's
    groups: dict[str, list[str]] | None = None
    # each group's entry as a key ("app/model" of the group "app.model"), to rank it by
    group_keys: dict[str, str] = field(default_factory=dict)
    paths: dict[str, tuple[str | int, ...]] = field(default_factory=dict)  # DCP planner_data
    notes: list[str] = field(default_factory=list)  # what else is there: no problem
    chunk_keys: bool = False  # chunks are keyed by key text (nested trees), not by names


def tied_records(root: dict[Any, Any], aliases: dict[str, str]) -> dict[str, TensorRecord]:
    """A record for each tied name ``aliases`` gives (alias -> the name
    stored) whose twin is a tensor of ``root`` and which ``root`` lacks: a
    copy of the twin's, sharing its storage (another record: the same object
    twice would read as a shared container)."""
    return {alias: replace(rec) for alias, kept in aliases.items()
            if type(rec := root.get(kept)) is TensorRecord and alias not in root}


def list_ties(multi: MultiRead) -> None:
    """Each name the files record as tied to a stored tensor (an index's
    ``metadata``, DeepSpeed's ``shared_params``) listed as a tensor of its
    own, sharing the stored one's storage and chunks: one tensor under two
    names, as ``torch.load`` of a file with tied weights gives it, so that
    every view lists it and a writer keeps it as a tie (``aliases`` still
    says which name is stored)."""
    root = multi.raw.root
    if not isinstance(root, dict):
        return
    added = tied_records(root, multi.aliases)
    root.update(added)
    for alias in added:
        kept = multi.aliases[alias]
        if kept in multi.chunks:
            multi.chunks[alias] = multi.chunks[kept]
        for names in (multi.groups or {}).values():
            if kept in names and alias not in names:
                names.append(alias)


def contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a row-major tensor of ``shape``."""
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def member(directory: str, name: object, named_by: str) -> str:
    """The path of file ``name`` that ``named_by`` names: a relative path
    inside ``directory``, never one that leaves it."""
    if not isinstance(name, str) or not name:
        raise CorruptCheckpointError(f"{named_by} names a file that is not a string",
                                     BROKEN_HINT)
    if "\0" in name:
        raise CorruptCheckpointError(f"{named_by} names {name!r:.80}, with a NUL byte in it",
                                     BROKEN_HINT)
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or ".." in parts:
        raise CorruptCheckpointError(
            f"{named_by} names {name!r:.80}, outside the checkpoint's directory",
            "a checkpoint names only files beside it; this one may be made to read others")
    return os.path.join(directory, *parts)


def file_size(path: str, shown: str, named_by: str) -> int:
    """The size of a file the checkpoint needs (a regular file: not a
    directory), or an error naming it."""
    try:
        if fs.is_remote(path):
            regular, size = fs.isfile(path), fs.getsize(path)  # (FileNotFoundError if missing)
        else:
            info = os.stat(path)
            regular, size = stat.S_ISREG(info.st_mode), info.st_size
        if not regular:
            raise CorruptCheckpointError(
                f"{shown} (named by {named_by}) is not a file",
                "a checkpoint's files are regular files: copy the checkpoint again")
        return size
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{shown} is missing (named by {named_by})",
                                     MISSING_HINT) from exc
    except OSError as exc:
        raise CorruptCheckpointError(f"{shown}: cannot read it ({exc.strerror})",
                                     "check its permissions") from exc
