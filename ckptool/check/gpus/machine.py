"""Which CUDA GPUs this machine has, which of them torch would see, and
which one a checkpoint should go to.

Owns the GPU probe: physical GPUs from NVML or ``nvidia-smi`` (``gpulist``,
asked only where a driver is there), the renumbering that
``CUDA_VISIBLE_DEVICES`` applies (parsed exactly like torch's
``torch.cuda._parse_visible_devices``), and what torch itself says it can
use. Pure and quiet: it never prints, never raises for a missing or broken
driver (the reason goes into ``Machine.note``), and imports torch only
after an NVIDIA driver was found, so a CPU-only machine never pays for it
(and never with ``ask_torch=False``).
It never creates a CUDA context (no ``mem_get_info``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from ckptool.check.gpus.listing import NO_DRIVER, NO_NVML, Gpu, query_nvml, query_smi

DRIVER_DIR = "/proc/driver/nvidia"  # present wherever the NVIDIA kernel driver is loaded
# the note's start where a driver is loaded but neither NVML nor nvidia-smi answers
UNLISTED = "an NVIDIA driver is loaded, but"
LISTERS = {"nvml": "NVML", "nvidia-smi": "nvidia-smi"}  # Machine.source -> its name in notes


@dataclass(frozen=True)
class Machine:
    gpus: tuple[Gpu, ...]  # visible GPUs in logical order (cuda:0, cuda:1, ...)
    cuda_available: bool  # torch.cuda.is_available() (False for a CPU build or no GPU)
    visible_env: str | None  # CUDA_VISIBLE_DEVICES as set, None when unset
    source: str  # "nvml", "nvidia-smi", "torch", "none" or "assumed"
    note: str  # why there are no GPUs, or caveats ("" if none)
    platform: str = sys.platform
    # every GPU the driver lists (NVML's or nvidia-smi's order), CUDA_VISIBLE_DEVICES
    # not applied; () when nothing lists them
    listed: tuple[Gpu, ...] = ()

    @property
    def device_count(self) -> int:
        """How many cuda:N torch can use here (0 when CUDA is unavailable)."""
        return len(self.gpus) if self.cuda_available else 0


def probe(ask_torch: bool = True) -> Machine:
    """This machine's GPUs as torch would number them. Never raises.

    ``ask_torch=False`` leaves torch out (not imported, ``cuda_available``
    False): the GPUs as the driver and ``CUDA_VISIBLE_DEVICES`` give them,
    for a new process that may run another torch (``devices --export``)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not os.path.exists(DRIVER_DIR) and shutil.which("nvidia-smi") is None:
        return Machine((), False, env, "none", NO_DRIVER)  # pynvml and torch never imported
    source, notes = "nvml", []
    physical, problem = query_nvml()
    if physical is None:
        nvml_absent = problem == NO_NVML
        if not nvml_absent:  # installed but failing: worth saying why smi was asked
            notes.append(f"{problem} (asked nvidia-smi instead)")
        source = "nvidia-smi"
        physical, problem = query_smi()
        if physical is None:
            return _without_smi(env, notes, nvml_absent, ask_torch)
        if problem:
            return Machine((), False, env, "none", "; ".join([*notes, problem]))
    listed = tuple(physical)
    visible, why = _parse(env, physical)
    if why:
        notes.append(why)
    lister = LISTERS[source]
    if not physical:
        notes.append(f"{lister} lists no GPUs")
    if not visible:
        return Machine((), False, env, source, "; ".join(notes), listed=listed)
    if len({g.name for g in physical}) > 1 and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        notes.append("these GPUs differ and CUDA_DEVICE_ORDER is not PCI_BUS_ID, so CUDA may "
                     "number them fastest first, not in nvidia-smi's order (set "
                     "CUDA_DEVICE_ORDER=PCI_BUS_ID to make the two agree)")
    if not ask_torch:
        return Machine(tuple(visible), False, env, source, "; ".join(notes), listed=listed)
    state = _torch_cuda()
    available = False
    if state is None:
        notes.append("torch is not installed here, so nothing can be loaded onto these GPUs")
    elif not state[0] and state[1] == 0:
        # the driver answers, so NVML works: a CUDA build of torch would count the GPUs
        notes.append("torch here is a CPU-only build, so torch.load cannot put anything "
                     "on a GPU")
    elif not state[0]:
        notes.append("torch here cannot initialise CUDA (is its CUDA newer than the "
                     "driver?), so torch.load cannot put anything on a GPU")
    else:
        available = True
        if state[1] != len(visible):
            notes.append(f"torch counts {state[1]} CUDA devices where {lister} and "
                         f"CUDA_VISIBLE_DEVICES give {len(visible)}; going by torch")
            visible = _resize(visible, state[1], lister)
    return Machine(tuple(visible), available, env, source, "; ".join(notes), listed=listed)


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


def _without_smi(env: str | None, notes: list[str], nvml_absent: bool,
                 ask_torch: bool) -> Machine:
    """Neither NVML nor nvidia-smi: ask torch, but only where a driver is
    loaded (so a CPU-only machine never imports torch) and torch may be
    asked (never for a new process's sake: the GPUs are then unknown)."""
    if not os.path.exists(DRIVER_DIR):
        return Machine((), False, env, "none", "; ".join([*notes, NO_DRIVER]))
    nvml = ("NVML cannot be asked (nvidia-ml-py is not installed)" if nvml_absent
            else "NVML failed")
    neither = f"{UNLISTED} {nvml} and nvidia-smi is not on PATH"
    if not ask_torch:
        return Machine((), False, env, "none", "; ".join([
            *notes, f"{neither}, so which GPUs are here is unknown (torch is not asked)"]))
    state = _torch_cuda()
    if state is None or not state[0] or state[1] <= 0:
        why = "torch is not installed" if state is None else "torch cannot use CUDA"
        return Machine((), False, env, "none", "; ".join([*notes, f"{neither}, and {why} here"]))
    return Machine(tuple(_torch_gpus(state[1])), True, env, "torch", "; ".join([
        *notes, f"{neither}: GPUs as torch numbers them, free memory unknown"]))


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


def _resize(gpus: list[Gpu], count: int, lister: str) -> list[Gpu]:
    """Torch's count wins: drop the extra GPUs, or add ones the driver did not list."""
    extra = [Gpu(i, None, f"unknown (not listed by {lister})", None, None, None)
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


def strtoul(text: str) -> int:
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
        n = strtoul(entry.strip())
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
