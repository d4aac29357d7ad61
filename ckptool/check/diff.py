"""Comparing two checkpoints: ``diff_checkpoints(a, b) -> DiffReport``.

By default the main state dicts are compared, name by name, after each
side's wrapper prefix (``module.``, ``model.``, ``_orig_mod.``...) is taken
off, so that a DataParallel save and a Lightning save of one model line up.
``all_tensors`` compares every tensor by its full key instead. For each
matched pair the report says what changed (shape, dtype, saved location,
layout) and, when values are compared, whether the values differ
(``ckptool.check.tensor_compare``). Values are read one pair at a time
(``ckptool.read.tensor_source``: one open file per side, or, for a
checkpoint of many files, each tensor from its shard or its chunks), so
memory follows the largest tensor, not the files.

Checkpoints of many files pair as their single-file equivalents would: a
name a Hugging Face index records as tied to a stored tensor (huggingface_hub
drops it from the shards) stands for that tensor, as the second name of a
tied weight in a ``torch.save`` file does; with ``all_tensors``, a DCP key
(``model.fc.weight``, flattened) is compared under the nested key it was
saved as (``model/fc.weight``, from ``.metadata``'s planner data), the key
``dcp_to_torch_save`` and ``torch.save`` of that dict give.

With ``manifests`` for both sides (``ckptool.check.diffdigest``), values are
told by the two manifests' tensor digests and no tensor byte is read, where
both manifests still describe their checkpoints; a note says which.

The report owns the exit-code policy: 1 when anything differs, else 0.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from ckptool.check import manyfiles
from ckptool.check.diffdigest import Found, by_digest, trusted_digests
from ckptool.check.tensor_compare import DIFFERENT, NOT_COMPARED, ValueDiff, not_compared
from ckptool.errors import EXIT_FINDINGS, EXIT_OK, UnsupportedCheckpointError, UsageError
from ckptool.keys import join_key, key_of, split_key
from ckptool.model import Checkpoint, StateDictInfo, TensorInfo
from ckptool.read.companions import why_no_weights
from ckptool.read.tensor_source import TensorValues

STATE_DICT, ALL = "state_dict", "all"


@dataclass(frozen=True)
class Side:
    """What was compared on one side."""

    path: str
    format: str
    state_dict: str | None  # container path of the state dict; None with all_tensors
    prefix: str  # the wrapper prefix taken off its names ("" if none)
    directory: bool = False  # a checkpoint of many files (a directory)
    entry: str | None = None  # DCP: the top-level entry its state dict was saved under


@dataclass(frozen=True)
class Change:
    """A name present on both sides whose tensors differ."""

    name: str
    a: TensorInfo
    b: TensorInfo
    changes: tuple[str, ...]  # among shape, dtype, location, layout, values
    values: ValueDiff | None  # None when values were not read (or shapes differ)


@dataclass
class DiffReport:
    a: Side
    b: Side
    mode: str  # state_dict or all
    values_compared: bool
    num_matched: int = 0
    num_identical: int = 0
    only_in_a: list[tuple[str, TensorInfo]] = field(default_factory=list)
    only_in_b: list[tuple[str, TensorInfo]] = field(default_factory=list)
    changed: list[Change] = field(default_factory=list)
    # matched names with equal metadata whose values could not be read
    not_compared: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # how names were paired, where not plain
    values_by_digest: bool = False  # values told by two manifests' digests
    manifest_notes: list[str] = field(default_factory=list)  # manifests used, or why not

    @property
    def has_differences(self) -> bool:
        return bool(self.only_in_a or self.only_in_b or self.changed)

    @property
    def exit_code(self) -> int:
        return EXIT_FINDINGS if self.has_differences else EXIT_OK


def diff_checkpoints(a: Checkpoint, b: Checkpoint, compare_values: bool = True,
                     all_tensors: bool = False,
                     manifests: tuple[Found | None, Found | None] = (None, None)
                     ) -> DiffReport:
    """Compare ``a`` with ``b``; values are read from ``a.path`` and ``b.path``,
    or told by the tensor digests of ``manifests`` (each side's path and
    content, ``diffdigest.find_manifest``) where both can be trusted."""
    notes: list[str] = []
    if all_tensors:
        names_a, names_b = _all_keys(a, "A", notes), _all_keys(b, "B", notes)
        side_a, side_b = _side(a, None, ""), _side(b, None, "")
    else:
        sd_a, sd_b = _state_dict(a, "A", notes), _state_dict(b, "B", notes)
        pa, pb = _pick_prefixes(a, b, sd_a, sd_b)
        names_a, names_b = _strip(sd_a, pa), _strip(sd_b, pb)
        side_a, side_b = _side(a, a.main_state_dict, pa), _side(b, b.main_state_dict, pb)
    report = DiffReport(side_a, side_b, ALL if all_tensors else STATE_DICT, compare_values)
    report.notes = notes
    report.only_in_a = [(n, t) for n, t in names_a.items() if n not in names_b]
    report.only_in_b = [(n, t) for n, t in names_b.items() if n not in names_a]
    pairs = [(n, t, names_b[n]) for n, t in names_a.items() if n in names_b]
    report.num_matched = len(pairs)
    digests = (trusted_digests(a, b, manifests, report.manifest_notes)
               if compare_values and pairs else None)
    with _Readers(a, b) as readers:
        for name, ta, tb in pairs:
            _compare_pair(report, name, ta, tb, readers if compare_values else None, digests)
    if digests is not None:
        _digest_note(report, manifests, readers.opened)
    return report


class _Readers(ExitStack):
    """Both sides' ``TensorValues``, opened when a value is first read."""

    def __init__(self, a: Checkpoint, b: Checkpoint) -> None:
        super().__init__()
        self._ckpts = (a, b)
        self._readers: tuple[TensorValues, TensorValues] | None = None
        self.opened = 0  # pairs whose values were read

    def pair(self) -> tuple[TensorValues, TensorValues]:
        self.opened += 1
        if self._readers is None:
            a, b = self._ckpts
            self._readers = (self.enter_context(TensorValues(a)),
                             self.enter_context(TensorValues(b)))
        return self._readers


def _digest_note(report: DiffReport, found: tuple[Found | None, Found | None],
                 read: int) -> None:
    fa, fb = found
    assert fa is not None and fb is not None
    tail = (f"; values of {read} pair{'s' if read != 1 else ''} read (digests cannot tell: "
            "dtypes differ, or no digest)" if read else "; no tensor bytes read")
    report.manifest_notes.append(f"values compared by the manifests' digests (A: {fa[0]}, "
                        f"B: {fb[0]}){tail}")
    report.values_by_digest = True


def _compare_pair(report: DiffReport, name: str, ta: TensorInfo, tb: TensorInfo,
                  readers: _Readers | None,
                  digests: tuple[dict[str, Any], dict[str, Any]] | None) -> None:
    changes = [what for what, x, y in (
        ("shape", ta.shape, tb.shape), ("dtype", ta.dtype, tb.dtype),
        ("location", ta.location, tb.location), ("layout", ta.layout, tb.layout),
    ) if x != y and not (what == "location" and (x is None or y is None))]
    values = None
    if readers is not None and ta.shape == tb.shape:
        if digests is not None:
            values = by_digest(ta, tb, digests[0].get(ta.key), digests[1].get(tb.key))
        if values is None:
            values = _compare_values(*readers.pair(), ta, tb)
        if values.status == DIFFERENT:
            changes.append("values")
    if changes:
        report.changed.append(Change(name, ta, tb, tuple(changes), values))
    elif values is not None and values.status == NOT_COMPARED:
        report.not_compared.append((name, values.reason or ""))
    else:
        report.num_identical += 1


def _compare_values(ra: TensorValues, rb: TensorValues, ta: TensorInfo,
                    tb: TensorInfo) -> ValueDiff:
    from ckptool.check.tensor_compare import compare_values

    if ta.parts or tb.parts:
        return _compare_parts(ra, rb, ta, tb)
    try:
        va = ra.values(ta)
        vb = rb.values(tb)
    except UnsupportedCheckpointError as exc:
        return not_compared(exc.message)
    return compare_values(va, vb, ta.dtype, tb.dtype)


def _compare_parts(ra: TensorValues, rb: TensorValues, ta: TensorInfo,
                   tb: TensorInfo) -> ValueDiff:
    """Two sparse tensors, part by part (never made dense: a sparse tensor's
    dense form can be far larger than the file): the same indices and the
    values compared, or a different sparsity pattern."""
    names_a = [split_key(p.key)[-1] for p in ta.parts]
    names_b = [split_key(p.key)[-1] for p in tb.parts]
    if ta.layout != tb.layout or names_a != names_b:
        return not_compared(f"a {ta.layout} tensor and a {tb.layout} one")
    results = {name: _compare_values(ra, rb, pa, pb)
               for name, pa, pb in zip(names_a, ta.parts, tb.parts, strict=True)}
    if any(r.status == NOT_COMPARED for r in results.values()):
        return next(r for r in results.values() if r.status == NOT_COMPARED)
    values = results.get("values", next(iter(results.values())))
    patterns = [r for name, r in results.items() if name != "values"]
    if any(r.status == DIFFERENT for r in patterns):
        return ValueDiff(DIFFERENT, values.numel, values.numel, None, 0)  # other places
    return values


def _state_dict(ckpt: Checkpoint, label: str, notes: list[str]) -> dict[str, TensorInfo]:
    if ckpt.main_state_dict is None:
        raise UsageError(f"{label} ({ckpt.path}): {why_no_weights(ckpt)}",
                         "compare every tensor by its key with --all")
    names = ckpt.state_dict()
    if ckpt.main_state_dict.path:  # an index's names are those of the root
        return names
    tied = {alias: names[kept] for alias, kept in ckpt.aliases.items()
            if kept in names and alias not in names}
    if tied:
        source = "shared_params record" if ckpt.format == "deepspeed" else "index records"
        notes.append(f"{label}: {_some(list(tied))} compared as the tensor its {source} "
                     "it tied to (not stored itself)")
    return {**names, **tied}


def _all_keys(ckpt: Checkpoint, label: str, notes: list[str]) -> dict[str, TensorInfo]:
    """Every tensor by its key; a DCP key by the nested key it was saved as,
    and an HF alias as the tensor it is tied to."""
    by_key = {t.key: t for t in ckpt.tensors}
    out: dict[str, TensorInfo] = {}
    nested = 0
    for t in ckpt.tensors:
        path = ckpt.tree_paths.get(split_key(t.key)[0]) if len(split_key(t.key)) == 1 else None
        key = key_of([str(p) for p in path]) if path else t.key
        nested += key != t.key
        out.setdefault(key, t)
    if nested:
        notes.append(f"{label}: DCP keys compared as the nested keys they were saved as "
                     "(model.fc.weight as model/fc.weight)")
    for alias, kept in ckpt.aliases.items():
        stored = by_key.get(join_key("", kept))
        if stored is not None:
            out.setdefault(join_key("", alias), stored)
    return out


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" (and {len(names) - 3} more)" if len(names) > 3 else "")


def _pick_prefixes(a: Checkpoint, b: Checkpoint, sd_a: dict[str, TensorInfo],
                   sd_b: dict[str, TensorInfo]) -> tuple[str, str]:
    """Which wrapper prefixes to take off: both, by default; fewer where that
    matches more names (a real submodule called ``model`` on one side only).
    A DCP entry's name (``app.model.``) goes with the wrapper: how it loads."""
    assert a.main_state_dict is not None and b.main_state_dict is not None
    pa, pb = a.main_state_dict.prefix, b.main_state_dict.prefix
    ea, eb = manyfiles.entry_prefix(a), manyfiles.entry_prefix(b)
    pa, pb = pa if len(pa) >= len(ea) else ea, pb if len(pb) >= len(eb) else eb
    options = dict.fromkeys([(pa, pb), (pa, ""), ("", pb), ("", "")])
    return max(options, key=lambda p: len(_strip(sd_a, p[0]).keys() & _strip(sd_b, p[1])))


def _strip(names: dict[str, TensorInfo], prefix: str) -> dict[str, TensorInfo]:
    if not prefix:
        return names
    return {n[len(prefix):] if n.startswith(prefix) else n: t for n, t in names.items()}


def _side(ckpt: Checkpoint, sd: StateDictInfo | None, prefix: str) -> Side:
    entry = ckpt.metadata.get("state_dict_entry") if sd is not None else None
    return Side(ckpt.path, ckpt.format, sd.path if sd is not None else None, prefix,
                ckpt.is_multifile, entry if isinstance(entry, str) else None)
