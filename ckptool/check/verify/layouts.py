"""Which layout a path holds, and which files it names, for verify: what
``ckptool.read.layouts.recognise`` says, and, where it refuses a directory
that is damaged, what can still be checked there (a DCP directory whose
``.metadata`` is no pickle, files saved per rank with one rank missing,
each checkpoint file of the directory alone).

Refusals that say the path is no checkpoint at all (or one ckptool cannot
read) are left to raise: verify exits 3 on them.
"""

from __future__ import annotations

import os
import re

from ckptool.check.verify.files import lexists
from ckptool.check.verify.problems import (
    EXTRA_FILE,
    HEADER,
    MISMATCH,
    MISSING_FILE,
    WARNING,
    Problem,
    classify,
)
from ckptool.errors import CorruptCheckpointError, InputError
from ckptool.read import fs
from ckptool.read.formats.safetensors_fmt import SAFETENSORS
from ckptool.read.layouts import framework, recognise
from ckptool.read.layouts.layout import DS_UNIVERSAL
from ckptool.read.layouts.names import (
    DATA_FILE,
    DEEPSPEED_FILE,
    INDEX_NAME,
    MAX_SNIFFED,
    METADATA,
    PREFERRED_INDEXES,
    RANK_METADATA,
    RANK_NAME,
    index_json,
    is_checkpoint_file,
    listing,
    shown,
)
from ckptool.read.layouts.recognise import (
    DCP,
    DEEPSPEED,
    FILE,
    HF,
    HF_STORAGE,
    MEGATRON,
    PER_RANK,
    Layout,
)
from ckptool.read.megatron import layout as megatron_layout

ALONE = "alone"  # files checked one by one: the directory's layout is refused
WORLD_SIZE = re.compile(r"world_size_(\d+)")
# the format names a layout's reader gives (Checkpoint.format), when it cannot be read
FORMATS = {DCP: "dcp", DEEPSPEED: "deepspeed", PER_RANK: "dtensor-ranks",
           HF_STORAGE: "hf-storage", MEGATRON: "megatron", DS_UNIVERSAL: "deepspeed-universal"}


def recognised(path: str) -> tuple[Layout | None, list[Problem]]:
    """``path``'s layout (None: one file), and what is wrong that made
    ``recognise`` refuse it, with the layout verify checks instead."""
    try:
        layout = recognise.recognise(path)
        if layout is not None and layout.kind == PER_RANK:
            missing = missing_ranks(layout)
            if missing:  # its reader would say it less well: each file alone
                return Layout(ALONE, path, path, metadata=layout.metadata), missing
        if layout is not None and layout.kind == MEGATRON:
            gap = megatron_layout.missing_rank_files(
                layout.directory, layout.metadata, naming=megatron_layout.naming_of(layout))
            if gap:  # the others checked alone
                problems = [Problem(MISSING_FILE, "a rank's file is missing (the other rank "
                                    "folders' names say so)", n) for n in gap.names]
                if gap.count > len(gap.names):
                    problems.append(Problem(MISSING_FILE, f"and {gap.count - len(gap.names)} "
                                            "more rank files are missing", layout.directory))
                return Layout(ALONE, path, layout.directory, metadata=tuple(
                    n for n in layout.metadata
                    if fs.isfile(os.path.join(layout.directory, n)))), problems
        if layout is not None and layout.kind == FILE and layout.file is not None and \
                fs.isdir(path) and RANK_NAME.match(fs.basename(layout.file)):
            ranks = _ranks_left(path)  # one rank's file is all that still reads
            if ranks is not None:
                return ranks
        return layout, _unfinished_saves(path)
    except CorruptCheckpointError as exc:
        if not fs.isdir(path):
            raise
        return _damaged(path, exc)
    except InputError:
        if fs.isdir(path):
            found = _rank_gap(path) or _index_lacking_shards(path)
            if found is not None:
                return found
        raise


def _damaged(path: str, exc: CorruptCheckpointError) -> tuple[Layout, list[Problem]]:
    files = sorted(n for n in listing(path) if fs.isfile(fs.join(path, n)))
    metadata = [n for n in files if n == METADATA or RANK_METADATA.match(n)]
    if metadata:  # a .metadata that is no pickle: the DCP check says so, naming it
        return Layout(DCP, path, path, metadata=tuple(metadata)), []
    message = exc.message.removeprefix(f"{path}: ")
    named: str | None = None  # the index the message names
    data = [n for n in files if DATA_FILE.match(n)]
    if data:  # (the reader's message names the directory: the problem names the file)
        problem = Problem(MISSING_FILE, f"the file is missing: the directory holds "
                          f"torch.distributed.checkpoint data files ({shown(data)}) and "
                          "nothing says what is in them (`cp src/* dst/` skips dot files; "
                          "DCP writes .metadata last)", METADATA)
    else:
        named = next((n for n in files if n in message and INDEX_NAME.search(n)), None)
        message = message.replace(os.path.join(path, ""), "")
        if named is not None:
            message = message.removeprefix(f"{named} ").removeprefix("is ")
        problem = Problem(HEADER if named else classify(message, MISMATCH), message, named)
    # every data file, whatever its first bytes say: a damaged one is checked too
    return Layout(ALONE, path, path, index=named, metadata=tuple(dict.fromkeys(
        data + _checkpoint_files(path, files)))), [problem]


def _ranks_left(path: str) -> tuple[Layout, list[Problem]] | None:
    """Files saved per rank of which only one still reads: the others are
    missing or damaged (their names say how many ranks saved)."""
    names = sorted(n for n in listing(path) if RANK_NAME.match(n))
    groups: dict[str, dict[int, str]] = {}
    for name in names:
        m = RANK_NAME.match(name)
        assert m is not None
        groups.setdefault(m.group("stem"), {})[int(m.group("rank"))] = name
    problems = [p for stem, ranks in sorted(groups.items()) for p in _missing(stem, ranks)]
    bad = [n for n in names if not is_checkpoint_file(fs.join(path, n))]
    problems += [Problem(HEADER, "a rank's file that is no checkpoint file: damaged, or cut "
                         "short", n) for n in bad]
    if not problems:
        return None
    return Layout(ALONE, path, path, metadata=tuple(n for n in names if n not in bad)), problems


def _unfinished_saves(path: str) -> list[Problem]:
    """Folders of a directory (an accelerate or Trainer folder's model and
    optimizer) holding DCP data files and no .metadata: a save killed
    before its end, which the layout's reader passes over."""
    if not fs.isdir(path):
        return []
    out = []
    for name in sorted(listing(path)):
        sub = fs.join(path, name)
        if not fs.isdir(sub) or fs.islink(sub):
            continue
        files = listing(sub)
        if any(DATA_FILE.match(n) for n in files) and METADATA not in files:
            out.append(Problem(MISSING_FILE, f"{name} holds DCP data files but no .metadata "
                               "to say what is in them (a save killed before its end?)",
                               f"{name}/{METADATA}"))
    return out


def _index_lacking_shards(path: str) -> tuple[Layout, list[Problem]] | None:
    """A directory refused as holding two checkpoints, one of them a shard
    index that names shards which are not there (a shard renamed to
    ``.bak``, moved, deleted): the index's checkpoint, read through the
    index, which says which shards are missing; the checkpoint files it
    does not name are warnings (the missing shard under another name?)."""
    files = sorted(n for n in listing(path) if fs.isfile(fs.join(path, n)))
    indexes = {n: data for n in files if INDEX_NAME.search(n)
               and (data := index_json(os.path.join(path, n))) is not None}
    chosen = next((n for n in PREFERRED_INDEXES if n in indexes),
                  next(iter(indexes)) if len(indexes) == 1 else None)
    if chosen is None:
        return None
    weight_map = indexes[chosen]["weight_map"]
    assert isinstance(weight_map, dict)
    shards = {v for v in weight_map.values() if isinstance(v, str)}
    if all(lexists(fs.join(path, s)) for s in shards):
        return None  # whole: two checkpoints indeed
    named = shards | set(indexes)
    strays = [Problem(EXTRA_FILE, f"a checkpoint file that {chosen} does not name (a "
                      "missing shard, renamed?)", n, severity=WARNING)
              for n in _checkpoint_files(path, [n for n in files if n not in named])
              if framework.role_of(n) is None]
    return Layout(HF, os.path.join(path, chosen), path, index=chosen), strays


def _checkpoint_files(path: str, files: list[str]) -> list[str]:
    return [n for n in files[:MAX_SNIFFED] if is_checkpoint_file(os.path.join(path, n))]


def _rank_gap(path: str) -> tuple[Layout, list[Problem]] | None:
    """Files named by rank (``model_world_size_4_rank_0.pt``) whose ranks
    leave a gap (``recognise`` refuses them): the ranks missing, and the
    others checked alone."""
    files = _checkpoint_files(path, sorted(listing(path)))
    groups: dict[str, dict[int, str]] = {}
    for name in files:
        m = RANK_NAME.match(name)
        if m:
            groups.setdefault(m.group("stem"), {})[int(m.group("rank"))] = name
    if not groups or sum(len(g) for g in groups.values()) != len(files):
        return None
    problems = [p for stem, ranks in sorted(groups.items()) for p in _missing(stem, ranks)]
    if not problems:
        return None
    return Layout(ALONE, path, path, metadata=tuple(files)), problems


def missing_ranks(layout: Layout) -> list[Problem]:
    """Rank files a per-rank layout lacks by its names' own world size
    (``model_world_size_4_rank_*.pt`` with ranks 0 to 2 only)."""
    ranks = {}
    stem = ""
    for name in layout.metadata:
        m = RANK_NAME.match(name)
        if m:
            ranks[int(m.group("rank"))] = name
            stem = m.group("stem")
    return _missing(stem, ranks) if ranks else []


def _missing(stem: str, ranks: dict[int, str]) -> list[Problem]:
    m = WORLD_SIZE.search(stem)
    world = max(max(ranks) + 1, int(m.group(1)) if m else 0)
    low = min(ranks)
    sample = ranks[low]
    out = []
    for rank in range(world):
        if rank not in ranks:
            name = sample.replace(f"rank_{low}.", f"rank_{rank}.") \
                if f"rank_{low}." in sample else f"{stem} rank {rank}"
            out.append(Problem(MISSING_FILE, f"rank {rank}'s file is missing (the directory "
                               f"holds ranks {_ranges(sorted(ranks))} of {world})", name))
    return out


def _ranges(ranks: list[int]) -> str:
    """``0-2, 5``."""
    out: list[str] = []
    for r in ranks:
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


def layout_files(layout: Layout) -> list[str]:
    """The files of a layout read file by file (per rank, HF storage shards,
    DeepSpeed's states, or a damaged directory's), relative to its directory."""
    if layout.kind in (PER_RANK, HF_STORAGE, ALONE, MEGATRON):
        return list(layout.metadata)
    if layout.kind == DS_UNIVERSAL:  # its model states, zero/'s files
        from ckptool.read.layouts.ds_universal import files_of
        return files_of(layout.directory)
    if layout.kind == DEEPSPEED:
        return sorted(n for n in listing(layout.directory)
                      if DEEPSPEED_FILE.search(n)
                      and fs.isfile(fs.join(layout.directory, n)))
    return []


def format_of(layout: Layout | None, sniffed: str | None) -> str | None:
    """The format name of a layout that could not be read whole."""
    if layout is None or layout.kind == FILE:
        return sniffed
    if layout.kind == HF or (layout.kind == ALONE and layout.index):
        return "hf-safetensors" if SAFETENSORS in (layout.index or "") else "hf-bin"
    if layout.kind == ALONE and layout.metadata and all(
            RANK_NAME.match(n) for n in layout.metadata):
        return FORMATS[PER_RANK]
    if layout.kind == ALONE and layout.metadata and all(
            DATA_FILE.match(n) for n in layout.metadata):
        return FORMATS[DCP]  # its .metadata missing
    if layout.kind == ALONE and layout.metadata and all(
            megatron_layout.rank_dir(n.split("/")[0]) for n in layout.metadata):
        return FORMATS[MEGATRON]  # a rank's file missing
    return FORMATS.get(layout.kind)


def one_file(path: str, layout: Layout | None) -> Layout:
    """The layout of one file: ``path`` itself, or a directory's one file."""
    if layout is not None and layout.file is not None:
        return layout
    folder = fs.dirname(path)
    return Layout(FILE, path, folder, file=path)
