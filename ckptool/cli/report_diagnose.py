"""The ``--json`` schema of ``ckptool diagnose``, built from a Diagnosis.

Plain dicts out (no rich, no click). The README documents every field;
``findings[].code`` values and ``exit_code`` are contracts.
"""

from __future__ import annotations

from typing import Any

from ckptool.check.diagnosis import Diagnosis
from ckptool.check.gpus import describe_machine
from ckptool.cli.report import SCHEMA_VERSION


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
        "load": {"succeeds": not d.load_errors(), "errors": d.load_errors()},
        "devices": [{"location": t.location, "tensors": t.tensors, "nbytes": t.nbytes,
                     "lands": t.lands, "physical": t.physical, "error": t.error}
                    for t in d.tags],
        "main_state_dict": None if sd is None else {
            "path": sd.path, "kind": sd.kind, "prefix": sd.prefix,
            "num_tensors": sd.num_tensors},
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
        },
        "findings": [{"code": f.code, "severity": f.severity, "message": f.message,
                      "fix": f.fix, "snippet": f.snippet, "keys": list(f.keys)}
                     for f in d.findings],
        "fix_command": d.fix_command,
        "fix_output": d.fix_output,
        "fix_refused": d.fix_refused,
        "remaining": d.remaining,
        "exit_code": d.exit_code,
    }
