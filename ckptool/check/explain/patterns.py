"""The errors of loading and placing a model, as torch words them: the
patterns ``explain_scan`` looks for in pasted text or a log, and what each
match gives (the first half of ``ckptool explain``; ``explain_findings``
says what each error means and what to do).

Each pattern is a wording of torch 1.x to 2.13 (copied from torch's own
source) with a reader that turns a match into facts: device index and
count, key names, shapes, globals, memory sizes. A pattern that ``opens``
begins an error; one that does not is a further line of the error before
it (the missing, unexpected and size-mismatch lines under one ``Error(s)
in loading state_dict``; the ``Unsupported global`` under ``Weights only
load failed``). Every pattern opens with literal text, which the regular
expression engine searches for fast, and none backtracks over a long line.
Pure text: no torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# kinds of error; each becomes findings of the codes explain_findings gives it
DEVICE = "device-unavailable"
KEYS = "state-dict"
WEIGHTS = "weights-only"
INVALID_ID = "invalid-device-id"
PRIMARY = "dataparallel-primary-device"
MISMATCH = "device-mismatch"
OOM = "cuda-oom"

_SIZE = r"[\d.]+ (?:[KMGT]iB|B|bytes)"
_UNITS = {"B": 1, "bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
Facts = dict[str, Any]
Reader = Callable[[re.Match[str], str], "Facts | None"]


@dataclass(slots=True)
class Error:
    """One error found in the text."""

    kind: str
    start: int  # where it begins in the normalised text
    end: int
    line: str  # the line that states it, as written ("RuntimeError: ..."); the last error's only
    facts: Facts = field(default_factory=dict)


# (kind, pattern, opens, reader), in the order registered
PATTERNS: list[tuple[str, re.Pattern[str], bool, Reader]] = []


def _pattern(kind: str, regex: str, opens: bool = True) -> Callable[[Reader], Reader]:
    """Register a reader of ``regex``'s matches; ``opens``: the match begins
    an error (else it is a further line of the error before it)."""
    def register(reader: Reader) -> Reader:
        PATTERNS.append((kind, re.compile(regex), opens, reader))
        return reader
    return register


def size_bytes(text: str) -> int:
    """``2.00 GiB`` (torch's ``format_size``) in bytes."""
    number, unit = text.split()
    return int(float(number) * _UNITS[unit])


def _ints(text: str) -> list[int]:
    return [int(n) for n in text.replace(",", " ").split()]


# -- torch.load: a saved device this process does not have ---------------------

@_pattern(DEVICE, r"Attempting to deserialize object on (?:an? )?(\w+) device(?: (\d+))?"
                  r"(?: but torch\.\w+\.(?:device_count\(\) is (\d+)|is_available\(\) is False))?")
def _deserialize(m: re.Match[str], text: str) -> Facts:
    backend, index, count = m.group(1).lower(), m.group(2), m.group(3)
    facts: Facts = {"device": f"{backend}:{index}" if index else backend, "backend": backend}
    if index:
        facts["device_index"] = int(index)
    if count is not None or "is_available() is False" in m.group(0):
        facts["device_count"] = int(count or 0)
    return facts


@_pattern(DEVICE, r"The (\w+) device module is not registered")
def _unregistered(m: re.Match[str], text: str) -> Facts:
    backend = m.group(1).lower()
    return {"device": backend, "backend": backend, "device_count": 0}


@_pattern(DEVICE, r"Storage device not recognized: ([\w:]+)")
@_pattern(DEVICE, r"don't know how to restore data location of \S+ \(tagged with ([^)\s]+)\)")
def _unknown_device(m: re.Match[str], text: str) -> Facts:
    device = m.group(1)
    return {"device": device, "backend": device.split(":")[0]}


# -- load_state_dict: keys and shapes ------------------------------------------

@_pattern(KEYS, r"Error\(s\) in loading state_dict for ([\w.]+):")
def _state_dict(m: re.Match[str], text: str) -> Facts:
    return {"model_class": m.group(1)}


# torch writes each key as "key" joined by ", " and ends the list with ". ":
# a key may hold a quote ("a"b.c"), so the list is split on the separator
_KEY_LIST = r'key\(s\) in state_dict: "(.*?)(?:"\. |"\.?[ \t]*$)'


@_pattern(KEYS, rf"(?m)Missing {_KEY_LIST}", opens=False)
@_pattern(KEYS, rf"(?m)Unexpected {_KEY_LIST}", opens=False)
def _keys(m: re.Match[str], text: str) -> Facts:
    return {m.group(0).partition(" ")[0].lower(): m.group(1).split('", "')}


@_pattern(KEYS, r"size mismatch for (\S+?): copying a param (?:with shape|of) "
                r"torch\.Size\(\[([\d, ]*)\]\) from checkpoint, (?:the shape in current model is"
                r"|where the shape is) torch\.Size\(\[([\d, ]*)\]\)", opens=False)
def _size_mismatch(m: re.Match[str], text: str) -> Facts:
    return {"mismatched": [{"key": m.group(1), "checkpoint": _ints(m.group(2)),
                            "model": _ints(m.group(3))}]}


# -- torch.load(weights_only=True) refusing what the file names ----------------

@_pattern(WEIGHTS, r"Weights only load failed")
def _weights_only(m: re.Match[str], text: str) -> Facts:
    return {}


# one pattern per wording, each opening with its literal text (searched for fast)
@_pattern(WEIGHTS, r"Unsupported (?:global: GLOBAL ([\w.]+) was not an allowed global"
                   r"|class ([\w.]+))", opens=False)
@_pattern(WEIGHTS, r"unrecognized function <(?:class '([\w.]+)'|(?:built-in )?function ([\w.]+))",
          opens=False)
@_pattern(WEIGHTS, r"allowlisted via `add_safe_globals`,? but got <class '([\w.]+)'>",
          opens=False)
def _refused_global(m: re.Match[str], text: str) -> Facts:
    return {"globals": [next(g for g in m.groups() if g)]}


@_pattern(WEIGHTS, r"Trying to load unsupported GLOBAL ([\w.]+) whose module [\w.]+ is blocked",
          opens=False)
def _blocked_global(m: re.Match[str], text: str) -> Facts:
    return {"globals": [m.group(1)], "blocked": [m.group(1)]}


@_pattern(WEIGHTS, r"Cannot use ``weights_only=True`` with TorchScript archives")
def _torchscript(m: re.Match[str], text: str) -> Facts:
    return {"torchscript": True}


# -- GPUs: indices, DataParallel's first device, tensors on two devices ---------

# no \b in front: a pattern that opens with a literal is searched for fast
@_pattern(INVALID_ID, r"Invalid device id\b")
@_pattern(INVALID_ID, r"CUDA error: invalid device ordinal")
def _invalid_id(m: re.Match[str], text: str) -> Facts | None:
    before = text[m.start() - 1:m.start()]
    return None if before.isalnum() or before == "_" else {}


@_pattern(PRIMARY, r"module must have its parameters and buffers on device (\S+) "
                   r"\(device_ids\[0\]\) but found one of them on device: ([\w:]+)")
def _primary(m: re.Match[str], text: str) -> Facts:
    return {"primary_device": m.group(1), "found_device": m.group(2)}


@_pattern(MISMATCH, r"Expected all tensors to be on the same device, but found at least two "
                    r"devices, ([\w:]+) and ([\w:]+)!(?: \(when checking argument for argument "
                    r"(\w+) in method (\w+)\))?")
def _two_devices(m: re.Match[str], text: str) -> Facts:
    return _mismatch(m.group(1), m.group(2), m.group(3), m.group(4))


@_pattern(MISMATCH, r"Expected all tensors to be on the same device, but got (\w+) is on "
                    r"([\w:]+), different from other tensors on ([\w:]+?)"
                    r"(?: \(when checking argument in method (\w+)\))?(?=[\s.]|$)")
def _other_devices(m: re.Match[str], text: str) -> Facts:
    return _mismatch(m.group(3), m.group(2), m.group(1), m.group(4))


@_pattern(MISMATCH, r"Expected all tensors to be on the same device\. (\w+):? expected '(\w+)' "
                    r"to be (?:a )?CPU tensor, but got tensor on ([\w:]+)")
def _cpu_kernel(m: re.Match[str], text: str) -> Facts:
    return _mismatch("cpu", m.group(3), m.group(2), m.group(1))


@_pattern(MISMATCH, r"Expected object of device type (\w+) but got device type (\w+) for "
                    r"argument #\d+ '(\w+)'")
def _device_type(m: re.Match[str], text: str) -> Facts:
    return _mismatch(m.group(1), m.group(2), m.group(3), None)


@_pattern(MISMATCH, r"Input type \(([\w.]+)\) and weight type \(([\w.]+)\) should be the same")
def _conv_types(m: re.Match[str], text: str) -> Facts | None:
    on = ["cuda" if ".cuda." in t else "cpu" for t in m.groups()]
    if on[0] == on[1]:  # a dtype mismatch (HalfTensor vs FloatTensor): not about devices
        return None
    return _mismatch(on[1], on[0], "input", None)


def _mismatch(expected: str, got: str, argument: str | None, operation: str | None) -> Facts:
    facts: Facts = {"devices": [expected, got]}
    if argument:
        facts["argument"] = argument
    if operation:
        facts["operation"] = operation
    return facts


# -- CUDA out of memory -----------------------------------------------------------

@_pattern(OOM, rf"CUDA (?:out of memory\.(?: Tried to allocate ({_SIZE}))?|error: out of memory)")
def _oom(m: re.Match[str], text: str) -> Facts:
    facts: Facts = {}
    if m.group(1):
        facts["requested"] = m.group(1)
    rest = text[m.end():m.end() + 1000].split("out of memory")[0]
    old = re.search(rf"\(GPU (\d+); ({_SIZE}) total capacity; (?:{_SIZE}) already allocated; "
                    rf"({_SIZE}) free", rest)
    new = re.search(rf"GPU (\d+) has a total capacity of ({_SIZE}) of which ({_SIZE}) is free",
                    rest)
    found = old or new
    if found:
        facts.update(gpu=int(found.group(1)), total=found.group(2), free=found.group(3))
    setting = re.search(r"(PYTORCH_(?:CUDA_)?ALLOC_CONF)=expandable_segments:True", rest)
    if setting:
        facts["alloc_conf"] = f"{setting.group(1)}=expandable_segments:True"
    for name in ("requested", "total", "free"):
        if name in facts:
            facts[f"{name}_bytes"] = size_bytes(facts[name])
    return facts
