"""Preview a fix from a checkpoint already read: what ``ckptool fix
--dry-run`` plans (``fix.fix(..., dry_run=True)``), without reading the
file again.

``fix.fix`` reads the file faithfully and ``plan.make_plan`` changes that
tree in place. Here ``make_plan`` runs on a copy of the containers of
``Checkpoint.root``, the tree of the ordinary read (tensor records, storages
and values are shared, not copied), so the plan and its errors are the dry
run's by construction and the checkpoint stays as it was read.

Both reads build the same containers and tensor records for everything
``torch.save`` writes, so the plan is the same. The few globals that only
the ordinary read rebuilds (``collections.defaultdict``, ``builtins.set``,
protocol-0 ``copyreg._reconstructor``) could name entries differently; a
write plans again from the faithful read whatever the preview said.

A checkpoint of many files (Hugging Face shards, DCP) is planned by the
dry run of its own fix (``shards.fix``, ``dcp.fix``) on the checkpoint
read, which needs no tree: the renames, drops, casts and device moves it
plans give every tensor's name and device in the output directory.

Cost on 100,000 tensors: about 2.4 s a preview (a browser debounces edits
and plans on a worker).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, NamedTuple

from ckptool import dtypes
from ckptool.describe import plural
from ckptool.errors import UnsupportedCheckpointError
from ckptool.keys import escape, unescape
from ckptool.model import NO_LOCATION, Checkpoint
from ckptool.read import ties
from ckptool.read.layouts.dcp import DCP
from ckptool.read.layouts.hf_sharded import HF_BIN, HF_SAFETENSORS
from ckptool.read.tensors import CompositeTensor
from ckptool.read.values import StandIn
from ckptool.read.walk import walk
from ckptool.write.fix import dcp as fix_dcp
from ckptool.write.fix import plan as plans
from ckptool.write.fix import run as fix_run
from ckptool.write.fix import shards as fix_shards
from ckptool.write.fix.plan import FixOptions, Plan
from ckptool.write.flagged import refuse_flagged


class KeyChange(NamedTuple):
    """One input tensor: its key and device before and after the fix."""

    before: str
    after: str | None  # None: the output leaves this tensor out
    before_loc: str
    after_loc: str


@dataclass
class FixPreview:
    plan: Plan  # renames, dropped, extracted, retargets, casts, notes, as the dry run's
    changes: list[KeyChange]  # every input tensor, in the input's order
    nbytes: int  # bytes of the storages the output carries
    kept: int  # input tensors the output has
    renamed: int  # ... under a new key
    moved: int  # ... on a new device
    added: list[str] = dataclasses.field(default_factory=list)
    # ^ output keys of no input key: a container listed once in the input
    #   (the same object twice) that the fix turns into two

    @property
    def left_out(self) -> int:
        return len(self.changes) - self.kept

    @property
    def tensors(self) -> int:
        """Tensors the output has."""
        return self.kept + len(self.added)

    def summary(self) -> str:
        parts = [f"{plural(self.kept, 'tensor')} kept", f"{self.renamed:,} renamed",
                 f"{self.moved:,} moved"]
        if self.left_out:
            parts.append(f"{self.left_out:,} left out")
        if self.added:
            parts.append(f"{len(self.added):,} listed twice")
        if self.plan.extracted is not None:
            parts.append(f"extracts '{self.plan.extracted or 'the file'}'")
        return " · ".join(parts)


def preview(ckpt: Checkpoint, opts: FixOptions) -> FixPreview:
    """What ``fix.fix(ckpt.path, opts, dry_run=True)`` would plan, from ``ckpt``."""
    return Previewer(ckpt).preview(opts)


class Previewer:
    """Previews fixes of one checkpoint (a browser replans on every edit).
    Threads share it one at a time."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self._lock = threading.Lock()
        self._records: list[int] | None = None  # id() of each input tensor's record

    def preview(self, opts: FixOptions) -> FixPreview:
        with self._lock:
            if self.ckpt.is_multifile:
                return _directory(self.ckpt, opts)
            plans.check_rewritable(self.ckpt.format, opts, self.ckpt.path)
            refuse_flagged(self.ckpt, opts.salvage, "fix")
            plan = plans.make_plan(
                dataclasses.replace(self.ckpt, root=copy_tree(self.ckpt.root)), opts)
            plans.refuse_unsafe(plan.unsafe)
            after, added = self._pair(walk(plan.root).tensors)
            preview = self._changes(plan, after, sum(r.nbytes for r in plan.storages.values()))
            preview.added = added
            return preview

    def _input_records(self) -> list[int]:
        if self._records is None:
            # the read lists its tensors in walk order: these are their records
            walked = walk(self.ckpt.root).tensors[: len(self.ckpt.tensors)]
            self._records = [id(rec) for _, rec in walked]
        return self._records

    def _pair(self, tensors: list[tuple[str, Any]]) -> tuple[list[str | None], list[str]]:
        """Each input tensor's key among ``tensors`` (those of the same record;
        the n-th time a record is listed goes with its n-th input key), and
        the keys left over."""
        keys: dict[int, list[str]] = {}
        for key, rec in tensors:
            keys.setdefault(id(rec), []).append(key)
        after = [found.pop(0) if (found := keys.get(rid)) else None
                 for rid in self._input_records()]
        left = {key for found in keys.values() for key in found}
        return after, [key for key, _ in tensors if key in left]

    def _changes(self, plan: Plan, after: list[str | None], nbytes: int) -> FixPreview:
        retargets = plan.retargets
        rows = []
        kept = moved = 0
        for info, new in zip(self.ckpt.tensors, after, strict=False):
            loc = info.location or NO_LOCATION
            new_loc = retargets.get(info.storage, loc) if info.storage else loc
            rows.append((info.key, new, loc, new_loc))
            if new is not None:
                kept += 1
                moved += new_loc != loc
        changes = list(map(KeyChange._make, rows))  # tuples: quick to make by the 100,000
        # renamed: state-dict names that change (taking the state dict out of
        # its wrapper changes every path, and renames none)
        return FixPreview(plan, changes, nbytes, kept, len(plan.renames), moved)


def _directory(ckpt: Checkpoint, opts: FixOptions) -> FixPreview:
    """What ``fix`` plans for a directory of shards or a DCP checkpoint:
    its dry run, on the checkpoint read (``fix.fix`` reads it the same way)."""
    refuse_flagged(ckpt, opts.salvage, "fix")
    output = fix_shards.default_output(ckpt.path)  # the plan does not depend on it
    if ckpt.format == DCP:
        plan = fix_dcp.fix(ckpt, opts, output, dry_run=True).plan
    elif ckpt.format in (HF_SAFETENSORS, HF_BIN):
        plan = fix_shards.fix(ckpt, opts, output, fix_file=fix_run.fix, dry_run=True).plan
    else:  # partitioned over its ranks' files: fix says why not, and what to do
        fix_run.fix(ckpt.path, opts, dry_run=True)
        raise UnsupportedCheckpointError(f"{ckpt.path}: a {ckpt.format} checkpoint has no "
                                         "fix preview", "see `ckptool fix --dry-run`")
    renames = dict(plan.renames)
    gone = _left_out(ckpt, plan)
    rows, kept, moved, nbytes = [], 0, 0, 0
    for t in ckpt.tensors:
        name = unescape(t.key)
        new: str | None = gone.get(name, name)
        new = renames.get(new, new) if new is not None else None
        loc = t.location or NO_LOCATION
        ref = t.storage or name
        new_loc = plan.retargets.get(ref, loc)
        rows.append(KeyChange(t.key, None if new is None else escape(new), loc, new_loc))
        if new is not None:
            kept += 1
            moved += new_loc != loc
            dtype = plan.casts.get(ref, (t.dtype, t.dtype))[1]
            nbytes += t.numel * dtypes.itemsize(dtype)
    return FixPreview(plan, rows, nbytes, kept, len(plan.renames), moved)


def _left_out(ckpt: Checkpoint, plan: Plan) -> dict[str, str | None]:
    """Names ``plan.dropped`` takes out (None), or gives to a tied name that
    is stored in their place (Hugging Face shards, as ``shards._drop``)."""
    out: dict[str, str | None] = {}
    paths = ckpt.tree_paths
    for drop in plan.dropped:
        name = unescape(drop)
        steps = name.split(".")
        for t in ckpt.tensors:
            own = unescape(t.key)
            path = [str(p) for p in paths.get(own, ())]
            if own == name or (len(path) > len(steps) and path[:len(steps)] == steps):
                out[own] = _heir(ckpt, own)
    return out


def _heir(ckpt: Checkpoint, name: str) -> str | None:
    heirs = [a for a, k in ckpt.aliases.items() if k == name]
    return ties.preferred(heirs) if heirs else None


def _is_container(obj: Any) -> bool:
    return isinstance(obj, (dict, list, StandIn, CompositeTensor)) or type(obj) is tuple


def _children(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, (list, tuple)):
        return list(obj)
    return list(vars(obj).values())  # a stand-in's arguments, state and items; parts


def _shell(obj: Any) -> Any:
    """A shallow copy of the same type with the same attributes."""
    if isinstance(obj, StandIn):  # its __setstate__ is the file's BUILD, not copy's
        clone = object.__new__(type(obj))
        clone.__dict__.update(vars(obj))
        return clone
    return copy.copy(obj)  # a dict's subclass and attributes (OrderedDict._metadata) too


def copy_tree(root: Any) -> Any:
    """A copy of every container under ``root`` (dicts, lists, tuples,
    stand-ins, composite tensors), each object once however often it is
    referred to, so that changing the copy in place changes nothing in
    ``root``; tensor records, storages and values are shared."""
    shells: dict[int, Any] = {}  # mutable containers: copied first, filled after
    tuples: dict[int, tuple[Any, ...]] = {}
    originals: list[Any] = []
    stack = [root]
    while stack:  # iterative: hostile files nest a million levels deep
        obj = stack.pop()
        if id(obj) in shells or id(obj) in tuples or not _is_container(obj):
            continue
        if type(obj) is tuple:
            tuples[id(obj)] = obj
        else:
            shells[id(obj)] = _shell(obj)
            originals.append(obj)
        stack.extend(_children(obj))
    made: dict[int, Any] = {}

    def copied(obj: Any) -> Any:
        if id(obj) in shells:
            return shells[id(obj)]
        if id(obj) not in tuples:
            return obj
        # a tuple is made after its items; cycles only pass through mutable
        # containers, whose shells already exist
        pending = [obj]
        while pending:
            top = pending[-1]
            if id(top) in made:
                pending.pop()
                continue
            inner = [x for x in top if id(x) in tuples and id(x) not in made]
            if inner:
                pending.extend(inner)
                continue
            made[id(top)] = tuple(made.get(id(x), shells.get(id(x), x)) for x in top)
            pending.pop()
        return made[id(obj)]

    for obj in originals:
        shell = shells[id(obj)]
        if isinstance(obj, dict):
            for k, v in obj.items():
                shell[k] = copied(v)
        elif isinstance(obj, list):
            shell[:] = [copied(v) for v in obj]
        else:
            for name, v in vars(obj).items():
                setattr(shell, name, copied(v))
    return copied(root)
