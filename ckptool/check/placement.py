"""Where to load a checkpoint on this machine, and how: the GPU with the
most free memory (else the CPU), the line of Python that loads it there,
and the ``ckptool fix --to`` command that makes a plain ``torch.load`` do it.

Pure data in (a ``gpus.Machine`` and a Checkpoint), plain data out, so the
text and the JSON of ``ckptool devices`` say the same thing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ckptool.check.gpus.machine import Machine, fits, pick
from ckptool.describe import shell_word
from ckptool.model import Checkpoint

# formats whose saved devices `ckptool fix --to` can rewrite
_RETARGETABLE = ("torch-zip", "torch-legacy", "hf-bin")


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
    if ckpt.format == "dcp":  # into the tensors of the state dict given, where they are
        return (f"torch.distributed.checkpoint.load(state_dict, checkpoint_id={path})"
                f"  # with state_dict's tensors on {device}")
    if ckpt.format == "deepspeed":  # consolidated first; the file records no device
        from ckptool.check.zerofix import consolidated

        out, snippet = consolidated(ckpt, device)
        return f"ckptool convert {shell_word(ckpt.path)} {shell_word(out)}; then {snippet}"
    if ckpt.format == "hf-bin":  # pickles: only with safe=False, and never running code
        return (f'huggingface_hub.load_torch_model(model, {path}, safe=False, '
                f'weights_only=True, map_location="{device}")')
    if ckpt.format == "hf-safetensors":
        return f'huggingface_hub.load_torch_model(model, {path}, map_location="{device}")'
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
    return f"ckptool fix {shell_word(ckpt.path)} --to {device}"
