"""What ``convert`` writes, decided before a byte is written: the tensors
under their names, the names that share one of them (tied weights), the
plain values kept, and what is left out, said rather than dropped.

- A model file (safetensors, a Hugging Face directory, a torch file from a
  torch file) holds the main state dict. Of a DCP checkpoint saved as
  ``{"model": ..., "optim": ...}`` that is the model's, under its own names
  (``fc.weight``, not ``model.fc.weight``): what ``model.load_state_dict``
  takes, and what ``torch.load(dcp_to_torch_save(...))["model"]`` holds.
- A torch file or a DCP directory made from a DCP checkpoint holds all of it,
  nested as it was saved (``tree``): every tensor, and the plain values
  (step, epoch, param_groups) as values, as ``dcp_to_torch_save`` writes it.
- From safetensors: every tensor, and the aliases ``convert`` recorded.
  From Hugging Face shards: the aliases the index records.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from ckptool import dtypes
from ckptool.describe import plural, shell_word
from ckptool.errors import UnsupportedCheckpointError
from ckptool.keys import unescape
from ckptool.model import Checkpoint, TensorInfo
from ckptool.read import ties
from ckptool.read.formats.safetensors_fmt import SAFETENSORS
from ckptool.read.layouts.dcp import DCP
from ckptool.read.layouts.deepspeed import DEEPSPEED
from ckptool.read.ties import recorded_aliases
from ckptool.read.values import is_plain
from ckptool.write.fix.plan import CASTABLE
from ckptool.write.formats.safetensors import ST_CODES

TORCH, WHOLE = "torch", "whole"  # into a torch file; into a torch file or DCP, all of it


@dataclass
class Written:
    """What one conversion writes."""

    tensors: dict[str, TensorInfo]  # name -> tensor, each written once
    aliases: dict[str, str] = field(default_factory=dict)  # another name -> the name kept
    copies: list[str] = field(default_factory=list)  # views written as their own copy
    entries: dict[str, Any] = field(default_factory=dict)  # plain values kept
    left_out: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # a nested tree (DCP into a torch file or DCP): each name's path in it
    paths: dict[str, tuple[str | int, ...]] = field(default_factory=dict)
    unplain: list[str] = field(default_factory=list)  # DCP values that are not plain data
    order: list[str] = field(default_factory=list)  # tensors and aliases, as in the source
    # fix on shards: the dtype a tensor is written as, the device tag it is saved on
    cast: dict[str, str] = field(default_factory=dict)
    location: dict[str, str] = field(default_factory=dict)

    def dtype(self, name: str) -> str:
        return self.cast.get(name) or self.tensors[name].dtype

    def nbytes(self, name: str) -> int:
        """The bytes tensor ``name`` is written as."""
        return self.tensors[name].numel * dtypes.itemsize(self.dtype(name))

    def names(self) -> list[str]:
        """Every name a torch file holds, tensors and aliases, in the source's order."""
        return self.order or [*self.tensors, *self.aliases]


def plan(source: Checkpoint, into: str, keep_entries: bool = True) -> Written:
    """What ``source`` becomes ``into`` SAFETENSORS, TORCH (a model file) or
    WHOLE (a torch file or DCP directory holding everything a DCP checkpoint
    does). Into one safetensors file, plain entries are kept in its
    ``__metadata__`` (not with ``keep_entries=False``: Hugging Face shards)."""
    if source.format == DCP and into == WHOLE:
        return _whole_dcp(source)
    if source.format == SAFETENSORS:  # a tied name is listed, sharing its twin's storage
        kept = {unescape(t.key): t for t in source.tensors
                if unescape(t.key) not in source.aliases}
        aliases, notes = recorded_aliases(source.metadata.get("metadata", {}), set(kept))
        return Written(kept, aliases, notes=notes)
    kind = SAFETENSORS if into == SAFETENSORS else TORCH
    every = source.state_dict()  # (once: 100,000 tensors' worth of lookups)
    kept, aliases, copies = _plan_names(source, kind, every)
    # into safetensors, what is left out is said once the entries kept are known
    written = Written(kept, aliases, copies,
                      left_out=[] if into == SAFETENSORS else _left_out(source, kind, every=every))
    for alias, stored in source.aliases.items():  # an HF index's tied names
        if stored in kept and alias not in kept:
            written.aliases[alias] = stored
    written.order = [n for n in every if n in kept or n in written.aliases] \
        if written.aliases else [n for n in every if n in kept]
    written.order += [a for a in written.aliases if a not in written.order]
    entry = source.metadata.get("state_dict_entry")
    if source.format == DCP and isinstance(entry, str):  # the model's own names
        _rename(written, {n: n.removeprefix(f"{entry}.") for n in kept})
        written.notes.append(f"the '{entry}' entry's tensors, under the names the model "
                             f"gives them (without '{entry}.')")
    if into == SAFETENSORS:
        bad = sorted({t.dtype for t in written.tensors.values() if t.dtype not in ST_CODES})
        if bad:
            names = [n for n, t in written.tensors.items() if t.dtype in bad]
            raise UnsupportedCheckpointError(
                f"safetensors cannot hold {', '.join(bad)} tensors ({', '.join(names[:3])}"
                f"{' …' if len(names) > 3 else ''})", _unholdable_hint(source, bad))
        for e in source.entries if keep_entries else ():
            if e.type != "alias" and (e.value is not None or e.summary == "None") \
                    and not _file_record(source, e.key):
                written.entries[e.key] = e.value
        written.left_out = _left_out(source, kind, written.entries, every)
    return written


def _unholdable_hint(source: Checkpoint, bad: list[str]) -> str:
    """What works for dtypes safetensors has no code for: a torch file keeps
    them (complex, quantized: a cast to a real float would lose half)."""
    if source.format in ("torch-zip", "torch-legacy", "pickle"):
        keep = "keep the torch file, which holds them (ckptool.load and torch.load read it)"
    elif any(d in dtypes.QUANTIZED for d in bad):
        keep = "keep the checkpoint as it is"
    else:
        keep = (f"write a torch file instead, which keeps them: ckptool convert "
                f"{shell_word(source.path)} {shell_word(_torch_name(source.path))}")
    if any(d in dtypes.QUANTIZED for d in bad):
        return keep + "; or store t.dequantize() (floats) from torch"
    if any(d in dtypes.COMPLEX for d in bad):
        return keep + "; or store torch.view_as_real(t) (their real and imaginary parts)"
    return keep


def _torch_name(path: str) -> str:
    stem = os.path.splitext(os.path.normpath(path))[0]
    return stem + (".pt" if not path.endswith(".pt") else ".converted.pt")


def cast(written: Written, dtype: str) -> None:
    """``--dtype``: every floating tensor written as ``dtype`` (as ``fix`` casts)."""
    for name, t in written.tensors.items():
        if t.dtype in CASTABLE and t.dtype != dtype:
            written.cast[name] = dtype


def _rename(written: Written, names: dict[str, str]) -> None:
    written.tensors = {names.get(n, n): t for n, t in written.tensors.items()}
    written.aliases = {names.get(a, a): names.get(k, k) for a, k in written.aliases.items()}
    written.copies = [names.get(n, n) for n in written.copies]
    written.order = [names.get(n, n) for n in written.order]


def _whole_dcp(source: Checkpoint) -> Written:
    """Every tensor and plain value of a DCP checkpoint, nested as saved;
    names are the raw fully qualified names (``.metadata``'s, as the tree's
    paths are keyed), not key text."""
    written = Written({unescape(t.key): t for t in source.tensors if t.chunks})
    root = source.root if isinstance(source.root, dict) else {}
    for fqn, value in root.items():
        if fqn in written.tensors or not isinstance(fqn, str):
            continue
        if is_plain(value):
            written.entries[fqn] = value
        else:
            written.unplain.append(fqn)
            written.left_out.append(f"{fqn} ({type(value).__name__}: not plain data)")
    written.paths = {fqn: source.tree_paths.get(fqn, (fqn,))
                     for fqn in [*written.tensors, *written.entries]}
    extra = [t.key for t in source.tensors if not t.chunks]
    if extra:
        written.left_out.append(f"{plural(len(extra), 'tensor')} inside values or meta.pt "
                                f"(e.g. {extra[0]})")
    return written


def _unwritten(t: TensorInfo, into: str) -> str | None:
    """Why a tensor of the state dict is not written ``into`` safetensors or
    torch, or None. (safetensors refuses quantized dtypes outright.)"""
    if t.parts:
        holds = "safetensors holds" if into == SAFETENSORS else "convert writes"
        return (f"a {t.layout} tensor: {holds} dense tensors only; .to_dense() it first "
                "to keep it")
    if t.layout == "quantized" and into != SAFETENSORS:
        return "a quantized tensor: convert writes plain tensors only; .dequantize() it " \
               "first to keep it"
    return None


def _plan_names(source: Checkpoint, into: str, every: dict[str, TensorInfo]) -> tuple[
        dict[str, TensorInfo], dict[str, str], list[str]]:
    """Of the main state dict ``every`` written ``into`` safetensors or torch:
    (tensors to write, aliases, names written as copies of shared storage)."""
    sd = {name: t for name, t in every.items()
          if not (t.parts or t.layout == "quantized") or _unwritten(t, into) is None}
    if not sd:
        raise _nothing_to_convert(every, into)
    share_count = Counter(map(attrgetter("storage"), sd.values()))
    # names of one tensor (the same view of one storage): one is kept, by
    # the framework's rule (the input embedding, not lm_head: read/ties.py);
    # a name alone on its storage (or with none) is one tensor alone
    same: dict[tuple[Any, ...], list[str]] = {}
    for name, t in sd.items():
        if t.storage is not None and share_count[t.storage] > 1:
            ident = (t.storage, t.storage_offset, t.shape, t.stride, t.dtype)
            same.setdefault(ident, []).append(name)
    # a name the checkpoint records as tied, not stored (an index's, DeepSpeed's
    # shared_params), stays the alias: the stored name is what its files hold
    aliases = {n: keep for names in same.values() if len(names) > 1
               for keep in (ties.preferred([n for n in names if n not in source.aliases]
                                           or names),) for n in names if n != keep}
    kept = {name: t for name, t in sd.items() if name not in aliases} if aliases else sd
    targets = set(aliases.values())
    copies = [n for n, t in kept.items() if t.storage is not None
              and share_count[t.storage] > 1 and n not in targets]
    return kept, aliases, copies


def _nothing_to_convert(every: dict[str, TensorInfo], into: str) -> UnsupportedCheckpointError:
    """The error for a file with no state dict, or none of whose tensors is written."""
    name = next(iter(every), None)
    why = ("no dict in the file holds tensors only" if name is None else
           f"{name} ({_unwritten(every[name], into)})"
           + (f" and {len(every) - 1} more" if len(every) > 1 else ""))
    return UnsupportedCheckpointError(f"no dense state dict to convert: {why}",
                                      "see `ckptool inspect` for what the file holds")


def _left_out(source: Checkpoint, into: str, kept_entries: Collection[str] = (),
              every: dict[str, TensorInfo] | None = None) -> list[str]:
    """What the output does not hold, never dropped silently: the state
    dict's tensors not written, the tensors outside it, the entries not kept.
    ``every``: ``source.state_dict()``, when the caller has it."""
    out = []  # tensors first: what a reader of a long list most needs to see
    values = [f"{e.key} ({e.type})" for e in source.entries
              if e.key not in kept_entries and e.type != "alias"
              and not _file_record(source, e.key)]
    records = sorted({e.key.split("/", 1)[0] for e in source.entries
                      if _file_record(source, e.key)}
                     | {t.key.split("/", 1)[0] for t in source.tensors
                        if _file_record(source, t.key)})
    if records:  # what DeepSpeed keeps to resume training, said once per file
        values.insert(0, f"what DeepSpeed keeps to resume training, in "
                      f"{plural(len(records), 'file')}: optimizer states, ds_config, the "
                      "module as trained")
    for name, t in (source.state_dict() if every is None else every).items():
        why = _unwritten(t, into)
        if why is not None:
            out.append(f"{name} ({why})")
    sd = source.main_state_dict
    if sd is None:
        return out + values
    if sd.path:
        outside = [t.key for t in source.tensors if not t.key.startswith(f"{sd.path}/")]
    elif source.is_multifile:  # a flat dict of many entries (DCP): by key
        keys = {sd.tensor_key(k) for k in sd.keys}
        outside = [t.key for t in source.tensors if t.key not in keys]
    else:
        outside = []
    outside = [k for k in outside if not _file_record(source, k)]
    if outside:
        where = f"'{sd.path}'" if sd.path else "the state dict"
        out.append(f"{plural(len(outside), 'tensor')} outside {where} (e.g. {outside[0]})")
    return out + values


def _file_record(source: Checkpoint, key: str) -> bool:
    """A key of a DeepSpeed checkpoint's file records (``<name.pt>/...``), beside
    its state dict."""
    return source.format == DEEPSPEED and key.startswith("<")
