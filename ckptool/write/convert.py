"""``ckptool convert``: torch checkpoints to safetensors and back, and the
weights of the torch files ``fix`` cannot rewrite (TorchScript archives,
plain pickles) into a torch zip, as a pipeline (read, plan, lay out, copy,
verify, commit: see ``ckptool.write.fix``).

torch -> safetensors writes the main state dict (of any torch format,
legacy, TorchScript and plain pickles included). safetensors cannot share
memory, so tied weights (exact aliases: same storage, offset, shape, stride
and dtype) are written once and the other names recorded under
``ckptool.aliases`` in ``__metadata__``; other views and non-contiguous
tensors are written as their own contiguous copies. Plain non-tensor entries
go to ``__metadata__`` as JSON under ``ckptool.entries``; everything else is
reported as left out, never silently dropped.

safetensors -> torch writes a torch zip state dict (``torch.save``'s layout),
restoring the recorded aliases as tensors that share storage again.
TorchScript or a plain pickle -> torch writes its main state dict the same
way: tied weights share one storage again, other views are their own
contiguous copies, and the rest (entries, sparse and quantized tensors,
tensors outside the state dict) is reported as left out. A torch.save file
is ``fix``'s to rewrite (``fix --extract`` keeps only its state dict).

Both directions stream tensor bytes into a temporary file, re-read every
byte they wrote (CRC), read the file back to check names, shapes and dtypes,
then rename it into place.
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptool import dtypes
from ckptool.describe import plural, shell_word
from ckptool.errors import UnsupportedCheckpointError, UsageError
from ckptool.keys import unescape
from ckptool.model import Checkpoint, TensorInfo
from ckptool.read import formats
from ckptool.read.formats.safetensors_fmt import SAFETENSORS
from ckptool.read.reader import open_checkpoint
from ckptool.read.tensor_data import TensorData
from ckptool.read.tensors import StorageRef, StorageType, TensorRecord
from ckptool.read.values import TorchDtype
from ckptool.write import copy, repickle, verify
from ckptool.write.commit import AtomicOutput
from ckptool.write.formats import safetensors
from ckptool.write.formats.safetensors import ST_CODES
from ckptool.write.formats.torch_zip import NewArchive
from ckptool.write.layout import contiguous_strides, tensor_segment
from ckptool.write.plan import REWRITABLE

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")
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
    notes: list[str] = field(default_factory=list)  # what was ignored, and why


def convert(src: str, dst: str, *, force: bool = False,
            progress: Progress | None = None, fsync: bool = False) -> ConvertResult:
    """Convert ``src`` into ``dst`` (the format from its extension). The output
    is durable on disk before this returns when ``fsync`` is set or it
    replaces a file (``AtomicOutput``)."""
    suffix = Path(dst).suffix.lower()
    if suffix not in (".safetensors", *TORCH_SUFFIXES):
        raise UsageError(f"cannot tell the output format from {dst!r}",
                         "name it *.safetensors, or *.pt / *.pth / *.bin for torch")
    src = formats.one_file(src, "convert")  # a directory holding one file is that file
    source = open_checkpoint(src)  # 1. read
    if suffix == ".safetensors":
        if source.format == SAFETENSORS:
            raise UsageError(f"{src} is already safetensors", "name a torch output: OUT.pth")
        return _to_safetensors(source, dst, AtomicOutput(dst, force, fsync), progress)
    if source.format != SAFETENSORS and source.format in REWRITABLE:  # a torch.save file
        raise UsageError(
            f"{src} is already a torch checkpoint ({source.format}): `ckptool fix` rewrites it",
            f"to keep only its state dict: `ckptool fix {shell_word(src)} --extract -o "
            f"{shell_word(dst)}`")
    return _to_torch(source, dst, AtomicOutput(dst, force, fsync), progress)


def _unwritten(t: TensorInfo, into: str) -> str | None:
    """Why a tensor of the state dict is not written ``into`` safetensors or
    torch, or None. (safetensors refuses quantized dtypes outright.)"""
    if t.parts:
        holds = "safetensors holds" if into == SAFETENSORS else "convert writes"
        return (f"a {t.layout} tensor: {holds} dense tensors only; .to_dense() it first "
                "to keep it")
    if t.layout == "quantized" and into != SAFETENSORS:
        return "a quantized tensor: convert writes plain tensors only; .dequantize() it " \
               "first to keep it"
    return None


def _plan_names(source: Checkpoint, into: str) -> tuple[
        dict[str, TensorInfo], dict[str, str], list[str]]:
    """Of the main state dict written ``into`` safetensors or torch: (tensors
    to write, aliases, names written as copies of shared storage)."""
    every = source.state_dict()
    sd = {name: t for name, t in every.items() if _unwritten(t, into) is None}
    if not sd:
        raise _nothing_to_convert(every, into)
    bad = sorted({t.dtype for t in sd.values() if t.dtype not in ST_CODES})
    if bad and into == SAFETENSORS:
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


def _nothing_to_convert(every: dict[str, TensorInfo], into: str) -> UnsupportedCheckpointError:
    """The error for a file with no state dict, or none of whose tensors is written."""
    name = next(iter(every), None)
    why = ("no dict in the file holds tensors only" if name is None else
           f"{name} ({_unwritten(every[name], into)})"
           + (f" and {len(every) - 1} more" if len(every) > 1 else ""))
    return UnsupportedCheckpointError(f"no dense state dict to convert: {why}",
                                      "see `ckptool inspect` for what the file holds")


def _left_out(source: Checkpoint, into: str, kept_entries: Collection[str] = ()) -> list[str]:
    """What the output does not hold, never dropped silently: the entries not
    kept, the state dict's tensors not written, the tensors outside it."""
    out = [f"{e.key} ({e.type})" for e in source.entries if e.key not in kept_entries]
    for name, t in source.state_dict().items():
        why = _unwritten(t, into)
        if why is not None:
            out.append(f"{name} ({why})")
    sd_path = source.main_state_dict.path if source.main_state_dict else ""
    outside = [t.key for t in source.tensors
               if not (t.key.startswith(f"{sd_path}/") or not sd_path)]
    if outside:
        out.append(f"{plural(len(outside), 'tensor')} outside '{sd_path}' (e.g. {outside[0]})")
    return out


def _to_safetensors(source: Checkpoint, dst: str, output: AtomicOutput,
                    progress: Progress | None) -> ConvertResult:
    # 2. plan: the names written, the aliases and entries kept in __metadata__
    kept, aliases, copies = _plan_names(source, SAFETENSORS)
    result = ConvertResult(source, dst, "safetensors", len(kept), aliases, copies)
    entries: dict[str, Any] = {}
    for e in source.entries:
        if e.value is not None or e.summary == "None":
            entries[e.key] = e.value
    result.kept_entries = list(entries)
    result.left_out = _left_out(source, SAFETENSORS, entries)
    meta = {"format": "pt"}
    if aliases:
        meta["ckptool.aliases"] = json.dumps(aliases)
    if entries:
        meta["ckptool.entries"] = json.dumps(entries, default=repr)
    items = [(name, t, t.dtype) for name, t in kept.items()]
    with output as out, TensorData(source) as reader:
        layout, starts = safetensors.lay_out(items, meta, reader)  # 3. lay out
        copy.write_checked(out.file.fileno(), out.durable, layout.segments, progress)  # 4, 5
        result.bytes_written = layout.end
        out.sync_in_background()
        verify.check_offsets(out.read_path, {n: (t.shape, t.dtype) for n, t in kept.items()},
                             starts)
        out.commit()  # 6. commit
    return result


def _to_torch(source: Checkpoint, dst: str, output: AtomicOutput,
              progress: Progress | None) -> ConvertResult:
    # 2. plan: a torch state dict, each tensor written on a storage of its
    # own, and the names that share one of them again (tied weights)
    if source.format == SAFETENSORS:  # its tensors, and the aliases convert recorded
        # each key is one name of the file's own dict, escaped: written as it is
        kept = {unescape(t.key): t for t in source.tensors}
        aliases, notes = _aliases(source.metadata.get("metadata", {}), set(kept))
        result = ConvertResult(source, dst, "torch", len(kept), aliases, notes=notes)
        names = [*kept, *aliases]
    else:  # the main state dict of a file fix cannot rewrite: TorchScript, a pickle
        kept, aliases, copies = _plan_names(source, "torch")
        result = ConvertResult(source, dst, "torch", len(kept), aliases, copies,
                               left_out=_left_out(source, "torch"), notes=_moved(kept))
        names = [n for n in source.state_dict() if n in kept or n in aliases]
    records = {name: _record(str(i), t) for i, (name, t) in enumerate(kept.items())}
    # an alias is the same record under a second name: shared storage again
    sd = OrderedDict((n, records[aliases.get(n, n)]) for n in names)
    pickled = repickle.dumps(sd, lambda ref: tuple([*(ref.pid or ())]))
    with output as out, TensorData(source) as reader:
        # 3. lay out: torch.save's records, in its order
        archive = NewArchive(Path(dst).stem)
        archive.add_bytes("data.pkl", pickled)
        for name, value in ((".format_version", b"1"), (".storage_alignment", b"64"),
                            ("byteorder", b"little")):
            archive.add_bytes(name, value)
        starts = {}
        for i, (name, t) in enumerate(kept.items()):
            segment_at = functools.partial(tensor_segment, reader, t, t.dtype, name=name)
            starts[name] = archive.add(f"data/{i}", t.nbytes, segment_at).at
        archive.add_bytes("version", b"3\n")
        layout = archive.close()
        copy.write_checked(out.file.fileno(), out.durable, layout.segments, progress)  # 4, 5
        result.bytes_written = layout.end
        expect = {n: (t.shape, t.dtype) for n, t in kept.items()}
        expect.update({a: expect[k] for a, k in aliases.items()})
        out.sync_in_background()
        verify.check_offsets(out.read_path, expect, starts)
        verify.check_directory(out.read_path, archive.records())
        out.commit()  # 6. commit
    return result


def _moved(kept: dict[str, TensorInfo]) -> list[str]:
    """The output's storages are all written as on cpu: say so of those that
    were saved elsewhere."""
    tags = sorted({t.location for t in kept.values()} - {"cpu", None}, key=str)
    return [f"storages saved on {', '.join(map(str, tags))} are written as on cpu "
            "(`ckptool fix --to DEVICE` retargets them)"] if tags else []


def _aliases(meta: dict[str, str], names: set[str]) -> tuple[dict[str, str], list[str]]:
    """The ``ckptool.aliases`` a safetensors file records (``convert`` wrote
    them: alias -> the tensor it shares), as far as they make sense: the
    file's metadata is input, not instructions. Returns (aliases, notes on
    what was ignored)."""
    text = meta.get("ckptool.aliases")
    if text is None:
        return {}, []
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return {}, ["__metadata__ 'ckptool.aliases' is not JSON: ignored"]
    if not isinstance(raw, dict):
        return {}, ["__metadata__ 'ckptool.aliases' is not a JSON object: ignored"]
    aliases: dict[str, str] = {}
    bad = []
    for alias, kept in raw.items():
        # an alias of a tensor the file has, under a name no tensor has: an
        # alias of an alias (or of itself) is no tensor at all
        if isinstance(kept, str) and kept in names and alias not in names:
            aliases[alias] = kept
        else:
            bad.append(alias)
    notes = [f"__metadata__ 'ckptool.aliases' names {len(bad)} alias(es) that are not "
             f"a new name for a tensor of the file: ignored ({', '.join(bad[:3])})"] if bad else []
    return aliases, notes


def _record(key: str, t: TensorInfo) -> TensorRecord:
    """A torch tensor record for ``t`` written contiguously on storage ``key``."""
    if t.dtype in _TYPED:
        stype, numel = StorageType(_TYPED[t.dtype], t.dtype), t.numel
        origin = "torch._utils._rebuild_tensor_v2"
        extra: tuple[Any, ...] = ()
    else:  # float8, uint16...: an untyped storage and the dtype beside it
        stype, numel = StorageType("UntypedStorage", "uint8"), t.nbytes
        origin = "torch._utils._rebuild_tensor_v3"
        extra = (TorchDtype(t.dtype),)
    ref = StorageRef(key, stype.dtype, "cpu", numel, None, ("storage", stype, key, "cpu", numel))
    rec = TensorRecord(t.shape, t.dtype, contiguous_strides(t.shape), 0, ref, "cpu")
    rec.origin = (origin, (ref, 0, t.shape, rec.stride, False, OrderedDict(), *extra))
    return rec
