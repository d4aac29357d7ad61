"""The ``--json`` schema of ``ckptool devices``, and the advice it gives:
which device a checkpoint should be loaded onto here, and how.

Pure data in (a ``gpus.Machine``, optionally a Checkpoint), plain dicts and
strings out, so the human view and the JSON say the same thing.
``SCHEMA_VERSION`` changes only when a field changes meaning or goes away.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from dataclasses import dataclass
from typing import Any

from ckptool.check.gpus import Gpu, Machine, fits, pick
from ckptool.check.loadcheck import missing_devices
from ckptool.model import Checkpoint

SCHEMA_VERSION = 1

# formats whose saved devices `ckptool fix --to` can rewrite
_RETARGETABLE = ("torch-zip", "torch-legacy")


def gpu_dict(g: Gpu) -> dict[str, Any]:
    return {"index": g.index, "physical": g.physical, "name": g.name, "uuid": g.uuid,
            "total_bytes": g.total_bytes, "free_bytes": g.free_bytes}


@dataclass(frozen=True)
class Advice:
    """Where to load a checkpoint here; for the CPU every other field is None."""

    device: str  # "cuda:N" (logical) or "cpu"
    physical: int | None
    free_bytes: int | None
    need_bytes: int | None
    fits: bool | None  # None when free memory is unknown


def recommend(machine: Machine, ckpt: Checkpoint) -> Advice:
    """The GPU with most free memory, else the CPU."""
    need = ckpt.total_bytes
    gpu = pick(machine, need)
    if gpu is None:
        return Advice("cpu", None, None, None, None)
    return Advice(f"cuda:{gpu.index}", gpu.physical, gpu.free_bytes, need, fits(gpu, need))


def load_snippet(ckpt: Checkpoint, device: str) -> str:
    """The Python line that loads ``ckpt`` onto ``device``."""
    path = json.dumps(ckpt.path)  # a valid Python string literal, quotes escaped
    if ckpt.format == "safetensors":
        return f'safetensors.torch.load_file({path}, device="{device}")'
    if ckpt.format == "torchscript":
        return f'torch.jit.load({path}, map_location="{device}")'
    return f'torch.load({path}, map_location="{device}")'


def fix_command(ckpt: Checkpoint, device: str) -> str | None:
    """``ckptool fix CKPT --to DEVICE``, when it applies to this file: a torch
    file that records a device, and (for the CPU) has tensors saved elsewhere."""
    if ckpt.format not in _RETARGETABLE:
        return None
    if device == "cpu" and not [loc for loc in ckpt.locations if loc != "cpu"]:
        return None
    return f"ckptool fix {shlex.quote(ckpt.path)} --to {device}"


def devices_dict(machine: Machine, ckpt: Checkpoint | None = None) -> dict[str, Any]:
    """The ``devices --json`` schema."""
    return {
        "schema_version": SCHEMA_VERSION,
        "source": machine.source,
        "cuda_visible_devices": machine.visible_env,
        "cuda_available": machine.cuda_available,
        "device_count": machine.device_count,
        "note": machine.note,
        "gpus": [gpu_dict(g) for g in machine.gpus],
        "checkpoint": None if ckpt is None else {
            "path": ckpt.path, "nbytes": ckpt.total_bytes, "locations": ckpt.locations,
            "missing_devices": missing_devices(machine, ckpt.locations),
        },
        "recommended": None if ckpt is None else dataclasses.asdict(recommend(machine, ckpt)),
    }
