"""One output file of ``convert``: a safetensors file or a torch zip of
what ``convert_plan`` decided, written by the pipeline (lay out, copy,
verify, commit), its tensor bytes from ``ckptool.write.sources``. A
directory's shards are files of the same kind (``convert_dir``).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
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
from ckptool.write.layout import contiguous_strides
from ckptool.write.sources import TensorSource

_TYPED = {v: k for k, v in dtypes.STORAGE_DTYPES.items() if k not in ("UntypedStorage",
                                                                       "TypedStorage")}
Progress = Callable[[int, int], None]


def write_safetensors(written: Written, meta: dict[str, str], tensors: TensorSource,
                      output: AtomicOutput, progress: Progress | None) -> int:
    """One safetensors file of ``written``'s tensors (aliases and entries go
    into ``meta``, the caller's to say); returns its size."""
    items = [(name, t, written.dtype(name)) for name, t in written.tensors.items()]
    with output as out:
        layout, starts = safetensors.lay_out(items, meta, tensors.segments)  # 3. lay out
        copy.write_checked(out.file.fileno(), out.durable, layout.segments, progress)  # 4, 5
        out.sync_in_background()
        expect = {n: (t.shape, written.dtype(n)) for n, t in written.tensors.items()}
        # the ties ``meta`` records read back as tensors sharing their twins'
        expect.update({a: expect[k] for a, k in
                       recorded_aliases(meta, set(written.tensors))[0].items()})
        verify.check_offsets(out.read_path, expect, starts)
        out.commit()  # 6. commit
    return layout.end


def write_torch(written: Written, tensors: TensorSource, output: AtomicOutput,
                progress: Progress | None) -> int:
    """One torch zip (``torch.save``'s layout) of ``written``: a state dict,
    aliases sharing their tensor's storage again; or the nested tree of
    ``written.paths`` with its values. Returns its size."""
    kept = written.tensors
    records = {name: _record(str(i), t, written.dtype(name), written.location.get(name, "cpu"))
               for i, (name, t) in enumerate(kept.items())}
    # an alias is the same record under a second name: shared storage again
    flat: dict[str, Any] = OrderedDict(
        (n, records[written.aliases.get(n, n)]) for n in written.names())
    if written.paths:
        flat.update(written.entries)
        root: Any = nest(flat, written.paths)
        keys = {n: key_of([str(p) for p in written.paths[n]]) for n in kept}
    else:
        root, keys = flat, {n: n for n in kept}
    pickled = repickle.dumps(root, lambda ref: tuple([*(ref.pid or ())]))
    with output as out:
        # 3. lay out: torch.save's records, in its order
        archive = NewArchive(Path(output.target).stem)
        archive.add_bytes("data.pkl", pickled)
        for name, value in ((".format_version", b"1"), (".storage_alignment", b"64"),
                            ("byteorder", b"little")):
            archive.add_bytes(name, value)
        starts = {}
        for i, (name, t) in enumerate(kept.items()):
            dtype = written.dtype(name)
            segment_at = functools.partial(tensors.single, t, dtype, name=f"tensor {name}")
            size = t.numel * dtypes.itemsize(dtype)
            starts[keys[name]] = archive.add(f"data/{i}", size, segment_at).at
        archive.add_bytes("version", b"3\n")
        layout = archive.close()
        copy.write_checked(out.file.fileno(), out.durable, layout.segments, progress)  # 4, 5
        expect = {keys[n]: (t.shape, written.dtype(n)) for n, t in kept.items()}
        if not written.paths:
            expect.update({a: expect[k] for a, k in written.aliases.items()})
        out.sync_in_background()
        verify.check_offsets(out.read_path, expect, starts, by_key=bool(written.paths))
        verify.check_directory(out.read_path, archive.records())
        out.commit()  # 6. commit
    return layout.end


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
