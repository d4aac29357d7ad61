"""Which GPUs a job scheduler or a container runtime gave this process, and
which ``cuda:N`` each of them is here.

Read from the environment: SLURM (``SLURM_STEP_GPUS`` inside a step, else
``SLURM_JOB_GPUS``: the node's GPU indices; ``SLURM_JOB_ID``,
``SLURMD_NODENAME``; ``GPU_DEVICE_ORDINAL``, which SLURM sets to the
``CUDA_VISIBLE_DEVICES`` it chose), a container's ``NVIDIA_VISIBLE_DEVICES``
(host indices or UUIDs), and the job ids of PBS and LSF, which show a job's
GPUs through ``CUDA_VISIBLE_DEVICES`` alone. ``ROCR_VISIBLE_DEVICES`` and
``HIP_VISIBLE_DEVICES`` are only reported: ckptool lists NVIDIA GPUs.

A job's GPUs are numbered two ways. Where the job's cgroup (SLURM's
``ConstrainDevices``) or the container hides the others, the driver lists
only the job's GPUs, renumbered from 0 in the node's order ("job" view: node
GPUs 4,5 are listed as 0,1, and SLURM sets ``CUDA_VISIBLE_DEVICES=0,1``);
elsewhere it lists the whole node ("node" view). Which one holds is told
from the counts; then ``CUDA_VISIBLE_DEVICES`` renumbers what is listed into
``cuda:0, cuda:1...`` (``gpus.probe``). Pure: an environment and a
``Machine`` in, data out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ckptool.check.gpus.machine import LISTERS, Machine

# the variables `devices --json` reports under "environment", when set
WATCHED = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS",
           "SLURM_GPUS_ON_NODE", "SLURM_LOCALID", "SLURMD_NODENAME", "GPU_DEVICE_ORDINAL",
           "NVIDIA_VISIBLE_DEVICES", "PBS_JOBID", "LSB_JOBID", "CUDA_VISIBLE_DEVICES",
           "CUDA_DEVICE_ORDER", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
_NO_LIST = ("", "all", "none", "void", "NoDevFiles")  # NVIDIA_VISIBLE_DEVICES values naming no list
_RANGE = re.compile(r"^(\d+)-(\d+)$")


@dataclass(frozen=True)
class Slot:
    """One GPU the job was given, and what it is here."""

    gpu: str  # as the scheduler names it: the node's index ("4") or a UUID
    physical: int | None  # its index in the driver's list here; None when unknown
    cuda: int | None  # its cuda:N in this process; None when hidden or unknown


@dataclass(frozen=True)
class Job:
    """The job this process runs in, its GPUs, and how they map here."""

    scheduler: str | None  # "slurm", "pbs", "lsf", "container"; None outside any job
    job_id: str | None
    node: str | None  # the node's name, when the scheduler says it
    variable: str | None  # the variable naming its GPUs (SLURM_STEP_GPUS...); None if none does
    given: tuple[str, ...]  # that variable's entries
    view: str | None  # "job", "node", or None when it cannot be told (see the docstring)
    slots: tuple[Slot, ...]
    notes: tuple[str, ...]
    environment: dict[str, str] = field(default_factory=dict)  # the WATCHED ones that are set

    def cuda_of(self, gpu: str) -> int | None:
        return next((s.cuda for s in self.slots if s.gpu == gpu), None)


def read_job(environ: Mapping[str, str], machine: Machine) -> Job:
    """The job and its GPUs from ``environ``, mapped onto ``machine``."""
    env = {k: environ[k] for k in WATCHED if k in environ}
    scheduler, job_id, variable = _scheduler(env)
    given = _entries(env[variable]) if variable else ()
    view, slots, notes = _map(given, machine) if variable else (None, [], [])
    if variable:
        notes += _hidden_and_foreign(slots, machine, scheduler, variable)
    ordinal = env.get("GPU_DEVICE_ORDINAL")
    if scheduler == "slurm" and ordinal is not None and ordinal != machine.visible_env:
        shown = " (unset)" if machine.visible_env is None else f"={machine.visible_env}"
        notes.append(f"CUDA_VISIBLE_DEVICES{shown} is not what SLURM set "
                     f"(GPU_DEVICE_ORDINAL={ordinal}): it was changed after the job started")
    for amd in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        if amd in env:
            notes.append(f"{amd}={env[amd]} is set: ckptool lists NVIDIA GPUs only; on a ROCm "
                         f"build of torch, cuda:N counts the GPUs {amd} leaves")
    mapped = [s for s in slots if s.cuda is not None]
    if mapped:
        first = min(mapped, key=lambda s: s.cuda or 0)
        notes.append("a cuda:N, here or saved in a checkpoint, is a process's own number after "
                     "its CUDA_VISIBLE_DEVICES, not a physical GPU: this process's "
                     f"cuda:{first.cuda} is {_name(scheduler, first.gpu)}")
    node = env.get("SLURMD_NODENAME") if scheduler == "slurm" else None
    return Job(scheduler, job_id, node, variable, given, view, tuple(slots), tuple(notes), env)


def gpu_name(job: Job, *gpus: str) -> str:
    """``node GPU 4``, ``node GPUs 6, 7``: a scheduler's GPU numbers are the
    node's (a container's, the host's)."""
    return _name(job.scheduler, *gpus)


def _name(scheduler: str | None, *gpus: str) -> str:
    where = "host" if scheduler == "container" else "node"
    return f"{where} GPU{'s' if len(gpus) > 1 else ''} {', '.join(gpus)}"


def _scheduler(env: Mapping[str, str]) -> tuple[str | None, str | None, str | None]:
    """(scheduler, job id, variable naming its GPUs)."""
    if "SLURM_JOB_ID" in env or "SLURM_JOB_GPUS" in env or "SLURM_STEP_GPUS" in env:
        variable = next((v for v in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS")
                         if env.get(v, "").strip()), None)
        return "slurm", env.get("SLURM_JOB_ID"), variable
    for name, var in (("pbs", "PBS_JOBID"), ("lsf", "LSB_JOBID")):
        if var in env:
            return name, env[var], None
    if env.get("NVIDIA_VISIBLE_DEVICES", "").strip() not in _NO_LIST:
        return "container", None, "NVIDIA_VISIBLE_DEVICES"
    return None, None, None


def _entries(value: str) -> tuple[str, ...]:
    """``4,5`` or ``4-7`` (SLURM writes ranges in some lists) -> entries."""
    out: list[str] = []
    for part in (p.strip() for p in value.split(",")):
        m = _RANGE.match(part)
        if m and int(m.group(1)) <= int(m.group(2)):
            out += [str(n) for n in range(int(m.group(1)), int(m.group(2)) + 1)]
        elif part:
            out.append(part)
    return tuple(out)


def _map(given: tuple[str, ...], machine: Machine
         ) -> tuple[str | None, list[Slot], list[str]]:
    """(view, one Slot per given GPU, notes)."""
    listed = machine.listed
    cuda = {g.physical: g.index for g in machine.gpus if g.physical is not None}
    lister = LISTERS.get(machine.source, "the driver")
    if not listed:
        return None, [Slot(g, None, None) for g in given], [
            "no GPU is listed here, so which cuda:N each of the job's GPUs is cannot be told"]
    if not all(g.isdigit() for g in given):  # UUIDs: the same everywhere
        slots = []
        for g in given:
            found = [i for i, x in enumerate(listed) if x.uuid and x.uuid.startswith(g)]
            k = found[0] if len(found) == 1 else None  # unknown or ambiguous: unmapped
            slots.append(Slot(g, k, None if k is None else cuda.get(k)))
        unknown = [s.gpu for s in slots if s.physical is None]
        notes = [f"{lister} lists no GPU named {', '.join(unknown)}"] if unknown else []
        return None, slots, notes
    numbers = [int(g) for g in given]
    n = len(listed)
    if max(numbers) < n and (n > len(numbers) or sorted(numbers) == list(range(n))):
        return "node", [Slot(g, k, cuda.get(k)) for g, k in zip(given, numbers, strict=True)], []
    if n == len(numbers):  # only the job's GPUs are listed, in the node's order
        rank = {k: i for i, k in enumerate(sorted(numbers))}
        return "job", [Slot(g, rank[k], cuda.get(rank[k]))
                       for g, k in zip(given, numbers, strict=True)], []
    return None, [Slot(g, None, None) for g in given], [
        f"{lister} lists {n} GPU{'s' if n != 1 else ''} here and the job was given "
        f"{len(given)}, so which is which cannot be told"]


def _hidden_and_foreign(slots: list[Slot], machine: Machine, scheduler: str | None,
                        variable: str) -> list[str]:
    """The job's GPUs CUDA_VISIBLE_DEVICES hides, and visible GPUs not the job's."""
    notes = []
    hidden = [s.gpu for s in slots if s.physical is not None and s.cuda is None]
    if hidden:
        verb = "is" if len(hidden) == 1 else "are"
        notes.append(f"{_name(scheduler, *hidden)} ({variable}) {verb} hidden from this "
                     "process by CUDA_VISIBLE_DEVICES")
    mapped = [s for s in slots if s.physical is not None]
    if mapped and len(mapped) == len(slots):
        ours = {s.physical for s in mapped}
        foreign = [g for g in machine.gpus if g.physical is not None and g.physical not in ours]
        if foreign:
            names = ", ".join(f"cuda:{g.index} (listed as GPU {g.physical})" for g in foreign)
            notes.append(f"{names} {'is' if len(foreign) == 1 else 'are'} not among the job's "
                         f"GPUs ({variable}): another job may be using "
                         f"{'it' if len(foreign) == 1 else 'them'}")
    return notes
