"""A fix as the browser previews it: each tensor's key and device before
and after, from the same dry run ``ckptool fix --dry-run`` makes. Pure: no
Textual, nothing written."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptool.model import NO_LOCATION, TensorInfo
from ckptool.plan import FixOptions
from ckptool.rewrite import FixResult, fix
from ckptool.tensors import StorageRef
from ckptool.walk import walk


@dataclass(frozen=True)
class KeyChange:
    before: str
    after: str | None  # None: the output leaves this tensor out
    before_loc: str
    after_loc: str

    @property
    def changed(self) -> bool:
        return self.after != self.before or self.after_loc != self.before_loc


@dataclass
class Preview:
    result: FixResult
    changes: list[KeyChange]

    @property
    def renamed(self) -> int:
        return sum(1 for c in self.changes if c.after is not None and c.after != c.before)

    @property
    def moved(self) -> int:
        return sum(1 for c in self.changes if c.after is not None and c.after_loc != c.before_loc)

    @property
    def left_out(self) -> int:
        return sum(1 for c in self.changes if c.after is None)

    @property
    def kept(self) -> int:
        return sum(1 for c in self.changes if c.after is not None)

    def summary(self) -> str:
        plan = self.result.plan
        parts = [f"{self.kept:,} tensors kept", f"{self.renamed:,} renamed",
                 f"{self.moved:,} moved"]
        if self.left_out:
            parts.append(f"{self.left_out:,} left out")
        if plan.extracted is not None:
            parts.append(f"extracts '{plan.extracted or 'the file'}'")
        return " · ".join(parts)


def _ident_info(t: TensorInfo) -> tuple[Any, ...]:
    return (t.storage, t.storage_offset, t.shape, t.stride)


def _ident_record(rec: Any) -> tuple[Any, ...]:
    if isinstance(rec, StorageRef):
        return (rec.key, 0, (rec.numel,), (1,))
    return (rec.storage.key if rec.storage else None, rec.storage_offset, rec.shape, rec.stride)


def make_preview(path: str, opts: FixOptions, output: str) -> Preview:
    """Plan ``opts`` on ``path`` exactly as ``ckptool fix --dry-run`` does
    (raising its errors) and pair every input tensor with its output key."""
    result = fix(path, opts, output, dry_run=True)
    return Preview(result, changes(result))


def changes(result: FixResult) -> list[KeyChange]:
    after: dict[tuple[Any, ...], list[str]] = {}
    for key, rec in walk(result.plan.root).tensors:
        after.setdefault(_ident_record(rec), []).append(key)
    out = []
    for t in result.source.tensors:
        keys = after.get(_ident_info(t))
        new_key = keys.pop(0) if keys else None
        loc = t.location or NO_LOCATION
        new_loc = result.plan.retargets.get(t.storage, loc) if t.storage else loc
        out.append(KeyChange(t.key, new_key, loc, new_loc))
    return out
