"""``verify --values``: every tensor's values read once, for the damage that
loads without a word.

``check_values(ckpt, jobs)`` reads each tensor of ``ckpt`` once
(``valuescan``: a slice at a time where its bytes lie in one file, else
whole through ``TensorValues``: a DCP or ZeRO tensor made from its chunks),
on ``jobs`` threads, and reports:

- NaN and Inf in floating tensors, counted (errors: the corruption that
  loads silently), with the chunk files holding them;
- tensors whose every value is zero (warnings: biases and optimizer moments
  start at zero; a region of a file that was never written reads as zeros);
- tensors with the same dtype, shape and bytes as another where nothing in
  the checkpoint ties them (warnings: a copy where a tie was meant, data
  written twice). Tied are views of one storage (torch's shared storage,
  the names a safetensors file or an HF index records as aliases; read once),
  ``ckpt.aliases``, and a DeepSpeed checkpoint's ``module`` copy of a
  parameter and its fp32 master. Tensors of one value throughout and of
  fewer than 2 elements are left out. Only tensors whose dtype and shape an
  untied tensor shares are fingerprinted; tensors of equal fingerprints are
  read again and compared by ``tensor_digest``: a tensor is read twice only
  when it is one of a pair found.

A quantized tensor, a meta tensor, a dtype this torch cannot check are
skipped and said in the summary; a sparse or nested tensor's stored values
are checked for NaN and Inf. A tensor that cannot be read is a Problem
(``classify``: truncated..., else unreadable); nothing here raises on damage.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ckptool import dtypes
from ckptool.check.verify import valuescan
from ckptool.check.verify.digest import tensor_digest
from ckptool.check.verify.problems import UNREADABLE, WARNING, Problem, classify
from ckptool.check.verify.valuescan import Found
from ckptool.describe import plural, shape_text
from ckptool.errors import InputError
from ckptool.keys import split_key
from ckptool.model import Checkpoint, TensorInfo
from ckptool.read import ties
from ckptool.read.tensor_source import TensorValues, located

MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta",
           "sum", "max_exp_avg_sq")


@dataclass
class Unit:
    """One read: a tensor (every check) or a part of a sparse/nested one (NaN, Inf)."""

    key: str  # the key reported
    tensor: TensorInfo  # what is read
    whole: bool = True
    names: list[str] = field(default_factory=list)  # every key of this one view
    compare: bool = False  # another untied tensor has its dtype and shape


def check_values(ckpt: Checkpoint, jobs: int = 1) -> tuple[list[Problem], dict[str, Any]]:
    """Read every tensor of ``ckpt`` once: (problems, summary). Summary:
    ``{"nan": {key: count}, "inf": {key: count}, "all_zero": [keys],
    "same_values": [[a, b], ...], "tensors_read": N, "bytes_read": N,
    "skipped": {key: reason}}``."""
    classes = tie_classes(ckpt)
    units = plan_units(ckpt, classes)
    found = list(_scan_all(ckpt, units, max(1, jobs)))
    problems: list[Problem] = []
    summary: dict[str, Any] = {"nan": {}, "inf": {}, "all_zero": [], "same_values": [],
                               "tensors_read": 0, "bytes_read": 0, "skipped": {}}
    for unit, got in zip(units, found, strict=True):
        _report(ckpt, unit, got, problems, summary)
    _same_values(ckpt, units, found, classes, problems, summary)
    return problems, summary


# -- what is read, and what is tied ------------------------------------------
def view_id(t: TensorInfo) -> tuple[Any, ...]:
    """Tensors with one id are one tensor under several names."""
    if t.chunks:
        return ("chunks", t.chunks, t.dtype, t.shape)
    if t.storage is None:
        return ("key", t.key)
    return ("view", t.file, t.storage, t.storage_offset, t.shape, t.stride, t.dtype)


def tie_classes(ckpt: Checkpoint) -> dict[str, str]:
    """Each tensor key -> its class: keys of one class are tied by the layout."""
    parent = {t.key: t.key for t in ckpt.tensors}

    def root(k: str) -> str:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    def union(a: str, b: str) -> None:
        if a in parent and b in parent:
            parent[root(a)] = root(b)

    first: dict[tuple[Any, ...], str] = {}
    for t in ckpt.tensors:
        union(t.key, first.setdefault(view_id(t), t.key))
    sd = ckpt.main_state_dict
    name_key = sd.tensor_key if sd is not None else (lambda n: n)
    for alias, stored in ckpt.aliases.items():
        union(name_key(alias), name_key(stored))
    if ckpt.format == "deepspeed":  # <rank file>/module/NAME: the model's copy of NAME
        for t in ckpt.tensors:
            parts = split_key(t.key)
            if len(parts) == 3 and parts[0].startswith("<") and parts[1] == "module":
                union(t.key, name_key(parts[2]))
    return {k: root(k) for k in parent}


def plan_units(ckpt: Checkpoint, classes: dict[str, str]) -> list[Unit]:
    """One unit per view (its first name reported: readers list a tied
    name after the stored one), parts of sparse tensors."""
    by_view: dict[tuple[Any, ...], Unit] = {}
    units: list[Unit] = []
    for t in ckpt.tensors:
        if t.parts:
            units += [Unit(t.key, p, whole=False, names=[t.key]) for p in t.parts
                      if dtypes.is_floating(p.dtype)]
            continue
        unit = by_view.get(view_id(t))
        if unit is None:
            unit = by_view[view_id(t)] = Unit(t.key, t)
            units.append(unit)
        unit.names.append(t.key)
    shapes: dict[tuple[str, tuple[int, ...]], set[str]] = {}
    for u in units:
        if u.whole:
            shapes.setdefault((u.tensor.dtype, u.tensor.shape), set()).add(classes[u.key])
    for u in units:
        u.compare = u.whole and u.tensor.numel >= 2 and \
            len(shapes[(u.tensor.dtype, u.tensor.shape)]) > 1
    return units


# -- reading --------------------------------------------------------------------
def _scan_all(ckpt: Checkpoint, units: list[Unit], jobs: int) -> Iterator[Found]:
    """Each unit's findings, in order; ``jobs`` threads each with its own
    readers, each running torch's operations on one core: they are small (a
    slice), and an intra-op team waiting for a busy core costs more than
    the operation (measured: 1 GiB in 1.1 s with it, 0.3 s without). The
    number torch gives new threads is put back when they are done."""
    import torch

    local = threading.local()
    opened: list[TensorValues] = []
    lock = threading.Lock()
    threads = torch.get_num_threads()

    def scan(unit: Unit) -> Found:
        source = getattr(local, "source", None)
        if source is None:
            torch.set_num_threads(1)  # this thread's (OpenMP), and new threads'
            source = local.source = TensorValues(ckpt)
            with lock:
                opened.append(source)
        return valuescan.scan(source, unit.tensor, unit.compare)

    try:
        with ThreadPoolExecutor(jobs, thread_name_prefix="ckptool-values") as pool:
            try:
                yield from pool.map(scan, units)
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
    finally:
        torch.set_num_threads(threads)
        for source in opened:
            source.close()


# -- what is said ---------------------------------------------------------------
def _file(ckpt: Checkpoint, t: TensorInfo, files: list[str] | None = None) -> str | None:
    """The file holding ``t`` (relative to the directory, or the file's name)."""
    if not ckpt.is_multifile:
        return os.path.basename(ckpt.path)
    where = files or sorted({c.file for c in t.chunks} or {located(ckpt, t).file or ""})
    return where[0] if len(where) == 1 and where[0] else None


def _report(ckpt: Checkpoint, unit: Unit, got: Found, problems: list[Problem],
            summary: dict[str, Any]) -> None:
    key, t = unit.key, unit.tensor
    if got.skipped is not None:
        summary["skipped"][key] = got.skipped
        return
    if got.error is not None:
        problems.append(Problem(classify(got.error, UNREADABLE),
                                f"its values cannot be read: {got.error}",
                                file=_file(ckpt, t), tensor=key))
        return
    summary["tensors_read"] += 1
    summary["bytes_read"] += got.nbytes
    where = f" (in {', '.join(got.files)})" if len(got.files) > 1 else ""
    what = "" if unit.whole else f" in the stored values ({t.key.rsplit('/', 1)[-1]})"
    tied = [n for n in unit.names if n != key]
    also = f"; tied to {', '.join(tied)}" if tied and unit.whole else ""
    of = f" of {got.numel:,} {t.dtype} values{what}{where}{also}"
    if got.nan:
        summary["nan"][key] = summary["nan"].get(key, 0) + got.nan
        problems.append(Problem("nan", f"{got.nan:,} NaN{of}",
                                file=_file(ckpt, t, got.files), tensor=key))
    if got.inf:
        signs = f" ({got.inf - got.inf_neg:,} +Inf, {got.inf_neg:,} -Inf)" \
            if t.dtype not in dtypes.COMPLEX else ""
        summary["inf"][key] = summary["inf"].get(key, 0) + got.inf
        problems.append(Problem("inf", f"{got.inf:,} Inf{of}{signs}",
                                file=_file(ckpt, t, got.files), tensor=key))
    if got.zero and unit.whole and got.numel >= 2:
        summary["all_zero"].append(key)
        problems.append(Problem("all-zero", f"every one of its {got.numel:,} values is zero"
                                f"{_zero_hint(key, t)}", file=_file(ckpt, t), tensor=key,
                                severity=WARNING))


def _zero_hint(key: str, t: TensorInfo) -> str:
    """Why a tensor of zeros may be fine, or why it may not."""
    name = split_key(key)[-1] if key else key
    last = name.rsplit(".", 1)[-1]
    if last == "bias" or last.endswith("_bias"):
        return " (biases often start at zero)"
    if last in MOMENTS:
        return " (optimizer moments are zero until the first step)"
    if last == "running_mean":
        return " (running statistics start at zero)"
    if dtypes.is_floating(t.dtype) and len(t.shape) >= 2:
        return " (a weight of zeros: part of a file that was never written reads as zeros)"
    return ""


def _same_values(ckpt: Checkpoint, units: list[Unit], found: list[Found],
                 classes: dict[str, str], problems: list[Problem],
                 summary: dict[str, Any]) -> None:
    """Tensors of equal fingerprints read again and compared by digest."""
    buckets: dict[tuple[Any, ...], list[Unit]] = {}
    for unit, got in zip(units, found, strict=True):
        if got.fingerprint is not None and not got.zero:
            t = unit.tensor
            buckets.setdefault((t.dtype, t.shape, got.fingerprint), []).append(unit)
    with TensorValues(ckpt) as source:
        for bucket in buckets.values():
            if len({classes[u.key] for u in bucket}) < 2:
                continue
            by_digest: dict[str, list[Unit]] = {}
            for unit in bucket:
                try:
                    digest = tensor_digest(source.values(unit.tensor))
                except (InputError, OSError):  # it was read a moment ago: said above if not
                    continue
                group = by_digest.setdefault(digest, [])
                if all(classes[u.key] != classes[unit.key] for u in group):
                    group.append(unit)
            for group in by_digest.values():
                if len(group) > 1:
                    _say_same(ckpt, group, problems, summary)


def _say_same(ckpt: Checkpoint, group: list[Unit], problems: list[Problem],
              summary: dict[str, Any]) -> None:
    first, second, rest = group[0], group[1], group[2:]
    summary["same_values"] += [[first.key, u.key] for u in group[1:]]
    t = first.tensor
    more = ""
    if rest:
        shown = ", ".join(u.key for u in rest[:3])
        more = f", as {'has' if len(rest) == 1 else 'have'} {plural(len(rest), 'more tensor')}" \
               f" ({shown}{' …' if len(rest) > 3 else ''})"
    problems.append(Problem(
        "same-values", f"the same values as {first.key} ({t.dtype} {shape_text(t.shape)})"
        f"{more}, and nothing in the checkpoint ties them{_same_hint(ckpt, group)}",
        file=_file(ckpt, second.tensor), tensor=second.key, severity=WARNING))


def _same_hint(ckpt: Checkpoint, group: list[Unit]) -> str:
    """Where copies are what the writer makes of tied weights, say so."""
    ranks = {ties.rank(split_key(u.key)[-1]) for u in group}
    if len(group) != 2 or ranks != {0, 2}:
        return " (a copy where a tie was meant, or data written twice?)"
    if ckpt.format == "dcp":
        return " (DCP writes tied weights as copies: expected if the model ties its " \
               "embeddings)"
    if ckpt.framework is not None and ckpt.framework.tie_word_embeddings:
        return " (config.json ties the word embeddings: the model loads one of them)"
    return " (an embedding and its output head: a copy where a tie was meant?)"

