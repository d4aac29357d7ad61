"""What ``convert --unstack-layers`` and ``convert --map`` write of a Megatron
checkpoint: a view of derived tensors (``ckptool.read.derived``) over the
checkpoint read, and, for a map, the ``config.json`` of the model it makes.

- ``--unstack-layers``: each stacked tensor of a ``torch_dist`` checkpoint
  (``decoder.layers.X`` of shape ``[L, ...]``) as one tensor per layer, under
  the name the model's module gives it (``decoder.layers.3.X``); an expert's
  (``decoder.layers.mlp.experts.linear_fc1.weight`` of ``[L, E, ...]``) as
  ``decoder.layers.3.mlp.experts.local_experts.1.linear_fc1.weight``, as
  Megatron-core's ``SequentialMLP`` names it. A legacy checkpoint's layers
  are already one per name. Every other tensor is kept as it is. A run of
  Megatron-core's local layer spec (``transformer_impl`` "local") saved its
  norms under Transformer Engine's names: they get the module's back
  (``input_layernorm.weight``, ``pre_mlp_layernorm.weight``).
- ``--map NAME``: the per-layer tensors as the Hugging Face model ``NAME``
  (``hfmap``) loads them; a stacked checkpoint is unstacked on the way, each
  output tensor made from the stacked tensor directly.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError, UsageError
from ckptool.model import Checkpoint
from ckptool.read import derived
from ckptool.read.derived import Derived
from ckptool.read.megatron import hfmap
from ckptool.read.megatron.stacked import STACKED, is_stacked

# Megatron-core's local layer spec saves its norms under Transformer Engine's
# names (gpt_layer_specs.py: ``sharded_state_dict_keys_map``); its modules
# name them as these, so a run with ``transformer_impl`` "local" gets them back
LOCAL_NAMES = ((".self_attention.linear_qkv.layer_norm_", ".input_layernorm."),
               (".mlp.linear_fc1.layer_norm_", ".pre_mlp_layernorm."))
# a layer's tensor under its number (a run whose layers are not all alike, or
# a legacy join)
NUMBERED = re.compile(r"(?:^|\.)layers\.[0-9]+\.")
# the most tensors the stacked tensors are unstacked into, in all (layers x
# experts, summed): above any model's (DeepSeek-V3: 61 layers of 256 experts,
# a few stacks of them), and a bound on the work of a crafted one
MAX_UNSTACKED = 1 << 18
# the experts of a stacked layer: what follows "experts." (SequentialMLP's
# sharded keys hold "experts.experts." in some versions)
_EXPERTS = re.compile(r"^(?P<head>.*\.mlp\.experts\.)(?:experts\.)?(?P<tail>linear_fc[12]\..+)$")


def for_convert(ckpt: Checkpoint, unstack: bool, hf_map: str | None) -> tuple[
        Checkpoint, dict[str, Any] | None]:
    """The view ``convert`` writes, and the ``config.json`` of a map."""
    meta = ckpt.metadata.get("megatron")
    option = f"--map {hf_map}" if hf_map else "--unstack-layers"
    if not isinstance(meta, dict):
        raise UsageError(f"{option} reads a Megatron checkpoint; {ckpt.path} is {ckpt.format}",
                         f"leave {option} out")
    args: dict[str, Any] = meta.get("args") or {}
    layers = _per_layer(ckpt, args)
    if hf_map is None:
        stacks = {d.source for d in layers if d.index}
        notes = [f"the layers stacked in {len(stacks)} tensors written one per layer ("
                 f"{sum(1 for d in layers if d.index)} tensors)"] if stacks else []
        return derived.view(ckpt, layers, notes, {"megatron": meta}), None
    by_name = {d.key: d for d in layers}
    sources = {t.key: t for t in ckpt.tensors}
    sizes = {d.key: d.shape(sources[d.source].shape) for d in layers}
    if hf_map.endswith((".toml", ".json")):  # a user's own rules
        from ckptool.read.megatron import rulesfile

        tensors, config, notes = rulesfile.plan(hf_map, sizes, args)
    elif hf_map in hfmap.MAPS:
        made = hfmap.plan(hf_map, sizes, args)
        tensors, config, notes = made.tensors, made.config, made.notes
    else:
        raise UsageError(f"--map {hf_map}: ckptool maps Megatron GPT models to "
                         f"{', '.join(hfmap.MAPS)}, or by a rules file (.toml, .json)",
                         "name one of them")
    out = [_compose(d, by_name[d.source]) for d in tensors]
    return derived.view(ckpt, out, notes, {"megatron": meta}), config


def _per_layer(ckpt: Checkpoint, args: dict[str, Any]) -> list[Derived]:
    """Each tensor of the model's state dict under its per-layer name (its
    layer, and expert, selected from a stacked tensor), made from its key."""
    entry = ckpt.metadata.get("state_dict_entry")
    prefix = f"{entry}." if isinstance(entry, str) else ""
    experts = args.get("num_experts")
    local = args.get("transformer_impl") == "local"
    out: list[Derived] = []
    total = 0
    tensors = {name.removeprefix(prefix): t for name, t in ckpt.state_dict().items()}
    _check_stacks(tensors, args)
    for name, t in tensors.items():
        if local and (is_stacked(name) or NUMBERED.search(name)):
            for saved, module in LOCAL_NAMES:
                name = name.replace(saved, module)
        if not is_stacked(name):
            m = _EXPERTS.match(name)
            if m is not None and NUMBERED.search(name) and isinstance(experts, int) and \
                    t.shape and t.shape[0] == experts and (
                        ".experts.experts." in name or len(t.shape) >= 3):
                # a numbered layer's experts, stacked on their own axis: a run whose
                # layers are not all alike (moe_layer_freq) saves each layer apart
                total += experts
                _bounded(name, f"{experts} experts", experts, total)
                out += [Derived(f"{m.group('head')}local_experts.{e}.{m.group('tail')}",
                                t.key, (e,)) for e in range(experts)]
                continue
            out.append(Derived(name, t.key))
            continue
        if not t.shape:
            raise UsageError(f"{name} is a scalar: it holds no stacked layers",
                             "leave --unstack-layers out")
        m = _EXPERTS.match(name)
        grouped = m is not None and isinstance(experts, int) and len(t.shape) >= 3 \
            and t.shape[1] == experts
        count = t.shape[0] * (t.shape[1] if grouped else 1)
        total += count
        _bounded(name, f"{t.shape[0]} layers of {t.shape[1]} experts" if grouped else
                 f"{t.shape[0]} layers", count, total)
        if t.shape[0] == 0:  # no layers: nothing to unstack, kept as it is
            out.append(Derived(name, t.key))
            continue
        for i in range(t.shape[0]):
            if grouped:
                assert m is not None
                head = STACKED.sub(f".layers.{i}.", m.group("head"), count=1).lstrip(".")
                out += [Derived(f"{head}local_experts.{e}.{m.group('tail')}", t.key, (i, e))
                        for e in range(t.shape[1])]
            else:
                layer = STACKED.sub(f".layers.{i}.", name, count=1).lstrip(".")
                out.append(Derived(layer, t.key, (i,)))
    return out


def _bounded(name: str, what: str, count: int, total: int) -> None:
    if count > MAX_UNSTACKED or total > MAX_UNSTACKED:  # (shapes of no bytes: [10**8, 0])
        raise UnsupportedCheckpointError(
            f"{name} holds {what} stacked, more than ckptool unstacks ({MAX_UNSTACKED} "
            "tensors in all)", "convert it without --unstack-layers or --map")


def _check_stacks(tensors: dict[str, Any], args: dict[str, Any]) -> None:
    """Every stack of one block (``decoder.``) holds as many layers, and the
    decoder's as many as ``args.num_layers``: Megatron's load refuses other
    global shapes, and an unstacked extra layer would be a half layer."""
    axes: dict[str, dict[int, str]] = {}
    for name, t in tensors.items():
        found = STACKED.search(name)
        if found is not None and t.shape:
            axes.setdefault(name[:found.start()], {}).setdefault(t.shape[0], name)
    for block, seen in axes.items():
        want = args.get("num_layers") if block == "decoder" else None
        if len(seen) > 1 or (isinstance(want, int) and not isinstance(want, bool)
                             and set(seen) != {want}):
            said = ", ".join(f"{n} ({k})" for n, k in sorted(seen.items())[:3])
            raise CorruptCheckpointError(
                f"the {block or 'model'}'s stacked tensors hold {said} layers"
                + (f", and args say num_layers {want}" if isinstance(want, int) else ""),
                "Megatron's dist_checkpointing refuses these shapes: the checkpoint is "
                "damaged, or its common.pt is another run's")


def _compose(outer: Derived, inner: Derived) -> Derived:
    """``outer`` (made from a per-layer tensor) made from what ``inner``
    makes that tensor of: one step from the stacked tensor."""
    assert not inner.rows and not inner.transpose
    return replace(outer, source=inner.source, index=inner.index + outer.index)
