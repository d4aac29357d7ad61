"""``ckptool.load_state_dict``: the flat ``{name: tensor}`` a model's
``load_state_dict(strict=True)`` takes, from any checkpoint ckptool reads.

- The main state dict, wherever it sits (``state_dict``, ``model``, a
  pickled module, Hugging Face shards, DCP's ``model`` entry, DeepSpeed's
  consolidated fp32 weights), read one tensor at a time
  (``read.tensor_source.TensorValues``): only its tensors' bytes are read,
  and nothing from the file runs, whatever else the file names.
- With ``model`` (an ``nn.Module``), its keys are reconciled as ``diagnose``
  reconciles them: the one prefix rewrite (strip ``module.``, add ``model.``...)
  that makes the keys match is applied, and a key the model ties to a key the
  checkpoint has (``head.weight`` = ``embed.weight``) is given that tensor.
  Nothing else is changed silently: where keys are still missing, left over
  or shaped differently, a ``StateDictMismatch`` carries the findings and the
  message ``diagnose`` prints. ``strict=False`` returns what
  ``load_state_dict(strict=False)`` takes instead: the model's keys, each with
  the model's shape; what it leaves out (keys the model does not have, keys
  shaped differently) is said in a ``StateDictMismatchWarning``.
- ``map_location`` (default ``"cpu"``) places every tensor; ``dtype`` casts
  floating tensors (``torch.bfloat16``, ``"bf16"``...).
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

from ckptool import dtypes
from ckptool.check import manyfiles
from ckptool.check.adapters import AdapterMatch
from ckptool.check.diagnosis import diagnose
from ckptool.check.findings import Finding, some_keys
from ckptool.check.gpus.machine import assumed
from ckptool.check.loadnames import Loaded, LoadNames
from ckptool.check.modelspec import module_keys
from ckptool.errors import CkptoolError, UnsupportedCheckpointError, UsageError
from ckptool.read.companions import why_no_weights
from ckptool.read.materialize import Builder, MapLocation, Placement, pick
from ckptool.read.reader import open_checkpoint
from ckptool.read.tensor_source import TensorValues
from ckptool.write.fix.plan import DTYPE_NAMES

if TYPE_CHECKING:
    import torch

KEY_CODES = ("key-prefix", "missing-keys", "unexpected-keys", "shape-mismatch", "tied-keys",
             "no-state-dict")


class StateDictMismatch(CkptoolError):
    """The checkpoint's state dict does not fit the model: ``findings`` say how."""

    def __init__(self, message: str, hint: str, findings: list[Finding]) -> None:
        super().__init__(message, hint)
        self.findings = findings


class StateDictMismatchWarning(UserWarning):
    """``strict=False`` left out keys that do not fit the model (ones it does
    not have, ones shaped differently): ``findings`` say how."""

    def __init__(self, message: str, findings: list[Finding]) -> None:
        super().__init__(message)
        self.findings = findings


def load_state_dict(path: str | os.PathLike[str], model: Any = None, *,
                    map_location: MapLocation = "cpu", dtype: Any = None,
                    strict: bool = True) -> dict[str, torch.Tensor]:
    """The main state dict of the checkpoint at ``path`` as real tensors,
    renamed to fit ``model`` where one is given (see the module docstring)."""
    path = os.fspath(path)
    ckpt = open_checkpoint(path)
    sd = ckpt.main_state_dict
    if sd is None:
        raise CkptoolError(f"{path}: {why_no_weights(ckpt)}",
                           "`ckptool inspect` shows what it holds")
    cast = _dtype(dtype)
    entry = manyfiles.entry_prefix(ckpt)  # DCP's "model.": how it loads, not a name
    tensors = {name[len(entry):]: t for name, t in ckpt.state_dict().items()}
    # tied names (an index's, DeepSpeed's, a safetensors file's __metadata__):
    # each the same tensor as the name stored
    aliases = {a[len(entry):]: k[len(entry):] for a, k in ckpt.aliases.items()}
    names = {**{n: n for n in tensors}, **{a: k for a, k in aliases.items() if k in tensors}}
    gathered: dict[str, Loaded] = {}  # names the model's library makes of several keys
    load_names = None
    if model is not None:
        keys = module_keys(model)
        report = diagnose(ckpt, assumed(0), keys)
        if report.adapter is not None:
            names = _adapter_names(path, type(model).__name__, report.adapter, names, report)
            model = None  # named: nothing else to fit
    if model is not None:
        assert report.keys is not None
        found = [f for f in report.findings if f.code in KEY_CODES]
        rewrite = report.keys.rewrite
        # a tied name the model does not have is no weight of its own: left out
        load_names = report.load_names
        if load_names is not None:  # named as the model's library loads them
            names, gathered = _as_loaded(load_names, {rewrite.apply(n): stored for n, stored
                                                      in names.items()}, keys.shapes,
                                         {rewrite.apply(a) for a in aliases})
        else:
            names = {rewrite.apply(n): stored for n, stored in names.items()
                     if n not in aliases or rewrite.apply(n) in keys.shapes}
        for missing, twin in report.keys.tied_missing.items():
            if twin in names:
                names[missing] = names[twin]  # the model ties them: the same tensor
        bad = [f for f in found if f.code in ("missing-keys", "unexpected-keys",
                                              "shape-mismatch")]
        if bad and strict:
            raise StateDictMismatch(
                f"{path} does not fit {type(model).__name__}: "
                + "; ".join(f"{f.code}: {f.message}" for f in bad),
                "see `ckptool diagnose` for the whole report, or pass strict=False",
                found)
        if not strict:
            fits = {n: g for n, g in gathered.items() if load_names is not None
                    and load_names.made_shapes(g, {k: tensors[k].shape for k in g.sources})
                    .get(n, ()) == keys.shapes.get(n)}
            names = _what_fits(path, type(model).__name__, names, tensors, keys.shapes, bad,
                               [n for n in gathered if n not in fits])
            gathered = fits
    place = Placement(map_location)
    out: dict[str, torch.Tensor] = {}
    made: dict[str, torch.Tensor] = {}
    tree: Any = None  # sparse, nested, quantized: the file built once, each taken from it

    def value_of(stored: str) -> torch.Tensor:
        nonlocal tree
        if stored not in made:
            t = tensors[stored]
            if t.layout == "strided" and not t.parts:
                value = values.values(t)
            else:
                if ckpt.is_multifile:
                    raise UnsupportedCheckpointError(
                        f"{t.key} is a {t.layout} tensor in {t.file or 'a shard'}: "
                        "ckptool builds those from single files", "name the file")
                if tree is None:
                    tree = Builder(ckpt, "cpu", mmap=True).build(ckpt.root)
                value = pick(tree, t.key)
            value = place.tensor(value, t.location or "cpu")
            if cast is not None and value.is_floating_point():
                value = value.to(cast)
            made[stored] = value
        return made[stored]

    with TensorValues(ckpt) as values:
        for name, stored in names.items():
            out[name] = value_of(stored)
        for target, group in gathered.items():
            parts: dict[str, list[torch.Tensor]] = {}
            for source, pattern in zip(group.sources, group.patterns, strict=True):
                parts.setdefault(pattern, []).append(value_of(source))
            assert load_names is not None
            out.update(load_names.make(group.converter, target, parts))
            for source in group.sources:  # each part is used once
                made.pop(source, None)
    return out


def _adapter_names(path: str, model: str, match: AdapterMatch, names: dict[str, str],
                   report: Any) -> dict[str, str]:
    """A PEFT adapter's keys as the PEFT-wrapped ``model`` names them (its
    adapter's name inserted, as ``set_peft_model_state_dict`` does); an
    adapter against a model no adapter wraps is refused with the loader."""
    found = [f for f in report.findings if f.code == "adapter-mismatch"]
    if found:
        raise StateDictMismatch(f"{path} does not fit {model}: {found[0].message}",
                                "an adapter loads into the base model it was trained on",
                                found)
    if match.wrapped is None:
        raise UsageError(
            f"{path} is a PEFT adapter: {model} is the model it adapts, which has no place "
            "for the adapter's weights",
            "load it with PeftModel.from_pretrained(model, path), or pass the model "
            "get_peft_model returns (load its result with strict=False: an adapter holds "
            "no base weights)")
    return {match.names.get(n, n): stored for n, stored in names.items()}


def _as_loaded(load_names: LoadNames, names: dict[str, str], expected: dict[str, Any],
               aliases: set[str]) -> tuple[dict[str, str], dict[str, Loaded]]:
    """``names`` (name: stored key) as the model's library loads them: the
    renamed ones, and those it makes of several keys (their sources given
    as stored keys). A tied name (of ``aliases``) the model lacks is left out."""
    plain: dict[str, str] = {}
    gathered: dict[str, Loaded] = {}
    for name, entry in load_names.loaded(names, expected).items():
        if entry.converter is None:
            if entry.sources[0] not in aliases or name in expected:
                plain[name] = names[entry.sources[0]]
        else:
            gathered[name] = Loaded(name, [names[s] for s in entry.sources], entry.converter,
                                    entry.patterns, entry.also)
    return plain, gathered


def _what_fits(path: str, model: str, names: dict[str, str], tensors: dict[str, Any],
               shapes: dict[str, tuple[int, ...] | None],
               findings: list[Finding], unmade: list[str]) -> dict[str, str]:
    """The names ``load_state_dict(strict=False)`` takes: the model's, each
    with the model's shape. What is left out (with ``unmade``: tensors the
    model's library gathers from several keys that these keys do not make
    in the model's shape) is said in a ``StateDictMismatchWarning``."""
    kept: dict[str, str] = {}
    unexpected: list[str] = []
    mismatched: list[str] = list(unmade)
    for name, stored in names.items():
        if name not in shapes:
            unexpected.append(name)
        elif (want := shapes[name]) is not None and tuple(tensors[stored].shape) != want:
            mismatched.append(name)
        else:
            kept[name] = stored
    if unexpected or mismatched:
        left = [f"{len(mismatched)} shaped differently ({some_keys(mismatched)})"
                ] if mismatched else []
        if unexpected:
            left.append(f"{len(unexpected)} the model does not have ({some_keys(unexpected)})")
        # (the findings, with their shapes and fixes, are the warning's .findings)
        warnings.warn(StateDictMismatchWarning(
            f"{path} does not fit {model}: left out {' and '.join(left)} "
            "(`ckptool diagnose --model` says why)", findings), stacklevel=3)
    return kept


def _dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None:
        return None
    import torch

    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    name = dtypes.canonical(DTYPE_NAMES.get(str(dtype), str(dtype)))
    found = getattr(torch, name, None) if name else None
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise UsageError(f"not a floating dtype: {dtype!r}",
                         "pass torch.bfloat16, 'bf16', 'float16'...")
    return found

