"""A legacy Megatron checkpoint (``--ckpt-format torch``): one
``model_optim_rng.pt`` per model-parallel rank
(``mp_rank_{tp:02d}[_{pp:03d}[_{ep:03d}]]/``), joined into one model.

Each rank's file is read with ckptool's own unpickler (its ``args``
Namespace, Megatron's enums: data). The run's sizes come from rank 0's
``args`` (``facts``); every rank's folder they imply must be there, and no
other. Each rank's ``model`` (``model0``, ``model1``... under virtual
pipeline parallelism) numbers its layers from 0 within its stage: they are
renumbered as the whole model's, stage after stage (a virtual chunk after
the other, each over the stages); experts likewise, expert-parallel rank
after rank. Each tensor is then joined as ``rules`` says (column-parallel
on dim 0, row-parallel on dim 1, a SwiGLU ``linear_fc1`` half by half, the
vocabulary on dim 0 cut to its true size where ``args`` records it; norms
and biases that every rank holds whole from the first rank). Each joined
tensor's chunks are the ranks' local tensors, or their halves: row-major
runs of raw elements in the ranks' zips (``Chunk.raw``), read in place one
tensor at a time. The optimizer's state, per rank, is not joined.

NeMo 1's rank files (``tp_rank_XX_pp_rank_YYY/model_weights.ckpt``: each
rank's LightningModule state dict, the model under ``model.``) are joined
the same way, the run's sizes read from the NeMo folder's config.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ckptool.describe import plural
from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.keys import escape
from ckptool.model import Chunk, FileInfo
from ckptool.read import dispatch, fs
from ckptool.read.formats.base import RawRead
from ckptool.read.layouts.base import BROKEN_HINT, MISSING_HINT, MultiRead
from ckptool.read.layouts.layout import Layout
from ckptool.read.layouts.per_rank import StorageOffsets
from ckptool.read.megatron import facts as facts_of
from ckptool.read.megatron import rules
from ckptool.read.megatron.join import MEGATRON, Piece, Rank, join
from ckptool.read.megatron.layout import missing_rank_files, naming_of
from ckptool.read.megatron.names import (
    MEGATRON_NAMING,
    NEMO_NAMING,
    OPTIMIZER_FILE,
    Naming,
)
from ckptool.read.seen import GlobalsSeen
from ckptool.read.tensors import StorageRef, TensorRecord

FC1 = re.compile(r"\.mlp\.(?:(?:experts\.local_experts\.[0-9]+\.)?linear_fc1\.weight|"
                 r"experts\.linear_fc1\.weight[0-9]+)$")  # (TEGroupedMLP: weight<e>)
DROPPED = ("optimizer", "opt_param_scheduler", "rng_state")  # per rank: not joined


def read(layout: Layout) -> MultiRead:
    naming = naming_of(layout)
    nemo = naming is NEMO_NAMING  # NeMo 1's rank files (``nemo``)
    gap = missing_rank_files(layout.directory, layout.metadata, naming=naming)
    if gap:
        raise CorruptCheckpointError(
            f"{layout.directory}: {gap.said()} {'is' if gap.count == 1 else 'are'} missing "
            "(its other rank folders' names say so)", MISSING_HINT)
    seen = GlobalsSeen()
    ranks: list[Rank] = []
    files: list[FileInfo] = []
    for i, name in enumerate(layout.metadata):
        where = naming.parse(name.split("/")[0])
        assert where is not None
        full = os.path.join(layout.directory, name)
        raw = dispatch.read(full)
        seen.merge(raw.seen, name)
        ranks.append(Rank(name, where, raw, flat=nemo))
        files.append(FileInfo(name, "rank", raw.format, fs.getsize(full), rank=i))
        optimizer = f"{name.split('/')[0]}/{OPTIMIZER_FILE}"
        opt_path = os.path.join(layout.directory, optimizer)
        if not nemo and fs.isfile(opt_path):
            # the distributed optimizer's state, which Megatron's load_checkpoint
            # torch.loads on a resume: its pickle judged, its tensors not joined
            opt = dispatch.read(opt_path)
            seen.merge(opt.seen, optimizer)
            files.append(FileInfo(optimizer, "optimizer states (distributed optimizer)",
                                  opt.format, fs.getsize(opt_path), rank=i))
    first = ranks[0]
    root0 = first.raw.root if isinstance(first.raw.root, dict) else {}
    if nemo:  # the LightningModule's state dict; the run's sizes in its config
        from ckptool.read.megatron import nemo as nemo_of

        args: dict[str, Any] | None = nemo_of.megatron_args(
            nemo_of.read_yaml(fs.join(layout.path, nemo_of.CONFIG)))
    else:
        args = facts_of.args_dict(root0.get("args"))
    if args is None:
        raise UnsupportedCheckpointError(
            f"{os.path.join(layout.path, first.name)} holds no 'args' Namespace: ckptool "
            "cannot tell how the ranks split the model",
            "read one rank's file alone by naming it")
    run = facts_of.facts(args, root0.get("iteration"))
    for r in ranks:
        r.placed(run)
    _check_grid(layout, ranks, run, naming)
    pieces, notes = _pieces(ranks, run)
    root: dict[str, Any] = {} if nemo else {
        k: v for k, v in root0.items() if not (k == "model" or _is_chunk_name(k) or k in DROPPED)}
    model: dict[str, Any] = {}
    chunks: dict[str, tuple[Chunk, ...]] = {}
    storages: dict[str, StorageRef] = {}
    devices: dict[int, dict[str, None]] = {}
    with StorageOffsets(layout.directory, [r.name for r in ranks],
                        [r.raw for r in ranks]) as offsets_of:
        for name, each in pieces.items():
            if not isinstance(each[0].rec, TensorRecord):
                model[name] = each[0].rec  # as the first rank holds it
                continue
            rec, parts = join(name, each, run, offsets_of, notes)
            _check_fc1(name, rec.shape, args, run.swiglu)
            chunks[f"model/{escape(name)}"] = parts
            assert rec.storage is not None
            storages[rec.storage.key] = rec.storage
            for p in each:
                saved = p.rec.storage.location if p.rec.storage else p.rec.location
                if saved:
                    devices.setdefault(ranks.index(p.rank), {})[saved] = None
            model[name] = rec
    root["model"] = model
    dropped = [k for k in DROPPED if k in root0]
    if dropped:
        notes.append(f"each rank's {', '.join(dropped)} is left out: only the model's "
                     "weights are joined")
    meta: dict[str, Any] = {"ranks": len(ranks), "world_size": len(ranks),
                            "megatron": _summary(layout, run, args, nemo)}
    raw_all = RawRead(MEGATRON, root, storages, seen, meta,
                      warnings=[f"{r.name}: {w}" for r in ranks for w in r.raw.warnings])
    return MultiRead(raw_all, layout.directory, files, {}, chunks,
                     notes=list(layout.notes) + notes + _devices_note(devices), chunk_keys=True)


def _summary(layout: Layout, run: facts_of.Facts, args: dict[str, Any],
             nemo: bool) -> dict[str, Any]:
    return {"format": "nemo-ranks" if nemo else "torch", "iteration": run.iteration,
            "folder": layout.iteration,
            "tensor_parallel": run.tp, "pipeline_parallel": run.pp,
            "expert_parallel": run.ep, "virtual_pipeline": run.vpp,
            "num_layers": run.num_layers, "rules": rules.MEGATRON_VERSION,
            "args": args or {}}


def _check_fc1(name: str, shape: tuple[int, ...], args: dict[str, Any], swiglu: bool) -> None:
    """A joined ``linear_fc1`` has the rows ``args`` say: twice the MLP's
    width under SwiGLU (gate, then up). (A config whose activation is not
    the files' would have the halves joined wrong, unsaid.)"""
    if not shape or not FC1.search(name):
        return
    expert = ".experts." in name
    size = args.get("moe_ffn_hidden_size") if expert else None
    size = size if size is not None else args.get("ffn_hidden_size")
    if not isinstance(size, int) or isinstance(size, bool):
        return
    want = size * (2 if swiglu else 1)
    if shape[0] != want:
        raise CorruptCheckpointError(
            f"{name} joins into {shape[0]} rows, and the run's "
            f"{'moe_' if expert and args.get('moe_ffn_hidden_size') is not None else ''}"
            f"ffn_hidden_size {size} {'with' if swiglu else 'without'} SwiGLU makes {want}",
            "the run's args (a NeMo config's activation) do not describe these files")


def _is_chunk_name(key: object) -> bool:
    return isinstance(key, str) and key.startswith("model") and key[5:].isascii() \
        and key[5:].isdigit()


def _check_grid(layout: Layout, ranks: list[Rank], run: facts_of.Facts,
                naming: Naming) -> None:
    """Every rank folder the run's sizes imply is there, and no other."""
    sizes = f"TP {run.tp} x PP {run.pp}" + (f" x EP {run.ep}" if run.ep > 1 else "")
    missing = missing_rank_files(layout.directory, tuple(r.name for r in ranks),
                                 (run.tp, run.pp, run.ep), naming)
    said = "its args say" if naming is MEGATRON_NAMING else "its config says"
    if missing:
        raise CorruptCheckpointError(
            f"{layout.directory}: {missing.said()} {'is' if missing.count == 1 else 'are'} "
            f"missing (the run was {sizes}, {said})", MISSING_HINT)
    places = 1 + (run.pp > 1) + (run.ep > 1)
    extra = [r.name for r in ranks if r.tp >= run.tp or r.pp >= run.pp or r.ep >= run.ep
             or 1 + (r.where.pp is not None) + (r.where.ep is not None) != places]
    if extra:
        raise CorruptCheckpointError(
            f"{layout.directory} holds {', '.join(extra[:4])} beyond the run's {sizes} "
            f"({said})",
            "the folder mixes checkpoints of different runs: copy one run's rank folders")


def _models(rank: Rank) -> list[dict[str, Any]]:
    """A rank's model state dicts: ``model``, or ``model0``, ``model1``...
    (virtual pipeline chunks)."""
    root = rank.raw.root if isinstance(rank.raw.root, dict) else {}
    if rank.flat:  # NeMo 1: the LightningModule's state dict, the model under "model."
        outside = [k for k in root if not (isinstance(k, str) and k.startswith("model."))]
        if outside:
            raise CorruptCheckpointError(
                f"{rank.name} holds {outside[0]!r:.80} beside the model's tensors (NeMo's "
                "are all under 'model.')", BROKEN_HINT)
        return [{k.removeprefix("model."): v for k, v in root.items()}]
    if isinstance(root.get("model"), dict):
        return [root["model"]]
    found = sorted((k for k in root if _is_chunk_name(k)), key=lambda k: int(k[5:]))
    if not found or not all(isinstance(root[k], dict) for k in found):
        raise UnsupportedCheckpointError(f"{rank.name} holds no 'model' state dict",
                                         "read the file alone by naming it")
    return [root[k] for k in found]


def _layers(model: dict[str, Any]) -> list[int]:
    return sorted({int(m.group("layer")) for k in model
                   if isinstance(k, str) and (m := rules.LAYER.match(k))})


def _pieces(ranks: list[Rank], run: facts_of.Facts) -> tuple[dict[str, list[Piece]],
                                                               list[str]]:
    """Each tensor of the whole model (by its name there) and the ranks'
    pieces of it, in tensor-parallel order."""
    models = {id(r): _models(r) for r in ranks}
    chunks = len(models[id(ranks[0])])
    # layers per (virtual chunk, stage), from tensor-parallel rank 0's files
    counts: dict[tuple[int, int], int] = {}
    for r in ranks:
        if r.tp == 0 and r.ep == 0:
            if len(models[id(r)]) != chunks:
                raise CorruptCheckpointError(f"{r.name} holds {len(models[id(r)])} model "
                                             f"chunks, {ranks[0].name} {chunks}", BROKEN_HINT)
            for v, model in enumerate(models[id(r)]):
                found = _layers(model)
                if found != list(range(len(found))):  # (a gap would drop a layer unsaid)
                    raise CorruptCheckpointError(
                        f"{r.name} holds its stage's layers {found[:8]}: Megatron numbers a "
                        "stage's layers from 0, without gaps", BROKEN_HINT)
                counts[(v, r.pp)] = len(found)
    offsets: dict[tuple[int, int], int] = {}
    total = 0
    for v, pp in sorted(counts):
        offsets[(v, pp)] = total
        total += counts[(v, pp)]
    notes: list[str] = []
    if run.num_layers is not None and total != run.num_layers:
        raise CorruptCheckpointError(
            f"the rank files hold {plural(total, 'layer')}, and args say num_layers="
            f"{run.num_layers}", BROKEN_HINT)
    out: dict[str, list[Piece]] = {}
    origin: dict[str, tuple[int, int]] = {}  # the stage (and chunk) a name is taken from
    local_experts = _experts_per_rank(ranks, models, run)
    for r in ranks:
        for v, model in enumerate(models[id(r)]):
            for key, value in model.items():
                if not isinstance(key, str):
                    raise CorruptCheckpointError(
                        f"{r.name} holds a {type(value).__name__} under the key {key!r:.40}, "
                        "not a name of the model's", BROKEN_HINT)
                where = rules.place(key, run.swiglu)
                if where is None:
                    raise UnsupportedCheckpointError(
                        f"{r.name}: ckptool cannot place {key} in the whole model: its name "
                        f"is not in the table of {rules.MEGATRON_VERSION}'s tensors",
                        "read the rank files alone by naming one; or join them with "
                        "Megatron's own checkpoint converter")
                layer = None if where.layer is None else offsets[(v, r.pp)] + where.layer
                expert = None if where.expert is None else \
                    r.ep * local_experts + where.expert
                if where.expert is None and r.ep and where.split != rules.EXTRA:
                    continue  # (the same on every expert-parallel rank: the first's)
                name = rules.renamed(key, layer, expert)
                if origin.setdefault(name, (r.pp, v)) != (r.pp, v):
                    if layer is not None:  # (stages whose layers are numbered alike)
                        raise CorruptCheckpointError(
                            f"{name} is in two pipeline stages' files ({r.name} and an "
                            "earlier stage's): their layers are not numbered as Megatron "
                            "numbers them", BROKEN_HINT)
                    continue  # on two stages (a tied output layer's copy): the first's
                held = out.get(name)
                if held and isinstance(held[0].rec, TensorRecord) != isinstance(
                        value, TensorRecord):  # (a None where the other ranks hold a half)
                    other = held[0].rec if isinstance(value, TensorRecord) else value
                    raise CorruptCheckpointError(
                        f"{name} is a tensor in one rank's file and {type(other).__name__} "
                        f"in another's ({held[0].rank.name}, {r.name})", BROKEN_HINT)
                if not isinstance(value, TensorRecord):
                    if r.tp == 0 and name not in out:
                        out[name] = [Piece(r, value, where)]
                    continue
                out.setdefault(name, []).append(Piece(r, value, where))
    return out, notes


def _local_experts(name: str, model: dict[str, Any]) -> int:
    """How many experts each MoE layer of this rank's model holds, numbered
    0 to n - 1 in every one of them."""
    per_layer: dict[int, set[int]] = {}
    for key in model:
        where = rules.place(key, False) if isinstance(key, str) else None
        if where is not None and where.expert is not None and where.layer is not None:
            per_layer.setdefault(where.layer, set()).add(where.expert)
    counts = {len(e) for e in per_layer.values()}
    if len(counts) > 1 or any(e != set(range(len(e))) for e in per_layer.values()):
        raise CorruptCheckpointError(
            f"{name}: its MoE layers hold experts "
            f"{sorted(sorted(e)[:8] for e in per_layer.values())[:4]}, not the same 0 to n - 1 "
            "in each", BROKEN_HINT)
    return counts.pop() if counts else 0


def _experts_per_rank(ranks: list[Rank], models: dict[int, list[dict[str, Any]]],
                      run: facts_of.Facts) -> int:
    """How many experts each expert-parallel rank holds per layer: the same
    on every rank, and the run's ``num_experts`` over them (each global id
    is ``ep_rank * this + local``: one count off would shift the rest)."""
    found = {r.name: _local_experts(r.name, m) for r in ranks for m in models[id(r)]}
    counts = set(found.values()) - {0}
    if len(counts) > 1:
        raise CorruptCheckpointError(
            f"the ranks hold different numbers of experts per layer ("
            f"{', '.join(f'{n}: {c}' for n, c in list(found.items())[:4])})", BROKEN_HINT)
    per_rank = counts.pop() if counts else 0
    if per_rank and run.num_experts is not None and per_rank * run.ep != run.num_experts:
        raise CorruptCheckpointError(
            f"each expert-parallel rank holds {per_rank} experts per layer, and args say "
            f"num_experts {run.num_experts} over EP {run.ep}", BROKEN_HINT)
    return per_rank


def _devices_note(devices: dict[int, dict[str, None]]) -> list[str]:
    saved = sorted({d for each in devices.values() for d in each})
    if len(saved) < 2:
        return []
    return [f"the ranks saved their pieces on {', '.join(saved)}: each tensor is shown where "
            "the first rank's piece was saved"]
