"""The files of a DeepSpeed tag directory: which rank and role each is, read
with ckptool's unpickler, and checked against each other before anything is
built from them.

- ``mp_rank_00_model_states.pt`` (ZeRO 0-2: one), or
  ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` (ZeRO 3: one per rank);
- ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``: one per rank.

- MoE runs: ``layer_<L>_expert_<E>_mp_rank_00_model_states.pt`` per expert
  (and, ZeRO 0, ``expp_rank_<r>_mp_rank_00_optim_states.pt``): see
  ``deepspeed_moe``.

Refused with the reason: tensor or pipeline parallel saves (``mp_rank_01``),
NVMe-offloaded optimizer states (``offloaded_tensors/``),
a rank's file missing (named), files of more ranks than the optimizer was
split over, ranks that disagree on the world size, the ZeRO stage or the
step they were saved at (files of two saves mixed).
Nothing is imported from DeepSpeed: its classes are inert stand-ins.

Also here: ``Offsets``, where each storage record's bytes start in a file,
and ``listed``, a file's tree as shown beside the state dict.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ckptool.describe import plural
from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.read import dispatch, fs
from ckptool.read.formats.base import RawRead
from ckptool.read.layouts.base import BROKEN_HINT, MISSING_HINT
from ckptool.read.layouts.names import (
    EXPERT_MODEL,
    EXPERT_OPTIM,
    MODEL_FILE,
    OLD_EXPERT_MODEL,
    OPTIM_FILE,
)
from ckptool.read.tensors import StorageRef, TensorRecord
from ckptool.read.values import StandIn
from ckptool.read.ziparchive import ZipArchive, ZipError

MIXED_HINT = ("the directory holds files of two saves (an old checkpoint overwritten by a "
              "run with another number of GPUs?): save again, or copy one save's files")


@dataclass
class Saved:
    """One file of the tag directory, read."""

    name: str
    rank: int | None  # data-parallel rank (None: ZeRO 0-2's one model-states file)
    raw: RawRead
    tree: dict[str, Any]


@dataclass
class Files:
    models: list[Saved]  # ZeRO 3: by rank; else one
    optims: list[Saved]  # by rank
    others: list[str]  # files beside them, not read
    stage: int
    world_size: int
    optimizer: str  # DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, BF16_Optimizer
    experts: list[Saved] = field(default_factory=list)  # MoE: layer_L_expert_E_... files
    expert_optims: list[Saved] = field(default_factory=list)  # MoE, ZeRO 0: expp_rank_r_...

    @property
    def all(self) -> list[Saved]:
        """Every file read, in the order they are listed."""
        return [*self.models, *self.experts, *self.optims, *self.expert_optims]


def read_files(folder: str) -> Files:
    try:
        names = sorted(n for n in fs.listdir(folder)
                       if fs.isfile(os.path.join(folder, n)))
    except OSError as exc:
        raise CorruptCheckpointError(f"{folder}: cannot list the directory ({exc.strerror})",
                                     "check its permissions") from exc
    if fs.isdir(os.path.join(folder, "offloaded_tensors")):
        raise UnsupportedCheckpointError(
            f"{folder} holds offloaded_tensors/: ZeRO-Infinity saved optimizer states to NVMe "
            "swap files, which ckptool does not read yet",
            "resume the run with DeepSpeed and save without NVMe offload, or use DeepSpeed's "
            "zero_to_fp32.py")
    old = [n for n in names if OLD_EXPERT_MODEL.match(n)]
    if old:
        raise UnsupportedCheckpointError(
            f"{folder} holds {old[0]}: expert files of DeepSpeed before 0.6 (no layer "
            "number), which ckptool does not join",
            "load it with that DeepSpeed and save again with a newer one")
    experts = [n for n in names if EXPERT_MODEL.match(n)]
    expert_optims = [n for n in names if EXPERT_OPTIM.match(n)]
    models: dict[int | None, str] = {}
    optims: dict[int, str] = {}
    mp: set[int] = set()
    for n in [*experts, *expert_optims]:
        m = EXPERT_MODEL.match(n) or EXPERT_OPTIM.match(n)
        assert m is not None
        mp.add(int(m.group(3) if m.re is EXPERT_MODEL else m.group(2)))
    for n in names:
        if m := MODEL_FILE.match(n):
            models[int(m.group(1)) if m.group(1) else None] = n
            mp.add(int(m.group(2)))
        elif m := OPTIM_FILE.match(n):
            optims[int(m.group(2))] = n
            mp.add(int(m.group(3)))
    if len(mp) > 1:
        raise UnsupportedCheckpointError(
            f"{folder} holds the files of {len(mp)} model-parallel ranks (mp_rank_00, "
            "mp_rank_01...): a tensor- or pipeline-parallel save, whose pieces only the "
            "model's code can join", "consolidate it with the training framework's tools "
            "(Megatron-DeepSpeed's checkpoint utilities, ds_to_universal.py)")
    if not models:
        raise CorruptCheckpointError(f"{folder} holds no *_model_states.pt file",
                                     MISSING_HINT)
    if None in models and len(models) > 1:
        raise CorruptCheckpointError(
            f"{folder} holds both {models[None]} (ZeRO 0-2) and per-rank model states "
            f"(ZeRO 3: {next(n for r, n in models.items() if r is not None)})", MIXED_HINT)
    used = set(models.values()) | set(optims.values()) | set(experts) | set(expert_optims)
    others = [n for n in names if n not in used]
    model_files = [_read(folder, n, r) for r, n in sorted(models.items(), key=_rank_order)]
    for f in model_files:
        if not ("module" in f.tree and "buffer_names" in f.tree):
            raise CorruptCheckpointError(
                f"{f.name} is not DeepSpeed model states: no 'module' and 'buffer_names' in it",
                BROKEN_HINT)
    optim_files = [_read(folder, n, r) for r, n in sorted(optims.items())]
    for f in optim_files:
        if not isinstance(f.tree.get("optimizer_state_dict"), dict):
            raise CorruptCheckpointError(
                f"{f.name} is not DeepSpeed optimizer states: no 'optimizer_state_dict' in it",
                BROKEN_HINT)
    stage, world, optimizer = _stage(folder, model_files, optim_files)
    _check_ranks(folder, model_files, optim_files, stage, world, optims)
    if (experts or expert_optims) and stage == 3:
        raise UnsupportedCheckpointError(
            f"{folder} holds MoE expert files beside ZeRO 3 partitions, which DeepSpeed "
            "itself does not write (native MoE runs on ZeRO 1 or 2)", MIXED_HINT)
    expert_files = [_read(folder, n, None) for n in experts]
    expert_optim_files = [_read(folder, n, int(m.group(1))) for n in expert_optims
                          if (m := EXPERT_OPTIM.match(n))]
    return Files(model_files, optim_files, others, stage, world, optimizer, expert_files,
                 expert_optim_files)


def _rank_order(item: tuple[int | None, str]) -> int:
    return -1 if item[0] is None else item[0]


def _read(folder: str, name: str, rank: int | None) -> Saved:
    raw = dispatch.read(os.path.join(folder, name))
    tree = raw.root if isinstance(raw.root, dict) else {}
    if not tree:
        raise CorruptCheckpointError(f"{name} holds {type(raw.root).__name__}, not the "
                                     "dict DeepSpeed saves", BROKEN_HINT)
    return Saved(name, rank, raw, tree)


def as_int(value: Any) -> int | None:
    """An int, or a DeepSpeed ``ZeroStageEnum(2)`` (an int enum) as its value."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, StandIn) and value.args and isinstance(value.args[0], int):
        return int(value.args[0])
    return None


def _stage(folder: str, models: list[Saved], optims: list[Saved]) -> tuple[int, int, str]:
    """(ZeRO stage, world size, optimizer) from the optimizer states, agreed by every rank."""
    if not optims:
        stage = _configured_stage(models[0].tree)
        if models[0].rank is not None or models[0].tree.get("param_shapes") or stage:
            raise CorruptCheckpointError(
                f"{folder} holds the model states of a ZeRO "
                f"{3 if models[0].rank is not None else stage or '1-2'} save but no "
                "*_optim_states.pt files: its fp32 weights are in those (every rank's "
                "optimizer states are missing)", MISSING_HINT)
        world = as_int(models[0].tree.get("dp_world_size")) or 1
        return 0, world, "none (ZeRO stage 0)"
    seen: dict[tuple[int, int, str], str] = {}
    for f in optims:
        osd = f.tree["optimizer_state_dict"]
        stage = as_int(osd.get("zero_stage"))
        if stage is None and "single_partition_of_fp32_groups" in osd:
            stage, optimizer = 1, "BF16_Optimizer"  # bf16 + ZeRO 1 + fp32 accumulation
        elif stage in (1, 2):
            optimizer = "DeepSpeedZeroOptimizer"
        elif stage == 3:
            optimizer = "DeepSpeedZeroOptimizer_Stage3"
        else:
            raise CorruptCheckpointError(
                f"{f.name} holds no ZeRO stage DeepSpeed can have written "
                f"(zero_stage = {osd.get('zero_stage')!r})", BROKEN_HINT)
        count = osd.get("partition_count")
        counts = count if isinstance(count, list) else [count]
        sizes = [as_int(c) for c in counts]
        if not sizes or any(s is None or s < 1 for s in sizes):
            raise CorruptCheckpointError(f"{f.name}: partition_count is {count!r}, not a "
                                         "number of ranks", BROKEN_HINT)
        seen.setdefault((stage, max(s for s in sizes if s is not None), optimizer), f.name)
    if len(seen) > 1:
        said = "; ".join(f"{name}: ZeRO {s}, {plural(w, 'rank')}"
                         for (s, w, _), name in seen.items())
        raise CorruptCheckpointError(f"the optimizer states disagree ({said})", MIXED_HINT)
    return next(iter(seen))


def _configured_stage(tree: dict[str, Any]) -> int | None:
    """The ZeRO stage ``ds_config`` asked for, where it is a dict that says."""
    config = tree.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    return as_int(zero.get("stage")) if isinstance(zero, dict) else None


def _check_ranks(folder: str, models: list[Saved], optims: list[Saved], stage: int,
                 world: int, by_rank: dict[int, str]) -> None:
    if stage == 0:
        return
    prefix = "bf16_" if optims and optims[0].name.startswith("bf16_") else ""
    for rank in range(world):
        if rank not in by_rank:
            raise CorruptCheckpointError(
                f"rank {rank}'s optimizer states are missing: {folder} has no "
                f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt ({plural(world, 'rank')} "
                f"saved, by partition_count)", MISSING_HINT)
    extra = sorted(r for r in by_rank if r >= world)
    if extra:
        raise CorruptCheckpointError(
            f"{folder} holds optimizer states of rank(s) {', '.join(map(str, extra))}, but the "
            f"optimizer was split over {plural(world, 'rank')} ({by_rank[extra[0]]})",
            MIXED_HINT)
    if stage == 3:
        ranks = {f.rank for f in models}
        for rank in range(world):
            if rank not in ranks:
                raise CorruptCheckpointError(
                    f"rank {rank}'s model states are missing: {folder} has no "
                    f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt", MISSING_HINT)
        extra = sorted(r for r in ranks if r is not None and r >= world)
        if extra:
            raise CorruptCheckpointError(
                f"{folder} holds model states of rank(s) {', '.join(map(str, extra))}, but "
                f"the optimizer was split over {plural(world, 'rank')}", MIXED_HINT)
    elif models[0].rank is not None:
        raise CorruptCheckpointError(
            f"{models[0].name} is a ZeRO-3 file, but the optimizer states are ZeRO {stage}",
            MIXED_HINT)
    for f in models:
        dp = as_int(f.tree.get("dp_world_size"))
        if dp is not None and dp != world:
            raise CorruptCheckpointError(
                f"{f.name} was saved by {plural(dp, 'rank')}, the optimizer states by "
                f"{world}", MIXED_HINT)
    steps = {f.name: f.tree.get("global_steps") for f in models}
    if len({repr(v) for v in steps.values()}) > 1:
        said = ", ".join(f"{n}: {v!r}" for n, v in steps.items())
        raise CorruptCheckpointError(f"the model states were saved at different steps "
                                     f"({said})", MIXED_HINT)


def step_tensor(f: Saved) -> TensorRecord | None:
    """The first ``step`` of a rank's torch optimizer state (Adam's), whose
    value every rank must share; None where there is none."""
    osd = f.tree["optimizer_state_dict"]
    inner = osd.get("base_optimizer_state", osd.get("optimizer_state_dict"))
    state = inner.get("state") if isinstance(inner, dict) else None
    if not isinstance(state, dict):
        return None
    for per_param in state.values():
        step = per_param.get("step") if isinstance(per_param, dict) else None
        if isinstance(step, TensorRecord) and step.numel == 1:
            return step
    return None


class Offsets:
    """Where each storage record's bytes start, per file (its zip directory
    read once); close() closes the files."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._zips: dict[str, ZipArchive] = {}

    def close(self) -> None:
        for archive in self._zips.values():
            archive.f.close()
        self._zips.clear()

    def start(self, f: Saved, ref: StorageRef) -> int:
        try:
            archive = self._zips.get(f.name)
            if archive is None:
                fh = fs.open_binary(os.path.join(self.folder, f.name))
                try:
                    archive = ZipArchive(fh, fs.size_of(fh))
                except BaseException:
                    fh.close()
                    raise
                self._zips[f.name] = archive
            member = archive.members.get(ref.record or "")
            if member is None or member.method != 0 or member.flags & 0x1 \
                    or member.size < ref.nbytes:
                raise CorruptCheckpointError(
                    f"{f.name}: storage record {ref.record} is missing, compressed or short",
                    BROKEN_HINT)
            return archive.data_offset(member)
        except (OSError, ZipError) as exc:
            raise CorruptCheckpointError(f"{f.name}: cannot locate {ref.record}: {exc}",
                                         BROKEN_HINT) from exc

    def read(self, f: Saved, at: int, length: int) -> bytes:
        """``length`` bytes at ``at`` of ``f``, opened by ``start`` already."""
        archive = self._zips[f.name]
        archive.f.seek(at)
        return archive.f.read(length)


def listed(f: Saved, replaced: set[int], client: dict[str, Any], names: set[str]) -> Any:
    """``f``'s tree as listed beside the state dict: the records the state
    dict is made of replaced by a line saying so; the client state (at the
    top level already) left out."""
    def swap(obj: Any, depth: int) -> Any:
        if id(obj) in replaced:
            return f"{obj.dtype} [{', '.join(map(str, obj.shape))}]: part of the state dict " \
                   "(consolidated)"
        if depth < 3 and isinstance(obj, dict):
            return {k: swap(v, depth + 1) for k, v in obj.items()}
        if depth < 3 and isinstance(obj, list):
            return [swap(v, depth + 1) for v in obj]
        return obj
    tree = {k: v for k, v in f.tree.items() if k not in client or k in names}
    return swap(tree, 0)


def kept_storages(tree: Any) -> set[int]:
    """Ids of the storages the records left in ``tree`` view (each object
    visited once: a pickle may share or nest objects in cycles)."""
    out: set[int] = set()
    seen: set[int] = set()
    stack = [tree]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, TensorRecord) and obj.storage is not None:
            out.add(id(obj.storage))
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
    return out

