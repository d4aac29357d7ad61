"""What a merged Megatron-core GPT model is, read from its state dict's
names and shapes and its ``args``, and the bookkeeping of a plan.

Owns the source names (``LAYER``, ``EXPERT``, ``EMBEDDING``, ``POSITIONS``,
``FINAL_NORM``, ``OUTPUT``) and the roles of a layer's tensors under their
Megatron-core local and Transformer Engine names; ``Builder``, which checks
every output tensor's shape as it is placed and refuses leftovers;
``read_model``, the sizes, norm, dtype, vocabulary and tying every map
starts from; and the pieces every map writes alike: the embeddings, the final
norm and ``lm_head``, a layer's role, the query/key/value row runs of a
``linear_qkv``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ckptool.errors import UnsupportedCheckpointError
from ckptool.read.derived import Derived
from ckptool.read.megatron import facts
from ckptool.read.megatron.hfmap.unexpressed import unexpressed

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)"
                    r"|(linear_fc[12])\.(weight|bias)(\d+))$")
EMBEDDING = "embedding.word_embeddings.weight"
POSITIONS = "embedding.position_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm"
OUTPUT = "output_layer.weight"

# the roles of a layer's tensors: each under its Megatron-core local and
# Transformer Engine names
_ROLES: dict[str, tuple[str, ...]] = {
    "attn_norm.weight": ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
    "attn_norm.bias": ("input_layernorm.bias", "self_attention.linear_qkv.layer_norm_bias"),
    "qkv.weight": ("self_attention.linear_qkv.weight",),
    "qkv.bias": ("self_attention.linear_qkv.bias",),
    "proj.weight": ("self_attention.linear_proj.weight",),
    "proj.bias": ("self_attention.linear_proj.bias",),
    "mlp_norm.weight": ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
    "mlp_norm.bias": ("pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias"),
    "fc1.weight": ("mlp.linear_fc1.weight",),
    "fc1.bias": ("mlp.linear_fc1.bias",),
    "fc2.weight": ("mlp.linear_fc2.weight",),
    "fc2.bias": ("mlp.linear_fc2.bias",),
    "router.weight": ("mlp.router.weight",),
    "shared_fc1.weight": ("mlp.shared_experts.linear_fc1.weight",),
    "shared_fc2.weight": ("mlp.shared_experts.linear_fc2.weight",),
    "shared_gate.weight": ("mlp.shared_experts.gate_weight",),
}

_DTYPES = ("float32", "float16", "bfloat16")


def layer_of(name: str) -> int | None:
    """3 for ``decoder.layers.3.mlp.linear_fc1.weight``; None outside the layers."""
    m = LAYER.match(name)
    return int(m.group(1)) if m else None


def ignored(name: str) -> bool:
    """Not a tensor a map places: Transformer Engine's ``_extra_state`` and
    rotary ``inv_freq`` buffers."""
    last = name.rsplit(".", 1)[-1]
    return last.startswith("_extra_state") or last == "inv_freq"


def refuse(message: str, hint: str = "") -> UnsupportedCheckpointError:
    return UnsupportedCheckpointError(message, hint or "this model cannot be written that way")


# the most attention heads a map or rules file splits a linear_qkv into (one
# run of rows per query group: far above any model's 128 or so)
MAX_HEADS = 1 << 16


def qkv_runs(groups: int, per_group: int, d: int, part: str) -> list[tuple[int, int]]:
    """The rows of ``part`` ('q', 'k' or 'v') of every query group of a
    Megatron ``linear_qkv``, in order."""
    size = (per_group + 2) * d
    start, length = {"q": (0, per_group * d), "k": (per_group * d, d),
                     "v": ((per_group + 1) * d, d)}[part]
    return [(g * size + start, g * size + start + length) for g in range(groups)]


def _merged(runs: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Adjacent runs joined: ``((0, 4), (4, 8))`` -> ``((0, 8),)``."""
    out: list[tuple[int, int]] = []
    for a, b in runs:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


@dataclass
class Layer:
    index: int
    roles: dict[str, str]  # role -> source name
    experts: dict[tuple[int, str], str]  # (expert, 'linear_fc1.weight') -> source name


class Builder:
    """The checks and bookkeeping of one plan: the source names used, the
    output tensors and their shapes."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], args: dict[str, Any],
                 map_name: str = "the"):
        self.shapes = {k: tuple(v) for k, v in shapes.items()}
        self.args = args
        self.map_name = map_name
        self.used: set[str] = set()
        self.tensors: list[Derived] = []
        self.notes: list[str] = []

    def arg(self, name: str, default: Any = None) -> Any:
        value = self.args.get(name)
        return default if value is None else value

    def size(self, name: str, default: int | None = None) -> int | None:
        """``args.name`` as a positive whole number (None: not recorded,
        ``default``); any other value refused by name."""
        value = self.args.get(name)
        if value is None:
            return default
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        raise self.unusable(name, value, "a positive whole number")

    def number(self, name: str, default: float) -> float:
        """``args.name`` as a finite number (``default``: not recorded)."""
        value = self.args.get(name)
        if value is None:
            return default
        if isinstance(value, (int, float)) and not isinstance(value, bool) and \
                math.isfinite(value):
            return float(value)
        raise self.unusable(name, value, "a number")

    def unusable(self, name: str, value: Any, wanted: str) -> UnsupportedCheckpointError:
        return refuse(f"the run's args hold a value the {self.map_name} map cannot use: "
                      f"{name} = {value!r:.40}, not {wanted}",
                      "convert it without --map, as Megatron names it")

    def need(self, name: str) -> str:
        if name not in self.shapes:
            raise refuse(f"the checkpoint has no {name}",
                         "the map needs it: is this a Megatron-core GPT model (merged)?")
        return name

    def out(self, key: str, source: str, expect: tuple[int, ...],
            rows: Iterable[tuple[int, int]] = (), transpose: bool = False,
            index: tuple[int, ...] = ()) -> None:
        self.need(source)
        d = Derived(key, source, index=index, rows=_merged(rows), transpose=transpose)
        got = d.shape(self.shapes[source])
        if got != tuple(expect):
            raise refuse(
                f"{key} would be {list(got)} from {source} {list(self.shapes[source])}, "
                f"not the {list(expect)} the model needs",
                "the checkpoint's sizes and its args disagree")
        self.used.add(source)
        self.tensors.append(d)

    def leftovers(self, map_name: str) -> None:
        left = sorted(k for k in self.shapes if k not in self.used and not ignored(k))
        if left:
            more = f" (and {len(left) - 3} more)" if len(left) > 3 else ""
            raise refuse(
                f"the {map_name} map has no place for {', '.join(left[:3])}{more}",
                "this model has parts the target architecture does not: choose another map")


@dataclass
class Model:
    """What the shapes and args say about the model."""

    hidden: int
    vocab_rows: int  # embedding rows as stored (padded)
    vocab: int  # rows written
    layers: list[Layer]
    heads: int
    groups: int
    head_dim: int
    qkv_bias: bool
    proj_bias: bool
    norm: str  # 'RMSNorm' or 'LayerNorm'
    eps: float
    tied: bool
    dtype: str


def _layers(b: Builder) -> list[Layer]:
    found: dict[int, Layer] = {}
    by_name = {name: role for role, names in _ROLES.items() for name in names}
    for key in b.shapes:
        m = LAYER.match(key)
        if m is None or ignored(key):
            continue
        i, rest = int(m.group(1)), m.group(2)
        layer = found.setdefault(i, Layer(i, {}, {}))
        role = by_name.get(rest)
        if role is not None:
            if role in layer.roles:
                raise refuse(f"layer {i} has both {layer.roles[role]} and {key}",
                             "a checkpoint of one layer spec was expected")
            layer.roles[role] = key
            continue
        e = EXPERT.match(rest)
        if e is not None:
            if e.group(1) is not None:
                expert, part = int(e.group(1)), f"{e.group(2)}.{e.group(3)}"
            else:
                expert, part = int(e.group(6)), f"{e.group(4)}.{e.group(5)}"
            if (expert, part) in layer.experts:
                raise refuse(f"layer {i} expert {expert} is named twice ({key})",
                             "a checkpoint of one layer spec was expected")
            layer.experts[(expert, part)] = key
        # anything else stays unused: refused by name at the end
    count = max(found) + 1 if found else 0
    if count != len(found):  # (a gap: the first number missing, found among len + 1)
        missing = next(i for i in range(len(found) + 1) if i not in found)
        raise refuse(f"the layers are not numbered 0 to {count - 1}: no layer {missing}",
                     "a merged checkpoint with every pipeline stage's layers is needed")
    if count == 0:
        raise refuse("the checkpoint has no decoder.layers.* tensors",
                     "is this a Megatron-core GPT model?")
    want = b.size("num_layers")
    if want is not None and want != count:
        raise refuse(f"args say num_layers {want}, the checkpoint has {count} layers",
                     "a merged checkpoint with every pipeline stage's layers is needed")
    return [found[i] for i in range(count)]


def _dtype(b: Builder) -> str:
    value = b.args.get("params_dtype")
    if value is not None:
        name = str(value).removeprefix("torch.")
        if name in _DTYPES:
            return name
    if b.args.get("bf16"):
        return "bfloat16"
    if b.args.get("fp16"):
        return "float16"
    if value is None:
        b.notes.append("params_dtype not recorded: torch_dtype float32")
    else:
        b.notes.append(f"params_dtype {value!r} not known: torch_dtype float32")
    return "float32"


def read_model(b: Builder) -> Model:
    found = unexpressed(b.args)
    if found is not None:
        raise refuse(found, "convert it without --map, as Megatron names it")
    emb = b.need(EMBEDDING)
    if len(b.shapes[emb]) != 2:
        raise refuse(f"{emb} is {list(b.shapes[emb])}, not a matrix")
    vocab_rows, hidden = b.shapes[emb]
    want_hidden = b.size("hidden_size")
    if want_hidden is not None and want_hidden != hidden:
        raise refuse(f"args say hidden_size {want_hidden}, {emb} is {list(b.shapes[emb])}",
                     "the checkpoint's sizes and its args disagree")
    padded = b.size("padded_vocab_size")
    true_vocab = facts.true_vocab(b.args)
    cut = true_vocab == vocab_rows  # (a legacy join cut the padding already)
    if padded is not None and padded != vocab_rows and not cut:
        b.notes.append(f"args say padded_vocab_size {padded}; the embedding has {vocab_rows} rows")
    if true_vocab is not None:
        if true_vocab > vocab_rows:
            raise refuse(f"args say vocab_size {true_vocab}, more than the embedding's "
                         f"{vocab_rows} rows", "the checkpoint's sizes and its args disagree")
        vocab = true_vocab
        if vocab < vocab_rows:
            b.notes.append(f"vocabulary padding cut: {vocab_rows} -> {vocab} rows")
    else:
        vocab = vocab_rows
        b.notes.append(f"the tokenizer's vocabulary size is not in args (tokenizer_type "
                       f"{b.args.get('tokenizer_type')}): all {vocab_rows} embedding rows "
                       "kept, Megatron's padding included")

    layers = _layers(b)
    heads = b.size("num_attention_heads")
    if heads is None:
        raise refuse("args has no num_attention_heads",
                     "the number of attention heads cannot be told from the shapes")
    first = layers[0].roles
    if "qkv.weight" not in first or "proj.weight" not in first:
        raise refuse("layer 0 has no self_attention.linear_qkv/linear_proj weight",
                     "only Megatron-core GPT models with self-attention can be mapped")
    for role in ("qkv.weight", "proj.weight"):
        if len(b.shapes[first[role]]) != 2:
            raise refuse(f"{first[role]} is {list(b.shapes[first[role]])}, not a matrix",
                         "the checkpoint's sizes and its args disagree")
    if heads > MAX_HEADS:
        raise refuse(f"args say num_attention_heads {heads}: more than ckptool maps "
                     f"({MAX_HEADS})", "the checkpoint's sizes and its args disagree")
    qkv_rows = b.shapes[first["qkv.weight"]][0]
    proj_cols = b.shapes[first["proj.weight"]][-1]
    if proj_cols % heads:
        raise refuse(f"{first['proj.weight']} has {proj_cols} columns, not a multiple of "
                     f"num_attention_heads {heads}",
                     "the checkpoint's sizes and its args disagree")
    head_dim = proj_cols // heads
    if head_dim == 0:
        raise refuse(f"{first['proj.weight']} has no columns: no attention head of any size",
                     "the checkpoint's sizes and its args disagree")
    kv = b.size("kv_channels")
    if kv is not None and kv != head_dim:
        raise refuse(f"args say kv_channels {kv}, the attention has {head_dim} per head",
                     "the checkpoint's sizes and its args disagree")
    extra = qkv_rows // head_dim - heads if qkv_rows % head_dim == 0 else -1
    groups = extra // 2
    if extra <= 0 or extra % 2 or heads % groups:
        raise refuse(f"{first['qkv.weight']} has {qkv_rows} rows: not query, key and value "
                     f"rows of {heads} heads of {head_dim}",
                     "the checkpoint's sizes and its args disagree")
    if b.args.get("group_query_attention") is False and groups != heads:
        raise refuse(f"args say no group query attention, {first['qkv.weight']} has {groups} "
                     f"key/value heads", "the checkpoint's sizes and its args disagree")
    want_groups = b.size("num_query_groups")
    if b.args.get("group_query_attention") and want_groups is not None \
            and want_groups != groups:
        raise refuse(f"args say num_query_groups {want_groups}, "
                     f"{first['qkv.weight']} has {groups}",
                     "the checkpoint's sizes and its args disagree")

    norm = str(b.arg("normalization", ""))
    has_norm_bias = "attn_norm.bias" in first
    if norm not in ("RMSNorm", "LayerNorm"):
        if norm:
            raise refuse(f"normalization {norm!r} is not RMSNorm or LayerNorm")
        norm = "LayerNorm" if has_norm_bias else "RMSNorm"
        b.notes.append(f"normalization not recorded: {norm}, as the norms "
                       f"{'have' if has_norm_bias else 'have no'} biases")
    key = "norm_epsilon" if b.args.get("norm_epsilon") is not None else "layernorm_epsilon"
    eps = b.number(key, 1e-5)
    if b.args.get(key) is None:
        b.notes.append("norm_epsilon not recorded: 1e-05 (Megatron's default)")

    untie = b.args.get("untie_embeddings_and_output_weights")
    tied = OUTPUT not in b.shapes
    if untie and tied:
        raise refuse(f"args say the output layer is untied, and there is no {OUTPUT}",
                     "a merged checkpoint with the last pipeline stage is needed")
    if untie is False and not tied:
        b.notes.append(f"args say the embeddings are tied, yet {OUTPUT} is there: written apart")
    return Model(hidden=hidden, vocab_rows=vocab_rows, vocab=vocab, layers=layers,
                 heads=heads, groups=groups, head_dim=head_dim,
                 qkv_bias="qkv.bias" in first, proj_bias="proj.bias" in first,
                 norm=norm, eps=eps, tied=tied, dtype=_dtype(b))



def _vocab_rows(m: Model) -> tuple[tuple[int, int], ...]:
    return ((0, m.vocab),) if m.vocab < m.vocab_rows else ()


def embeddings(b: Builder, m: Model, key: str) -> None:
    b.out(key, EMBEDDING, (m.vocab, m.hidden), rows=_vocab_rows(m))


def head(b: Builder, m: Model, norm_key: str, bias_key: str | None = None) -> None:
    b.out(f"{norm_key}.weight", b.need(f"{FINAL_NORM}.weight"), (m.hidden,))
    if bias_key is not None:
        b.out(bias_key, b.need(f"{FINAL_NORM}.bias"), (m.hidden,))
    if not m.tied:
        b.out("lm_head.weight", OUTPUT, (m.vocab, m.hidden), rows=_vocab_rows(m))


def role_of(b: Builder, layer: Layer, role: str) -> str:
    name = layer.roles.get(role)
    if name is None:
        raise refuse(f"layer {layer.index} has no {' or '.join(_ROLES[role])}",
                     "the layers of this checkpoint are not all alike")
    return name



def ffn_of(b: Builder, fc2: str) -> int:
    return b.shapes[b.need(fc2)][-1]

