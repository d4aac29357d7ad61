"""DeepSpeed's native MoE layers in a ZeRO checkpoint (``deepspeed.moe.layer.MoE``,
DeepSpeed 0.19.8's ``_save_moe_checkpoint``): the experts' weights, each
under its global expert id.

What DeepSpeed saves:

- ``mp_rank_00_model_states.pt``'s ``module`` holds no expert: every name
  with ``expert`` in it but the gate (``deepspeed_moe.gate.wg.weight``)
  is left out; ``num_experts`` lists each MoE layer's count;
- ``layer_{L}_expert_{E}_mp_rank_00_model_states.pt``: expert ``E`` (its
  global id) of the ``L``-th MoE layer, a dict of the expert's tensors under
  names holding that global id (``moe1.deepspeed_moe.experts.deepspeed_experts.3.0.weight``),
  as the model holds them (bf16 in a bf16 run); written by each
  expert-parallel rank for its own experts;
- ZeRO 1/2: the experts' fp32 master weights in their own parameter group
  (``moe: True``, named ``ep_size_{E}``), split over the expert-data-parallel
  ranks only (``partition_count`` ``world / ep_size``); rank r is
  expert-parallel rank ``r % ep_size`` and expert-data-parallel rank
  ``r // ep_size`` (``groups._create_expert_and_data_parallel``); the group's
  ``param_shapes`` are rank 0's, under its local expert ids, and every
  expert-parallel rank's group lists its own experts in that order (global
  id = ``ep_rank * local experts + local id``);
- ZeRO 0: ``expp_rank_{r}_mp_rank_00_optim_states.pt``, each rank's torch
  optimizer state (its moments: named, not read).

DeepSpeed's own ``zero_to_fp32`` refuses these folders; its
``load_checkpoint`` puts the experts back from the expert files.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from ckptool.describe import plural
from ckptool.errors import CorruptCheckpointError
from ckptool.read.layouts import zero
from ckptool.read.layouts.base import BROKEN_HINT, MISSING_HINT, contiguous
from ckptool.read.layouts.deepspeed_files import Files
from ckptool.read.layouts.names import EXPERT_MODEL
from ckptool.read.tensors import TensorRecord

LOCAL_ID = re.compile(r"^(?P<head>.*\.deepspeed_experts\.)(?P<id>0|[1-9][0-9]{0,8})"
                      r"(?P<tail>\..+)$")
# a parameter group of experts: DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer``
MOE_GROUP = re.compile(r"^ep_size_([1-9][0-9]{0,8})$")
# the most experts, all MoE layers together (DeepSeek-V3: 58 layers of 256)
MAX_EXPERTS = 1 << 18


def groups_of_experts(optim: Any) -> list[int]:
    """The parameter groups of one rank's ZeRO 1/2 optimizer states that
    hold experts (``moe: True``)."""
    osd = optim.get("optimizer_state_dict") if isinstance(optim, dict) else None
    inner = osd.get("base_optimizer_state") if isinstance(osd, dict) else None
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    return [i for i, g in enumerate(groups if isinstance(groups, list) else ())
            if isinstance(g, dict) and g.get("moe") is True]


def ep_size(optim: Any, group: int) -> int:
    """The expert-parallel size of the expert group ``group`` (its name,
    ``ep_size_2``)."""
    osd = optim["optimizer_state_dict"]
    g = osd["base_optimizer_state"]["param_groups"][group]
    m = MOE_GROUP.match(str(g.get("name"))[:40])
    if m is None:
        raise CorruptCheckpointError(f"the expert parameter group {group} is named "
                                     f"{g.get('name')!r:.40}, not ep_size_N", BROKEN_HINT)
    return int(m.group(1))


def global_name(name: str, ep_rank: int, local: int) -> str:
    """``name`` (a local expert id, as a rank's ``param_shapes`` has it) under
    the global id of expert-parallel rank ``ep_rank`` of ``local`` experts."""
    m = LOCAL_ID.match(name)
    if m is None:
        raise CorruptCheckpointError(f"{name} is in a group of experts but names no "
                                     "deepspeed_experts.N", BROKEN_HINT)
    return f"{m.group('head')}{ep_rank * local + int(m.group('id'))}{m.group('tail')}"


def local_counts(names: Sequence[str]) -> dict[str, int]:
    """Each MoE layer's (its name up to ``deepspeed_experts.``) local experts,
    numbered 0 to n - 1 as DeepSpeed numbers them (other numbers would give
    two experts one global id)."""
    ids: dict[str, set[int]] = {}
    for name in names:
        m = LOCAL_ID.match(name)
        if m is not None:
            ids.setdefault(m.group("head"), set()).add(int(m.group("id")))
    for head, found in ids.items():
        if found != set(range(len(found))):
            raise CorruptCheckpointError(
                f"the experts of {head.rstrip('.')} in param_shapes are numbered "
                f"{sorted(found)[:8]}, not 0 to {len(found) - 1}", BROKEN_HINT)
    return {head: len(found) for head, found in ids.items()}


def place(lengths: Sequence[Sequence[int]], shapes: dict[str, tuple[int, ...]],
          paddings: Sequence[int] | None, world: int, ep: int) -> dict[str, tuple[
              tuple[int, ...], list[tuple[int, zero.Piece]]]]:
    """Each expert parameter (global name) of one expert group: its shape,
    and its runs in the ranks' partitions of that group (``lengths[r]``:
    rank r's), as (global rank, piece). Every expert-parallel rank's share
    is placed as rank 0's ``param_shapes`` (``shapes``) lays it out."""
    if world % ep:
        raise CorruptCheckpointError(f"{world} ranks do not split into expert-parallel "
                                     f"groups of {ep}", BROKEN_HINT)
    replicas = world // ep
    local = local_counts(list(shapes))
    out: dict[str, tuple[tuple[int, ...], list[tuple[int, zero.Piece]]]] = {}
    for e in range(ep):
        ranks = [d * ep + e for d in range(replicas)]
        try:
            placed = zero.stage12([[lengths[r][0]] for r in ranks],
                                  [[(n, math.prod(s)) for n, s in shapes.items()]],
                                  None if paddings is None else [paddings], replicas)
        except zero.LayoutError as exc:
            raise CorruptCheckpointError(
                f"the experts' fp32 partitions of expert-parallel rank {e} do not hold "
                f"its experts: {exc}", BROKEN_HINT) from exc
        for name, pieces in placed.items():
            head = LOCAL_ID.match(name)
            count = local[head.group("head")] if head else 0
            out[global_name(name, e, count)] = (shapes[name],
                                                [(ranks[p.rank], p) for p in pieces])
    return out


def check_files(shapes: dict[str, tuple[int, ...]],
                files: dict[str, tuple[str, TensorRecord]], folder: str) -> None:
    """The experts the partitions hold are those the expert files hold, of
    the same shapes."""
    missing = sorted(set(shapes) - set(files))
    extra = sorted(set(files) - set(shapes))
    if missing:
        raise CorruptCheckpointError(
            f"{folder}: no expert file holds {missing[0]}"
            f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}, which the "
            "optimizer's partitions hold", MISSING_HINT)
    if extra:
        raise CorruptCheckpointError(
            f"{folder}: {files[extra[0]][0]} holds {extra[0]}, which no partition of the "
            "optimizer holds", "the directory mixes files of two saves: copy one save's")
    for name, shape in shapes.items():
        file, rec = files[name]
        if tuple(rec.shape) != tuple(shape):
            raise CorruptCheckpointError(
                f"{name} is {list(rec.shape)} in {file} and {list(shape)} in the optimizer's "
                "partitions", "the directory mixes files of two saves: copy one save's")


def _layer(name: str) -> str | None:
    """``moe1.deepspeed_moe.`` of a name in a MoE layer; None elsewhere."""
    head, found, _ = name.partition("deepspeed_moe.")
    return head + found if found else None


def ordered(module: Sequence[str], extra: Sequence[str]) -> list[str]:
    """``module``'s names with each expert of ``extra`` after the last name
    of its MoE layer (its gate), as the model's ``state_dict`` orders them;
    the rest of ``extra`` at the end."""
    last_of: dict[str, str] = {}  # a MoE layer -> its last name in module
    for name in module:
        if (layer := _layer(name)) is not None:
            last_of[layer] = name
    after: dict[str, list[str]] = {}
    rest: list[str] = []
    for name in extra:
        layer = _layer(name)
        last = last_of.get(layer) if layer is not None else None
        (after.setdefault(last, []) if last is not None else rest).append(name)
    out: list[str] = []
    for name in module:
        out.append(name)
        out += after.get(name, [])
    return out + rest


def expert_tensors(trees: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, tuple[str,
                                                                                 TensorRecord]]:
    """Every tensor of the expert files (``(file name, tree)``), by name:
    the file it is in and its record. Anything else a file holds is left
    where it is (listed, and judged by the safety verdict); a file of no
    tensor, or a name in two files, refused."""
    out: dict[str, tuple[str, TensorRecord]] = {}
    for file, tree in trees:
        found = {n: r for n, r in tree.items()
                 if isinstance(n, str) and isinstance(r, TensorRecord)}
        if not found:
            raise CorruptCheckpointError(f"{file} holds no expert's tensor", BROKEN_HINT)
        m = EXPERT_MODEL.match(file)
        for name, rec in found.items():
            held = LOCAL_ID.match(name)
            if m is not None and (held is None or held.group("id") != m.group(2)):
                # (DeepSpeed loads file E as expert E: another's names would swap them)
                raise CorruptCheckpointError(f"{file} holds {name!r:.80}, not expert "
                                             f"{m.group(2)}'s", BROKEN_HINT)
            if name in out:
                raise CorruptCheckpointError(f"{name} is in both {out[name][0]} and {file}",
                                             "the directory mixes files of two saves: copy "
                                             "one save's")
            out[name] = (file, rec)
    return out


def missing_files(num_experts: Any, present: Sequence[str], folder: str) -> None:
    """Every expert file the model states' ``num_experts`` (each MoE layer's
    count) implies is there, and no other."""
    if not present and num_experts in (None, []):
        return  # no MoE layer
    if not isinstance(num_experts, list) or not num_experts or \
            len(num_experts) > MAX_EXPERTS or not all(
                isinstance(n, int) and not isinstance(n, bool) and 0 < n <= MAX_EXPERTS
                for n in num_experts) or sum(num_experts) > MAX_EXPERTS:
        raise CorruptCheckpointError(
            f"{folder} holds {plural(len(present), 'MoE expert file')}, and the model "
            f"states' num_experts is {num_experts!r:.60}, not each MoE layer's count of "
            "experts",
            "the directory mixes files of two saves: copy one save's")
    want = [f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt"
            for layer, n in enumerate(num_experts) for e in range(n)]
    there = set(present)
    missing = [n for n in want if n not in there]
    if missing:
        raise CorruptCheckpointError(
            f"{folder}: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} "
            f"{'is' if len(missing) == 1 else 'are'} missing (num_experts says "
            f"{num_experts})", MISSING_HINT)
    extra = sorted(set(present) - set(want))
    if extra:
        raise CorruptCheckpointError(
            f"{folder} holds {extra[0]}, beyond the experts num_experts says "
            f"({num_experts})", "the directory mixes files of two saves: copy one save's")


def master_weights(files: Files, parts: list[list[TensorRecord]], lengths: list[list[int]],
                   groups: list[dict[str, tuple[int, ...]]], paddings: Any,
                   expert_groups: list[int], built: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The experts' fp32 master weights, under their global names, as
    ``deepspeed``'s state dict holds a parameter (shape, runs, kind): put in
    ``built``; their shapes returned."""
    shapes: dict[str, tuple[int, ...]] = {}
    for g in expert_groups:
        if g >= len(groups) or any(g >= len(per_rank) for per_rank in lengths):
            raise CorruptCheckpointError(f"the expert parameter group {g} has no partition "
                                         "or param_shapes", BROKEN_HINT)
        pads = paddings[g] if paddings is not None else None  # (checked by the caller)
        placed = place([[per_rank[g]] for per_rank in lengths], groups[g], pads,
                       files.world_size, ep_size(files.optims[0].tree, g))
        dtype = parts[0][g].dtype
        for name, (shape, pieces) in placed.items():
            if name in built:
                raise CorruptCheckpointError(f"{name} is in two parameter groups' partitions",
                                             BROKEN_HINT)
            runs = [(files.optims[r], parts[r][g], p.start, p.count, p.at) for r, p in pieces]
            built[name] = (TensorRecord(shape, dtype, contiguous(shape), 0, None, None), runs,
                           "trainable")
            shapes[name] = shape
    return shapes
