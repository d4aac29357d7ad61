"""Human output of ``ckptool devices``: what CUDA sees here, how
``CUDA_VISIBLE_DEVICES`` renumbered it, a table of the visible GPUs, and
where a checkpoint should be loaded (rich).

Imported only when text is printed. Rich honours ``NO_COLOR`` and the
terminal width.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ckptool.check.gpus import Gpu, Machine
from ckptool.check.loadcheck import missing_devices
from ckptool.check.placement import Advice, fix_command, load_snippet, recommend
from ckptool.describe import human_bytes
from ckptool.model import NO_LOCATION, Checkpoint

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
    if not machine.cuda_available:
        return Text(f"{n} {noun} found by {machine.source}, but torch here cannot use them",
                    style="yellow")
    return Text(f"{n} {noun} visible to CUDA (from {machine.source})")


def mapping_line(machine: Machine) -> str | None:
    """'CUDA_VISIBLE_DEVICES=1,2: physical GPU 1 is cuda:0, ...', when it is set."""
    if machine.visible_env is None or not machine.gpus:
        return None
    parts = [f"physical GPU {g.physical} is cuda:{g.index}" if g.physical is not None
             else f"{g.uuid} is cuda:{g.index}" if g.uuid
             else f"cuda:{g.index} is unknown to nvidia-smi" for g in machine.gpus]
    return f"CUDA_VISIBLE_DEVICES={machine.visible_env}: {', '.join(parts)}"


def _size(n: int | None) -> str:
    return "-" if n is None else human_bytes(n)


def render_gpu_table(console: Console, gpus: tuple[Gpu, ...]) -> None:
    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    table.add_column("device", no_wrap=True)
    table.add_column("physical", justify="right")
    table.add_column("name", overflow="fold", ratio=1)
    table.add_column("total", justify="right", no_wrap=True)
    table.add_column("free", justify="right", no_wrap=True)
    for g in gpus:
        table.add_row(f"cuda:{g.index}", "-" if g.physical is None else str(g.physical),
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


def render_advice(console: Console, machine: Machine, ckpt: Checkpoint) -> None:
    advice = recommend(machine, ckpt)
    grid = _grid()
    files = f" in {len(ckpt.files)} files" if ckpt.is_multifile else ""
    grid.add_row("checkpoint", f"{ckpt.path} · {human_bytes(ckpt.total_bytes)} of tensors{files}")
    grid.add_row("saved on", _saved_on(machine, ckpt))
    grid.add_row("use", _use_line(ckpt, advice))
    grid.add_row("load", load_snippet(ckpt, advice.device))
    command = fix_command(ckpt, advice.device)
    if command:
        grid.add_row("or fix", command)
    console.print(grid)


def render_devices(console: Console, machine: Machine, ckpt: Checkpoint | None) -> None:
    grid = _grid()
    grid.add_row("gpus", _gpus_line(machine))
    mapping = mapping_line(machine)
    if mapping:
        grid.add_row("mapping", mapping)
    if machine.note:
        grid.add_row("note", Text(machine.note, style="yellow" if not machine.device_count
                                  else ""))
    console.print(grid)
    if machine.gpus:
        console.print()
        render_gpu_table(console, machine.gpus)
    if ckpt is not None:
        console.print()
        render_advice(console, machine, ckpt)
