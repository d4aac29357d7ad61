"""Which CUDA GPUs this machine has, which of them torch would see, and
which one a checkpoint should go to.

Owns the GPU probe: physical GPUs from ``nvidia-smi``, the renumbering that
``CUDA_VISIBLE_DEVICES`` applies (parsed exactly like torch's
``torch.cuda._parse_visible_devices``), and what torch itself says it can
use. Pure and quiet: it never prints, never raises for a missing or broken
driver (the reason goes into ``Machine.note``), and imports torch only
after an NVIDIA driver was found, so a CPU-only machine never pays for it.
It never creates a CUDA context (no ``mem_get_info``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

SMI_QUERY = ("--query-gpu=index,name,uuid,memory.total,memory.free",
             "--format=csv,noheader,nounits")
SMI_TIMEOUT_S = 10.0
DRIVER_DIR = "/proc/driver/nvidia"  # present wherever the NVIDIA kernel driver is loaded
_MIB = 1024 * 1024


@dataclass(frozen=True)
class Gpu:
    index: int  # logical index: torch's cuda:<index>
    physical: int | None  # nvidia-smi's index (PCI bus order); None if unknown
    name: str
    uuid: str | None
    total_bytes: int | None
    free_bytes: int | None  # None when unknown


@dataclass(frozen=True)
class Machine:
    gpus: tuple[Gpu, ...]  # visible GPUs in logical order (cuda:0, cuda:1, ...)
    cuda_available: bool  # torch.cuda.is_available() (False for a CPU build or no GPU)
    visible_env: str | None  # CUDA_VISIBLE_DEVICES as set, None when unset
    source: str  # "nvidia-smi", "torch", "none" or "assumed"
    note: str  # why there are no GPUs, or caveats ("" if none)
    platform: str = sys.platform

    @property
    def device_count(self) -> int:
        """How many cuda:N torch can use here (0 when CUDA is unavailable)."""
        return len(self.gpus) if self.cuda_available else 0


def probe() -> Machine:
    """This machine's GPUs as torch would number them. Never raises."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical, problem = _query_smi()
    if physical is None:
        return _without_smi(env)
    if problem:
        return Machine((), False, env, "none", problem)
    visible, why = _parse(env, physical)
    notes = [why] if why else []
    if not physical:
        notes.append("nvidia-smi lists no GPUs")
    if not visible:
        return Machine((), False, env, "nvidia-smi", "; ".join(notes))
    if len({g.name for g in physical}) > 1 and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        notes.append("these GPUs differ and CUDA_DEVICE_ORDER is not PCI_BUS_ID, so CUDA may "
                     "number them fastest first, not in nvidia-smi's order (set "
                     "CUDA_DEVICE_ORDER=PCI_BUS_ID to make the two agree)")
    state = _torch_cuda()
    available = False
    if state is None:
        notes.append("torch is not installed here, so nothing can be loaded onto these GPUs")
    elif not state[0] and state[1] == 0:
        # nvidia-smi works, so NVML does: a CUDA build of torch would count the GPUs
        notes.append("torch here is a CPU-only build, so torch.load cannot put anything "
                     "on a GPU")
    elif not state[0]:
        notes.append("torch here cannot initialise CUDA (is its CUDA newer than the "
                     "driver?), so torch.load cannot put anything on a GPU")
    else:
        available = True
        if state[1] != len(visible):
            notes.append(f"torch counts {state[1]} CUDA devices where nvidia-smi and "
                         f"CUDA_VISIBLE_DEVICES give {len(visible)}; going by torch")
            visible = _resize(visible, state[1])
    return Machine(tuple(visible), available, env, "nvidia-smi", "; ".join(notes))


def assumed(count: int) -> Machine:
    """A hypothetical Linux machine with ``count`` visible CUDA GPUs, memory unknown."""
    gpus = tuple(Gpu(i, None, "assumed GPU", None, None, None) for i in range(count))
    noun = "GPU" if count == 1 else "GPUs"
    return Machine(gpus, count > 0, None, "assumed",
                   f"an assumed Linux machine with {count} CUDA {noun}, memory unknown",
                   platform="linux")


def parse_visible(value: str | None, physical: Sequence[Gpu]) -> list[Gpu]:
    """The GPUs CUDA shows for ``CUDA_VISIBLE_DEVICES=value``, renumbered cuda:0, 1...

    ``physical`` are all the machine's GPUs (nvidia-smi's order). Follows
    torch's ``_parse_visible_devices``: a comma list of integers read like
    ``strtoul`` (``1gpu2`` is 1), of ``GPU-`` UUID prefixes, or of ``MIG-``
    UUIDs; a negative or unreadable entry, or one that names no GPU, ends the
    list; a repeated entry hides every GPU; unset shows them all.
    """
    return _parse(value, physical)[0]


def pick(machine: Machine, need_bytes: int) -> Gpu | None:
    """The usable GPU with the most free memory (lowest index on ties).

    None when torch can use no GPU here. Free memory unknown ranks below any
    known amount, then by total memory. The GPU with most room is the best
    bet whatever ``need_bytes`` is; ``fits`` says whether it is enough.
    """
    usable = machine.gpus[:machine.device_count]
    if not usable:
        return None
    return max(usable, key=lambda g: (g.free_bytes is not None, g.free_bytes or 0,
                                      g.total_bytes or 0, -g.index))


def fits(gpu: Gpu, need_bytes: int) -> bool | None:
    """Whether ``need_bytes`` fit in the GPU's free memory; None when unknown."""
    return None if gpu.free_bytes is None else gpu.free_bytes >= need_bytes


def _query_smi() -> tuple[list[Gpu] | None, str]:
    """(physical GPUs, "") from nvidia-smi; (None, why) when it is missing,
    ([], why) when it fails or says something we cannot read."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, "no NVIDIA driver found (nvidia-smi is not on PATH)"
    try:
        proc = subprocess.run([smi, *SMI_QUERY], capture_output=True, text=True,
                              timeout=SMI_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return [], f"nvidia-smi did not answer within {SMI_TIMEOUT_S:g} s"
    except OSError as exc:
        return [], f"nvidia-smi could not run: {exc.strerror or exc}"
    if proc.returncode != 0:
        return [], f"nvidia-smi failed (exit {proc.returncode}): {_first_line(proc)}"
    gpus = []
    for line in proc.stdout.splitlines():
        if not line.strip():
            continue
        gpu = _smi_row(line)
        if gpu is None:
            return [], f"nvidia-smi printed what ckptool cannot read: {line.strip()!r}"
        gpus.append(gpu)
    return gpus, ""


def _smi_row(line: str) -> Gpu | None:
    fields = [f.strip() for f in line.split(",")]
    if len(fields) < 5 or not fields[0].isdigit():
        return None
    index = int(fields[0])
    name = ", ".join(fields[1:-3])  # a name with a comma stays whole
    uuid = fields[-3] if fields[-3].startswith(("GPU-", "MIG-")) else None
    return Gpu(index, index, name, uuid, _mib(fields[-2]), _mib(fields[-1]))


def _mib(text: str) -> int | None:
    return int(text) * _MIB if text.isdigit() else None  # "[N/A]" on some boards


def _first_line(proc: subprocess.CompletedProcess[str]) -> str:
    for text in (proc.stderr, proc.stdout):
        for line in text.splitlines():
            if line.strip():
                return line.strip()
    return "no message"


def _without_smi(env: str | None) -> Machine:
    """No nvidia-smi: ask torch, but only where a driver is loaded, so a
    CPU-only machine never imports torch."""
    if not os.path.exists(DRIVER_DIR):
        return Machine((), False, env, "none",
                       "no NVIDIA driver found (nvidia-smi is not on PATH)")
    state = _torch_cuda()
    if state is None or not state[0] or state[1] <= 0:
        why = "torch is not installed" if state is None else "torch cannot use CUDA"
        return Machine((), False, env, "none", "an NVIDIA driver is loaded but nvidia-smi "
                       f"is not on PATH and {why} here")
    return Machine(tuple(_torch_gpus(state[1])), True, env, "torch",
                   "nvidia-smi is not on PATH: GPUs as torch numbers them, free memory unknown")


def _torch_cuda() -> tuple[bool, int] | None:
    """(torch.cuda.is_available(), torch.cuda.device_count()); None without torch."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.is_available(), torch.cuda.device_count()


def _torch_gpus(count: int) -> list[Gpu]:
    import torch

    gpus = []
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        uuid = getattr(props, "uuid", None)
        gpus.append(Gpu(i, None, str(props.name), f"GPU-{uuid}" if uuid else None,
                        int(props.total_memory), None))
    return gpus


def _resize(gpus: list[Gpu], count: int) -> list[Gpu]:
    """Torch's count wins: drop the extra GPUs, or add ones nvidia-smi did not show."""
    extra = [Gpu(i, None, "unknown (not listed by nvidia-smi)", None, None, None)
             for i in range(len(gpus), count)]
    return gpus[:count] + extra


def _parse(value: str | None, physical: Sequence[Gpu]) -> tuple[list[Gpu], str]:
    """parse_visible, plus what CUDA_VISIBLE_DEVICES hid and why ("" if nothing)."""
    if value is None:
        return [dataclasses.replace(g, index=i) for i, g in enumerate(physical)], ""
    shown = f'CUDA_VISIBLE_DEVICES="{value}"'
    entries = value.split(",")
    if value.startswith(("GPU-", "MIG-")):
        chosen, stop = _by_uuid(entries, value[:4], physical)
    else:
        chosen, stop = _by_ordinal(entries, physical)
    if chosen is None:
        return [], f"{shown} repeats a device, so CUDA shows none"
    visible = [dataclasses.replace(g, index=i) for i, g in enumerate(chosen)]
    why = (f'"{stop}" names no GPU here, so CUDA ignores it and every entry after it'
           if stop is not None else "")
    real = {g.physical for g in physical if g.physical is not None}
    hidden = len(real - {g.physical for g in visible})
    if real and not visible:
        hides = "the only GPU" if len(real) == 1 else f"all {len(real)} GPUs"
    elif hidden and not any(g.physical is None for g in visible):
        hides = f"{hidden} of {len(real)} GPUs"
    else:
        return visible, f"{shown}: {why}" if why else ""
    return visible, f"{shown} hides {hides}" + (f": {why}" if why else "")


def _strtoul(text: str) -> int:
    """The leading integer of ``text``, -1 when there is none (as torch reads it)."""
    end = 0
    while end < len(text) and (text[end].isdigit() or (end == 0 and text[end] in "+-")):
        end += 1
    try:
        return int(text[:end])
    except ValueError:  # "", "-", "+x": torch would raise here; CUDA stops the list
        return -1


def _by_ordinal(entries: list[str], physical: Sequence[Gpu]
                ) -> tuple[list[Gpu] | None, str | None]:
    """(GPUs named, entry the list stopped at); (None, None) for a repeat."""
    by_index = {(g.physical if g.physical is not None else i): g
                for i, g in enumerate(physical)}
    ordinals: list[int] = []
    stop: str | None = None
    for entry in entries:
        n = _strtoul(entry.strip())
        if n in ordinals:
            return None, None
        if n < 0:
            # a lone "-1" or a trailing comma is deliberate: no need to explain it
            if len(entries) > 1 and any(e.strip() for e in entries[len(ordinals):]):
                stop = entry.strip()
            break
        ordinals.append(n)
    chosen: list[Gpu] = []
    for n in ordinals:
        if n not in by_index:  # like torch's NVML count: the first unknown ends it
            return chosen, str(n)
        chosen.append(by_index[n])
    return chosen, stop


def _by_uuid(entries: list[str], prefix: str, physical: Sequence[Gpu]
             ) -> tuple[list[Gpu] | None, str | None]:
    """GPU-/MIG- entries: a GPU UUID may be given by any unambiguous prefix;
    MIG instances are not listed by nvidia-smi's GPU query, so they stay
    unresolved (physical None) and torch's own count has the last word."""
    seen: list[str] = []
    for entry in entries:
        if entry in seen:
            return None, None
        if not entry.startswith(prefix):
            break
        seen.append(entry)
    if prefix == "MIG-":
        return [Gpu(0, None, "MIG instance", e, None, None) for e in seen], None
    chosen: list[Gpu] = []
    for entry in seen:
        found = [g for g in physical if g.uuid is not None and g.uuid.startswith(entry)]
        if len(found) != 1:  # unknown or ambiguous: CUDA stops here
            return chosen, entry
        if found[0] in chosen:
            return None, None
        chosen.append(found[0])
    stop = entries[len(seen)] if len(seen) < len(entries) else None
    return chosen, stop


def describe_machine(machine: Machine) -> str:
    if machine.source == "assumed":
        n = machine.device_count
        return f"a machine with {n} visible CUDA GPU{'s' if n != 1 else ''}"
    if not machine.device_count:
        return "this machine (no usable CUDA GPU)"
    n = machine.device_count
    return f"this machine ({n} visible CUDA GPU{'s' if n != 1 else ''})"


def describe_target(machine: Machine) -> str:
    """The machine a diagnosis was made for, with what was noticed about it."""
    target = describe_machine(machine)
    if machine.note and machine.source != "assumed":
        target += f"; {machine.note}"
    return target
