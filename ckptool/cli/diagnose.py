"""``ckptool diagnose``: why a checkpoint will not load here or into a model;
the command and its JSON report (the text view: ``diagnose_text.py``).

``diagnose_dict`` is the ``--json`` schema: ``findings[].code`` values and
``exit_code`` are contracts.
"""

from __future__ import annotations

from typing import Any

import click

from ckptool.check import adapters, manyfiles
from ckptool.check.diagnosis import Diagnosis
from ckptool.check.gpus.machine import describe_machine
from ckptool.cli.common import (
    SCHEMA_VERSION,
    console,
    model_loader,
    one_shot,
    target_options,
    write_json,
)
from ckptool.cli.inputs import InputPath


@click.command()
@click.argument("path", type=InputPath(streams=False, why="its commands read the file again"))
@target_options
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")
def diagnose(path: str, model_spec: str | None, model_args: tuple[str, ...],
             reference: str | None, device_count: int | None, as_json: bool) -> int:
    """Say why a checkpoint will not load here (or into a model) and print the
    one `ckptool fix` command that repairs it. Exits 0 when nothing needs
    fixing, 1 when problems were found."""
    from ckptool.check.diagnosis import diagnose as run_diagnose
    from ckptool.check.gpus import machine as gpus
    from ckptool.read.reader import open_checkpoint

    loader = model_loader(model_spec, model_args, reference)
    with one_shot():
        ckpt = open_checkpoint(path)
        model = loader(ckpt) if loader else None
        machine = gpus.assumed(device_count) if device_count is not None else gpus.probe()
        result = run_diagnose(ckpt, machine, model)
        if as_json:
            write_json(diagnose_dict(result))
        else:
            from ckptool.cli.diagnose_text import render_diagnose

            render_diagnose(console(), result)
    return result.exit_code


command = diagnose


def diagnose_dict(d: Diagnosis) -> dict[str, Any]:
    ckpt, machine, keys = d.checkpoint, d.machine, d.keys
    sd = ckpt.main_state_dict
    return {
        "schema_version": SCHEMA_VERSION,
        "path": ckpt.path,
        "format": ckpt.format,
        "target": {
            "description": describe_machine(machine),
            "source": machine.source,
            "device_count": machine.device_count,
            "cuda_available": machine.cuda_available,
            "cuda_visible_devices": machine.visible_env,
            "note": machine.note,
            "gpus": [{"index": g.index, "physical": g.physical, "name": g.name,
                      "total_bytes": g.total_bytes, "free_bytes": g.free_bytes}
                     for g in machine.gpus],
        },
        "load": {"succeeds": not d.load_errors(), "errors": d.load_errors(),
                 "loader": manyfiles.loader(ckpt)},
        "devices": [{"location": t.location, "tensors": t.tensors, "nbytes": t.nbytes,
                     "lands": t.lands, "physical": t.physical, "error": t.error}
                    for t in d.tags],
        "framework": ckpt.framework.as_dict() if ckpt.framework is not None else None,
        "main_state_dict": None if sd is None else {
            "path": sd.path, "kind": sd.kind, "prefix": sd.prefix,
            "num_tensors": sd.num_tensors, "entry_prefix": manyfiles.entry_prefix(ckpt)},
        "keys": None if keys is None or d.model is None else {
            "against": d.model.source,
            "rewrite": {"strip": keys.rewrite.strip, "add": keys.rewrite.add},
            "expected": keys.expected,
            "matched_as_saved": keys.before,
            "matched": len(keys.matched),
            "missing": keys.missing,
            "unexpected": keys.unexpected,
            "mismatched": [{"key": k, "file": list(a), "model": list(b)}
                           for k, a, b in keys.mismatched],
            "tied_missing": keys.tied_missing,
            "renamed_at_load": None if d.load_names is None else {
                "library": d.load_names.library, "origin": d.load_names.origin,
                "note": d.load_note},
        },
        "adapter": None if d.adapter is None else adapters.as_dict(d.adapter),
        "findings": [{"code": f.code, "severity": f.severity, "message": f.message,
                      "fix": f.fix, "snippet": f.snippet, "keys": list(f.keys)}
                     for f in d.findings],
        # facts said that are no problem (severity info): never counted
        "notes": [{"code": f.code, "severity": f.severity, "message": f.message,
                   "snippet": f.snippet, "keys": list(f.keys)} for f in d.notes],
        "fix_command": d.fix_command,
        "fix_output": d.fix_output,
        "fix_refused": d.fix_refused,
        "remaining": d.remaining,
        "exit_code": d.exit_code,
    }
