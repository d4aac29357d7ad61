"""Which files of a Megatron save directory are the checkpoint, for
``ckptool.read.layouts.recognise``: the iteration its tracker file names,
a ``torch_dist`` iteration's companions, a legacy iteration's rank files.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.read import fs
from ckptool.read.layouts.layout import Layout
from ckptool.read.layouts.names import shown
from ckptool.read.megatron.names import (
    BACKEND_FILE,
    COMMON_FILE,
    ITERATION_DIR,
    MEGATRON_NAMING,
    MODEL_FILE,
    NEMO_NAMING,
    RELEASE,
    TRACKER,
    Naming,
    backend,
    rank_dir,
    tracked,
)

SHOWN = 8  # the missing rank files named

__all__ = ["TRACKER", "Gap", "iteration", "missing_rank_files", "naming_of", "rank_dir",
           "rank_files", "torch_dist"]


def iteration(path: str, dirs: list[str]) -> tuple[str, tuple[str, ...]]:
    """The iteration folder the tracker file of the save directory ``path``
    names, as Megatron's ``load_checkpoint`` picks it, and a note naming the
    other iterations there."""
    tracker = os.path.join(path, TRACKER)
    chosen, why = tracked(path)
    if chosen is None:
        raise CorruptCheckpointError(f"{tracker} does not name an iteration: {why}",
                                     "write the iteration to load in it (or 'release'), or "
                                     "name an iteration folder")
    saved = sorted(d for d in dirs if ITERATION_DIR.match(d) or d == RELEASE)
    if chosen not in dirs:
        have = f"it has {shown([d + '/' for d in saved])}" if saved else "it has none"
        raise CorruptCheckpointError(
            f"{tracker} names {chosen}, but {path} has no {chosen}/ ({have})",
            "the save was interrupted, or the iteration folder was not copied; name an "
            "iteration folder to read it")
    if fs.isfile(os.path.join(path, chosen, TRACKER)):  # (a save directory in a save
        raise UnsupportedCheckpointError(                 # directory: none Megatron writes)
            f"{path}/{chosen} holds a {TRACKER} of its own: Megatron saves no iteration "
            "inside another", "name the iteration folder that holds the weights")
    others = [d + "/" for d in saved if d != chosen]
    return chosen, (f"{path} also holds {shown(others)}: other iterations, read by naming "
                    "one",) if others else ()


def torch_dist(path: str, files: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """For a DCP folder that is a Megatron-core ``torch_dist`` checkpoint
    (its ``metadata.json`` says so): the files read beside its DCP files
    (``common.pt``) and notes; None for another DCP folder."""
    found = backend(path) if BACKEND_FILE in files else None
    if found is None:
        return None
    if found["sharded_backend"] != "torch_dist":
        raise UnsupportedCheckpointError(
            f"{path} is a Megatron-core distributed checkpoint with the "
            f"{found['sharded_backend']!r:.40} backend: ckptool reads torch_dist",
            "convert it to torch_dist with Megatron's dist_checkpointing, then read that")
    if COMMON_FILE in files:
        return (COMMON_FILE,), ()
    return (), (f"{path} has no {COMMON_FILE}: the run's arguments are not known, and "
                "Megatron's load_checkpoint refuses it",)


def rank_files(path: str, dirs: list[str]) -> tuple[str, ...]:
    """A legacy iteration folder's rank files (``mp_rank_00_000/model_optim_rng.pt``
    ...), in rank order; () where ``path`` is not one."""
    ranks = [d for d in dirs if rank_dir(d) is not None]
    if not ranks or not any(fs.isfile(os.path.join(path, d, MODEL_FILE)) for d in ranks):
        return ()
    return tuple(f"{d}/{MODEL_FILE}" for d in sorted(ranks))


@dataclass(frozen=True)
class Gap:
    """The rank files a legacy iteration folder lacks: the first few, in
    the order Megatron numbers them, and how many in all."""

    names: tuple[str, ...]
    count: int

    def __bool__(self) -> bool:
        return self.count > 0

    def said(self, shown: int = 4) -> str:
        """``a, b, c, d and 12 more are missing``'s first part."""
        more = self.count - min(shown, len(self.names))
        return ", ".join(self.names[:shown]) + (f" and {more} more" if more > 0 else "")


def naming_of(layout: Layout) -> Naming:
    """How the rank folders of the legacy layout ``layout`` are named: NeMo
    1's (a NeMo folder's), or Megatron's."""
    return NEMO_NAMING if layout.nemo is not None else MEGATRON_NAMING


def missing_rank_files(directory: str, files: tuple[str, ...],
                       sizes: tuple[int, int, int] | None = None,
                       naming: Naming = MEGATRON_NAMING) -> Gap:
    """The rank files a legacy iteration folder lacks (relative to it).
    With the run's sizes (TP, PP, EP from its args), the folders Megatron
    names for them (``_{pp:03d}`` only with pipeline parallelism,
    ``_{ep:03d}`` only with expert parallelism); without, the folders the
    highest numbers in each place of the names there imply. Only the
    folders that are there are looked at: a grid of a billion ranks (a
    crafted args, a folder named ``mp_rank_99_999_999``) is counted, not
    walked. ``naming``: NeMo 1's rank folders, or Megatron's."""
    found = [naming.parse(f.split("/")[0]) for f in files]
    ranks = [r for r in found if r is not None]
    if not ranks:
        return Gap((), 0)
    if sizes is not None:
        tp, pp, ep = sizes
        places = [tp] + ([pp] if pp > 1 else []) + ([ep] if ep > 1 else [])
    else:
        places = [max(r.tp for r in ranks) + 1]
        if any(r.pp is not None for r in ranks):
            places.append(max(r.pp or 0 for r in ranks) + 1)
        if any(r.ep is not None for r in ranks):
            places.append(max(r.ep or 0 for r in ranks) + 1)
    there = {r.name for r in ranks if fs.isfile(os.path.join(directory, r.name, naming.file))}
    in_grid = sum(1 for name in there if _in_grid(naming, name, places))
    names: list[str] = []
    total = math.prod(places)
    index = 0  # the grid walked in order, lazily: stops at SHOWN missing names
    while index < total and len(names) < SHOWN:
        numbers = _digits(index, places)
        name = naming.name(numbers)
        if name not in there:
            names.append(f"{name}/{naming.file}")
        index += 1
    return Gap(tuple(names), total - in_grid)


def _digits(index: int, places: list[int]) -> tuple[int, ...]:
    """The ``index``-th numbers of the grid ``places`` spans, the last place
    counting fastest (``itertools.product``'s order, which would hold each
    place's whole range in memory)."""
    out = []
    for n in reversed(places):
        index, digit = divmod(index, n)
        out.append(digit)
    return tuple(reversed(out))


def _in_grid(naming: Naming, name: str, places: list[int]) -> bool:
    """Whether the rank folder ``name`` is one of the grid ``places`` spans,
    named as its writer names it."""
    r = naming.parse(name)
    if r is None:
        return False
    numbers = tuple(n for n in (r.tp, r.pp, r.ep) if n is not None)
    return len(numbers) == len(places) and naming.name(numbers) == name and \
        all(n < p for n, p in zip(numbers, places, strict=True))
