"""Rewrite plans: what ``ckptool fix`` changes, applied to a faithful tree.

A ``FixOptions`` says what to do; ``make_plan`` applies it to the object
tree of a file read with ``resolve.faithful()`` and returns the new tree
with the list of changes (key renames, dropped entries, new location tags,
casts). Nothing is written here and no tensor byte is read: the writer
(``ckptool.write.fix.run``) streams the bytes afterwards.

Order of operations: ``--drop`` (paths in the input), ``--extract``, then key
changes on the state dict (``--strip-module``, ``--strip-prefix``,
``--rename``, ``--add-prefix``), then devices (``--to``, ``--map``) and
``--dtype`` on the storages that remain.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ckptool.errors import UnsupportedCheckpointError, UsageError
from ckptool.keys import split_key
from ckptool.model import Checkpoint
from ckptool.read.companions import why_no_weights
from ckptool.read.formats.safetensors_fmt import SAFETENSORS
from ckptool.read.formats.torch_legacy import HEADER_PICKLES, TORCH_LEGACY
from ckptool.read.formats.torch_zip import TORCH_ZIP
from ckptool.read.pickle.policy import UNSAFE
from ckptool.read.tensors import CompositeTensor, StorageRef, StorageType, TensorRecord
from ckptool.read.values import StandIn
from ckptool.read.walk import children, module_kind, module_metadata, module_tensors

DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32",
               "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}
CASTABLE = frozenset({"float64", "float32", "float16", "bfloat16"})
_STORAGE_CLASS = {"float32": "FloatStorage", "float16": "HalfStorage",
                  "bfloat16": "BFloat16Storage"}
_TAG = re.compile(r"^[a-z][a-z0-9_]*(:\d+)?$")  # a tag as files write it
# what torch.device() accepts (c10's device types), each with an optional
# index; anything else is refused as torch refuses it
DEVICE_TYPES = ("cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip",
                "ve", "fpga", "maia", "xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia",
                "privateuseone")
_DEVICE = re.compile(rf"^({'|'.join(DEVICE_TYPES)})(:(0|[1-9][0-9]*))?$")
_LIKELY = {"gpu": "cuda", "cuda0": "cuda:0", "nvidia": "cuda", "apple": "mps", "tpu": "xla"}
REWRITABLE = (TORCH_ZIP, TORCH_LEGACY, SAFETENSORS)  # formats fix writes back
# pickles a rewrite copies byte for byte (the rest it writes from the plan)
COPIED_PICKLES = {TORCH_LEGACY: HEADER_PICKLES}


@dataclass
class FixOptions:
    strip_module: bool = False
    strip_prefixes: tuple[str, ...] = ()
    add_prefix: str | None = None
    renames: tuple[tuple[str, str], ...] = ()  # (regex, replacement)
    extract: str | None = None  # "auto" or a container path
    drop: tuple[str, ...] = ()
    dtype: str | None = None  # canonical name
    to: str | None = None
    maps: tuple[tuple[str, str], ...] = ()  # (source tag, target tag)
    salvage: bool = False  # write from a flagged file: its tensors and plain values only

    def changes_keys(self) -> bool:
        return bool(self.strip_module or self.strip_prefixes or self.add_prefix
                    or self.renames)


@dataclass
class Plan:
    root: Any
    renames: list[tuple[str, str]] = field(default_factory=list)  # (old, new) state-dict keys
    dropped: list[str] = field(default_factory=list)
    extracted: str | None = None
    retargets: dict[str, str] = field(default_factory=dict)  # storage id -> new tag
    casts: dict[str, tuple[str, str]] = field(default_factory=dict)  # storage id -> (from, to)
    notes: list[str] = field(default_factory=list)
    rename: Callable[[str], str] | None = None  # the rule keys were renamed by
    # what writing ``root`` back writes: its storages, and the unsafe globals it
    # names (one walk of the tree, by make_plan)
    storages: dict[str, StorageRef] = field(default_factory=dict)
    unsafe: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.renames or self.dropped or self.extracted is not None
                    or self.retargets or self.casts)


def check_rewritable(fmt: str, opts: FixOptions, path: str = "FILE") -> None:
    """What ``fix`` refuses for a file of format ``fmt`` (at ``path``), before any plan."""
    if fmt not in REWRITABLE:
        import os.path

        from ckptool.describe import shell_word

        what = {"torchscript": "a TorchScript archive", "pickle": "a plain pickle"}.get(fmt, fmt)
        stem = os.path.splitext(path)[0]
        pth = f"{stem}.pth" if f"{stem}.pth" != path else f"{stem}.weights.pth"
        src, pth, st = (shell_word(p) for p in (path, pth, f"{stem}.safetensors"))
        raise UnsupportedCheckpointError(
            f"ckptool fix rewrites torch.save files and safetensors; this is {what}",
            f"take its weights out into a torch.save file that fix rewrites: "
            f"`ckptool convert {src} {pth}` (or into safetensors: "
            f"`ckptool convert {src} {st}`)")
    if fmt == SAFETENSORS and (opts.to or opts.maps):
        raise UsageError("safetensors files record no device: there is nothing to retarget",
                         "pick the device when loading: load_file(path, device='cuda:0')")


def refuse_unsafe(names: list[str]) -> None:
    """``fix`` never writes an unsafe global back."""
    if names:
        raise UnsupportedCheckpointError(
            f"the output would keep unsafe globals: {', '.join(names)}",
            "drop the entries that hold them (--drop PATH) or keep only the weights "
            "(--extract); see `ckptool inspect` for where they are")


def parse_device(text: str) -> str:
    """A device to write storages as on: what ``torch.device()`` accepts."""
    if not _DEVICE.match(text):
        low = text.lower().replace(" ", "")
        guess = low if _DEVICE.match(low) else _LIKELY.get(low)
        meant = f"did you mean {guess}? " if guess else ""
        raise UsageError(f"not a torch device: {text!r}",
                         f"{meant}use one torch.device() accepts, such as cpu, cuda:0, mps "
                         "or xpu:1")
    return text


def parse_tag(text: str) -> str:
    """A saved location tag to match (the left side of ``--map``): any tag a
    file can carry, torch's or a backend's torch here does not know (npu:0)."""
    if not _TAG.match(text):
        raise UsageError(f"not a location tag: {text!r}",
                         "name a device as the file saved it: see `ckptool inspect FILE`")
    return text


def parse_pair(text: str, what: str) -> tuple[str, str]:
    left, sep, right = text.partition("=")
    if not sep or not left:
        example = "cuda:2=cuda:0" if what == "--map" else r"enc\.=encoder."
        raise UsageError(f"{what} needs the form A=B, got {text!r}", f"for example {example}")
    return left, right


def _find(root: Any, path: str) -> tuple[Any, Any, Any]:
    """(parent container, key in it, object) at a container path: a key as
    ckptool writes it, a name's own ``/`` and ``\\`` escaped (``ckptool.keys``)."""
    parent: Any = None
    key: Any = None
    obj = root
    for part in split_key(path):
        for raw_key, name, child in _keyed_children(obj):
            if name == part:
                parent, key, obj = obj, raw_key, child
                break
        else:
            raise UsageError(f"no entry {path!r} in this checkpoint",
                             "run `ckptool inspect FILE` to see the entries and their paths")
    return parent, key, obj


def _keyed_children(obj: Any) -> list[tuple[Any, str, Any]]:
    if isinstance(obj, dict):
        return [(k, name, v) for (name, v), k in zip(children(obj), obj, strict=True)]
    if isinstance(obj, list):
        return [(i, str(i), v) for i, v in enumerate(obj)]
    return [(None, name, v) for name, v in children(obj)]


def _replace(root: Any, parent: Any, key: Any, new: Any) -> Any:
    if parent is None:
        return new
    if isinstance(parent, (dict, list)):
        parent[key] = new
        return root
    raise UsageError("cannot change an entry inside a non-container object",
                     "extract or drop the container that holds it instead")


def _state_dict_of(obj: Any) -> Any:
    """A module (pickled nn.Module, TorchScript) as an OrderedDict of its
    tensors: what its ``state_dict()`` returns, ``_metadata`` included."""
    if module_kind(obj) is None:
        return obj
    sd: Any = OrderedDict(module_tensors(obj))
    meta = OrderedDict(module_metadata(obj))
    if meta:
        sd._metadata = meta
    return sd


def _rename_all(sd: Any, rename: Any) -> tuple[Any, list[tuple[str, str]]]:
    """A copy of ``sd`` with keys through ``rename``; ``_metadata`` follows."""
    new: Any = type(sd)() if isinstance(sd, OrderedDict) else {}
    changes = []
    for k, v in sd.items():
        nk = rename(k) if isinstance(k, str) else k
        if nk in new:
            raise UsageError(f"two keys would both become {nk!r}",
                             "check the prefixes and --rename patterns")
        new[nk] = v
        if nk != k:
            changes.append((k, nk))
    meta = getattr(sd, "__dict__", {}).get("_metadata")
    if meta is not None and isinstance(new, OrderedDict):
        # module paths in _metadata lose or gain the prefix like the keys;
        # "module" itself (the wrapper) becomes the root module ""
        renamed_meta: OrderedDict[Any, Any] = OrderedDict()
        for mk, mv in meta.items():
            # a module path is a key prefix without its dot: "lin" names "lin.*",
            # and the root "" names every key ("" + "model." is "model")
            nk = rename(f"{mk}." if mk else "").removesuffix(".") if isinstance(mk, str) else mk
            renamed_meta.setdefault(nk, mv)
        new._metadata = renamed_meta  # type: ignore[attr-defined]
    return new, changes


def key_function(opts: FixOptions, wrapper: str) -> Any:
    patterns = []
    for regex, repl in opts.renames:
        try:
            patterns.append((re.compile(regex), repl))
        except re.error as exc:
            raise UsageError(f"bad --rename pattern {regex!r}: {exc}",
                             "use a Python regular expression") from exc
    strip = ([wrapper] if opts.strip_module and wrapper else []) + list(opts.strip_prefixes)

    def rename(key: str) -> str:
        for prefix in strip:
            if prefix and key.startswith(prefix):
                key = key[len(prefix):]
        for pattern, repl in patterns:
            key = pattern.sub(repl, key)
        return (opts.add_prefix or "") + key

    return rename


def check_consistent(opts: FixOptions) -> None:
    """Options that contradict each other are refused, never settled silently."""
    if opts.to is not None and opts.maps:
        raise UsageError("--to moves every storage and --map only some: they conflict",
                         "use --to alone, or one --map per saved device")
    sources = [src for src, _ in opts.maps]
    twice = sorted({src for src in sources if sources.count(src) > 1})
    if twice:
        raise UsageError(f"--map gives {twice[0]} more than one target",
                         "one --map per saved device: --map SRC=DST")


def _check_extract_and_drops(plan: Plan, opts: FixOptions, extract: str | None) -> None:
    """A --drop that would remove what --extract keeps is an error; one
    outside it is left out anyway (noted)."""
    if extract is None:
        return
    for drop in opts.drop:
        if drop == extract or extract.startswith(drop + "/"):
            raise UsageError(f"--drop {drop} removes the entry --extract keeps ({extract})",
                             "drop entries inside it, or extract another one")
        if not drop.startswith(extract + "/") and extract != "":
            plan.notes.append(f"--drop {drop}: left out anyway, --extract keeps only "
                              f"{extract}")


def make_plan(ckpt: Checkpoint, opts: FixOptions) -> Plan:
    """Apply ``opts`` to ``ckpt.root`` (read faithfully); ``ckpt`` is its analysis."""
    check_consistent(opts)
    plan = Plan(ckpt.root)
    sd_main = ckpt.main_state_dict
    _check_extract_and_drops(plan, opts, (sd_main.path if sd_main else None)
                             if opts.extract == "auto" else opts.extract)
    for drop in opts.drop:
        parent, key, _ = _find(plan.root, drop)
        if parent is None or not isinstance(parent, (dict, list)):
            raise UsageError(f"cannot drop {drop!r}", "drop an entry of a dict or list")
        del parent[key]
        plan.dropped.append(drop)
    sd_info = ckpt.main_state_dict
    sd_path = sd_info.path if sd_info else None
    if opts.extract is not None:
        path: str | None = sd_path if opts.extract == "auto" else opts.extract
        if path is None:
            raise UsageError(f"nothing to extract: {why_no_weights(ckpt)}",
                             "name a dict to keep: --extract PATH (see `ckptool inspect`)")
        _, _, obj = _find(plan.root, path)
        plan.root = _state_dict_of(obj)
        plan.extracted = path
        sd_path = "" if path == sd_path else None
    if opts.changes_keys():
        if sd_path is None or sd_info is None:
            raise UsageError("no state dict to rename keys in",
                             "extract one first: --extract PATH")
        parent, key, sd = _find(plan.root, sd_path)
        if not isinstance(sd, dict):
            raise UsageError(
                f"'{sd_info.path or 'the file'}' is a whole pickled module, not a state dict",
                "add --extract to turn it into a state dict first")
        plan.rename = key_function(opts, sd_info.prefix)
        new_sd, plan.renames = _rename_all(sd, plan.rename)
        plan.root = _replace(plan.root, parent, key, new_sd)
        if opts.strip_module and not sd_info.prefix:
            plan.notes.append("--strip-module: no module./_orig_mod./model. prefix found")
    _plan_storages(plan, opts, ckpt)
    return plan


def _reachable(root: Any) -> Iterator[Any]:
    """Every object that writing ``root`` back would write, each once: what
    the output carries (storages) and what it would name (stand-in globals)."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if isinstance(obj, (str, bytes, int, float, type(None))) or id(obj) in seen:
            continue
        seen.add(id(obj))
        yield obj
        if isinstance(obj, (TensorRecord, CompositeTensor)):
            if isinstance(obj, TensorRecord):
                if obj.storage is not None:
                    stack.append(obj.storage)
                stack.extend((obj.extra or {}).values())  # its attributes, in either read
            if obj.origin is not None:
                stack.extend(obj.origin[1])
        elif isinstance(obj, dict):
            stack.extend([*obj.values(), *obj, *getattr(obj, "__dict__", {}).values()])
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, StandIn):
            stack.extend([*obj.args, *obj.kwargs.values(), obj.state, *obj.items,
                          *obj.dictitems, *obj.dictitems.values()])


def _survey(root: Any, unsafe: set[str]) -> tuple[dict[str, StorageRef], list[str]]:
    """The storages ``root`` carries, and which of the ``unsafe`` globals it
    names (a stand-in class, or an object made from one)."""
    storages: dict[str, StorageRef] = {}
    named = set()
    for obj in _reachable(root):
        if isinstance(obj, StorageRef):
            storages.setdefault(obj.key, obj)
            continue
        cls = obj if isinstance(obj, type) else type(obj)
        if issubclass(cls, StandIn):
            name = cls.qualname.split("()", 1)[0]  # x() was made by calling x
            if name in unsafe:
                named.add(name)
    return storages, sorted(named)


def _copied_unsafe(ckpt: Checkpoint) -> set[str]:
    """Unsafe globals in the pickles a rewrite copies as they are (a legacy
    file's header pickles), not rebuilt from the plan's tree."""
    copied = COPIED_PICKLES.get(ckpt.format, ())
    return {g.name for g in ckpt.globals
            if g.category == UNSAFE and any(w in copied for w in g.where)}


def _plan_storages(plan: Plan, opts: FixOptions, ckpt: Checkpoint) -> None:
    maps = dict(opts.maps)
    plan.storages, reached = _survey(plan.root, set(ckpt.unsafe_globals))
    plan.unsafe = sorted(set(reached) | _copied_unsafe(ckpt))
    used = plan.storages
    for sid, ref in used.items():
        tag = opts.to if opts.to is not None else maps.get(ref.location or "")
        if tag is not None and tag != ref.location:
            plan.retargets[sid] = tag
        if opts.dtype is not None and ref.dtype in CASTABLE and ref.dtype != opts.dtype:
            plan.casts[sid] = (ref.dtype, opts.dtype)
    for src in maps:
        if not any(r.location == src for r in used.values()):
            plan.notes.append(f"--map {src}=...: no storage is saved on {src}")
    if "meta" in {opts.to, *maps.values()} and plan.retargets:
        plan.notes.append("meta: the output's storages have no values; torch.load gives "
                          "tensors of the right shapes that hold nothing")


def new_pid(ref: StorageRef, plan: Plan, shared: dict[str, Any]) -> tuple[Any, ...]:
    """The persistent id ``ref`` is written with: its own, or retargeted/cast.

    ``shared`` holds one tag string and one storage type per value, so the
    pickle memo writes each once, as torch does."""
    pid = list(ref.pid or ())
    if ref.key in plan.retargets:
        tag = plan.retargets[ref.key]
        pid[3] = shared.setdefault(f"tag:{tag}", tag)
    if ref.key in plan.casts:
        dtype = plan.casts[ref.key][1]
        pid[1] = shared.setdefault(f"type:{dtype}", StorageType(_STORAGE_CLASS[dtype], dtype))
    return tuple(pid)
