"""Read a checkpoint into the pure data model: ``ckptool.open(path)``.

Sniffs and reads the file (``ckptool.read.formats``), walks its object tree
(``ckptool.read.walk``), and assembles a ``Checkpoint``: tensors with their keys,
storages with the tensors that view them, non-tensor entries, the globals
the file names, and the main state dict with its key prefix.

A directory or an index file is a checkpoint of many files
(``ckptool.read.layouts``): its reader gives one merged tree, assembled here
the same way, with the files, each tensor's shard or chunks, and the names
an index records as tied.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from ckptool.describe import plural
from ckptool.keys import escape, join_key, join_keys, split_key
from ckptool.model import Checkpoint, Entry, GlobalInfo, StateDictInfo, StorageInfo, TensorInfo
from ckptool.read import companions, dispatch, fs, observe, optim, params, prefixes
from ckptool.read.collector import no_cycle_collection
from ckptool.read.formats.base import RawRead
from ckptool.read.formats.safetensors_fmt import SAFETENSORS
from ckptool.read.layouts import recognise
from ckptool.read.layouts.layout import DS_UNIVERSAL
from ckptool.read.pickle import policy
from ckptool.read.pickle.policy import UNSAFE
from ckptool.read.summary import plain_value, summarize, type_name
from ckptool.read.tensors import CompositeTensor, StorageRef, TensorRecord
from ckptool.read.values import StandIn
from ckptool.read.walk import Candidate, walk

if TYPE_CHECKING:
    from ckptool.read.layouts.base import MultiRead

TENSORS = (TensorRecord, StorageRef, CompositeTensor)
# names under which checkpoints keep their weights, most telling first
PREFERRED_NAMES = (
    "state_dict", "model_state_dict", "model", "net", "network", "module",
    "weights", "params", "generator", "actor", "policy",
)
_CATEGORY_ORDER = {UNSAFE: 0, "custom": 1, "data": 2, "torch": 3}


def open_checkpoint(path: str | os.PathLike[str],
                    on_tensors: Callable[[list[TensorInfo]], None] | None = None) -> Checkpoint:
    """Read ``path`` safely (no code from the file runs, no tensor bytes are read).

    ``on_tensors``, if given, is called on the reading thread while the
    pickle is read, with a batch of tensors each time a dict of them grows
    (every 1000 entries of a state dict), keyed as ``Checkpoint.tensors``
    will key them. Only tensors in dicts the pickle stack places are sent
    (none from a pickled module, a list, or under int keys). They are a
    preview: a state dict that ends up inside a tuple of at most 3 items
    (``torch.save((sd, opt))``) is sent under the keys it would have outside
    it (see ``ckptool.read.observe``). The returned Checkpoint is complete,
    and the same as without ``on_tensors``.

    ``path`` may be a directory or a shard index (``ckptool.read.layouts``):
    a checkpoint of many files is read whole (``on_tensors`` is not called),
    and a directory holding one checkpoint file reads as that file.
    """
    path = os.fspath(path)
    if fs.is_remote(path):  # listings made now, not kept from an earlier read
        from ckptool.read import remote

        remote.forget()
    with no_cycle_collection():
        return _open(path, on_tensors)


def _open(given: str, on_tensors: Callable[[list[TensorInfo]], None] | None) -> Checkpoint:
    layout = recognise.recognise(given)
    if layout is not None and layout.kind != recognise.FILE:
        ckpt = assemble_multi(given, read_layout(layout))
    else:
        # a directory holding one checkpoint file (or one model beside a
        # framework's other files) reads as that file
        path = layout.file if layout is not None and layout.file is not None else given
        if on_tensors is None:
            raw = dispatch.read(path)
        else:
            with observe.observe(_partial_tensors(on_tensors), TENSORS):
                raw = dispatch.read(path)
        raw, aliases = _recorded_ties(raw)
        ckpt = assemble(path, raw)
        ckpt.aliases = aliases
        notes = list(layout.notes) if layout is not None else []  # what else its folder holds
        # the layouts of many files are imported only for a file that may be
        # one of theirs: a plain file's read loads none of them
        if any(t.subclass for t in ckpt.tensors):
            from ckptool.read.layouts import per_rank

            shard = per_rank.one_rank(path, ckpt.root)
            notes += [shard] if shard else []
        if ckpt.format == SAFETENSORS and ckpt.metadata.get("metadata"):
            from ckptool.read.layouts import hf_storage

            if hf_storage.SHARDING_INFO in ckpt.metadata["metadata"]:
                piece = hf_storage.one_piece(path, ckpt.metadata)
                notes += [piece] if piece else []
        if notes:
            ckpt.metadata["notes"] = [*ckpt.metadata.get("notes", ()), *notes]
    if layout is not None and layout.nemo:
        ckpt.metadata["nemo"] = layout.nemo
    ckpt.framework = companions.framework_of(given, layout, ckpt)
    return ckpt


def _recorded_ties(raw: RawRead) -> tuple[RawRead, dict[str, str]]:
    """A safetensors file's tied names (the ones huggingface_hub drops and
    records in ``__metadata__`` as dropped -> kept, or ``convert``'s
    ``ckptool.aliases``), each listed as a tensor sharing its twin's storage,
    as an index's recorded ties are: in a new tree, so that a rewrite's
    faithful read of the file stays the file."""
    if raw.format != SAFETENSORS or not isinstance(raw.root, dict):
        return raw, {}
    from ckptool.read import ties

    aliases, _ = ties.recorded_aliases(raw.metadata.get("metadata") or {}, set(raw.root))
    if not aliases:
        return raw, {}
    from ckptool.read.layouts.base import tied_records

    added = tied_records(raw.root, aliases)
    if not added:
        return raw, {}
    return dataclasses.replace(raw, root={**raw.root, **added}), aliases


def _partial_tensors(on_tensors: Callable[[list[TensorInfo]], None]) -> observe.Observer:
    def added(path: tuple[str, ...], pairs: list[tuple[Any, Any]]) -> None:
        # as walk.path_of: every name escaped, joined by "/" (walk.key_text
        # of a str is itself)
        prefix = "".join(f"{escape(name)}/" for name in path)
        infos = [tensor_info(prefix + escape(key), value) for key, value in pairs
                 if type(key) is str and isinstance(value, TENSORS)]
        if infos:
            on_tensors(infos)
    return added


def read_layout(layout: recognise.Layout) -> MultiRead:
    """The files of a checkpoint of many files, read and merged (each
    layout's reader imported only for its own)."""
    with dispatch.explained(layout.path):
        if layout.kind == recognise.HF:
            from ckptool.read.layouts.hf_sharded import read
        elif layout.kind == recognise.DEEPSPEED:
            from ckptool.read.layouts.deepspeed import read
        elif layout.kind == recognise.PER_RANK:
            from ckptool.read.layouts.per_rank import read
        elif layout.kind == recognise.HF_STORAGE:
            from ckptool.read.layouts.hf_storage import read
        elif layout.kind == DS_UNIVERSAL:
            from ckptool.read.layouts.ds_universal import read
        elif layout.kind == recognise.MEGATRON:
            from ckptool.read.megatron.legacy import read
        else:
            from ckptool.read.layouts.dcp import read
        return read(layout)


def assemble_multi(path: str, multi: MultiRead) -> Checkpoint:
    """The Checkpoint of a checkpoint of many files: assembled as one file's,
    then each tensor and storage told where it lives."""
    from ckptool.read.layouts.base import list_ties

    list_ties(multi)  # a tied name is a tensor of its own, sharing the stored one's storage
    ckpt = assemble(path, multi.raw, sum(f.size for f in multi.files), multi.groups is None)
    ckpt.directory, ckpt.files = multi.directory, multi.files
    ckpt.tree_paths, ckpt.aliases = multi.paths, dict(multi.aliases)
    if multi.notes:  # inspect says them; diagnose does not count them as problems
        ckpt.metadata["notes"] = list(multi.notes)
    for s in ckpt.storages.values():
        s.file = multi.storage_files.get(s.id)
    chunks = multi.chunks if multi.chunk_keys else {  # names -> keys
        join_key("", name): c for name, c in multi.chunks.items()}
    for t in ckpt.tensors:
        t.chunks = chunks.get(t.key, ())
        t.file = multi.storage_files.get(t.storage) if t.storage is not None else None
    listed = {t.key for t in ckpt.tensors}
    ckpt.entries += [Entry(join_key("", name), "alias", f"same tensor as {kept} (the index "
                           "records it; not stored)") for name, kept in multi.aliases.items()
                     if join_key("", name) not in listed]
    if multi.groups is not None:
        # the state dict is one top-level entry's names, ranked by the entry's
        # name as a file's entries are (tensors saved at the top level rank low)
        ranked = [(20 if name == "" else _rank(Candidate(
                       multi.group_keys.get(name) or escape(name), "dict", [])),
                   Candidate("", "dict", names)) for name, names in multi.groups.items()]
        top = max((rank for rank, _ in ranked), default=-1)
        best = [c for rank, c in ranked if rank == top and rank >= 0]
        ckpt.main_state_dict = _main_state_dict(best, ckpt.tensors)
        sd = ckpt.main_state_dict
        entry = next((name for name, names in multi.groups.items()
                      if sd and names == list(sd.keys)), None)
        if sd and entry:  # its keys keep the entry's name as their prefix ("model.")
            ckpt.metadata["state_dict_entry"] = entry
    return ckpt


def with_state_dict(ckpt: Checkpoint, path: str, names: list[str]) -> Checkpoint:
    """``ckpt`` with its main state dict the dict at ``path`` (key text)
    holding ``names`` (DeepSpeed's module weights, instead of its fp32 masters)."""
    from dataclasses import replace

    return replace(ckpt, main_state_dict=_main_state_dict([Candidate(path, "dict", names)],
                                                          ckpt.tensors))


def assemble(path: str, raw: RawRead, file_size: int | None = None,
             state_dict: bool = True) -> Checkpoint:  # (False: the caller picks it)
    """The Checkpoint of an already read file (rewrites read it faithfully first)."""
    walked = walk(raw.root)
    for name, extra in raw.extra_roots.items():
        more = walk(extra, f"<{name}>")
        walked.tensors += more.tensors
        walked.entries += more.entries
    tensors = [tensor_info(key, rec) for key, rec in walked.tensors]
    entries = [Entry(key, type_name(v), summarize(v), plain_value(v))
               for key, v in walked.entries]
    entries += [Entry(key, "alias", f"same object as {same}") for key, same in walked.aliases]
    seen = raw.seen
    storages = _storages(raw.storages, tensors)
    unviewed = [s.id for s in storages.values() if not s.tensors]
    if unviewed:  # a quantizer's scales, a DTensor's local shard: its tensor's
        held = _held_storages(walked.tensors)
        unviewed = [sid for sid in unviewed if sid not in held]
    warnings = list(raw.warnings)
    if unviewed:  # reached by the pickle, yet in no object ckptool lists
        warnings.append(f"{plural(len(unviewed), 'storage')} the pickle loads that no listed "
                        f"tensor views ({', '.join(unviewed[:3])}"
                        f"{', …' if len(unviewed) > 3 else ''})")
    optimizers = optim.find(raw.root)
    metadata = raw.metadata
    if optimizers:  # shown as what they are; their per-parameter dicts are no state dict
        metadata = {**metadata, "optimizer_states": [o.as_dict() for o in optimizers]}
    globals_ = sorted(
        (GlobalInfo(n, v.category, v.reason, seen.counts[n],
                    tuple(u for u in policy.USES if u in seen.uses.get(n, ())),
                    tuple(seen.where.get(n, ())))
         for n, v in seen.final().items()),
        key=lambda g: (_CATEGORY_ORDER.get(g.category, 9), g.name),
    )
    return Checkpoint(
        path=path,
        format=raw.format,
        file_size=fs.getsize(path) if file_size is None else file_size,
        tensors=tensors,
        storages=storages,
        entries=entries,
        globals=globals_,
        main_state_dict=_main_state_dict(walked.candidates, tensors,
                                         tuple(o.state_path for o in optimizers))
        if state_dict else None,
        metadata=metadata,
        root=raw.root,
        warnings=warnings,
    )


def _held_storages(records: list[tuple[str, Any]]) -> set[str]:
    """Storages a tensor record holds beside its own: a quantizer's
    per-channel scales, a DTensor's local shard and its mesh's rank map.
    Part of that tensor, not unviewed."""
    held: set[str] = set()
    stack = [(0, rec.extra) for _, rec in records if type(rec) is TensorRecord and rec.extra]
    while stack:
        depth, obj = stack.pop()
        if isinstance(obj, TensorRecord):
            if obj.storage is not None:
                held.add(obj.storage.key)
            obj = obj.extra
        if depth > 8 or obj is None:
            continue
        if isinstance(obj, dict):
            stack += [(depth + 1, v) for v in obj.values()]
        elif isinstance(obj, (list, tuple)):
            stack += [(depth + 1, v) for v in obj]
        elif isinstance(obj, StandIn):
            stack += [(depth + 1, obj.state), (depth + 1, obj.args)]
    return held


def tensor_info(key: str, rec: Any) -> TensorInfo:
    """The TensorInfo of a TensorRecord, of a StorageRef saved on its own, or
    of a sparse or nested tensor (its parts under it)."""
    if type(rec) is TensorRecord:  # nearly every one: tested first
        # positional, in TensorInfo's field order: a third faster than by name
        return TensorInfo(key, rec.shape, rec.dtype, rec.stride, rec.storage_offset,
                          rec.storage.key if rec.storage else None, rec.location, rec.nbytes,
                          rec.requires_grad, rec.is_parameter, rec.layout, rec.subclass)
    if isinstance(rec, CompositeTensor):
        parts = tuple(tensor_info(join_key(key, name), part) for name, part in rec.parts.items()
                      if isinstance(part, (TensorRecord, StorageRef, CompositeTensor)))
        main = next((p for p in parts if p.key.endswith("/values")), parts[0] if parts else None)
        return TensorInfo(key, rec.shape, main.dtype if main else "?", None, 0, None,
                          main.location if main else None, sum(p.nbytes for p in parts),
                          layout=rec.layout, parts=parts)
    if isinstance(rec, StorageRef):  # a storage saved on its own
        return TensorInfo(key, (rec.numel,), rec.dtype, (1,), 0, rec.key, rec.location,
                          rec.nbytes, layout="storage")
    raise TypeError(f"not a tensor record: {type(rec).__name__}")


def _storages(refs: dict[str, StorageRef], tensors: list[TensorInfo]) -> dict[str, StorageInfo]:
    # most storages have one viewer: kept as itself, a list only from the second
    viewers: dict[str | None, TensorInfo | list[TensorInfo]] = {}
    sids = list(map(attrgetter("storage"), tensors))
    if len(set(sids)) == len(sids) and not any(map(attrgetter("parts"), tensors)):
        # every tensor views a storage of its own (the common state dict): in C
        viewers = dict(zip(sids, tensors, strict=True))
    else:
        for t in tensors:
            for view in (t, *t.parts) if t.parts else (t,):  # a sparse tensor views its parts'
                sid = view.storage
                if sid is None:
                    continue
                seen = viewers.get(sid)
                if seen is None:
                    viewers[sid] = view
                elif isinstance(seen, list):
                    seen.append(view)
                else:
                    viewers[sid] = [seen, view]
    out = {}
    for sid, ref in refs.items():
        found = viewers.get(sid)
        views: Sequence[TensorInfo]
        keys: tuple[str, ...]
        if found is None:
            views, keys = (), ()
        elif isinstance(found, list):
            views, keys = found, tuple([t.key for t in found])
        else:  # no comprehension for the one viewer most have: it costs a call
            views, keys = (found,), (found.key,)
        # untyped storages count bytes: name them by the dtype viewing them
        dtype = views[0].dtype if views and ref.dtype == "uint8" else ref.dtype
        out[sid] = StorageInfo(sid, dtype, ref.location, ref.nbytes, ref.record, keys)
    return out


def _rank(c: Candidate, optimizer_states: tuple[str, ...] = ()) -> int:
    if any(c.path == s or c.path.startswith(s + "/") for s in optimizer_states):
        return -1  # one parameter's moments (exp_avg, step...): never the weights
    if c.path == "":
        return 100
    lowered = c.path.lower()
    if "optim" in lowered or "scheduler" in lowered:
        return -1  # optimizer state is dicts of tensors too, never the weights
    last = split_key(c.path)[-1]
    if last in PREFERRED_NAMES:
        return 90 - PREFERRED_NAMES.index(last)
    return 40 if "ema" in last.lower() else 10


def _main_state_dict(cands: list[Candidate], tensors: list[TensorInfo],
                     optimizer_states: tuple[str, ...] = ()) -> StateDictInfo | None:
    ranked = [(_rank(c, optimizer_states), c) for c in cands]
    top = max((rank for rank, _ in ranked), default=-1)
    if top < 0:
        return None
    by_key = dict(zip(map(attrgetter("key"), tensors), tensors, strict=True))

    def members(c: Candidate) -> list[TensorInfo]:
        return list(filter(None, map(by_key.get, join_keys(c.path, c.names))))

    # the best ranked; among equals, the one with the most elements
    scored = [(c, members(c)) for rank, c in ranked if rank == top]
    best, ts = scored[0] if len(scored) == 1 else max(
        scored, key=lambda cm: sum(t.numel for t in cm[1]))
    common = prefixes.common_prefix(best.names)
    counted = params.count(ts, module=best.kind == "module")
    return StateDictInfo(
        path=best.path, kind=best.kind, keys=tuple(best.names),
        prefix=prefixes.wrapper_prefix(best.names, common),
        common_prefix=common,
        num_tensors=len(ts),
        num_parameters=counted.parameters,
        num_buffers=counted.buffers,
        nbytes=sum(map(attrgetter("nbytes"), ts)),
    )
