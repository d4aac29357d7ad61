"""A DeepSpeed checkpoint (ZeRO 0-3, any world size) as one checkpoint whose
state dict is the consolidated fp32 master weights, as DeepSpeed's
``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` builds them, made
of byte runs in the ranks' files rather than of tensors in memory.

Read: every file of the tag directory (``deepspeed_files``), pickles only.
The state dict is, per name (in the model's order: ``module``'s):

- trainable parameters: their runs in the ranks' fp32 partitions
  (``single_partition_of_fp32_groups``, ZeRO 1/2 and the BF16_Optimizer;
  ``fp32_flat_groups``, ZeRO 3), placed by ``zero``;
- frozen parameters: ``frozen_param_fragments`` (ZeRO 2: rank 0's, whole;
  ZeRO 3: every rank's piece), as saved (bf16 in a bf16 run), as DeepSpeed
  does. Where a save records none (ZeRO 1, the BF16_Optimizer, ZeRO 0), they
  are taken from ``module``, as the model holds them: DeepSpeed leaves them
  out there, and the model then does not load;
- buffers: rank 0's ``module``, floating ones as float32 (DeepSpeed casts
  them); tied parameters (``shared_params``) as aliases of their owner,
  listed as tensors sharing its storage (``base.list_ties``).
- ZeRO 0 keeps no partitions: the state dict is ``module`` as saved, its
  tied names (one view of one storage) aliases of the first.

Each tensor's ``chunks`` are ``flat`` runs: file, rank, the run of the
flattened tensor it fills, and the absolute byte range of its elements in
that file's (uncompressed) storage record. Reading a tensor reads exactly
those bytes (``tensor_bytes``); ``convert`` copies them.

Everything else is kept, under each file's name (``<mp_rank_00_model_states.pt>/
module/...``): the half-precision ``module`` weights, each rank's optimizer
moments (sizes only: no value is read), ``ds_config``. The fp32 partitions
and frozen fragments the state dict is made of are not listed twice. The
client state (``epoch``, user values) is at the top level, as entries.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from ckptool import dtypes
from ckptool.describe import plural
from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.model import Chunk, FileInfo
from ckptool.read import fs
from ckptool.read.formats.base import RawRead
from ckptool.read.layouts import deepspeed_moe as moe
from ckptool.read.layouts import zero
from ckptool.read.layouts.base import BROKEN_HINT, MultiRead, contiguous
from ckptool.read.layouts.deepspeed_files import (
    MIXED_HINT,
    Files,
    Offsets,
    Saved,
    kept_storages,
    listed,
    read_files,
    step_tensor,
)
from ckptool.read.layouts.recognise import Layout
from ckptool.read.seen import GlobalsSeen
from ckptool.read.tensors import StorageRef, TensorRecord

DEEPSPEED = "deepspeed"
# what DeepSpeed itself puts in a model-states file; every other key is client state
DS_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
    "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
    "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config",
    "ds_version", "universal_checkpoint_info", "ds_autoep_layers", "autoep_layers",
    "num_experts"})
PARTITIONS = {1: "single_partition_of_fp32_groups", 2: "single_partition_of_fp32_groups",
              3: "fp32_flat_groups"}
Run = tuple[Saved, TensorRecord, int, int, int]  # file, record, start, count, at


def read(layout: Layout) -> MultiRead:
    folder = layout.directory
    files = read_files(folder)
    offsets = Offsets(folder)
    try:
        return _read(layout, files, offsets)
    finally:
        offsets.close()


def _read(layout: Layout, files: Files, offsets: Offsets) -> MultiRead:
    folder = layout.directory
    m0 = files.models[0]
    module = m0.tree.get("module")
    if not isinstance(module, dict):
        raise CorruptCheckpointError(f"{m0.name}: 'module' is not a state dict", BROKEN_HINT)
    _check_steps(files, offsets)
    built: dict[str, tuple[TensorRecord, list[Run], str]] = {}  # name -> (shape rec, runs, kind)
    notes = list(layout.notes)
    replaced: set[int] = set()  # ids of records the state dict is made of
    tied: dict[str, str] = {}
    moe.missing_files(m0.tree.get("num_experts"), [f.name for f in files.experts], folder)
    experts = moe.expert_tensors([(f.name, f.tree) for f in files.experts])
    if files.stage == 0:
        tied = _same_views(module)  # ZeRO 0 records no shared_params: the module's own ties
        for name, rec in module.items():
            if isinstance(rec, TensorRecord) and name not in tied:
                built[name] = (rec, [_whole(m0, rec, name)], "module")
        expert_files = {e.name: e for e in files.experts}
        for name, (file, rec) in experts.items():
            built[name] = (rec, [_whole(expert_files[file], rec, name)], "module")
        notes.append("ZeRO stage 0: the weights are the module's, as saved (no partitions)")
    else:
        _buffers(m0, module, built)
        placed = _trainable(files, built, replaced)
        if experts or placed:
            moe.check_files(placed, experts, folder)
        _frozen(files, module, built, replaced, notes)
    if experts:
        notes.append(f"MoE: {plural(len(files.experts), 'expert file')} of "
                     f"{plural(len({n.split('.deepspeed_experts.')[0] for n in experts}), 'layer')}"
                     ": each expert under its global id, as DeepSpeed's load_checkpoint puts "
                     "it back")
    aliases = {**_aliases(m0, built), **tied}
    order = moe.ordered([n for n in module if n in built], [n for n in built if n not in module])
    root: dict[str, Any] = {}
    storages: dict[str, StorageRef] = {}
    chunks: dict[str, tuple[Chunk, ...]] = {}
    for name in order:
        shape_of, runs, kind = built[name]
        dtype = _dtype(name, shape_of, runs, kind)
        shape = shape_of.shape
        ref = StorageRef(name, dtype, None, math.prod(shape))
        storages[name] = ref
        root[name] = TensorRecord(shape, dtype, contiguous(shape), 0, ref, None,
                                  requires_grad=kind == "trainable",
                                  is_parameter=kind in ("trainable", "frozen", "module"))
        chunks[name] = tuple(_chunk(offsets, name, dtype, run) for run in runs) or (
            Chunk(m0.name, (0,), (0,), 0, 0, None, flat=True),)  # 0 elements: nothing to read
    seen = GlobalsSeen()
    client = {k: v for k, v in m0.tree.items() if k not in DS_KEYS}
    warnings: list[str] = []
    for key, value in client.items():
        if key in root:
            warnings.append(f"client state {key!r} has a parameter's name: shown under "
                            f"<{m0.name}>/{key}")
        else:
            root[key] = value
    extra_roots: dict[str, Any] = {}
    storage_files: dict[str, str] = {}
    infos = []
    for f in files.all:
        seen.merge(f.raw.seen, f.name)
        warnings += [f"{f.name}: {w}" for w in f.raw.warnings]
        extra_roots[f.name] = listed(f, replaced, client if f is m0 else {}, set(root))
        kept = kept_storages(extra_roots[f.name])
        for key, s in f.raw.storages.items():
            if id(s) in kept:
                s.key = f"{f.name}:{key}"
                storages[s.key], storage_files[s.key] = s, f.name
        role = "model states" if f in files.models else "expert states" \
            if f in files.experts else "optimizer states"
        infos.append(FileInfo(f.name, role, f.raw.format,
                              fs.getsize(os.path.join(folder, f.name)),
                              num_tensors=len(f.raw.storages), rank=f.rank))
    if files.others:
        notes.append(f"{layout.directory} also holds {', '.join(files.others[:6])}: not part "
                     "of the DeepSpeed checkpoint")
    meta = _metadata(layout, files, module)
    raw = RawRead(DEEPSPEED, root, storages, seen, meta, extra_roots, warnings)
    return MultiRead(raw, folder, infos, storage_files, chunks, aliases,
                     groups={"": [n for n in order]}, notes=notes)


def _metadata(layout: Layout, files: Files, module: dict[str, Any]) -> dict[str, Any]:
    m0 = files.models[0].tree
    buffers = m0.get("buffer_names")
    skip = set(buffers) if isinstance(buffers, list) else set()
    run = next((r.dtype for n, r in module.items() if isinstance(r, TensorRecord)
                and n not in skip and dtypes.is_floating(r.dtype)), None)
    return {"zero_stage": files.stage, "world_size": files.world_size, "tag": layout.tag,
            "run_dtype": run, "optimizer": files.optimizer,
            "ds_version": m0.get("ds_version"), "global_steps": m0.get("global_steps"),
            "ranks": files.world_size, "model_states": files.models[0].name,
            **({"expert_files": len(files.experts)} if files.experts else {})}


def _check_steps(files: Files, offsets: Offsets) -> None:
    """Every rank's optimizer took as many steps (its first ``step`` value):
    files of two saves mixed in one directory are refused."""
    values: dict[bytes, str] = {}
    for f in files.optims:
        rec = step_tensor(f)
        if rec is None or rec.storage is None:
            continue
        size = dtypes.itemsize(rec.dtype)
        at = offsets.start(f, rec.storage) + rec.storage_offset * size
        values.setdefault(offsets.read(f, at, size) + rec.dtype.encode(), f.name)
    if len(values) > 1:
        raise CorruptCheckpointError(
            f"the ranks' optimizer states were saved at different steps "
            f"({', '.join(values.values())} differ)", MIXED_HINT)


def _dense(rec: TensorRecord) -> bool:
    """A plain tensor whose elements lie one after the other in its storage."""
    return rec.storage is not None and rec.layout == "strided" and rec.storage_offset >= 0 \
        and (rec.numel <= 1 or rec.stride == contiguous(rec.shape))


def _whole(f: Saved, rec: TensorRecord, name: str) -> Run:
    """A tensor of a file, saved contiguous, as one run."""
    if not _dense(rec):
        raise UnsupportedCheckpointError(
            f"{name} in {f.name} is not a contiguous dense tensor", BROKEN_HINT)
    return (f, rec, 0, rec.numel, 0)


def _buffers(m0: Saved, module: dict[str, Any], built: dict[str, Any]) -> None:
    names = m0.tree.get("buffer_names")
    for name in names if isinstance(names, list) else ():
        rec = module.get(name)
        if isinstance(name, str) and isinstance(rec, TensorRecord):
            built[name] = (rec, [_whole(m0, rec, name)], "buffer")


def _shapes(f: Saved, key: str) -> list[dict[str, tuple[int, ...]]]:
    value = f.tree.get(key)
    groups = value if isinstance(value, list) else [value] if isinstance(value, dict) else None
    if groups is None:
        raise CorruptCheckpointError(f"{f.name}: '{key}' is {type(value).__name__}, not the "
                                     "parameters' shapes", BROKEN_HINT)
    out = []
    for g in groups:
        if not isinstance(g, dict) or not all(
                isinstance(n, str) and isinstance(s, tuple)
                and all(isinstance(d, int) and d >= 0 for d in s) for n, s in g.items()):
            raise CorruptCheckpointError(f"{f.name}: '{key}' is not names and shapes",
                                         BROKEN_HINT)
        out.append(dict(g))
    return out


def _partitions(files: Files) -> list[list[TensorRecord]]:
    key = PARTITIONS[files.stage]
    out = []
    for f in files.optims:
        parts = f.tree["optimizer_state_dict"].get(key)
        if not isinstance(parts, list) or not all(
                isinstance(p, TensorRecord) and _dense(p) and len(p.shape) == 1 for p in parts):
            raise CorruptCheckpointError(f"{f.name}: '{key}' is not a list of flat tensors",
                                         BROKEN_HINT)
        out.append(parts)
    return out


def _trainable(files: Files, built: dict[str, Any],
               replaced: set[int]) -> dict[str, tuple[int, ...]]:
    """The fp32 master weights' runs; the MoE experts' shapes (global names)."""
    parts = _partitions(files)
    for per_rank in parts:
        replaced.update(id(p) for p in per_rank)
    lengths = [[p.numel for p in per_rank] for per_rank in parts]
    groups = _shapes(files.models[0], "param_shapes")
    paddings = files.optims[0].tree["optimizer_state_dict"].get("param_alignment_paddings")
    if files.stage != 3 and paddings is not None and not (
            isinstance(paddings, list) and len(paddings) == len(groups) and all(
                isinstance(g, list) and all(type(x) is int and x >= 0 for x in g)
                for g in paddings)):
        raise CorruptCheckpointError(f"the fp32 partitions do not hold the parameters: "
                                     f"param_alignment_paddings is {paddings!r:.60}",
                                     BROKEN_HINT)
    expert_groups = moe.groups_of_experts(files.optims[0].tree) if files.stage != 3 else []
    experts = moe.master_weights(files, parts, lengths, groups, paddings, expert_groups, built)
    keep = [g for g in range(len(groups)) if g not in expert_groups]
    if expert_groups:
        lengths = [[per_rank[g] for g in keep if g < len(per_rank)] for per_rank in lengths]
        groups = [groups[g] for g in keep]
        if paddings is not None:
            paddings = [paddings[g] for g in keep]
    try:
        if files.stage == 3:
            merged = [(n, s) for g in groups for n, s in g.items()]
            placed = zero.stage3(lengths, [(n, math.prod(s)) for n, s in merged],
                                 files.world_size)
            shapes = dict(merged)
        else:
            placed = zero.stage12(lengths, [[(n, math.prod(s)) for n, s in g.items()]
                                            for g in groups], paddings, files.world_size)
            shapes = {n: s for g in groups for n, s in g.items()}
    except zero.LayoutError as exc:
        raise CorruptCheckpointError(
            f"the fp32 partitions do not hold the parameters: {exc}", BROKEN_HINT) from exc
    dtype = next((p.dtype for per_rank in parts for p in per_rank), "float32")
    for name, pieces in placed.items():
        runs = [(files.optims[p.rank], parts[p.rank][keep[p.group]], p.start, p.count, p.at)
                for p in pieces]
        built[name] = (_shaped(shapes[name], dtype), runs, "trainable")
    return experts


def _frozen(files: Files, module: dict[str, Any], built: dict[str, Any],
            replaced: set[int], notes: list[str]) -> None:
    m0 = files.models[0]
    shapes = m0.tree.get("frozen_param_shapes")
    if isinstance(shapes, dict) and shapes:
        fragments = [f.tree.get("frozen_param_fragments") for f in files.models]
        for name, shape in _shapes(m0, "frozen_param_shapes")[0].items():
            numel = math.prod(shape)
            found = [fr.get(name) if isinstance(fr, dict) else None for fr in fragments]
            recs = [r for r in found if isinstance(r, TensorRecord) and _dense(r)
                    and (files.stage != 3 or len(r.shape) == 1)]
            if len(recs) != len(found):
                raise CorruptCheckpointError(
                    f"the frozen parameter {name} has no dense fragment in every model-states "
                    "file", BROKEN_HINT)
            replaced.update(id(r) for r in recs)
            if files.stage == 3:
                try:
                    pieces = zero.frozen3(name, numel, [r.numel for r in recs])
                except zero.LayoutError as exc:
                    raise CorruptCheckpointError(str(exc), BROKEN_HINT) from exc
                runs: list[Run] = [(files.models[p.rank], recs[p.rank], p.start, p.count, p.at)
                                   for p in pieces]
            else:
                if recs[0].numel != numel:
                    raise CorruptCheckpointError(
                        f"the frozen parameter {name} is {list(shape)}, its fragment "
                        f"{list(recs[0].shape)}", BROKEN_HINT)
                runs = [_whole(m0, recs[0], name)]
            built[name] = (_shaped(shape, recs[0].dtype), runs, "frozen")
        return
    shared = m0.tree.get("shared_params")
    tied = set(shared) if isinstance(shared, dict) else set()
    taken = [n for n, rec in module.items() if n not in built and n not in tied
             and isinstance(rec, TensorRecord) and rec.layout == "strided"]
    if files.stage == 3:  # the module holds 0-element placeholders: nothing to take
        if taken:
            notes.append(f"{plural(len(taken), 'parameter')} of the module ({taken[0]}...) "
                         "are in no partition: frozen parameters saved with "
                         "exclude_frozen_parameters, not in the state dict")
        return
    for name in taken:
        built[name] = (module[name], [_whole(m0, module[name], name)], "frozen")
    if taken:
        notes.append(f"{plural(len(taken), 'frozen parameter')} ({taken[0]}...) taken from "
                     f"{m0.name}'s module as the model holds them: this save records none "
                     "(DeepSpeed's zero_to_fp32 leaves them out)")


def _aliases(m0: Saved, built: dict[str, Any]) -> dict[str, str]:
    shared = m0.tree.get("shared_params")
    out: dict[str, str] = {}
    for alias, owner in (shared.items() if isinstance(shared, dict) else ()):
        if isinstance(alias, str) and isinstance(owner, str) and owner in built \
                and alias not in built:
            out[alias] = owner
    return out


def _same_views(module: dict[str, Any]) -> dict[str, str]:
    """Names of ``module`` that view one storage exactly as an earlier name
    does (tied weights, as torch.save keeps them) -> that earlier name."""
    first: dict[tuple[Any, ...], str] = {}
    out: dict[str, str] = {}
    for name, rec in module.items():
        if isinstance(rec, TensorRecord) and rec.storage is not None:
            view = (id(rec.storage), rec.storage_offset, rec.shape, rec.stride, rec.dtype)
            if view in first:
                out[name] = first[view]
            else:
                first[view] = name
    return out


def _dtype(name: str, shape_of: TensorRecord, runs: Sequence[Run], kind: str) -> str:
    stored = {rec.dtype for _, rec, _, _, _ in runs}
    if len(stored) > 1:
        raise CorruptCheckpointError(f"{name} is saved as {', '.join(sorted(stored))} on "
                                     "different ranks", BROKEN_HINT)
    dtype = stored.pop() if stored else shape_of.dtype
    if kind == "buffer" and dtype in dtypes.FLOATING:
        return "float32"  # DeepSpeed restores floating buffers as fp32 (.float())
    return dtype


def _chunk(offsets: Offsets, name: str, dtype: str, run: Run) -> Chunk:
    f, rec, start, count, at = run
    assert rec.storage is not None
    itemsize = dtypes.itemsize(rec.dtype)
    first = rec.storage_offset + start  # in elements of the tensor's dtype
    if start < 0 or count < 0 or first < 0 or start + count > rec.numel or \
            (first + count) * itemsize > rec.storage.nbytes:
        raise CorruptCheckpointError(f"{name}: its elements run outside a storage of {f.name}",
                                     BROKEN_HINT)
    begin = offsets.start(f, rec.storage) + first * itemsize
    return Chunk(f.name, (at,), (count,), begin, count * itemsize, f.rank, flat=True,
                 dtype=rec.dtype if rec.dtype != dtype else None)


def _shaped(shape: tuple[int, ...], dtype: str) -> TensorRecord:
    return TensorRecord(tuple(shape), dtype, contiguous(tuple(shape)), 0, None, None)
