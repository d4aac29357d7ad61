"""One tensor of a legacy Megatron checkpoint joined from its ranks' pieces,
as ``rules`` places each (``legacy`` reads the ranks and finds the pieces):
column-parallel pieces on dim 0, row-parallel on dim 1, a SwiGLU
``linear_fc1`` half by half, the vocabulary cut to its true size, the rest
taken whole from the first rank. Each piece is a raw chunk of its rank's
file, read in place when the tensor is."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ckptool import dtypes
from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.model import Chunk
from ckptool.read.formats.base import RawRead
from ckptool.read.layouts import dcp_metadata
from ckptool.read.layouts.base import BROKEN_HINT, contiguous
from ckptool.read.layouts.per_rank import StorageOffsets
from ckptool.read.megatron import facts as facts_of
from ckptool.read.megatron import rules
from ckptool.read.megatron.names import RankDir
from ckptool.read.tensors import StorageRef, TensorRecord

MEGATRON = "megatron"


@dataclass
class Rank:
    name: str  # mp_rank_01_001/model_optim_rng.pt
    where: RankDir
    raw: RawRead
    pp: int = 0
    ep: int = 0
    flat: bool = False  # NeMo 1's: the model's tensors at the top, under "model."

    @property
    def tp(self) -> int:
        return self.where.tp

    def placed(self, run: facts_of.Facts) -> None:
        """Its pipeline and expert ranks, as Megatron numbers its folder
        (``_{pp:03d}`` only with pipeline parallelism)."""
        second, third = self.where.pp or 0, self.where.ep or 0
        self.pp, self.ep = (second, third) if run.pp > 1 else (0, second)


@dataclass
class Piece:
    rank: Rank
    rec: Any  # a TensorRecord, or a value no tensor (Transformer Engine's extra state)
    place: rules.Place


def join(name: str, pieces: list[Piece], run: facts_of.Facts, offsets_of: StorageOffsets,
          notes: list[str]) -> tuple[TensorRecord, tuple[Chunk, ...]]:
    """The whole tensor ``name`` and its chunks."""
    first = pieces[0]
    split = first.place.split
    tp_pieces = sorted(pieces, key=lambda p: p.rank.tp)
    if first.place.expert is not None and (run.etp or run.tp) == 1 and split != rules.EXTRA:
        split = rules.WHOLE  # experts not split over tensor parallelism
    if [p.rank.tp for p in tp_pieces] != list(range(run.tp)):
        held = [p.rank.name.split("/")[0] for p in tp_pieces]
        raise CorruptCheckpointError(
            f"{name}: the {run.tp} tensor-parallel ranks' pieces are in "
            f"{', '.join(held[:4])}{' ...' if len(held) > 4 else ''} alone"
            if len(set(held)) == len(held) else
            f"{name}: the tensor-parallel ranks' pieces are {held[:8]}", BROKEN_HINT)
    dtype = first.rec.dtype
    for p in tp_pieces:
        if p.rec.dtype != dtype or len(p.rec.shape) != len(first.rec.shape):
            raise CorruptCheckpointError(
                f"{name} is {list(first.rec.shape)} {dtype} in {first.rank.name} and "
                f"{list(p.rec.shape)} {p.rec.dtype} in {p.rank.name}", BROKEN_HINT)
    boxes: list[Chunk] = []
    if split in (rules.WHOLE, rules.EXTRA):
        shape = first.rec.shape
        for p in tp_pieces[1:]:
            if p.rec.shape != shape:
                raise CorruptCheckpointError(
                    f"{name} should be the same on every tensor-parallel rank, but is "
                    f"{list(shape)} in {first.rank.name} and {list(p.rec.shape)} in "
                    f"{p.rank.name}", BROKEN_HINT)
        boxes.append(chunk(name, first, (0,) * len(shape), shape, 0, offsets_of))
    else:
        dim = 1 if split == rules.ROW else 0
        local = first.rec.shape
        if len(local) <= dim or any(p.rec.shape != local for p in tp_pieces):
            raise CorruptCheckpointError(
                f"{name}: the tensor-parallel ranks' pieces differ in shape "
                f"({', '.join(str(list(p.rec.shape)) for p in tp_pieces)})", BROKEN_HINT)
        n = local[dim]
        shape = tuple(s * len(tp_pieces) if d == dim else s for d, s in enumerate(local))
        if split == rules.SWIGLU:
            if n % 2:
                raise CorruptCheckpointError(f"{name}: a SwiGLU weight of {n} rows on a rank "
                                             "cannot hold gate and up halves", BROKEN_HINT)
            half, whole_half = n // 2, n // 2 * len(tp_pieces)
            for p in tp_pieces:
                sub = (half, *local[1:])
                boxes.append(chunk(name, p, (p.rank.tp * half,) + (0,) * (len(local) - 1),
                                    sub, 0, offsets_of))
                boxes.append(chunk(name, p, (whole_half + p.rank.tp * half,)
                                    + (0,) * (len(local) - 1), sub, half, offsets_of))
        else:
            keep = shape[0]
            if split == rules.VOCAB and run.vocab_size is not None and run.vocab_size < keep:
                keep = run.vocab_size
                cut = f"vocabulary padding cut from {name}: {shape[0]} -> {keep} rows"
                notes.append(cut)
                shape = (keep, *shape[1:])
            for p in tp_pieces:
                at = p.rank.tp * n
                rows = min(n, keep - at) if dim == 0 else n
                if rows <= 0:
                    continue
                sub = tuple(rows if d == dim else s for d, s in enumerate(local))
                offsets = tuple(at if d == dim else 0 for d in range(len(local)))
                boxes.append(chunk(name, p, offsets, sub, 0, offsets_of))
    problem = dcp_metadata.check_cover(shape, [(c.offsets, c.sizes) for c in boxes])
    if problem:
        raise CorruptCheckpointError(f"{name}: the ranks' pieces do not make it whole: "
                                     f"{problem}", BROKEN_HINT)
    location = first.rec.storage.location if first.rec.storage else first.rec.location
    ref = StorageRef(f"{MEGATRON}:{name}", dtype, location, math.prod(shape))
    rec = TensorRecord(shape, dtype, contiguous(shape), 0, ref, location,
                       first.rec.requires_grad, first.rec.is_parameter)
    return rec, tuple(boxes)


def chunk(name: str, piece: Piece, offsets: tuple[int, ...], sizes: tuple[int, ...],
           first_row: int, offsets_of: StorageOffsets) -> Chunk:
    """The raw chunk of ``piece``'s rows from ``first_row`` on, of shape
    ``sizes``, placed at ``offsets`` of the whole tensor."""
    rec, file = piece.rec, piece.rank.name
    itemsize = dtypes.itemsize(rec.dtype)
    row = math.prod(rec.shape[1:]) * itemsize if rec.shape else itemsize
    length = math.prod(sizes) * itemsize
    if length == 0:
        return Chunk(file, offsets, sizes, 0, 0, None, raw=True)
    ref = rec.storage
    if ref is None or rec.stride is None or any(
            s != c for n, s, c in zip(rec.shape, rec.stride, contiguous(rec.shape), strict=True)
            if n > 1):
        raise UnsupportedCheckpointError(
            f"{name} in {file} is not row-major: ckptool does not join it yet",
            "join the ranks with Megatron's own checkpoint converter")
    begin = rec.storage_offset * itemsize + first_row * row
    if begin + length > ref.nbytes:
        raise CorruptCheckpointError(f"{name} in {file} runs past its storage", BROKEN_HINT)
    return Chunk(file, offsets, sizes, offsets_of.start(file, ref) + begin, length, None,
                 raw=True)
