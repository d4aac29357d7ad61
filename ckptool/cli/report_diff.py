"""The ``--json`` schema of ``ckptool diff``, built from a DiffReport.

Pure data in, plain dicts out, like ``ckptool.cli.report`` for ``inspect``, and
written with the same ``dumps`` (one line per list item). ``SCHEMA_VERSION``
changes only when a field changes meaning or goes away; new fields may be
added.
"""

from __future__ import annotations

import math
from typing import Any

from ckptool.check.diff import Change, DiffReport, Side
from ckptool.check.tensor_compare import ValueDiff
from ckptool.model import TensorInfo

SCHEMA_VERSION = 1


def _side(s: Side) -> dict[str, Any]:
    return {"path": s.path, "format": s.format, "state_dict": s.state_dict, "prefix": s.prefix}


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
        "nan_mismatch": v.nan_mismatch, "reason": v.reason,
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
    }
