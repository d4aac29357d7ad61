"""Preview a fix from a checkpoint already read: what ``ckptool fix
--dry-run`` plans (``rewrite.fix(..., dry_run=True)``), without reading the
file again.

``rewrite.fix`` reads the file faithfully and ``plan.make_plan`` changes that
tree in place. Here the plan is made from ``Checkpoint.root``, the tree of
the ordinary read, which stays as it is. In general ``make_plan`` itself
runs on a copy of the tree's containers (the records and values are
shared). The common cases take a shorter way with the same result, keeping
what successive options share: ``--extract`` changes nothing in the tree,
and renaming copies only the containers above the state dict; only the
keys of renamed tensors change. Either way the errors are the dry run's.

Both reads build the same containers and tensor records for everything
``torch.save`` writes, so the plan is the same. The few globals that only
the ordinary read rebuilds (``collections.defaultdict``, ``builtins.set``,
protocol-0 ``copyreg._reconstructor``) could name entries differently; a
write plans again from the faithful read whatever the preview said.

Cost on 100,000 tensors: the first preview walks the tree (a second or
two); later key or device options take a pass over the state dict.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, NamedTuple

from ckptool import plan as plans
from ckptool.errors import UsageError
from ckptool.model import NO_LOCATION, Checkpoint
from ckptool.plan import FixOptions, Plan
from ckptool.tensors import CompositeTensor, StorageRef, TensorRecord
from ckptool.values import StandIn
from ckptool.walk import walk


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
        parts = [f"{self.kept:,} tensors kept", f"{self.renamed:,} renamed",
                 f"{self.moved:,} moved"]
        if self.left_out:
            parts.append(f"{self.left_out:,} left out")
        if self.added:
            parts.append(f"{len(self.added):,} listed twice")
        if self.plan.extracted is not None:
            parts.append(f"extracts '{self.plan.extracted or 'the file'}'")
        return " · ".join(parts)


Storages = tuple[dict[str, str], dict[str, tuple[str, str]], list[str]]  # retargets, casts, notes


@dataclass
class _Shape:
    """The tree after ``--extract`` (or as read), and what is known of it."""

    root: Any
    extracted: str | None
    sd_path: str | None  # where the main state dict is in ``root``, if there
    used: dict[str, StorageRef]  # the storages it carries
    unsafe: list[str]  # unsafe globals it names
    after: list[str | None]  # each input tensor's key in it (None: not in it)
    nbytes: int  # of ``used``
    storages: dict[tuple[Any, ...], Storages]  # device and dtype plans, by options


def preview(ckpt: Checkpoint, opts: FixOptions) -> FixPreview:
    """What ``rewrite.fix(ckpt.path, opts, dry_run=True)`` would plan, from ``ckpt``."""
    return Previewer(ckpt).preview(opts)


class Previewer:
    """Previews fixes of one checkpoint, keeping what successive options share
    (a browser replans on every edit). Threads share it one at a time."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self._lock = threading.Lock()
        self._shapes: dict[str | None, _Shape] = {}
        self._records: list[int] | None = None  # id() of each input tensor's record
        self._aliased = False  # the read met a container twice

    def preview(self, opts: FixOptions) -> FixPreview:
        with self._lock:
            return self._preview(opts)

    def _preview(self, opts: FixOptions) -> FixPreview:
        ckpt = self.ckpt
        plans.check_rewritable(ckpt.format, opts)
        self._input_records()
        if opts.drop or self._aliased:
            return self._general(opts)
        shape = self._shape(opts.extract)
        plan = Plan(shape.root, extracted=shape.extracted)
        after = shape.after
        if opts.changes_keys():
            renamed = self._rename(plan, shape, opts)
            if renamed is None:
                return self._general(opts)
            after = renamed
        key = (opts.to, opts.maps, opts.dtype)
        if key not in shape.storages:
            shape.storages[key] = _plan_storages(shape.used, opts)
        retargets, casts, notes = shape.storages[key]
        plan.retargets, plan.casts = dict(retargets), dict(casts)
        plan.notes += notes
        plans.refuse_unsafe(shape.unsafe)
        return self._changes(plan, after, shape.nbytes)

    def _general(self, opts: FixOptions) -> FixPreview:
        """``make_plan`` on a copy of the tree's containers: any options, any tree."""
        plan = plans.make_plan(dataclasses.replace(self.ckpt, root=copy_tree(self.ckpt.root)),
                               opts)
        used = plans.used_storages(plan.root)
        plans.refuse_unsafe(plans.unsafe_in(plan.root))
        after, added = self._pair(walk(plan.root).tensors)
        preview = self._changes(plan, after, sum(r.nbytes for r in used.values()))
        preview.added = added
        return preview

    def _rename(self, plan: Plan, shape: _Shape, opts: FixOptions) -> list[str | None] | None:
        """Rename the state dict's keys in ``plan.root`` as ``make_plan`` does;
        each input tensor's new key, or None where that takes the general way."""
        sd_info = self.ckpt.main_state_dict
        if shape.sd_path is None or sd_info is None:
            raise UsageError("no state dict to rename keys in",
                             "extract one first: --extract PATH")
        steps, sd = _find_path(plan.root, shape.sd_path)
        if not isinstance(sd, dict):
            raise UsageError(
                f"'{sd_info.path or 'the file'}' is a whole pickled module, not a state dict",
                "add --extract to turn it into a state dict first")
        new_sd, plan.renames = plans.rename_all(sd, plans.key_function(opts, sd_info.prefix))
        if steps and not isinstance(steps[-1][0], (dict, list)):
            plans.replace_child(plan.root, steps[-1][0], steps[-1][1], new_sd)  # raises
        renamed = {old for old, _ in plan.renames}
        if (set(getattr(sd, "__dict__", {})) - {"_metadata"}
                or not all(isinstance(c, (dict, list, tuple)) for c, _, _ in steps)
                or not all(isinstance(v, (TensorRecord, StorageRef))
                           for k, v in sd.items() if k in renamed)):
            return None  # what the tree holds besides the renamed tensors could change
        for container, key, name in reversed(steps):  # copy the path down to the state dict
            if isinstance(container, tuple):
                new_sd = (*container[:int(name)], new_sd, *container[int(name) + 1:])
            else:
                parent = copy.copy(container)  # keeps a dict's type and attributes
                parent[key] = new_sd
                new_sd = parent
        plan.root = new_sd
        if opts.strip_module and not sd_info.prefix:
            plan.notes.append("--strip-module: no module./_orig_mod./model. prefix found")
        # the same records in the same places: only the renamed keys differ
        # (walk lists a state dict's tensors as ``path/name``)
        base = f"{shape.sd_path}/" if shape.sd_path else ""
        moved = {base + old: (id(sd[old]), base + new) for old, new in plan.renames}
        get = moved.get
        after = []
        for key, rid in zip(shape.after, self._input_records(), strict=False):
            hit = get(key) if key is not None else None
            after.append(hit[1] if hit is not None and hit[0] == rid else key)
        return after

    # -- the tree after --extract ----------------------------------------------
    def _input_records(self) -> list[int]:
        if self._records is None:
            walked = walk(self.ckpt.root)
            # the read lists its tensors in walk order: these are their records
            self._records = [id(rec) for _, rec in walked.tensors[: len(self.ckpt.tensors)]]
            self._aliased = bool(walked.aliases)
        return self._records

    def _shape(self, extract: str | None) -> _Shape:
        cached = self._shapes.get(extract)
        if cached is not None:
            return cached
        ckpt = self.ckpt
        root = ckpt.root
        sd_path = ckpt.main_state_dict.path if ckpt.main_state_dict else None
        extracted = None
        if extract is not None:
            path = sd_path if extract == "auto" else extract
            if path is None:
                raise UsageError("no state dict found to extract",
                                 "name one: --extract PATH (see `ckptool inspect`)")
            root = plans.state_dict_of(_find_path(root, path)[1])
            extracted = path
            sd_path = "" if path == sd_path else None
            # no container is met twice (else the general way): what the read
            # listed under ``path/`` is what a walk of the extracted tree lists
            prefix = f"{path}/" if path else ""
            cut = len(prefix)
            after = [key[cut:] if key.startswith(prefix) else ("" if key == path else None)
                     for key in (t.key for t in ckpt.tensors)]
        else:
            after = [t.key for t in ckpt.tensors]
        used = plans.used_storages(root)
        shape = _Shape(root, extracted, sd_path, used, plans.unsafe_in(root), after,
                       sum(ref.nbytes for ref in used.values()), {})
        self._shapes[extract] = shape
        return shape

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

    # -- before and after, tensor by tensor ------------------------------------
    def _changes(self, plan: Plan, after: list[str | None], nbytes: int) -> FixPreview:
        retargets = plan.retargets
        rows = []
        kept = renamed = moved = 0
        for info, new in zip(self.ckpt.tensors, after, strict=False):
            loc = info.location or NO_LOCATION
            new_loc = retargets.get(info.storage, loc) if info.storage else loc
            rows.append((info.key, new, loc, new_loc))
            if new is not None:
                kept += 1
                renamed += new != info.key
                moved += new_loc != loc
        changes = list(map(KeyChange._make, rows))  # tuples: quick to make by the 100,000
        return FixPreview(plan, changes, nbytes, kept, renamed, moved)


def _plan_storages(used: dict[str, StorageRef], opts: FixOptions) -> Storages:
    """``plan.plan_storages`` over the storages ``used``: a plan of just them."""
    alone = Plan(list(used.values()))
    plans.plan_storages(alone, opts)
    return alone.retargets, alone.casts, alone.notes


def _find_path(root: Any, path: str) -> tuple[list[tuple[Any, Any, str]], Any]:
    """(container, its key for the child, the child's name) from ``root``
    down to the object at ``path``, and that object, as ``plan.find_entry`` reads
    the path; its error if there is none."""
    steps = []
    obj = root
    for part in path.split("/") if path else []:
        for key, name, child in plans.keyed_children(obj):
            if name == part:
                steps.append((obj, key, name))
                obj = child
                break
        else:
            plans.find_entry(root, path)  # raises the plan's error
    return steps, obj


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
