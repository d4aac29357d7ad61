"""``ckptool devices``: the GPUs torch would see here, how a scheduler's GPUs
map to them, where a checkpoint should go, the ``CUDA_VISIBLE_DEVICES`` to
export (``--export``) and whether a DataParallel plan works
(``--device-ids``); the command and its JSON report (the text view:
``devices_text.py``).

Exit codes: 0; 1 when ``--export`` has no GPU to export (none visible, or
none with the room asked for: nothing is printed on stdout, so ``eval``
does nothing) or ``--device-ids`` would fail or run on the CPU; 2 usage;
3 an unreadable CKPT.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import click

from ckptool.check.gpus.dataparallel import Verdict
from ckptool.check.gpus.machine import Gpu, Machine
from ckptool.check.gpus.order import Export
from ckptool.check.gpus.scheduler import Job
from ckptool.check.loadcheck import missing_devices
from ckptool.check.placement import recommend
from ckptool.cli.common import SCHEMA_VERSION, console, write_json
from ckptool.errors import EXIT_FINDINGS, CkptoolError, UsageError
from ckptool.model import Checkpoint


class NoGpuToExportError(CkptoolError):
    """``--export`` found no visible GPU (with the room asked for)."""

    exit_code = EXIT_FINDINGS


@click.command()
@click.argument("path", metavar="[CKPT]", required=False,
                type=click.Path(dir_okay=True, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")
@click.option("--export", "export", is_flag=True,
              help="Print only 'export CUDA_VISIBLE_DEVICES=...': the visible GPUs, most free "
                   "memory first, ties keeping their cuda:N order (with --need or CKPT, only "
                   "those with room), for "
                   "eval \"$(ckptool devices --export)\". Exit 1, printing nothing on "
                   "stdout, when no GPU qualifies.")
@click.option("--need", metavar="SIZE",
              help="Keep only GPUs with SIZE free (12GB, 800MiB; as convert's "
                   "--max-shard-size, but a unit is required) in the export order.")
@click.option("--device-ids", "device_ids", metavar="IDS",
              help="Check nn.DataParallel(model, device_ids=[IDS]) against the GPUs "
                   "visible here (IDS like 1,2); exit 1 if it would fail.")
def devices(path: str | None, as_json: bool, export: bool, need: str | None,
            device_ids: str | None) -> int:
    """Show the CUDA GPUs torch would see here (CUDA_VISIBLE_DEVICES and a
    SLURM job's GPUs mapped to cuda:N) and, given CKPT, which device to load
    it onto and how."""
    from ckptool.check.gpus import dataparallel
    from ckptool.check.gpus import order as gpuorder
    from ckptool.check.gpus.machine import probe
    from ckptool.check.gpus.scheduler import read_job

    if export and (as_json or device_ids is not None):
        other = "--json" if as_json else "--device-ids"
        raise UsageError(f"--export prints one shell line, {other} a report",
                         "run them apart")
    if need is not None and path is not None:
        raise UsageError("--need and CKPT both say how much room to look for",
                         "give one of them: CKPT (its tensors' bytes) or --need SIZE")
    ids = parse_ids(device_ids) if device_ids is not None else None
    need_bytes = None if need is None else parse_need(need)
    ckpt = None
    if path is not None:
        from ckptool.read.reader import open_checkpoint

        ckpt = open_checkpoint(path)
        need_bytes = ckpt.total_bytes
    machine = probe(ask_torch=not export)  # a new process has its own torch: no import here
    order = gpuorder.plan_export(machine, need_bytes)
    if export:
        return print_export(order)
    job = read_job(os.environ, machine)
    verdict = dataparallel.check(machine, ids, job) if ids is not None else None
    if as_json:
        write_json(devices_dict(machine, ckpt, job=job, order=order, verdict=verdict))
    else:
        from ckptool.cli.devices_text import render_devices

        render_devices(console(), machine, ckpt, job=job, order=order, verdict=verdict)
    return EXIT_FINDINGS if verdict is not None and not verdict.works else 0


command = devices


def parse_ids(text: str) -> tuple[int, ...]:
    """``1,2``, ``[1, 2]`` or ``cuda:1,cuda:2`` -> (1, 2)."""
    parts = [p.strip().removeprefix("cuda:") for p in text.strip().strip("[]()").split(",")]
    try:
        ids = tuple(int(p) for p in parts)
    except ValueError:
        raise UsageError(f"--device-ids {text!r} is not a list of GPU numbers",
                         "write them as nn.DataParallel takes them: --device-ids 0,1") from None
    return ids


def parse_need(text: str) -> int:
    """``12GB`` -> 12000000000, as convert's --max-shard-size, except that a
    plain number is refused: ``--need 12`` meaning 12 bytes is never meant."""
    from ckptool.write.shards import parse_size

    number = text.strip()
    if number.replace(".", "", 1).isdigit():
        raise UsageError(f"--need {text!r} has no unit",
                         f"say {number}GB or {number}GiB")
    return parse_size(text, "--need")


def print_export(order: Export) -> int:
    """The one line of ``--export`` on stdout; what was left out on stderr."""
    if order.line is None:
        raise NoGpuToExportError(order.problem, order.hint)
    click.echo(order.line)
    if order.left_out:
        from ckptool.describe import human_bytes

        left = ", ".join(f"cuda:{g.index}" for g in order.left_out)
        click.echo(f"ckptool: note: left out {left}: less than "
                   f"{human_bytes(order.need_bytes or 0)} free, or free memory unknown", err=True)
    return 0


def gpu_dict(g: Gpu, job: Job | None = None) -> dict[str, Any]:
    node = None if job is None else next(
        (s.gpu for s in job.slots if s.physical is not None and s.physical == g.physical), None)
    return {"index": g.index, "physical": g.physical, "name": g.name, "uuid": g.uuid,
            "total_bytes": g.total_bytes, "free_bytes": g.free_bytes, "node": node}


def job_dict(job: Job) -> dict[str, Any] | None:
    if job.scheduler is None and not job.notes:
        return None
    return {"name": job.scheduler, "job_id": job.job_id, "node": job.node,
            "variable": job.variable, "given": list(job.given), "view": job.view,
            "gpus": [dataclasses.asdict(s) for s in job.slots], "notes": list(job.notes)}


def export_dict(order: Export) -> dict[str, Any]:
    return {"need_bytes": order.need_bytes, "order": [g.index for g in order.order],
            "value": order.value, "command": order.line,
            "left_out": [g.index for g in order.left_out], "problem": order.problem or None}


def verdict_dict(v: Verdict) -> dict[str, Any]:
    return {"device_ids": list(v.device_ids), "works": v.works, "error": v.error,
            "problem": v.problem or None,
            "suggested": None if v.suggested is None else list(v.suggested),
            "reason": v.reason or None, "module_device": v.first, "snippet": v.snippet,
            "warnings": list(v.warnings),
            "invalid": None if v.invalid is None else list(v.invalid)}


def devices_dict(machine: Machine, ckpt: Checkpoint | None = None, *, job: Job | None = None,
                 order: Export | None = None, verdict: Verdict | None = None
                 ) -> dict[str, Any]:
    """The ``devices --json`` schema."""
    return {
        "schema_version": SCHEMA_VERSION,
        "source": machine.source,
        "cuda_visible_devices": machine.visible_env,
        "cuda_available": machine.cuda_available,
        "device_count": machine.device_count,
        "note": machine.note,
        "gpus": [gpu_dict(g, job) for g in machine.gpus],
        "checkpoint": None if ckpt is None else {
            "path": ckpt.path, "nbytes": ckpt.total_bytes, "locations": ckpt.locations,
            "missing_devices": missing_devices(machine, ckpt.locations),
        },
        "recommended": None if ckpt is None else dataclasses.asdict(recommend(machine, ckpt)),
        "environment": {} if job is None else job.environment,
        "scheduler": None if job is None else job_dict(job),
        "export": None if order is None else export_dict(order),
        "data_parallel": None if verdict is None else verdict_dict(verdict),
    }
