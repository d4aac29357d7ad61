"""Walk a checkpoint's inert object tree: find every tensor, the non-tensor
entries, and the dicts and modules that could be its state dict.

The walk is iterative (hostile files can nest a million levels deep), visits
each container once (a second reference to the same object is reported as
an alias, not walked again), and presents pickled ``nn.Module``s and
TorchScript modules as state dicts with dotted names. Names are yielded as
they are; keys are made from them by ``ckptool.keys`` (which escapes a
``/`` or ``\\`` inside a name), in ``path_of`` and ``join_key``.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ckptool.describe import shape_text
from ckptool.keys import escape, join_key
from ckptool.read.tensors import CompositeTensor, StorageRef, TensorRecord
from ckptool.read.values import StandIn

MAX_MODULE_DEPTH = 256


@dataclass
class Candidate:
    """A dict of tensors, or a module, that may be the main state dict."""

    path: str  # its key (escaped: ckptool.keys)
    kind: str  # "dict" or "module"
    names: list[str]  # state-dict names as they are, in order


@dataclass
class Walked:
    tensors: list[tuple[str, Any]] = field(default_factory=list)  # (key, record)
    entries: list[tuple[str, Any]] = field(default_factory=list)  # (key, value)
    aliases: list[tuple[str, str]] = field(default_factory=list)  # (key, same-as key)
    candidates: list[Candidate] = field(default_factory=list)


def key_text(key: Any) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, (int, float, bool)) or key is None:
        return str(key)
    if isinstance(key, TensorRecord):  # an optimizer pickled whole keys its state by parameter
        where = key.storage.key if key.storage is not None else "-"
        return f"<tensor {shape_text(key.shape)} {key.dtype} in storage {where} at " \
            f"{key.storage_offset}>"
    return repr(key)


def is_tensor(obj: Any) -> bool:
    """A tensor, a storage saved on its own, or a sparse (nested) tensor: one
    tensor each, whatever its parts."""
    return isinstance(obj, (TensorRecord, StorageRef, CompositeTensor))


def module_kind(obj: Any) -> str | None:
    """"nn" for a pickled nn.Module, "script" for a TorchScript module."""
    if not isinstance(obj, StandIn):
        return None
    if obj.qualname.startswith("__torch__."):
        return "script"
    state = obj.state_dict_view()
    if "_parameters" in state and "_modules" in state:
        return "nn"
    return None


def module_tensors(mod: StandIn, prefix: str = "", depth: int = 0) -> Iterator[tuple[str, Any]]:
    """(dotted name, tensor) in ``state_dict()`` order: params, buffers, children."""
    if depth > MAX_MODULE_DEPTH:
        return
    if module_kind(mod) == "script":
        for name, value in mod.state_dict_view().items():
            if is_tensor(value):
                yield prefix + name, value
            elif module_kind(value) == "script":
                yield from module_tensors(value, f"{prefix}{name}.", depth + 1)
        return
    for name, value, in_state_dict in _members(mod, prefix, depth):
        if in_state_dict:
            yield name, value


def module_extras(mod: StandIn) -> Iterator[tuple[str, Any]]:
    """(dotted name, value) of what a pickled nn.Module holds besides its
    state dict, for it and its submodules: plain attributes (a tensor kept as
    ``self.scale``, torchmetrics' metric states) and non-persistent buffers.
    Tensors among them are tensors of the file, listed beside the state dict."""
    if module_kind(mod) != "nn":
        return
    for name, value, in_state_dict in _members(mod, "", 0):
        if not in_state_dict:
            yield name, value


def _members(mod: StandIn, prefix: str, depth: int) -> Iterator[tuple[str, Any, bool]]:
    """Everything an nn.Module and its submodules hold, by dotted name, and
    whether ``state_dict()`` has it (those in its order: params, persistent
    buffers, then each child's)."""
    if depth > MAX_MODULE_DEPTH:
        return
    state = mod.state_dict_view()
    skip = _set_of(state.get("_non_persistent_buffers_set"))
    for table in ("_parameters", "_buffers"):
        items = state.get(table)
        for name, value in items.items() if isinstance(items, dict) else ():
            kept = is_tensor(value) and not (table == "_buffers" and name in skip)
            yield prefix + key_text(name), value, kept
    for name, value in state.items():
        if name not in ("_parameters", "_buffers", "_modules"):
            yield prefix + key_text(name), value, False
    subs = state.get("_modules")
    if isinstance(subs, dict):
        for name, sub in subs.items():
            below = f"{prefix}{key_text(name)}."
            if module_kind(sub) == "nn":
                yield from _members(sub, below, depth + 1)
            elif module_kind(sub) == "script":
                yield from ((n, v, True) for n, v in module_tensors(sub, below, depth + 1))


def _set_of(value: Any) -> set[Any]:
    """A pickled set, as either read makes it: a real set, or (read
    faithfully, to be written back) the call ``builtins.set([...])``."""
    if isinstance(value, (set, frozenset)):
        return set(value)
    if isinstance(value, StandIn) and value.qualname in ("builtins.set", "builtins.frozenset"):
        items = value.args[0] if value.args else ()
        if isinstance(items, (list, tuple)):
            return {k for k in items if isinstance(k, str)}
    return set()


# torch.nn classes whose ``_version`` is not Module's 1 (state_dict's _metadata)
_VERSIONS = {f"torch.nn.modules.batchnorm.{name}": 2 for name in (
    "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "LazyBatchNorm1d",
    "LazyBatchNorm2d", "LazyBatchNorm3d", "_BatchNorm", "_NormBase")}


def module_metadata(mod: StandIn, prefix: str = "", depth: int = 0
                    ) -> Iterator[tuple[str, dict[str, int]]]:
    """``state_dict()._metadata`` of a pickled nn.Module: each module's dotted
    path (the root's is "") with its class's version, in state_dict order."""
    if depth > MAX_MODULE_DEPTH or module_kind(mod) != "nn":
        return
    yield prefix[:-1], {"version": _VERSIONS.get(mod.qualname, 1)}
    subs = mod.state_dict_view().get("_modules")
    if isinstance(subs, dict):
        for name, sub in subs.items():
            yield from module_metadata(sub, f"{prefix}{key_text(name)}.", depth + 1)


def children(obj: Any) -> Iterator[tuple[str, Any]]:
    """Named children of a container; nothing for leaves."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield key_text(k), v
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield str(i), v
    elif isinstance(obj, StandIn):
        for i, v in enumerate(obj.args):
            yield str(i), v
        yield from obj.state_dict_view().items()
        state = obj.state
        if state is not None and not isinstance(state, dict) and not (
            isinstance(state, tuple) and len(state) == 2
            and all(isinstance(p, dict) or p is None for p in state)
        ):
            yield "state", state
        for i, v in enumerate(obj.items):
            yield str(len(obj.args) + i), v
        for k, v in obj.dictitems.items():
            yield key_text(k), v
        for k, v in obj.kwargs.items():
            yield key_text(k), v


def _is_state_dict(obj: Any) -> bool:
    if not isinstance(obj, dict) or not obj:
        return False
    found = False
    for k, v in obj.items():
        if isinstance(v, (TensorRecord, CompositeTensor)):
            found = True
        elif not (isinstance(k, str) and k.endswith("_extra_state")):
            return False
    return found


# A node's path as a chain of (parent link, name) pairs: built in O(1) per
# node and turned into a string only for the few nodes that are reported, so
# a deep chain of containers costs linear, not quadratic, memory.
Link = tuple[Any, str] | None


def path_of(link: Link, base: str) -> str:
    """The key of a node: its names from ``base`` (a raw name, or "" for the
    root) down, each escaped (``ckptool.keys``)."""
    names: list[str] = []
    while link is not None:
        link, name = link
        names.append(escape(name))
    if base:
        names.append(escape(base))
    return "/".join(reversed(names))


def walk(root: Any, base: str = "") -> Walked:
    """Find tensors, non-tensor entries and state-dict candidates under ``root``."""
    out = Walked()
    first_link: dict[int, Link] = {}
    parent: dict[int, int] = {}
    holds_tensors: set[int] = set()
    order: list[tuple[Link, Any, int | None]] = []  # every visited node, preorder

    stack: list[tuple[Link, Any, int | None]] = [(None, root, None)]
    while stack:
        link, obj, par = stack.pop()
        if is_tensor(obj):
            out.tensors.append((path_of(link, base), obj))
            _mark(par, parent, holds_tensors)
            order.append((link, obj, par))
            continue
        if not _is_container(obj):
            order.append((link, obj, par))
            continue
        oid = id(obj)
        if oid in first_link:
            out.aliases.append((path_of(link, base), path_of(first_link[oid], base)))
            continue
        first_link[oid] = link
        if par is not None:
            parent[oid] = par
        order.append((link, obj, par))
        kind = module_kind(obj)
        if kind is not None:
            path = path_of(link, base)
            names = []
            listed = set()
            for name, tensor in module_tensors(obj):
                names.append(name)
                listed.add(id(tensor))
                out.tensors.append((join_key(path, name), tensor))
            extra = _module_extra_tensors(obj, path, listed)
            out.tensors += extra
            if names or extra:
                _mark(oid, parent, holds_tensors)
            if names:
                out.candidates.append(Candidate(path, "module", names))
            continue
        if _is_state_dict(obj):
            out.candidates.append(
                Candidate(path_of(link, base), "dict", [key_text(k) for k in obj]))
        kids = list(children(obj))
        if kids and all(type(child) is TensorRecord for _, child in kids):
            # a state dict's own level: its tensors come next in preorder
            # anyway, so they are listed here, not through the stack (they
            # need no place in ``order``: entries skip tensors)
            # as path_of((link, name), base): a parent with any name, even
            # an empty one, puts a "/" before the child's
            at = f"{path_of(link, base)}/" if link is not None or base else ""
            out.tensors += [(at + escape(name), child) for name, child in kids]
            _mark(oid, parent, holds_tensors)
            continue
        for name, child in reversed(kids):
            stack.append(((link, name), child, oid))

    # entries: the largest tensor-free subtrees hanging off tensor-holding containers
    for link, obj, par in order:
        if is_tensor(obj) or (_is_container(obj) and id(obj) in holds_tensors):
            continue
        # a module's own attributes never reach ``order``: its walk stops at it
        if par is None or par in holds_tensors:
            out.entries.append((path_of(link, base), obj))
    return out


def _module_extra_tensors(mod: StandIn, path: str, listed: set[int]
                          ) -> list[tuple[str, Any]]:
    """Tensors a module holds outside its state dict (``module_extras``),
    keyed under the module's key by dotted attribute path; each container
    walked once, tensors already listed skipped."""
    found: list[tuple[str, Any]] = []
    active = _EXPANDING.get()
    if id(mod) in active:  # a module its own attributes reach (m.refs = [m], a hook of m)
        return found
    token = _EXPANDING.set(active | {id(mod)})
    try:
        _extra_tensors(mod, path, listed, found)
    finally:
        _EXPANDING.reset(token)
    return found


# the modules whose extras are being walked, outermost first: a cycle back to
# one of them stops there
_EXPANDING: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "ckptool_expanding", default=frozenset())


def _extra_tensors(mod: StandIn, path: str, listed: set[int],
                   found: list[tuple[str, Any]]) -> None:
    walked: set[int] = set()
    for name, value in module_extras(mod):
        where = f"{path}/{escape(name)}" if path else escape(name)
        if is_tensor(value):
            if id(value) not in listed:
                listed.add(id(value))
                found.append((where, value))
            continue
        if not _is_container(value) or id(value) in walked or module_kind(value) is not None:
            continue
        walked.add(id(value))
        inner = walk(value)
        for key, tensor in inner.tensors:
            if id(tensor) not in listed:
                listed.add(id(tensor))
                found.append((f"{where}/{key}" if key else where, tensor))


def _is_container(obj: Any) -> bool:
    return isinstance(obj, (dict, list, tuple, StandIn))


def _mark(oid: int | None, parent: dict[int, int], holds: set[int]) -> None:
    while oid is not None and oid not in holds:
        holds.add(oid)
        oid = parent.get(oid)
