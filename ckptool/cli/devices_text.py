"""Human output of ``ckptool devices``: what CUDA sees here, how
``CUDA_VISIBLE_DEVICES`` and a scheduler's allocation map to ``cuda:N``, the
order to export, a table of the visible GPUs, where a checkpoint should be
loaded, and the verdict on a DataParallel plan (rich).

Imported only when text is printed. Rich honours ``NO_COLOR`` and the
terminal width.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ckptool.check.gpus.dataparallel import Verdict, describe_ids
from ckptool.check.gpus.machine import LISTERS, Gpu, Machine
from ckptool.check.gpus.order import Export
from ckptool.check.gpus.scheduler import Job, gpu_name
from ckptool.check.loadcheck import missing_devices
from ckptool.check.placement import Advice, fix_command, load_snippet, recommend
from ckptool.describe import human_bytes
from ckptool.model import NO_LOCATION, Checkpoint

_SCHEDULERS = {"slurm": "SLURM", "pbs": "PBS", "lsf": "LSF"}
_VIEWS = {"job": "only the job's GPUs are listed here, renumbered from 0",
          "node": "the driver here lists the whole node, by the node's numbers"}

_LABEL_WIDTH = len("checkpoint")  # both grids line up


def _grid() -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", min_width=_LABEL_WIDTH)
    grid.add_column(overflow="fold")
    return grid


def _gpus_line(machine: Machine) -> Text:
    n = len(machine.gpus)
    if not n:
        return Text("none: no CUDA GPU is visible here", style="yellow")
    noun = "GPU" if n == 1 else "GPUs"
    source = LISTERS.get(machine.source, machine.source)
    if not machine.cuda_available:
        return Text(f"{n} {noun} found by {source}, but torch here cannot use them",
                    style="yellow")
    return Text(f"{n} {noun} visible to CUDA (from {source})")


def job_line(job: Job, machine: Machine | None = None) -> str | None:
    """'SLURM job 812 on gpu07: SLURM_JOB_GPUS=4,5,6,7 (...)', inside a job."""
    if job.scheduler is None:
        return None
    if job.scheduler == "container":
        line = "a container"
    else:
        line = f"{_SCHEDULERS[job.scheduler]} job {job.job_id or '(no id)'}"
        line += f" on {job.node}" if job.node else ""
    if job.variable is None:
        return f"{line}: {_unnamed_gpus(job, machine)}"
    view = f" ({_VIEWS[job.view]})" if job.view else ""
    return f"{line}: {job.variable}={job.environment.get(job.variable, '')}{view}"


def _unnamed_gpus(job: Job, machine: Machine | None) -> str:
    """A job whose GPUs no scheduler variable names: what this process sees."""
    seen = len(machine.gpus) if machine else 0
    if job.scheduler != "slurm":
        return "its GPUs show through CUDA_VISIBLE_DEVICES alone"
    if not seen:
        return "no GPUs (SLURM_JOB_GPUS is unset)"
    env = job.environment.get("CUDA_VISIBLE_DEVICES")
    noun = "GPU" if seen == 1 else "GPUs"
    through = (f"through CUDA_VISIBLE_DEVICES={env}" if env is not None
               else "as the driver lists them (CUDA_VISIBLE_DEVICES is unset)")
    return (f"its GPUs are not named by SLURM variables (SLURM_JOB_GPUS and SLURM_STEP_GPUS "
            f"are unset); this process sees {seen} {noun} {through}")


def mapping_line(machine: Machine, job: Job | None = None) -> str | None:
    """'CUDA_VISIBLE_DEVICES=1,2: physical GPU 1 is cuda:0, ...', when it is
    set; inside a job, 'node GPU 4 is cuda:0, ...' (a scheduler's numbers)."""
    mapped = [s for s in job.slots if s.cuda is not None] if job else []
    if job and mapped:
        parts = [f"{gpu_name(job, s.gpu)} is cuda:{s.cuda}"
                 for s in sorted(mapped, key=lambda s: s.cuda or 0)]
        env = machine.visible_env
        return ", ".join(parts) + ("" if env is None else f" (CUDA_VISIBLE_DEVICES={env})")
    if machine.visible_env is None or not machine.gpus:
        return None
    parts = [f"physical GPU {g.physical} is cuda:{g.index}" if g.physical is not None
             else f"{g.uuid} is cuda:{g.index}" if g.uuid
             else f"cuda:{g.index} is unknown to nvidia-smi" for g in machine.gpus]
    return f"CUDA_VISIBLE_DEVICES={machine.visible_env}: {', '.join(parts)}"


def _size(n: int | None) -> str:
    return "-" if n is None else human_bytes(n)


def _export_line(order: Export) -> Text:
    if order.line is None:
        return Text(order.problem, style="yellow")
    room = (f", those with {human_bytes(order.need_bytes)} free" if order.need_bytes is not None
            else "")
    left = f"; {len(order.left_out)} left out" if order.left_out else ""
    return Text(f"CUDA_VISIBLE_DEVICES={order.value} (most free memory first{room}{left}; "
                "--export prints it for eval)")


def render_gpu_table(console: Console, gpus: tuple[Gpu, ...], job: Job | None = None) -> None:
    node = {s.physical: s.gpu for s in job.slots if s.physical is not None} if job else {}
    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    table.add_column("device", no_wrap=True)
    if node:
        table.add_column("node" if job is None or job.scheduler != "container" else "host",
                         justify="right")
    table.add_column("physical", justify="right")
    table.add_column("name", overflow="fold", ratio=1)
    table.add_column("total", justify="right", no_wrap=True)
    table.add_column("free", justify="right", no_wrap=True)
    for g in gpus:
        mapped = [node.get(g.physical, "-") if g.physical is not None else "-"] if node else []
        table.add_row(f"cuda:{g.index}", *mapped, "-" if g.physical is None else str(g.physical),
                      g.name, _size(g.total_bytes), _size(g.free_bytes))
    console.print(table)


def _saved_on(machine: Machine, ckpt: Checkpoint) -> Text:
    where = [loc for loc in ckpt.locations if loc != NO_LOCATION]
    if ckpt.format == "dcp":
        return Text("no device recorded (DCP saves none: dcp.load puts each tensor where "
                    "the state dict you pass has it)")
    if not where:
        return Text("no device recorded (loads where you ask)")
    missing = missing_devices(machine, where)
    if not missing:
        return Text(f"{', '.join(where)}: loads here as saved")
    lacks = ", ".join(missing)
    said = (f"{lacks}, which this machine lacks" if missing == where
            else f"{', '.join(where)}; this machine lacks {lacks}")
    if ckpt.format == "hf-bin":
        return Text(f"{said}: a plain torch.load of a shard fails here (huggingface_hub and "
                    "transformers load shards to the CPU unless told otherwise)", style="yellow")
    return Text(f"{said}: a plain torch.load fails here", style="yellow")


def _use_line(ckpt: Checkpoint, advice: Advice) -> Text:
    if advice.device == "cpu":
        return Text("cpu (no CUDA GPU torch can use here)")
    where = "" if advice.physical is None else f" (physical GPU {advice.physical})"
    text = Text(advice.device + where)
    need = human_bytes(ckpt.total_bytes)
    if advice.free_bytes is None:
        text.append(f" · free memory unknown; the tensors take {need}")
    elif advice.fits:
        text.append(f" · {human_bytes(advice.free_bytes)} free for {need}: fits")
    else:
        text.append(f" · {human_bytes(advice.free_bytes)} free for {need}: does not fit on "
                    'any GPU here; load it with map_location="cpu"', style="yellow")
    return text


def _logical_note(machine: Machine, ckpt: Checkpoint, job: Job | None) -> str | None:
    """Where devices are renumbered, that a saved cuda:N is no physical GPU."""
    tags = [loc for loc in ckpt.locations if loc.startswith("cuda")]
    if not tags or (machine.visible_env is None and (job is None or job.scheduler is None)):
        return None
    one = len(tags) == 1
    return (f"{', '.join(tags)} {'is' if one else 'are'} the saving process's own "
            f"number{'' if one else 's'} (after its CUDA_VISIBLE_DEVICES), not a physical "
            "GPU: the file cannot say which GPU it was, nor which to use here")


def render_advice(console: Console, machine: Machine, ckpt: Checkpoint,
                  job: Job | None = None) -> None:
    advice = recommend(machine, ckpt)
    grid = _grid()
    files = f" in {len(ckpt.files)} files" if ckpt.is_multifile else ""
    grid.add_row("checkpoint", f"{ckpt.path} · {human_bytes(ckpt.total_bytes)} of tensors{files}")
    grid.add_row("saved on", _saved_on(machine, ckpt))
    logical = _logical_note(machine, ckpt, job)
    if logical:
        grid.add_row("", logical)
    grid.add_row("use", _use_line(ckpt, advice))
    grid.add_row("load", load_snippet(ckpt, advice.device))
    command = fix_command(ckpt, advice.device)
    if command:
        grid.add_row("or fix", command)
    console.print(grid)


def render_verdict(console: Console, machine: Machine, verdict: Verdict,
                   job: Job | None) -> None:
    """What nn.DataParallel(model, device_ids=...) does here, and how to wrap."""
    grid = _grid()
    ids = list(verdict.device_ids)
    if verdict.works:
        used = describe_ids(machine, verdict.device_ids, job)
        grid.add_row("device_ids", f"{ids}: works here: {used}")
    else:
        fails = f"fails here with {verdict.error}" if verdict.error else "does not use the GPUs"
        grid.add_row("device_ids", Text(f"{ids}: {fails}", style="yellow"))
        grid.add_row("why", verdict.problem)
    if verdict.suggested is not None:
        grid.add_row("instead", f"device_ids={list(verdict.suggested)}: {verdict.reason}")
    for i, warning in enumerate(verdict.warnings):
        grid.add_row("warning" if i == 0 else "", Text(warning, style="yellow"))
    if verdict.snippet:
        for i, line in enumerate(verdict.snippet.splitlines()):
            grid.add_row("wrap" if i == 0 else "", line)
        grid.add_row("", f"forward() raises a RuntimeError unless the module's parameters and "
                     f"buffers are on {verdict.first} (device_ids[0])")
    console.print(grid)


def render_devices(console: Console, machine: Machine, ckpt: Checkpoint | None, *,
                   job: Job | None = None, order: Export | None = None,
                   verdict: Verdict | None = None) -> None:
    grid = _grid()
    grid.add_row("gpus", _gpus_line(machine))
    scheduled = job_line(job, machine) if job else None
    if scheduled:
        grid.add_row("job", scheduled)
    mapping = mapping_line(machine, job)
    if mapping:
        grid.add_row("mapping", mapping)
    notes = ([machine.note] if machine.note else []) + (list(job.notes) if job else [])
    for i, note in enumerate(notes):
        grid.add_row("note" if i == 0 else "",
                     Text(note, style="yellow" if not machine.device_count else ""))
    if order is not None and machine.gpus:
        grid.add_row("export", _export_line(order))
    console.print(grid)
    if machine.gpus:
        console.print()
        render_gpu_table(console, machine.gpus, job)
    if ckpt is not None:
        console.print()
        render_advice(console, machine, ckpt, job)
    if verdict is not None:
        console.print()
        render_verdict(console, machine, verdict, job)
