"""``ckptool devices``: the GPUs torch would see here and where a checkpoint
should go; the command and its JSON report (the text view: ``devices_text.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import click

from ckptool.check.gpus import Gpu, Machine
from ckptool.check.loadcheck import missing_devices
from ckptool.check.placement import recommend
from ckptool.cli.common import SCHEMA_VERSION, console, write_json
from ckptool.model import Checkpoint


@click.command()
@click.argument("path", metavar="[CKPT]", required=False,
                type=click.Path(dir_okay=True, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")
def devices(path: str | None, as_json: bool) -> None:
    """Show the CUDA GPUs torch would see here (CUDA_VISIBLE_DEVICES applied)
    and, given CKPT, which device to load it onto and how."""
    from ckptool.check.gpus import probe

    ckpt = None
    if path is not None:
        from ckptool.read.reader import open_checkpoint

        ckpt = open_checkpoint(path)
    machine = probe()
    if as_json:
        write_json(devices_dict(machine, ckpt))
        return
    from ckptool.cli.devices_text import render_devices

    render_devices(console(), machine, ckpt)


command = devices


def gpu_dict(g: Gpu) -> dict[str, Any]:
    return {"index": g.index, "physical": g.physical, "name": g.name, "uuid": g.uuid,
            "total_bytes": g.total_bytes, "free_bytes": g.free_bytes}


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
