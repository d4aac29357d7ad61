"""One output file of ``convert``: a safetensors file or a torch zip of
what ``convert_plan`` decided, written by the pipeline (lay out, copy,
verify, commit), its tensor bytes from ``ckptool.write.sources``. A
directory's shards are files of the same kind (``convert_dir``).
"""

from __future__ import annotations

import functools
import math
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptool import dtypes
from ckptool.keys import key_of
from ckptool.model import TensorInfo
from ckptool.read.layouts.dcp import nest
from ckptool.read.tensors import StorageRef, StorageType, TensorRecord
from ckptool.read.ties import recorded_aliases
from ckptool.read.values import TorchDtype
from ckptool.write import copy, repickle, verify
from ckptool.write.commit import AtomicOutput
from ckptool.write.convert.plan import Written
from ckptool.write.formats import safetensors
from ckptool.write.formats.torch_zip import NewArchive
from ckptool.write.layout import Layout, Segment, contiguous_strides
from ckptool.write.sources import TensorSource
from ckptool.write.streamhash import StreamHash, Streams

_TYPED = {v: k for k, v in dtypes.STORAGE_DTYPES.items() if k not in ("UntypedStorage",
                                                                       "TypedStorage")}
Progress = Callable[[int, int], None]


# a tensor's bytes as one segment, written at an offset (a zip record's CRC is one segment's)
SingleAt = Callable[[TensorInfo, str, int, str], Segment]


@dataclass
class FileLayout:
    """One output file laid out, and what reading it back must find: its
    tensors' names, shapes and dtypes (``expect``) and where each one's bytes
    start (``starts``, by key in a nested tree: ``by_key``); a torch zip's
    records for its directory (known once every record's CRC is)."""

    layout: Layout
    expect: dict[str, tuple[tuple[int, ...], str]]
    starts: dict[str, int]
    by_key: bool = False
    archive: NewArchive | None = None

    def check(self, path: str) -> None:
        """The written file read back: its own records point at the planned bytes."""
        verify.check_offsets(path, self.expect, self.starts, by_key=self.by_key)
        if self.archive is not None:
            verify.check_directory(path, self.archive.records())


def lay_out_safetensors(written: Written, meta: dict[str, str],
                        segments_at: safetensors.SegmentsAt) -> FileLayout:
    """One safetensors file of ``written``'s tensors (aliases and entries in
    ``meta``, the caller's to say); ``segments_at`` gives each tensor's bytes."""
    items = [(name, t, written.dtype(name)) for name, t in written.tensors.items()]
    layout, starts = safetensors.lay_out(items, meta, segments_at)
    expect = {n: (t.shape, written.dtype(n)) for n, t in written.tensors.items()}
    # the ties ``meta`` records read back as tensors sharing their twins'
    expect.update({a: expect[k] for a, k in
                   recorded_aliases(meta, set(written.tensors))[0].items()})
    return FileLayout(layout, expect, starts)


def lay_out_torch(written: Written, single_at: SingleAt, root: str) -> FileLayout:
    """One torch zip (``torch.save``'s layout, archive folder ``root``) of
    ``written``: a state dict, aliases sharing their tensor's storage again;
    or the nested tree of ``written.paths`` with its values."""
    kept = written.tensors
    records = {name: _record(str(i), t, written.dtype(name), written.location.get(name, "cpu"))
               for i, (name, t) in enumerate(kept.items())}
    # an alias is the same record under a second name: shared storage again
    flat: dict[str, Any] = OrderedDict(
        (n, records[written.aliases.get(n, n)]) for n in written.names())
    if written.paths:
        flat.update(written.entries)
        tree: Any = nest(flat, written.paths)
        keys = {n: key_of([str(p) for p in written.paths[n]]) for n in kept}
    else:
        tree, keys = flat, {n: n for n in kept}
    pickled = repickle.dumps(tree, lambda ref: tuple([*(ref.pid or ())]))
    # torch.save's records, in its order
    archive = NewArchive(root)
    archive.add_bytes("data.pkl", pickled)
    for name, value in ((".format_version", b"1"), (".storage_alignment", b"64"),
                        ("byteorder", b"little")):
        archive.add_bytes(name, value)
    starts = {}
    for i, (name, t) in enumerate(kept.items()):
        dtype = written.dtype(name)
        size = t.numel * dtypes.itemsize(dtype)
        segment_at = functools.partial(_single, single_at, t, dtype, f"tensor {name}")
        starts[keys[name]] = archive.add(f"data/{i}", size, segment_at).at
    archive.add_bytes("version", b"3\n")
    layout = archive.close()
    expect = {keys[n]: (t.shape, written.dtype(n)) for n, t in kept.items()}
    if not written.paths:
        expect.update({a: expect[k] for a, k in written.aliases.items()})
    return FileLayout(layout, expect, starts, bool(written.paths), archive)


def _single(single_at: SingleAt, t: TensorInfo, dtype: str, name: str, at: int) -> Segment:
    return single_at(t, dtype, at, name)


def write_safetensors(written: Written, meta: dict[str, str], tensors: TensorSource,
                      output: AtomicOutput, progress: Progress | None,
                      streams: Streams | None = None) -> int:
    """One safetensors file of ``written``'s tensors (aliases and entries go
    into ``meta``, the caller's to say); returns its size. With ``streams``,
    its sha256 and its tensors' digests are taken from the bytes written."""
    return _write(lay_out_safetensors(written, meta, tensors.segments), output, progress,
                  streams)


def write_torch(written: Written, tensors: TensorSource, output: AtomicOutput,
                progress: Progress | None, streams: Streams | None = None) -> int:
    """One torch zip (``torch.save``'s layout) of ``written``; returns its size."""
    return _write(lay_out_torch(written, tensors.single, Path(output.target).stem), output,
                  progress, streams)


def _write(planned: FileLayout, output: AtomicOutput, progress: Progress | None,
           streams: Streams | None = None) -> int:
    stream = None
    if streams is not None:
        stream = StreamHash({key: (at, math.prod(planned.expect[key][0])
                                   * dtypes.itemsize(planned.expect[key][1]))
                             for key, at in planned.starts.items()})
        streams[os.path.realpath(output.shown)] = (stream, planned.layout.end)
    with output as out:  # 3. laid out (before a byte is written)
        copy.write_checked(out.file.fileno(), out.durable, planned.layout.segments,
                           progress, stream.feed if stream is not None else None)  # 4, 5
        out.sync_in_background()
        planned.check(out.read_path)
        out.commit()  # 6. commit
    return planned.layout.end


def _record(key: str, t: TensorInfo, dtype: str, location: str = "cpu") -> TensorRecord:
    """A torch tensor record for ``t`` as ``dtype``, written contiguously on
    storage ``key``, saved on ``location``."""
    if dtype in _TYPED:
        stype, numel = StorageType(_TYPED[dtype], dtype), t.numel
        origin = "torch._utils._rebuild_tensor_v2"
        extra: tuple[Any, ...] = ()
    else:  # float8, uint16...: an untyped storage and the dtype beside it
        stype, numel = StorageType("UntypedStorage", "uint8"), t.numel * dtypes.itemsize(dtype)
        origin = "torch._utils._rebuild_tensor_v3"
        extra = (TorchDtype(dtype),)
    ref = StorageRef(key, stype.dtype, location, numel, None,
                     ("storage", stype, key, location, numel))
    rec = TensorRecord(t.shape, dtype, contiguous_strides(t.shape), 0, ref, location)
    rec.origin = (origin, (ref, 0, t.shape, rec.stride, False, OrderedDict(), *extra))
    return rec
