"""A ``torch.save`` archive embedded in a slice of a file, read as a file of its own.

DCP's ``FileSystemWriter`` writes every item of a ``.distcp`` file (a tensor
chunk, or a non-tensor value) as a complete ``torch.save`` zip, one after
the other; ``.metadata`` gives each one's offset and length. Zip offsets
inside an item are relative to the item's start, so the item is opened
through a ``Window`` onto its bytes, and read by the torch zip reader (its
pickle with ckptool's own unpickler). Only the zip directory and the pickle
record are read, never a storage's bytes; ``absolute`` says where a
storage record's bytes lie in the outer file.
"""

from __future__ import annotations

from typing import IO

from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.read import fs
from ckptool.read.formats import torch_zip
from ckptool.read.formats.base import RawRead
from ckptool.read.ziparchive import ZipArchive, ZipError

ZIP_MAGIC = b"PK\x03\x04"
TRANSFORM_HINT = ("the checkpoint was saved with a compressing extension "
                  "(FileSystemWriter(_extensions=[ZStandard()])); ckptool does not read "
                  "those yet")


class Window:
    """The bytes ``[start, start + length)`` of an open file, as a file
    (``seek``, ``read``, ``tell``) that cannot read outside them."""

    def __init__(self, f: IO[bytes], start: int, length: int) -> None:
        self.f, self.start, self.length = f, start, length
        self.pos = 0

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, min(self.length, base + pos))
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        left = self.length - self.pos
        n = left if n is None or n < 0 else min(n, left)
        self.f.seek(self.start + self.pos)
        data = self.f.read(n)
        self.pos += len(data)
        return data


def open_item(f: IO[bytes], start: int, length: int, shown: str) -> ZipArchive:
    """The zip directory of the archive at ``f[start:start + length]``."""
    window = Window(f, start, length)
    head = window.read(4)
    window.seek(0)
    if head != ZIP_MAGIC:
        raise CorruptCheckpointError(
            f"{shown} holds no torch.save archive at byte {start} (it starts with {head!r})",
            "the .distcp file does not match its .metadata: it was damaged or replaced")
    try:
        return ZipArchive(window, length)  # type: ignore[arg-type]
    except ZipError as exc:
        raise CorruptCheckpointError(f"{shown}: the archive at byte {start} is damaged ({exc})",
                                     "the file was probably cut short or damaged") from exc


def read_item(path: str, shown: str, start: int, length: int,
              transforms: tuple[str, ...] = ()) -> tuple[RawRead, dict[str, int]]:
    """The archive at ``path[start:start + length]``, read as a torch file;
    and, for each storage record, the absolute offset of its bytes in ``path``."""
    refuse_transforms(shown, transforms)
    with fs.open_binary(path) as f:
        size = fs.size_of(f)
        if start + length > size:
            raise CorruptCheckpointError(
                f"{shown} ends at byte {size}, inside the item at bytes {start}..{start + length} "
                "(truncated)", "the file was cut short while copying; copy it again")
        archive = open_item(f, start, length, shown)
        raw = torch_zip.read_archive(archive)
        offsets = {}
        for key, ref in raw.storages.items():
            if ref.record is not None:
                try:
                    offsets[key] = start + archive.data_offset(archive.members[ref.record])
                except (ZipError, KeyError) as exc:
                    raise CorruptCheckpointError(
                        f"{shown}: storage record {ref.record} of the archive at byte "
                        f"{start} is damaged ({exc})", "the file was damaged") from exc
    return raw, offsets


def refuse_transforms(shown: str, transforms: tuple[str, ...]) -> None:
    if transforms:
        raise UnsupportedCheckpointError(
            f"{shown}: an item is stored through {', '.join(transforms)}, which ckptool does "
            "not undo yet", TRANSFORM_HINT)
