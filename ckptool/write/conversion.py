"""``ckptool convert``: torch checkpoints to safetensors and back.

torch -> safetensors writes the main state dict (of any torch format,
legacy and TorchScript included). safetensors cannot share memory, so tied
weights (exact aliases: same storage, offset, shape and stride) are written
once and the other names recorded under ``ckptool.aliases`` in
``__metadata__``; other views and non-contiguous tensors are written as their
own contiguous copies. Plain non-tensor entries go to ``__metadata__`` as
JSON under ``ckptool.entries``; everything else is reported as left out,
never silently dropped.

safetensors -> torch writes a torch zip state dict (``torch.save``'s layout),
restoring the recorded aliases as tensors that share storage again.

Both directions stream tensor bytes, write a temporary file, read it back to
check names, shapes, dtypes and every tensor's bytes (CRC), then rename it
into place.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptool import dtypes
from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError, UsageError
from ckptool.model import Checkpoint, TensorInfo
from ckptool.read.formats.safetensors_fmt import SAFETENSORS
from ckptool.read.reader import open_checkpoint
from ckptool.read.tensor_data import TensorData
from ckptool.read.tensors import StorageRef, StorageType, TensorRecord
from ckptool.read.values import TorchDtype
from ckptool.write import repickle
from ckptool.write.atomic import AtomicOutput
from ckptool.write.bytecheck import ByteChecker
from ckptool.write.fastcrc import crc_file_range
from ckptool.write.gather import copy_pieces
from ckptool.write.outputcheck import Expected, check_bytes
from ckptool.write.zipwriter import ZipWriter

ST_CODES = {v: k for k, v in dtypes.SAFETENSORS_DTYPES.items()}
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")
CHUNK = 16 << 20
CHECK_BATCH = 64 << 20  # bytes handed to the verifier at a time
_TYPED = {v: k for k, v in dtypes.STORAGE_DTYPES.items() if k not in ("UntypedStorage",
                                                                       "TypedStorage")}
Progress = Callable[[int, int], None]


@dataclass
class ConvertResult:
    source: Checkpoint
    output: str
    direction: str  # "safetensors" or "torch"
    tensors: int = 0
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> kept name
    copied_views: list[str] = field(default_factory=list)  # written as their own copy
    kept_entries: list[str] = field(default_factory=list)  # in __metadata__
    left_out: list[str] = field(default_factory=list)  # not representable, reported
    bytes_written: int = 0


def convert(src: str, dst: str, *, force: bool = False,
            progress: Progress | None = None, fsync: bool = False) -> ConvertResult:
    """Convert ``src`` into ``dst`` (the format from its extension). The output
    is durable on disk before this returns when ``fsync`` is set or it
    replaces a file (``AtomicOutput``)."""
    suffix = Path(dst).suffix.lower()
    if suffix not in (".safetensors", *TORCH_SUFFIXES):
        raise UsageError(f"cannot tell the output format from {dst!r}",
                         "name it *.safetensors, or *.pt / *.pth / *.bin for torch")
    source = open_checkpoint(src)
    if suffix == ".safetensors":
        if source.format == SAFETENSORS:
            raise UsageError(f"{src} is already safetensors", "name a torch output: OUT.pth")
        return _to_safetensors(source, dst, AtomicOutput(dst, force, fsync), progress)
    if source.format != SAFETENSORS:
        raise UsageError(f"{src} is already a torch checkpoint",
                         "use `ckptool fix` to rewrite torch files")
    return _to_torch(source, dst, AtomicOutput(dst, force, fsync), progress)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def _is_dense(t: TensorInfo) -> bool:
    return t.numel <= 1 or tuple(
        s for s, n in zip(t.stride or (), t.shape, strict=True) if n > 1) == tuple(
        s for s, n in zip(_contiguous_strides(t.shape), t.shape, strict=True) if n > 1)


def _tensor_chunks(reader: TensorData, t: TensorInfo) -> Iterator[bytes]:
    """A tensor's elements, C-contiguous, as bytes: read straight from its
    storage when dense, gathered through torch otherwise."""
    size = dtypes.itemsize(t.dtype)
    if t.storage is not None and _is_dense(t):
        start = t.storage_offset * size
        for at in range(0, t.nbytes, CHUNK):
            yield bytes(reader.read_range(t.storage, start + at, min(CHUNK, t.nbytes - at)))
        return
    values = reader.values(t).contiguous()
    yield ctypes.string_at(values.data_ptr(), values.numel() * values.element_size())


def _plan_names(source: Checkpoint) -> tuple[dict[str, TensorInfo], dict[str, str], list[str]]:
    """(tensors to write, aliases, names written as copies of shared storage)."""
    sd = source.state_dict()
    if not sd:
        raise UnsupportedCheckpointError("no state dict found to convert",
                                         "see `ckptool inspect` for what the file holds")
    bad = sorted({t.dtype for t in sd.values() if t.dtype not in ST_CODES})
    if bad:
        raise UnsupportedCheckpointError(f"safetensors cannot hold {', '.join(bad)} tensors",
                                         "cast them first, e.g. `ckptool fix --dtype fp32`")
    kept: dict[str, TensorInfo] = {}
    aliases: dict[str, str] = {}
    first: dict[tuple[Any, ...], str] = {}
    share_count: dict[str | None, int] = {}
    for t in sd.values():
        share_count[t.storage] = share_count.get(t.storage, 0) + 1
    copies = []
    for name, t in sd.items():
        ident = (t.storage, t.storage_offset, t.shape, t.stride, t.dtype)
        if t.storage is not None and ident in first:
            aliases[name] = first[ident]
            continue
        first[ident] = name
        kept[name] = t
        if t.storage is not None and share_count[t.storage] > 1:
            copies.append(name)
    copies = [n for n in copies if n not in set(aliases.values())]
    return kept, aliases, copies


def _to_safetensors(source: Checkpoint, dst: str, output: AtomicOutput,
                    progress: Progress | None) -> ConvertResult:
    kept, aliases, copies = _plan_names(source)
    result = ConvertResult(source, dst, "safetensors", len(kept), aliases, copies)
    sd_path = source.main_state_dict.path if source.main_state_dict else ""
    entries: dict[str, Any] = {}
    for e in source.entries:
        if e.value is not None or e.summary == "None":
            entries[e.key] = e.value
        else:
            result.left_out.append(f"{e.key} ({e.type})")
    result.kept_entries = list(entries)
    outside = [t.key for t in source.tensors
               if not (t.key.startswith(f"{sd_path}/") or not sd_path)]
    if outside:
        result.left_out.append(f"{len(outside)} tensors outside '{sd_path}' "
                               f"(e.g. {outside[0]})")
    meta = {"format": "pt"}
    if aliases:
        meta["ckptool.aliases"] = json.dumps(aliases)
    if entries:
        meta["ckptool.entries"] = json.dumps(entries, default=repr)
    items = [(name, t, t.dtype) for name, t in kept.items()]
    with output as out, TensorData(source) as reader:
        spans = write_safetensors(out.file, items, meta, reader, progress, out.durable)
        result.bytes_written = out.file.tell()
        out.sync_in_background()
        verify(out.read_path, {n: (t.shape, t.dtype) for n, t in kept.items()}, spans)
        out.commit()
    return result




def write_safetensors(f: Any, items: list[tuple[str, TensorInfo, str]], meta: dict[str, str],
                      reader: TensorData, progress: Progress | None = None,
                      durable: bool = False) -> Expected:
    """Write (name, tensor, dtype to write it as) to ``f``; returns where each
    tensor's bytes went and the CRC they must have, every one of them re-read
    and checked before this returns.

    A tensor kept as it is and laid out densely in its storage is copied
    with a read-ahead thread (``gather``); its CRC comes from the zip
    directory when it fills its record, else from reading the source. Casts
    and strided views go through torch."""
    header: dict[str, Any] = {}
    offset = 0
    for name, t, dtype in items:
        size = t.numel * dtypes.itemsize(dtype)
        header[name] = {"dtype": ST_CODES[dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = meta
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-byte aligned
    f.write(len(raw).to_bytes(8, "little") + raw)
    f.flush()
    base = 8 + len(raw)
    with ByteChecker(f.fileno(), durable) as checker:  # an error drops what is queued
        expected = _write_tensors(f.fileno(), items, {n: base + h["data_offsets"][0]
                                                      for n, h in header.items()
                                                      if n != "__metadata__"},
                                  offset, reader, checker, progress)
        check_bytes(checker)
    f.seek(base + offset)
    return expected


def _write_tensors(fd: int, items: list[tuple[str, TensorInfo, str]], starts: dict[str, int],
                   total: int, reader: TensorData, checker: ByteChecker,
                   progress: Progress | None) -> Expected:
    expected: Expected = {}
    done = 0
    batch: list[tuple[str, int, int, int]] = []  # checks handed over together

    def written(name: str, start: int, size: int, crc: int) -> None:
        nonlocal batch, done
        expected[name] = (start, size, crc)
        done += size
        if progress is not None:
            progress(done, total)
        batch.append((name, start, size, crc))
        if start + size - batch[0][1] >= CHECK_BATCH:
            checker.check_many(batch)
            batch = []

    copies: list[tuple[str, int, int, int, int]] = []  # name, source, size, dest, crc
    for name, t, dtype in items:
        start, size = starts[name], t.numel * dtypes.itemsize(dtype)
        if dtype == t.dtype and t.storage is not None and _is_dense(t):
            src = reader.storage_offset(t.storage) + t.storage_offset * dtypes.itemsize(t.dtype)
            whole = t.storage_offset == 0 and size == reader.storage(t.storage).nbytes
            crc = reader.record_crc(t.storage) if whole else None
            if crc is None:  # a view into a larger storage: its own bytes' CRC
                crc = crc_file_range(reader.fileno(), src, size)
            copies.append((name, src, size, start, crc))
        else:
            data = b"".join(_tensor_chunks(reader, t))
            if dtype != t.dtype:
                data = cast_bytes(data, t.dtype, dtype)
            os.pwrite(fd, data, start)
            written(name, start, len(data), zlib.crc32(data))

    def copied(i: int) -> None:
        name, _, size, start, crc = copies[i]
        written(name, start, size, crc)

    # dense tensors: read ahead on a thread while this one writes (gather.py)
    copy_pieces(reader.fileno(), fd, [(s, n, d) for _, s, n, d, _ in copies], copied)
    checker.check_many(batch)
    return expected


def cast_bytes(data: bytes | bytearray, src: str, dst: str) -> bytes:
    """Elements of dtype ``src`` as dtype ``dst`` (through torch)."""
    import torch  # only casts need torch

    if not data:
        return b""
    cast = torch.frombuffer(bytearray(data), dtype=getattr(torch, src)).to(getattr(torch, dst))
    return ctypes.string_at(cast.data_ptr(), cast.numel() * cast.element_size())


def _to_torch(source: Checkpoint, dst: str, output: AtomicOutput,
              progress: Progress | None) -> ConvertResult:
    st_meta = source.metadata.get("metadata", {})
    aliases = json.loads(st_meta.get("ckptool.aliases", "{}"))
    result = ConvertResult(source, dst, "torch", len(source.tensors), aliases)
    sd: OrderedDict[str, Any] = OrderedDict()
    records: dict[str, TensorInfo] = {}
    for i, t in enumerate(source.tensors):
        key = str(i)
        if t.dtype in _TYPED:
            stype, numel = StorageType(_TYPED[t.dtype], t.dtype), t.numel
            origin = ("torch._utils._rebuild_tensor_v2",)
            extra: tuple[Any, ...] = ()
        else:  # float8, uint16...: an untyped storage and the dtype beside it
            stype, numel = StorageType("UntypedStorage", "uint8"), t.nbytes
            origin = ("torch._utils._rebuild_tensor_v3",)
            extra = (TorchDtype(t.dtype),)
        ref = StorageRef(key, stype.dtype, "cpu", numel, None,
                         ("storage", stype, key, "cpu", numel))
        rec = TensorRecord(t.shape, t.dtype, _contiguous_strides(t.shape), 0, ref, "cpu")
        rec.origin = (origin[0], (ref, 0, t.shape, rec.stride, False, OrderedDict(), *extra))
        sd[t.key] = rec
        records[key] = t
    for alias, kept in aliases.items():
        if kept in sd:
            sd[alias] = sd[kept]  # one tensor under two names: shared storage again
    pickled = repickle.dumps(sd, lambda ref: tuple([*(ref.pid or ())]))
    root = Path(dst).stem
    spans: Expected = {}
    with output as out, TensorData(source) as reader:
        writer = ZipWriter(out.file)
        writer.write_bytes(f"{root}/data.pkl", pickled)
        for name, value in ((".format_version", b"1"), (".storage_alignment", b"64"),
                            ("byteorder", b"little")):
            writer.write_bytes(f"{root}/{name}", value)
        total = sum(t.nbytes for t in records.values())
        done = 0
        with ByteChecker(out.file.fileno(), out.durable) as checker:
            for key, t in records.items():
                written = writer.write_record(f"{root}/data/{key}", _tensor_chunks(reader, t))
                spans[t.key] = (written.data_offset, written.size, written.crc)
                out.file.flush()
                checker.check(t.key, *spans[t.key])
                done += t.nbytes
                if progress is not None:
                    progress(done, total)
            writer.write_bytes(f"{root}/version", b"3\n")
            writer.close()
            out.file.flush()
            # the pickle and the small records are re-read too
            checker.check_many([(r.name, r.data_offset, r.size, r.crc) for r in writer.records
                                if not r.name.startswith(f"{root}/data/")])
            check_bytes(checker)
        result.bytes_written = out.file.tell()
        expect = {t.key: (t.shape, t.dtype) for t in source.tensors}
        expect.update({a: expect[k] for a, k in aliases.items() if k in expect})
        out.sync_in_background()
        verify(out.read_path, expect, spans)
        out.commit()
    return result


def verify(path: str, expect: dict[str, tuple[tuple[int, ...], str]], spans: Expected) -> None:
    """Read the converted file back: names, shapes and dtypes from a fresh read
    of ``path``; each tensor's bytes were re-read and CRC-checked as they were
    written (``ByteChecker``), and here the file must point at those bytes."""
    written = open_checkpoint(path)
    got = written.state_dict() or {t.key: t for t in written.tensors}
    if {k: (t.shape, t.dtype) for k, t in got.items()} != expect:
        raise CorruptCheckpointError("the converted file's tensors differ from the input's",
                                     "nothing was written; report this as a bug")
    with TensorData(written) as reader:
        for name, (start, _, _) in spans.items():
            t = got[name]
            at = reader.storage_offset(t.storage) if t.storage is not None else -1
            if at != start:
                raise CorruptCheckpointError(f"the converted {name} does not match its bytes",
                                             "nothing was written; report this as a bug")
