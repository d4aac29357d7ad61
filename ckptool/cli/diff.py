"""``ckptool diff``: how two checkpoints differ; the command and its JSON
report (the text view: ``diff_text.py``).

``diff_dict`` is the ``--json`` schema, written with the same ``dumps`` as
every report (one line per list item).
"""

from __future__ import annotations

import math
from typing import Any

import click

from ckptool.check.diff import Change, DiffReport, Side
from ckptool.check.tensor_compare import ValueDiff
from ckptool.cli.common import SCHEMA_VERSION, console, one_shot, write_json
from ckptool.cli.inputs import InputPath, is_spooled
from ckptool.model import TensorInfo


@click.command()
@click.argument("path_a", metavar="A", type=InputPath())
@click.argument("path_b", metavar="B", type=InputPath())
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")
@click.option("--no-values", is_flag=True,
              help="Compare metadata only (shape, dtype, location); read no tensor bytes.")
@click.option("--all", "all_tensors", is_flag=True,
              help="Compare every tensor by its full key, not only the main state dicts.")
@click.option("--limit", "-n", type=click.IntRange(min=0), default=200, show_default=True,
              help="Most difference rows to print; 0 prints all.")
@click.option("--manifest-a", metavar="FILE", type=click.Path(dir_okay=False),
              help="A's manifest (default: A.manifest.json beside A, if there).")
@click.option("--manifest-b", metavar="FILE", type=click.Path(dir_okay=False),
              help="B's manifest (default: B.manifest.json beside B, if there).")
def diff(path_a: str, path_b: str, as_json: bool, no_values: bool, all_tensors: bool,
         limit: int, manifest_a: str | None, manifest_b: str | None) -> int:
    """Compare two checkpoints: names only in A or B, shape, dtype, location
    and value changes. Exits 0 when they match, 1 when they differ. When both
    have a manifest (ckptool verify --write-manifest), values are compared by
    its tensor digests, reading no tensor bytes."""
    from ckptool.check.diff import diff_checkpoints
    from ckptool.check.diffdigest import find_manifest
    from ckptool.read.reader import open_checkpoint

    with one_shot():
        ckpt_a, ckpt_b = open_checkpoint(path_a), open_checkpoint(path_b)
        notes: list[str] = []
        found = (None, None) if no_values else tuple(
            find_manifest(path, given, label, notes, look_beside=not is_spooled(path))
            for path, given, label in ((path_a, manifest_a, "A"), (path_b, manifest_b, "B")))
        report = diff_checkpoints(ckpt_a, ckpt_b, compare_values=not no_values,
                                  all_tensors=all_tensors, manifests=(found[0], found[1]))
        report.manifest_notes[:0] = notes
        if as_json:
            write_json(diff_dict(report))
        else:
            from ckptool.cli.diff_text import render_diff

            render_diff(console(), report, limit)
    return report.exit_code


command = diff


def _side(s: Side) -> dict[str, Any]:
    return {"path": s.path, "format": s.format, "state_dict": s.state_dict, "prefix": s.prefix,
            "directory": s.directory, "entry": s.entry}


def _tensor(t: TensorInfo) -> dict[str, Any]:
    return {"key": t.key, "shape": list(t.shape), "dtype": t.dtype, "location": t.location,
            "layout": t.layout}


def _values(v: ValueDiff | None) -> dict[str, Any] | None:
    if v is None:
        return None
    top = v.max_abs_diff
    return {
        "status": v.status, "numel": v.numel, "num_different": v.num_different,
        # JSON has no infinity: an infinite gap (inf facing a number) is the string "inf"
        "max_abs_diff": "inf" if top is not None and math.isinf(top) else top,
        "nan_mismatch": v.nan_mismatch, "reason": v.reason, "by_digest": v.by_digest,
    }


def _change(c: Change) -> dict[str, Any]:
    return {"name": c.name, "changes": list(c.changes), "a": _tensor(c.a), "b": _tensor(c.b),
            "values": _values(c.values)}


def diff_dict(report: DiffReport) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "a": _side(report.a),
        "b": _side(report.b),
        "mode": report.mode,
        "values_compared": report.values_compared,
        "values_by_digest": report.values_by_digest,
        "has_differences": report.has_differences,
        "num_matched": report.num_matched,
        "num_identical": report.num_identical,
        "num_changed": len(report.changed),
        "num_only_in_a": len(report.only_in_a),
        "num_only_in_b": len(report.only_in_b),
        "num_not_compared": len(report.not_compared),
        "only_in_a": [{"name": n, **_tensor(t)} for n, t in report.only_in_a],
        "only_in_b": [{"name": n, **_tensor(t)} for n, t in report.only_in_b],
        "changed": [_change(c) for c in report.changed],
        "not_compared": [{"name": n, "reason": r} for n, r in report.not_compared],
        "notes": report.notes,
        "manifest_notes": report.manifest_notes,
    }
