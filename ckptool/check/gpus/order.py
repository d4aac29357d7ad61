"""The ``CUDA_VISIBLE_DEVICES`` to hand a new process: the GPUs visible here,
most free memory first, only those with room for what it needs.

The value is written in the terms the new process reads it in, which are
this process's: a reordering of the entries of the current
``CUDA_VISIBLE_DEVICES`` (indices as numbers, ``GPU-``/``MIG-`` entries as
written), never a GPU outside it; unset, the driver's indices, or the GPUs'
UUIDs where their models differ (CUDA may then number them fastest first,
not in the driver's order, and a UUID means one GPU either way). Pure: a
``Machine`` in, an ``Export`` out; ``devices --export`` prints its line.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from ckptool.check.gpus.listing import Gpu
from ckptool.check.gpus.machine import UNLISTED, Machine, strtoul
from ckptool.describe import human_bytes


@dataclass(frozen=True)
class Export:
    need_bytes: int | None  # room asked for (--need or a checkpoint's tensors)
    order: tuple[Gpu, ...]  # visible GPUs kept, most free memory first (ties: cuda:N order)
    entries: tuple[str, ...]  # their CUDA_VISIBLE_DEVICES entries for a new process
    left_out: tuple[Gpu, ...]  # visible GPUs without the room asked for
    problem: str  # why there is nothing to export ("" when there is)
    hint: str

    @property
    def value(self) -> str | None:
        return ",".join(self.entries) if self.entries else None

    @property
    def line(self) -> str | None:
        """``export CUDA_VISIBLE_DEVICES=2,3``, for ``eval``; None with a problem.
        The value is one quoted shell word: entries copied from the
        environment (UUIDs as written) never run anything under ``eval``.
        POSIX single quotes, not bash's ``$'...'``: the line is for any
        shell's ``eval``, and a newline inside single quotes is itself."""
        value = self.value
        return None if value is None else f"export CUDA_VISIBLE_DEVICES={shlex.quote(value)}"


def plan_export(machine: Machine, need_bytes: int | None = None) -> Export:
    """The visible GPUs with room for ``need_bytes`` (all, when None), most
    free memory first; free memory unknown ranks last and, with a need, is
    no room."""
    ranked = sorted(machine.gpus, key=lambda g: (g.free_bytes is None, -(g.free_bytes or 0),
                                                 g.index))
    kept = tuple(g for g in ranked if _room(g, need_bytes))
    left = tuple(g for g in ranked if g not in kept)
    names = entries(machine)
    if not machine.gpus:
        if machine.listed:
            hint = "unset CUDA_VISIBLE_DEVICES, which hides them"
        elif UNLISTED in machine.note:  # a driver, but nothing to list its GPUs
            hint = "install nvidia-ml-py (pip install 'ckptool[gpu]') or put nvidia-smi on PATH"
        else:
            hint = ("run it where the GPUs are: inside the job (srun ckptool devices "
                    "--export) or on a GPU node")
        why = machine.note or "none is listed"
        return Export(need_bytes, (), (), (), f"no CUDA GPU is visible here: {why}", hint)
    if not kept:
        return Export(need_bytes, (), (), left, *_no_room(machine, need_bytes or 0))
    unnamed = [g for g in kept if names[g.index] is None]
    if unnamed:
        return Export(need_bytes, (), (), left,
                      f"cuda:{unnamed[0].index} has no entry in CUDA_VISIBLE_DEVICES="
                      f"{machine.visible_env} to hand on (torch counts more GPUs than it names)",
                      "set CUDA_VISIBLE_DEVICES to the GPUs you want by hand")
    return Export(need_bytes, kept, tuple(str(names[g.index]) for g in kept), left, "", "")


def entries(machine: Machine) -> list[str | None]:
    """Each visible GPU's ``CUDA_VISIBLE_DEVICES`` entry, by logical index
    (None for a GPU torch counts that the variable does not name)."""
    env = machine.visible_env
    if env is None:
        mixed = len({g.name for g in machine.listed}) > 1
        return [g.uuid if mixed and g.uuid else
                str(g.physical if g.physical is not None else g.index) for g in machine.gpus]
    given = env.split(",")
    by_uuid = env.startswith(("GPU-", "MIG-"))  # as CUDA reads them: entries as written
    out: list[str | None] = []
    for g in machine.gpus:
        if g.index >= len(given):
            out.append(None)
        elif by_uuid:
            out.append(given[g.index])
        else:  # "1gpu2" and " 1" both mean 1
            out.append(str(g.physical if g.physical is not None
                           else strtoul(given[g.index].strip())))
    return out


def _room(gpu: Gpu, need_bytes: int | None) -> bool:
    return need_bytes is None or (gpu.free_bytes is not None and gpu.free_bytes >= need_bytes)


def _no_room(machine: Machine, need: int) -> tuple[str, str]:
    """(problem, hint) when no visible GPU has ``need`` bytes free."""
    known = [g for g in machine.gpus if g.free_bytes is not None]
    if not known:
        return (f"the free memory of the visible GPUs is unknown, so none is known to have "
                f"{human_bytes(need)} free",
                "install nvidia-ml-py or put nvidia-smi on PATH, or leave out --need and CKPT")
    best = max(known, key=lambda g: (g.free_bytes or 0, -g.index))
    return (f"no visible GPU has {human_bytes(need)} free (the most is "
            f"{human_bytes(best.free_bytes or 0)}, on cuda:{best.index})",
            'free memory on a GPU, ask for less with --need, or load on the CPU '
            '(map_location="cpu")')
