"""A ``torch.distributed.checkpoint`` directory as one checkpoint.

Read: every ``.metadata`` (one, or one per rank from
``dcp.save(use_collectives=False)``, or one per accelerate sub-directory),
merged; then each tensor is one logical tensor under its flattened key
(``model.layers.0.attn.qkv.weight``) with its global shape and dtype, and
the chunks it is saved in (file, rank, box, byte range). DCP records no
device, so no tensor has a location. The files the chunks name must exist
and hold their byte ranges, each chunk must start with a ``torch.save``
archive, and the chunks must fill their tensor exactly; anything else is an
error naming the file or the key.

Non-tensor values (DCP's BYTE_IO items: ``step``, ``epoch``,
``optim.param_groups.0.lr``...) are ``torch.save`` archives too, read with
ckptool's unpickler into entries. A Lightning ``meta.pt`` beside the
``.metadata`` is read as a torch file, its entries under ``<meta.pt>/``.
No tensor byte is read.
"""

from __future__ import annotations

import itertools
import math
import os
from typing import Any

from ckptool import dtypes
from ckptool.describe import plural
from ckptool.errors import CkptoolError, CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.keys import key_of, split_key
from ckptool.model import FileInfo
from ckptool.read import dispatch, fs, optim
from ckptool.read.formats.base import RawRead
from ckptool.read.formats.safetensors_fmt import sniff as sniff_safetensors
from ckptool.read.layouts import dcp_chunks, dcp_metadata, embedded
from ckptool.read.layouts.base import BROKEN_HINT, MultiRead, contiguous, file_size, member
from ckptool.read.layouts.dcp_chunks import RANK_FILE
from ckptool.read.layouts.dcp_chunks import rank as _rank
from ckptool.read.layouts.dcp_metadata import Item, Metadata, TensorMeta
from ckptool.read.layouts.recognise import Layout
from ckptool.read.seen import GlobalsSeen
from ckptool.read.tensors import StorageRef, TensorRecord
from ckptool.read.values import brief

DCP = "dcp"
# the name under which a value ckptool cannot read is reported
UNREAD_VALUE = "torch.distributed.checkpoint.<value stored through a transform>"
MAX_VALUE_BYTES = 64 << 20  # a non-tensor value read for inspect; larger ones are not
TRUNCATED_HINT = "the file was cut short while copying or downloading; copy it again"


class Unread:
    """A non-tensor value ckptool did not read (too large, or compressed)."""

    def __init__(self, why: str) -> None:
        self.why = why

    def __repr__(self) -> str:
        return f"<not read: {self.why}>"


UNREAD_FALLBACK = "torch.distributed.checkpoint.<a rank's .metadata ckptool cannot read>"


def _judge_fallback(directory: str, name: str, seen: GlobalsSeen, warnings: list[str]) -> None:
    """A ``__<rank>.metadata`` beside ``.metadata``: dcp.load unpickles it
    (``pickle.load``) when ``.metadata`` fails it or reads as nothing, so what
    it names is the checkpoint's; unreadable, it is unsafe."""
    outer = seen.part
    try:
        dcp_metadata.parse(directory, name, seen)
    except CkptoolError as exc:
        seen.flag(UNREAD_FALLBACK, f"{name}: dcp.load unpickles it when it cannot use "
                  f".metadata, and ckptool cannot read it ({exc.message})", name)
    finally:
        seen.part = outer  # (parse names the pickle it reads)
    warnings.append(f"{name}: a rank's metadata beside .metadata; dcp.load reads it when "
                    ".metadata fails, so it was read for the globals it names")


def read(layout: Layout) -> MultiRead:
    seen = GlobalsSeen()
    metas = [dcp_metadata.parse(layout.directory, name, seen) for name in layout.metadata]
    warnings: list[str] = []
    notes = list(layout.notes)  # what else is there: said, not a problem
    for name, md in zip(layout.metadata, metas, strict=True):
        if md.other is not None and not seen.unsafe():  # a hostile one is reported instead
            raise CorruptCheckpointError(
                f"{name} holds {brief(md.other)}, not a torch.distributed.checkpoint "
                "Metadata", BROKEN_HINT)
    for name in layout.fallbacks:
        _judge_fallback(layout.directory, name, seen, warnings)
    merged, others = _merge(list(zip(layout.metadata, metas, strict=True)), warnings, notes)
    sizes = _data_files(layout, merged)
    root: dict[str, Any] = {}
    storages: dict[str, StorageRef] = {}
    storage_files: dict[str, str] = {}
    strides: dict[tuple[int, ...], tuple[int, ...]] = {}  # (shapes repeat: layers)
    prod = math.prod
    for fqn, tm in merged.tensors.items():
        shape, boxes = tm.shape, tm.boxes
        if not _tiles(shape, boxes):  # the common case, proved cheaply; else in full
            problem = dcp_metadata.check_cover(shape, [(o, s) for o, s, _ in boxes])
            if problem:
                raise CorruptCheckpointError(f"{fqn} is not whole: {problem}", BROKEN_HINT)
        _check_lengths(fqn, tm)
        ref = StorageRef(fqn, tm.dtype, None, prod(shape))
        storages[fqn] = ref
        stride = strides.get(shape)
        if stride is None:
            stride = strides[shape] = contiguous(shape)
        root[fqn] = TensorRecord(shape, tm.dtype, stride, 0, ref, None,
                                 requires_grad=tm.requires_grad)
    chunks = dcp_chunks.chunks(merged.tensors)  # (all at once)
    for fqn, item in merged.values.items():
        root[fqn] = _value(layout, fqn, item, seen, storages, storage_files)
    extra_roots: dict[str, Any] = dict(others)
    files = [FileInfo(n, "metadata", None, fs.getsize(os.path.join(layout.directory, n)))
             for n in layout.metadata]
    files += _file_infos(merged, sizes)
    for name in layout.extras:
        raw = dispatch.read(os.path.join(layout.directory, name))
        extra_roots[name] = raw.root
        for key, ref in raw.storages.items():
            ref.key = f"{name}:{key}"
            storages[ref.key], storage_files[ref.key] = ref, name
        seen.merge(raw.seen, name)
        warnings += [f"{name}: {w}" for w in raw.warnings]
        files.append(FileInfo(name, "extra", raw.format,
                              fs.getsize(os.path.join(layout.directory, name))))
    ranks = {f.rank for f in files if f.rank is not None}
    meta: dict[str, Any] = {"version": merged.version, "ranks": len(ranks) or None,
                            "metadata_files": list(layout.metadata)}
    if layout.wrapper:
        meta["wrapper"] = layout.wrapper
    if layout.wrapper in ("megatron", "megatron-dcp"):
        from ckptool.read.megatron import stacked

        meta["megatron"] = stacked.summary(root, extra_roots, layout.iteration or
                                           fs.basename(layout.directory))
    paths = {fqn: tuple(p) for fqn, p in merged.planner.items()
             if all(isinstance(x, (str, int)) for x in p) and p}
    # an optimizer's state, by the paths its names were saved under
    # (optim/state/fc.weight/exp_avg), as in a tree
    found = optim.find_flat(paths.values())
    if found:
        meta["optimizer_states"] = [o.as_dict() for o in found]
    groups, group_keys = _groups(merged, paths, found)
    raw_all = RawRead(DCP, root, storages, seen, meta, extra_roots, warnings)
    return MultiRead(raw_all, layout.directory, files, storage_files, chunks, groups=groups,
                     group_keys=group_keys, paths=paths, notes=notes)


def _merge(metas: list[tuple[str, Metadata]], warnings: list[str],
           notes: list[str]) -> tuple[Metadata, list[tuple[str, Any]]]:
    """One Metadata from several (ranks that wrote their own, accelerate's
    sub-directories): a tensor saved whole by more than one keeps the first."""
    if len(metas) == 1 and metas[0][1].other is None:  # one .metadata: itself
        return metas[0][1], []
    out, others, repeated = Metadata(), [], 0
    for name, md in metas:
        if md.other is not None:
            others.append((name, md.other))
            warnings.append(f"{others[-1][0]} holds {brief(md.other)}, not a "
                            "torch.distributed.checkpoint Metadata: it describes no tensors")
            continue
        out.version = out.version or md.version
        out.planner.update(md.planner)
        for fqn, item in md.values.items():
            out.values.setdefault(fqn, item)
        for fqn, tm in md.tensors.items():
            have = out.tensors.get(fqn)
            if have is None:
                out.tensors[fqn] = TensorMeta(fqn, tm.shape, tm.dtype, tm.requires_grad,
                                              list(tm.boxes))
                continue
            if (have.shape, have.dtype) != (tm.shape, tm.dtype):
                raise CorruptCheckpointError(
                    f"{fqn} is {list(have.shape)} {have.dtype} in one .metadata and "
                    f"{list(tm.shape)} {tm.dtype} in another", BROKEN_HINT)
            known = {o for o, _, _ in have.boxes}
            repeated += any(o in known for o, _, _ in tm.boxes)
            have.boxes += [b for b in tm.boxes if b[0] not in known]
    if repeated:
        notes.append(f"{plural(repeated, 'tensor')} saved by more than one rank's "
                        ".metadata (dcp.save(use_collectives=False)): the first is read")
    return out, others


def _tiles(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...], Item]]
           ) -> bool:
    """True when ``boxes`` cut ``shape`` along one dimension into slabs that
    follow each other from 0 to its end, in the order listed (how DCP saves
    a tensor sharded on one dimension, or whole): then they fill it exactly
    (``dcp_metadata.check_cover`` would find nothing). False proves nothing."""
    if not boxes:
        return False
    offsets, sizes, _ = boxes[0]
    n = len(shape)
    if len(offsets) != n or len(sizes) != n:
        return False
    dim = next((i for i, (m, d) in enumerate(zip(sizes, shape, strict=True)) if m != d), None)
    if dim is None:  # the first box is the whole tensor
        return len(boxes) == 1 and not any(offsets)
    zeros_before, zeros_after = (0,) * dim, (0,) * (n - dim - 1)
    before, after = shape[:dim], shape[dim + 1:]
    at = 0
    for offsets, sizes, _ in boxes:
        step = sizes[dim] if len(sizes) == n else 0
        if offsets != (*zeros_before, at, *zeros_after) or sizes != (*before, step, *after):
            return False
        at += step
    return at == shape[dim]


def _check_lengths(fqn: str, tm: TensorMeta) -> None:
    """Each chunk's item holds at least its elements' bytes (a torch.save
    archive of them): sizes the file does not back are refused here, before
    anything is made that large."""
    itemsize = dtypes.itemsize(tm.dtype)
    for offsets, sizes, item in tm.boxes:
        need = math.prod(sizes) * itemsize
        if need and not item.transforms and item.length < need:
            raise CorruptCheckpointError(
                f"{fqn}: its chunk at {list(offsets)} is {list(sizes)} {tm.dtype} "
                f"({need} bytes), but its item in {item.file} is {item.length} bytes",
                BROKEN_HINT)


def _data_files(layout: Layout, md: Metadata) -> dict[str, int]:
    """The size of every file an item names, each checked: it exists, holds
    the items' byte ranges, and starts a tensor item with a torch.save archive."""
    items = [item for tm in md.tensors.values() for _, _, item in tm.boxes]
    items += list(md.values.values())
    sizes: dict[str, int] = {}
    for item in items:
        if item.file not in sizes:
            folder = os.path.dirname(item.file)  # accelerate's sub-directories name their own
            named_by = next((m for m in layout.metadata if os.path.dirname(m) == folder),
                            layout.metadata[0])
            path = member(layout.directory, item.file, named_by)
            sizes[item.file] = file_size(path, item.file, named_by)
        if item.offset + item.length > sizes[item.file]:
            raise CorruptCheckpointError(
                f"{item.file} is {sizes[item.file]} bytes long, but an item lies at bytes "
                f"{item.offset}..{item.offset + item.length} (truncated)", TRUNCATED_HINT)
    first: dict[str, Item] = {}
    for tm in md.tensors.values():
        for _, _, item in tm.boxes:
            first.setdefault(item.file, item)
    for name, item in first.items():
        _check_archive(os.path.join(layout.directory, name), name, item)
    for folder in {os.path.dirname(m) for m in layout.metadata}:
        for name in fs.listdir(os.path.join(layout.directory, folder) if folder
                               else layout.directory):
            rel = os.path.join(folder, name) if folder else name
            path = os.path.join(layout.directory, rel)
            if name.endswith(".distcp") and rel not in sizes and fs.isfile(path):
                sizes[rel] = fs.getsize(path)  # a rank's file no item names
    return sizes


def _check_archive(path: str, shown: str, item: Item) -> None:
    if item.transforms or item.length == 0:
        return
    with fs.open_binary(path) as f:
        f.seek(item.offset)
        head = f.read(16)
        f.seek(0)
        start = f.read(16)
    if head.startswith(embedded.ZIP_MAGIC):
        return
    if sniff_safetensors(start):
        raise UnsupportedCheckpointError(
            f"{shown} holds safetensors, not torch.save archives: a DCP checkpoint saved "
            "with SerializationFormat.SAFETENSORS, which ckptool does not read yet",
            "save it with the default FileSystemWriter, or consolidate it with torch")
    raise CorruptCheckpointError(
        f"{shown} holds no torch.save archive at byte {item.offset}, where .metadata puts "
        "a tensor chunk", BROKEN_HINT)


def _file_infos(md: Metadata, sizes: dict[str, int]) -> list[FileInfo]:
    tensors, values = dcp_chunks.counts(md.tensors, md.values)
    return [FileInfo(name, "data", DCP, size, tensors.get(name, 0), values.get(name, 0),
                     _rank(name)) for name, size in sorted(sizes.items(), key=_file_order)]


def _file_order(pair: tuple[str, int]) -> tuple[str, int, int, str]:
    folder, name = os.path.split(pair[0])
    m = RANK_FILE.match(name)
    return (folder, int(m.group(1)), int(m.group(2)), "") if m else (folder, -1, -1, name)


def _value(layout: Layout, fqn: str, item: Item, seen: GlobalsSeen,
           storages: dict[str, StorageRef], storage_files: dict[str, str]) -> Any:
    """A BYTE_IO item's object, read with ckptool's unpickler; tensors inside
    it keep where their bytes lie in the .distcp file."""
    if item.transforms:
        # dcp.load undoes the transforms (stream.zstd) and unpickles the
        # value with weights_only=False; ckptool cannot read it, so it
        # cannot vouch for it: failing closed, the value counts as unsafe
        how = ", ".join(item.transforms)
        seen.flag(UNREAD_VALUE, f"a value stored through {how}, which ckptool does not "
                  "undo: dcp.load unpickles it with weights_only=False, and what it runs is "
                  "unknown", f"{item.file}: {fqn}")
        return Unread(f"stored through {how}; not read, so not vouched for")
    path = os.path.join(layout.directory, item.file)
    shown = f"{item.file} (item {fqn})"
    raw, offsets = embedded.read_item(path, shown, item.offset, item.length)
    if item.length > MAX_VALUE_BYTES:  # dcp.load unpickles it whatever its size: so do we
        seen.merge(raw.seen, f"{item.file}: {fqn}")
        return Unread(f"{item.length} bytes; read for the globals it names")
    for key, ref in raw.storages.items():
        ref.key, ref.record = f"{fqn}:{key}", f"@{offsets[key]}"
        storages[ref.key], storage_files[ref.key] = ref, item.file
    seen.merge(raw.seen, f"{item.file}: {fqn}")
    return raw.root


def _groups(md: Metadata, paths: dict[str, tuple[str | int, ...]],
            found: list[optim.OptimizerState]) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Tensor keys by the entry they were saved under (from planner_data),
    and each entry's key (its path, for ranking): the top-level entry; or,
    where an entry holds an optimizer's state beside other entries (the DCP
    recipe's ``{"app": AppState}`` saves ``{"model": ..., "optim": ...}``
    under ``app``), each of those (``app.model``), named as its keys begin.
    Tensors saved at the top level are the group "". ``paths``: each name's
    planner path; ``found``: the optimizer states they hold."""
    # the entries holding an optimizer's state beside others ("app" of app/optim)
    parents = sorted({tuple(split_key(s.path))[:-1] for s in found if "/" in s.path},
                     key=len, reverse=True)
    groups: dict[str, list[str]] = {}
    keys: dict[str, str] = {}
    entry_keys: dict[tuple[str, ...], str] = {}  # (100,000 names: a few entries)
    for fqn in md.tensors:
        steps = tuple(map(str, paths.get(fqn, ())))
        parent = next((p for p in parents if steps[:len(p)] == p and len(steps) > len(p) + 1),
                      None) if parents else None
        entry = steps[:len(parent) + 1] if parent is not None else steps[:1] \
            if len(steps) > 1 else ()
        name = ".".join(entry)
        groups.setdefault(name, []).append(fqn)
        key = entry_keys.get(entry)
        if key is None:
            key = entry_keys[entry] = key_of(list(entry))
        keys[name] = key
    return groups, keys


def nest(items: dict[str, Any], paths: dict[str, tuple[str | int, ...]]) -> dict[str, Any]:
    """The nested dict the flat ``items`` came from (DCP's planner paths; an
    int step is a list index, as ``torch.distributed.checkpoint`` unflattens)."""
    tree: dict[str, Any] = {}
    for name, value in items.items():
        path = paths.get(name, (name,))
        node: Any = tree
        for step, after in itertools.pairwise(path):
            node = _child(node, step, [] if isinstance(after, int) else {})
        _set(node, path[-1], value)
    return tree


def _child(node: Any, step: str | int, empty: Any) -> Any:
    if isinstance(node, list) and isinstance(step, int):
        node.extend([None] * (step + 1 - len(node)))
        if node[step] is None:
            node[step] = empty
        return node[step]
    return node.setdefault(step, empty)


def _set(node: Any, step: str | int, value: Any) -> None:
    if isinstance(node, list) and isinstance(step, int):
        node.extend([None] * (step + 1 - len(node)))
    node[step] = value
