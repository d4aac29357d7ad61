"""What a plain ``torch.load(path)`` will do on a target machine, predicted
from metadata alone: where each saved location tag lands or the exact
error torch raises for it, and which globals ``weights_only=True`` (the
default since torch 2.6) refuses.

The error texts and the allowlist mirror torch 2.13's ``serialization.py``
and ``_weights_only_unpickler.py``; tests check both against the real
thing. Nothing here imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata

from ckptool import dtypes
from ckptool.check.gpus.machine import Machine
from ckptool.describe import human_bytes
from ckptool.model import NO_LOCATION, Checkpoint

_CPU_HINT = ("If you are running on a CPU-only machine, please use torch.load with "
             "map_location=torch.device('cpu') to map your storages to the CPU.")
_TAG = re.compile(r"^([a-z][a-z0-9_]*?)(?::?(\d+))?$")
# backends torch registers a deserializer for, besides cpu, mps and meta
_BACKENDS = ("cuda", "privateuseone", "hpu", "xpu", "mtia")
# of those, the ones whose device module exists in every torch build
_MODULES = frozenset({"cuda", "xpu", "mtia"})


@dataclass(frozen=True)
class TagLoad:
    """One saved location tag and what plain ``torch.load`` does with it."""

    location: str  # "cuda:2", "cpu", "mps"; "unrecorded" for safetensors
    tensors: int
    nbytes: int
    lands: str | None  # the device its storages land on, None when loading fails
    error: str | None  # torch's RuntimeError text when loading fails
    physical: int | None = None  # physical GPU behind a cuda tag, when renumbered


def restore_error(location: str, machine: Machine) -> tuple[str | None, str | None]:
    """(device it lands on, None) or (None, torch's error text) for one tag."""
    if location == "cpu" or location == "meta":
        return location, None
    if location.startswith("mps"):
        if machine.platform == "darwin":
            return "mps", None
        return None, "torch.UntypedStorage(): Storage device not recognized: mps"
    match = _TAG.match(location)
    backend = match.group(1) if match else ""
    if backend not in _BACKENDS:
        return None, ("don't know how to restore data location of "
                      f"torch.storage.UntypedStorage (tagged with {location})")
    if backend not in _MODULES:
        return None, f"The {backend.upper()} device module is not registered. {_CPU_HINT}"
    if backend != "cuda" or not machine.cuda_available:
        return None, (f"Attempting to deserialize object on a {backend.upper()} device but "
                      f"torch.{backend}.is_available() is False. {_CPU_HINT}")
    index = int(match.group(2)) if match and match.group(2) else 0
    if index >= machine.device_count:
        return None, (f"Attempting to deserialize object on CUDA device {index} but "
                      f"torch.cuda.device_count() is {machine.device_count}. Please use "
                      "torch.load with map_location to map your storages to an existing "
                      "device.")
    return f"cuda:{index}", None


def missing_devices(machine: Machine, locations: Iterable[str]) -> list[str]:
    """The saved device tags (``cuda:2``, ``mps``) that torch.load cannot
    restore on this machine without ``map_location``."""
    return [tag for tag in locations
            if tag != "unrecorded" and restore_error(tag, machine)[1] is not None]


def plan_tags(ckpt: Checkpoint, machine: Machine) -> list[TagLoad]:
    """Every saved tag in the order torch meets them (storage order), with
    its tensor count, bytes, and where it lands or why it fails."""
    counts, sizes = ckpt.tensors_by_location, ckpt.bytes_by_location
    met = [s.location or NO_LOCATION for s in ckpt.storages.values()]  # storage order
    out = []
    for tag in dict.fromkeys([*met, *counts]):
        if tag == NO_LOCATION:  # safetensors: the loader picks the device (cpu by default);
            # DCP: the state dict passed to dcp.load does (none here to say where)
            lands = None if ckpt.format == "dcp" else "cpu"
            out.append(TagLoad(tag, counts.get(tag, 0), sizes.get(tag, 0), lands, None))
            continue
        lands, error = restore_error(tag, machine)
        physical = None
        if lands and lands.startswith("cuda:"):
            gpu = machine.gpus[int(lands[5:])]
            physical = gpu.physical if gpu.physical != gpu.index else None
        out.append(TagLoad(tag, counts.get(tag, 0), sizes.get(tag, 0), lands, error, physical))
    return out


def bytes_per_gpu(loads: list[TagLoad]) -> dict[int, int]:
    """Bytes a plain load would put on each logical GPU."""
    out: dict[int, int] = {}
    for load in loads:
        if load.lands and load.lands.startswith("cuda:"):
            index = int(load.lands[5:])
            out[index] = out.get(index, 0) + load.nbytes
    return out


# -- weights_only ---------------------------------------------------------

_ALLOWED = frozenset({
    "collections.OrderedDict", "collections.Counter", "torch.nn.parameter.Parameter",
    "torch.serialization._get_layout", "torch.Size", "torch.Tensor", "torch.device",
    "_codecs.encode", "builtins.bytearray", "builtins.set", "builtins.complex",
    "torch.storage.TypedStorage", "torch.storage.UntypedStorage",
    "torch._tensor._rebuild_from_type_v2",
    "torch.per_tensor_affine", "torch.per_tensor_symmetric", "torch.per_channel_affine",
    "torch.per_channel_symmetric", "torch.per_channel_affine_float_qparams",
    "torch.bits1x8", "torch.bits2x4", "torch.bits4x2", "torch.bits8", "torch.bits16",
    "torch.qint8", "torch.qint32", "torch.quint8", "torch.quint4x2", "torch.quint2x4",
    "torch.complex32",
})
_REBUILDS = frozenset({
    "_rebuild_parameter", "_rebuild_parameter_with_state", "_rebuild_qtensor",
    "_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_sparse_tensor",
    "_rebuild_meta_tensor_no_storage", "_rebuild_nested_tensor", "_rebuild_wrapper_subclass",
    "_rebuild_device_tensor_from_numpy", "_rebuild_device_tensor_from_cpu_tensor",
})
_LEGACY_CLASS = re.compile(
    r"^torch\.(cuda\.)?(Byte|Char|Short|Int|Long|Half|Float|Double|BFloat16|Bool)"
    r"(Storage|Tensor)$|^torch\.(cuda\.)?sparse\.(Byte|Char|Short|Int|Long|Half|Float|Double"
    r"|BFloat16)Tensor$|^torch\.(ComplexFloat|ComplexDouble|QInt8|QInt32|QUInt8|QUInt4x2"
    r"|QUInt2x4)Storage$|^torch\.cuda\.Complex(Float|Double)Storage$")
_SMALL_INTS = re.compile(r"^torch\.u?int[1-7]$")


def weights_only_allows(name: str) -> bool:
    """Whether torch's ``weights_only`` unpickler accepts global ``name`` by default."""
    if name in _ALLOWED or _LEGACY_CLASS.match(name) or _SMALL_INTS.match(name):
        return True
    module, _, attr = name.rpartition(".")
    if module == "torch._utils":
        return attr in _REBUILDS
    return module == "torch" and attr in dtypes.ITEMSIZE


def refused_globals(ckpt: Checkpoint) -> list[str]:
    """Globals the file names that plain ``torch.load`` (weights_only) refuses.
    None for DCP: its loader reads ``.metadata`` and its values without weights_only."""
    if ckpt.format == "dcp":
        return []
    return [g.name for g in ckpt.globals if not weights_only_allows(g.name)]


def weights_only_default() -> bool:
    """Whether plain ``torch.load`` here means ``weights_only=True`` (torch >= 2.6,
    or no torch installed: ckptool advises for current torch)."""
    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return True
    numbers = re.findall(r"\d+", version)[:2]
    return tuple(int(n) for n in numbers) >= (2, 6)


def describe_landing(machine: Machine, tag: TagLoad) -> str:
    """Where plain ``torch.load`` puts a saved device's tensors (a GPU with its
    physical number and free memory), or "-" (a tag whose load fails has its
    error instead: callers say so)."""
    if tag.lands and tag.lands.startswith("cuda:"):
        gpu = machine.gpus[int(tag.lands[5:])]
        extra = f" (physical GPU {tag.physical})" if tag.physical is not None else ""
        free = f" · {human_bytes(gpu.free_bytes)} free" if gpu.free_bytes is not None else ""
        return f"{tag.lands}{extra}{free}"
    return tag.lands or "-"
