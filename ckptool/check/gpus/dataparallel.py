"""Whether ``nn.DataParallel(model, device_ids=[...])`` works with the GPUs this
process sees, which ids to use instead, and where the module must be.

What torch 2.x does, in ``torch/nn/parallel/data_parallel.py``: without a
usable CUDA device it keeps the module where it is and ignores
``device_ids`` (everything runs unparallelised, on the CPU); otherwise its
constructor asks for each id's properties, and an id below 0 or not below
``torch.cuda.device_count()`` raises ``AssertionError: Invalid device id``;
``forward`` raises a RuntimeError unless every parameter and buffer is on
``device_ids[0]`` (it moves the module itself only for a single id); GPUs
with under 75% of the largest one's memory draw an imbalance warning.

The ids of ``device_ids`` are the process's logical numbers (``cuda:N``,
after ``CUDA_VISIBLE_DEVICES``). Ids that fail are most often physical
numbers (nvidia-smi's, or the node's a scheduler gave): where they name
visible GPUs that way, the ids those GPUs have here are suggested. Where
torch cannot use the GPUs listed (a CPU-only build), the ids are still
judged against them, as a CUDA build of torch would judge them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptool.check.gpus.machine import Machine
from ckptool.check.gpus.scheduler import Job, gpu_name

INVALID = "AssertionError: Invalid device id"


@dataclass(frozen=True)
class Verdict:
    device_ids: tuple[int, ...]
    works: bool  # DataParallel would run the module on exactly these GPUs
    error: str | None  # what torch raises (INVALID), None when nothing is raised
    problem: str  # why it does not work ("" when it does)
    suggested: tuple[int, ...] | None  # ids to use instead, None when these work or none would
    reason: str  # why those ids ("" without a suggestion)
    warnings: tuple[str, ...]
    # the ids that name no visible GPU (a CUDA build of torch raises INVALID for
    # them); None when no GPU is visible to judge them by
    invalid: tuple[int, ...] | None = None

    @property
    def use(self) -> tuple[int, ...] | None:
        """The ids to wrap with: these when they work or only torch stops
        them (a CPU-only build), else the suggested ones."""
        if self.works or (self.invalid == () and self.suggested is None):
            return self.device_ids
        return self.suggested

    @property
    def first(self) -> str | None:
        """``cuda:N`` the module must be on before wrapping (device_ids[0])."""
        use = self.use
        return f"cuda:{use[0]}" if use else None

    @property
    def snippet(self) -> str | None:
        use = self.use
        if not use:
            return None
        return (f'model.to("{self.first}")  # device_ids[0]: before wrapping\n'
                f"model = nn.DataParallel(model, device_ids={list(use)})")


def check(machine: Machine, device_ids: tuple[int, ...], job: Job | None = None) -> Verdict:
    """What ``nn.DataParallel(model, device_ids=list(device_ids))`` does here.

    The ids are judged against the visible GPUs even where torch cannot use
    them (a CPU-only build): it then runs on the CPU, which fails the check,
    but the verdict still says which ids name no GPU and which to use."""
    count = len(machine.gpus)
    if count == 0:
        return Verdict(device_ids, False, None, "torch sees no CUDA GPU here (see the note), "
                       "so DataParallel ignores device_ids and runs the module on the CPU, "
                       "unparallelised", None, "", ())
    usable = machine.device_count > 0
    bad = tuple(i for i in device_ids if not 0 <= i < count)
    cpu = "" if usable else (
        f"torch here cannot use the {count} visible GPU{'s' if count != 1 else ''} (see the "
        "note), so DataParallel ignores device_ids and runs the module on the CPU, "
        "unparallelised; with a CUDA build of torch, ")
    if bad:
        top = {1: "cuda:0 only", 2: "cuda:0 and cuda:1"}.get(count, f"cuda:0 to cuda:{count - 1}")
        if usable:
            problem = (f"device_ids {_ids(bad)} {'is' if len(bad) == 1 else 'are'} not below "
                       f"torch.cuda.device_count() = {count}: this process has {top}")
        else:
            problem = (f"{cpu}device_ids {_ids(bad)} would not be below "
                       f"torch.cuda.device_count() = {count} ({top}) and the constructor "
                       f"would raise {INVALID}")
        suggested, reason = _instead(machine, device_ids, job)
        return Verdict(device_ids, False, INVALID if usable else None, problem, suggested,
                       reason, (), bad)
    warnings = tuple(_warnings(machine, device_ids))
    if not usable:
        problem = f"{cpu}they would be {describe_ids(machine, device_ids, job)}"
        return Verdict(device_ids, False, None, problem, None, "", warnings, ())
    return Verdict(device_ids, True, None, "", None, "", warnings, ())


def describe_ids(machine: Machine, ids: tuple[int, ...], job: Job | None = None) -> str:
    """``cuda:0 (physical GPU 2), cuda:1 (physical GPU 3)``: valid ids only."""
    return ", ".join(_describe(machine, i, job) for i in ids if 0 <= i < len(machine.gpus))


def _describe(machine: Machine, i: int, job: Job | None) -> str:
    gpu = machine.gpus[i]
    node = next((s.gpu for s in job.slots if s.cuda == i), None) if job else None
    if node is not None and job is not None:
        return f"cuda:{i} ({gpu_name(job, node)})"
    return f"cuda:{i}" + ("" if gpu.physical is None else f" (physical GPU {gpu.physical})")


def _instead(machine: Machine, ids: tuple[int, ...], job: Job | None
             ) -> tuple[tuple[int, ...], str]:
    """The ids to use: those of the GPUs ``ids`` name as physical or node
    numbers, when they all do; else the first visible ones."""
    use = _as_physical(machine, ids)
    if use is not None:
        return use, _meant(ids, use)
    if job is not None and len(set(ids)) == len(ids):
        here = [job.cuda_of(str(i)) for i in ids]
        if all(c is not None for c in here):
            use = tuple(c for c in here if c is not None)
            return use, (f"if you meant the job's {gpu_name(job, *map(str, ids))}, "
                         f"{'it is' if len(use) == 1 else 'they are'} {_cuda(use)} in this "
                         "process")
    k = min(len(ids), len(machine.gpus))
    use = tuple(range(k))
    return use, f"the first {k} of the {len(machine.gpus)} GPUs this process sees"


def _warnings(machine: Machine, ids: tuple[int, ...]) -> list[str]:
    out = []
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        out.append(f"device_ids repeats {_ids(repeated)}: two replicas on one GPU run no "
                   "faster than one")
    totals = [(machine.gpus[i].total_bytes, i) for i in ids]
    known = [(t, i) for t, i in totals if t is not None]
    if len(known) > 1 and min(known)[0] < 0.75 * max(known)[0]:
        out.append(f"torch will warn of an imbalance: cuda:{min(known)[1]} has less than 75% "
                   f"of the memory of cuda:{max(known)[1]}, and every replica waits for the "
                   "slowest")
    meant = _as_physical(machine, ids) if machine.visible_env is not None else None
    if meant is not None and meant != ids:
        out.append(f"device_ids are this process's numbers: {describe_ids(machine, ids)}; "
                   f"{_meant(ids, meant)}, so use device_ids={list(meant)}")
    return out


def _as_physical(machine: Machine, ids: tuple[int, ...]) -> tuple[int, ...] | None:
    """The logical ids of the visible GPUs whose physical numbers are ``ids``,
    when every id is one (and none repeats)."""
    by_physical = {g.physical: g.index for g in machine.gpus if g.physical is not None}
    if len(set(ids)) != len(ids) or not all(i in by_physical for i in ids):
        return None
    return tuple(by_physical[i] for i in ids)


def _meant(ids: tuple[int, ...], use: tuple[int, ...]) -> str:
    noun = "GPU" if len(ids) == 1 else "GPUs"
    return (f"if you meant physical {noun} {_ids(ids)} (nvidia-smi's numbers), "
            f"{'it is' if len(ids) == 1 else 'they are'} {_cuda(use)} in this process")


def _cuda(ids: tuple[int, ...]) -> str:
    return ", ".join(f"cuda:{i}" for i in ids)


def _ids(ids: list[int] | tuple[int, ...]) -> str:
    return ", ".join(str(i) for i in ids)
