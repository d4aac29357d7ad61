"""Tensor bytes on demand: a storage's bytes and a tensor's values, read
from the checkpoint file only when asked, only the bytes asked for.

Everything else in the core reads metadata; this is the one module that
reads tensor bytes. It finds where a storage's bytes lie (a stored zip
record's data offset, or the absolute ``@offset`` that legacy and
safetensors files, and the storages embedded in a plain pickle, record),
checks them against the file, and reads the byte range a tensor views into
a fresh buffer. torch is imported inside the functions that build tensors,
never at import time.

``TensorData(ckpt)`` keeps one open file (and one parsed zip directory) for
many reads; the module functions are one-shot conveniences.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ckptool import dtypes
from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.model import Checkpoint, StorageInfo, TensorInfo
from ckptool.read import fs
from ckptool.read.ziparchive import ZipArchive, ZipError

if TYPE_CHECKING:
    import torch

CHUNK_SIZE = 8 << 20
_READABLE_LAYOUTS = ("strided", "storage")
_HINT = "metadata (inspect, diff --no-values) is still available for this file"


class TensorData:
    """Reads storage bytes and tensor values of ``ckpt`` from its file.

    Use as a context manager, or call ``close()``. The file must be the one
    ``ckpt`` was read from; a file whose size changed since is refused.
    """

    def __init__(self, ckpt: Checkpoint) -> None:
        if ckpt.is_multifile:  # its tensors: ckptool.read.layouts.tensor_bytes
            raise UnsupportedCheckpointError(
                f"{ckpt.path} is a checkpoint of many files: reading its tensor values is "
                "not supported here yet", _HINT)
        self.ckpt = ckpt
        self.byteswap = _is_big_endian(ckpt)
        self._f = fs.open_binary(ckpt.path)  # closed by close()
        self._zip: ZipArchive | None = None
        self._spans: dict[str, int] = {}  # storage id -> absolute offset of its bytes
        size = fs.size_of(self._f)
        if size != ckpt.file_size:
            self.close()
            raise CorruptCheckpointError(
                f"{ckpt.path} changed since it was read ({ckpt.file_size} -> {size} bytes)",
                "run the command again once the file is no longer being written")

    def __enter__(self) -> TensorData:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._f.close()

    # -- bytes --------------------------------------------------------------
    def storage(self, storage_id: str) -> StorageInfo:
        info = self.ckpt.storages.get(storage_id)
        if info is None:
            raise UnsupportedCheckpointError(
                f"storage {storage_id} has no data record in {self.ckpt.path}", _HINT)
        return info

    def storage_offset(self, storage_id: str) -> int:
        """Absolute file offset of the first byte of storage ``storage_id``."""
        if storage_id in self._spans:
            return self._spans[storage_id]
        info = self.storage(storage_id)
        record = info.record
        if record is None and self.ckpt.format == "pickle":
            raise UnsupportedCheckpointError(
                f"storage {storage_id} of {self.ckpt.path} is spelled as text in the pickle "
                "(as pickle protocols 0 to 2 write bytes), not stored as it is",
                "save the file again with pickle protocol 3 or later, or with torch.save, "
                "to read its values")
        if record is None or record.startswith("@view:"):
            raise UnsupportedCheckpointError(
                f"storage {storage_id} has no readable bytes in {self.ckpt.path}", _HINT)
        if record.startswith("@"):
            start = int(record[1:])
        else:
            start = self._record_offset(record, info.nbytes)
        if start + info.nbytes > self.ckpt.file_size:
            raise CorruptCheckpointError(
                f"storage {storage_id} runs past the end of {self.ckpt.path} (truncated?)")
        self._spans[storage_id] = start
        return start

    def fileno(self) -> int:
        return self._f.fileno()

    def source(self) -> Any:
        """The input to copy bytes from: its descriptor, or for a remote
        checkpoint the file itself (read by ranges: ``pread``)."""
        return self._f if fs.is_remote(self.ckpt.path) else self._f.fileno()

    def record_crc(self, storage_id: str) -> int | None:
        """The zip directory's CRC of a storage whose record it fills, else None."""
        info = self.storage(storage_id)
        if info.record is None or info.record.startswith("@"):
            return None
        self.storage_offset(storage_id)  # parses the directory and checks the record
        assert self._zip is not None
        member = self._zip.members[info.record]
        return member.crc if member.size == info.nbytes else None

    def _record_offset(self, record: str, nbytes: int) -> int:
        try:
            if self._zip is None:
                self._zip = ZipArchive(self._f, self.ckpt.file_size)
            member = self._zip.members.get(record)
            if member is None:
                raise CorruptCheckpointError(f"storage record {record} is missing")
            if member.flags & 0x1 or member.method != 0:
                raise UnsupportedCheckpointError(
                    f"storage record {record} is compressed or encrypted "
                    "(torch.save stores records uncompressed)", _HINT)
            if member.compressed_size < nbytes:
                raise CorruptCheckpointError(
                    f"storage record {record} holds {member.compressed_size} bytes, "
                    f"{nbytes} expected")
            return self._zip.data_offset(member)
        except ZipError as exc:
            raise CorruptCheckpointError(f"cannot locate {record}: {exc}") from exc

    def _check_record(self, storage_id: str, data: bytearray) -> None:
        crc = self.record_crc(storage_id)
        if crc is not None and zlib.crc32(data) != crc:
            raise CorruptCheckpointError(
                f"storage {storage_id} of {self.ckpt.path} does not match its own checksum",
                "the file is damaged: fetch or copy it again; nothing was written")

    def storage_bytes(self, storage_id: str) -> bytearray:
        """All of a storage's bytes."""
        return self.read_range(storage_id, 0, self.storage(storage_id).nbytes)

    def read_range(self, storage_id: str, start: int, length: int) -> bytearray:
        """``length`` bytes of a storage from byte ``start`` (within the storage)."""
        info = self.storage(storage_id)
        if start < 0 or length < 0 or start + length > info.nbytes:
            raise CorruptCheckpointError(
                f"bytes {start}..{start + length} lie outside storage {storage_id} "
                f"({info.nbytes} bytes)")
        self._f.seek(self.storage_offset(storage_id) + start)
        buf = bytearray(length)
        view, got = memoryview(buf), 0
        while got < length:
            n = self._f.readinto(view[got:])
            if not n:
                raise CorruptCheckpointError(f"{self.ckpt.path} ends inside storage "
                                             f"{storage_id} (truncated?)")
            got += n
        return buf

    def iter_storage_chunks(self, storage_id: str,
                            chunk_size: int = CHUNK_SIZE) -> Iterator[bytes]:
        """A storage's bytes, ``chunk_size`` at a time (as saved: no byte swapping)."""
        nbytes = self.storage(storage_id).nbytes
        for start in range(0, nbytes, chunk_size):
            yield bytes(self.read_range(storage_id, start, min(chunk_size, nbytes - start)))

    # -- values -------------------------------------------------------------
    def values(self, tensor: TensorInfo, checked: bool = False) -> torch.Tensor:
        """``tensor``'s values as a CPU torch tensor with its shape and stride.
        ``checked``: when they fill their zip record, its bytes must have the
        directory's CRC (a writer that casts or re-serializes them must not
        turn damaged bytes into plausible ones)."""
        import torch

        _check_readable(tensor)
        assert tensor.storage is not None and tensor.stride is not None
        dtype = _torch_dtype(tensor.dtype)
        size = dtype.itemsize
        numel = tensor.numel
        if numel == 0:
            return torch.empty(tensor.shape, dtype=dtype)
        last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride, strict=True))
        start, length = tensor.storage_offset * size, (last + 1) * size
        buf = self.read_range(tensor.storage, start, length)
        if checked and start == 0 and length == self.storage(tensor.storage).nbytes:
            self._check_record(tensor.storage, buf)
        raw = torch.frombuffer(buf, dtype=torch.uint8)
        if self.byteswap and size > 1:
            unit = size // 2 if tensor.dtype in dtypes.COMPLEX else size
            raw = raw.view(-1, unit).flip(1).reshape(-1)
        if dtype == torch.bool and bool((raw > 1).any()):
            raw = raw != 0  # bytes other than 0/1 are not valid bools
        try:
            return raw.view(dtype).as_strided(tensor.shape, tensor.stride, 0)
        except RuntimeError as exc:
            raise UnsupportedCheckpointError(
                f"cannot view the bytes of {tensor.key} as {tensor.dtype}: {exc}",
                _HINT) from exc


Identity = tuple[int, int, int, int]


def file_identity(stat: os.stat_result) -> Identity:
    """What tells one version of a file from another: device, inode, size and
    modification time (a re-save by rename changes the inode, in place the
    size or time)."""
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


def check_unchanged(path: str, identity: Identity | None, fd: int | None = None) -> None:
    """A rewrite opens its input more than once: every open (``fd``), and the
    path itself after a read, must be the file the rewrite was planned from,
    or bytes of one version would be written under the pickle of another."""
    if identity is None:
        return
    try:
        now = file_identity(os.fstat(fd) if fd is not None else os.stat(path))
    except OSError as exc:
        raise CorruptCheckpointError(f"{path} disappeared while ckptool was reading it",
                                     "check the path and try again") from exc
    if now != identity:
        raise CorruptCheckpointError(
            f"{path} changed while ckptool was reading it",
            "run the command again once nothing is writing the file; nothing was written")


def _check_readable(tensor: TensorInfo) -> None:
    if tensor.layout not in _READABLE_LAYOUTS:
        raise UnsupportedCheckpointError(
            f"{tensor.key} is a {tensor.layout} tensor: reading its values is not supported",
            _HINT)
    if tensor.storage is None and (tensor.subclass or "").endswith(".DTensor"):
        raise UnsupportedCheckpointError(
            f"{tensor.key} is a DTensor: this file holds one rank's shard of it",
            "read the directory holding every rank's file: ckptool joins the shards")
    if tensor.storage is None or tensor.stride is None:
        what = "a meta tensor" if tensor.location == "meta" else "a tensor without storage"
        raise UnsupportedCheckpointError(f"{tensor.key} is {what}: the file holds no values",
                                         _HINT)
    if tensor.dtype in dtypes.QUANTIZED:
        raise UnsupportedCheckpointError(
            f"{tensor.key} is quantized ({tensor.dtype}): reading its values is not supported",
            _HINT)


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedCheckpointError(f"this torch has no dtype {name}",
                                         "upgrade torch to read these values")
    return dtype


def _is_big_endian(ckpt: Checkpoint) -> bool:
    meta = ckpt.metadata
    if ckpt.format in ("torch-zip", "torchscript"):
        order = meta.get("byteorder", "little")
        if order not in ("little", "big"):
            raise UnsupportedCheckpointError(f"{ckpt.path} has unknown byte order {order!r}")
        return bool(order == "big")
    if ckpt.format == "torch-legacy":
        sys_info: Any = meta.get("sys_info")
        return isinstance(sys_info, dict) and sys_info.get("little_endian") is False
    return False  # safetensors is little-endian by definition


def iter_storage_chunks(path: str | os.PathLike[str], ckpt: Checkpoint, storage_id: str,
                        chunk_size: int = CHUNK_SIZE) -> Iterator[bytes]:
    """Stream storage ``storage_id`` of ``ckpt`` (read from ``path``) in chunks."""
    with TensorData(_at(ckpt, path)) as data:
        yield from data.iter_storage_chunks(storage_id, chunk_size)


def read_storage(path: str | os.PathLike[str], ckpt: Checkpoint, storage_id: str) -> bytes:
    """All bytes of storage ``storage_id``, as saved."""
    with TensorData(_at(ckpt, path)) as data:
        return bytes(data.storage_bytes(storage_id))


def tensor_values(path: str | os.PathLike[str], ckpt: Checkpoint,
                  tensor: TensorInfo) -> torch.Tensor:
    """One tensor's values (a CPU torch tensor), read from ``path``."""
    with TensorData(_at(ckpt, path)) as data:
        return data.values(tensor)


def _at(ckpt: Checkpoint, path: str | os.PathLike[str]) -> Checkpoint:
    path = os.fspath(path)
    if path == ckpt.path:
        return ckpt
    from dataclasses import replace

    return replace(ckpt, path=path)
