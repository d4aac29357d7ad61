"""How each tensor of a legacy Megatron checkpoint is split over the
tensor-parallel ranks, so that the ranks' files join into one model.

One table, ``RULES``, following Megatron-core 0.16 (``megatron/core``:
``tensor_parallel/layers.py``'s ``ColumnParallelLinear`` (split on dim 0)
and ``RowParallelLinear`` (split on dim 1, its bias whole on every rank),
``VocabParallelEmbedding`` (rows), ``transformer/mlp.py`` (a SwiGLU
``linear_fc1`` holds each rank's gate rows, then its up rows:
``apply_swiglu_sharded_factory``), ``transformer/attention.py`` (a fused
``linear_qkv`` holds whole query groups on each rank, each group's query,
key and value rows together: the ranks' rows follow each other),
``transformer/moe/`` (experts numbered per expert-parallel rank)). Names
are matched with the layer and expert numbers taken out; a name the table
does not know is refused by name, never guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MEGATRON_VERSION = "megatron-core 0.16"

COLUMN = "column"  # split on dim 0 (a column-parallel weight, or its bias)
ROW = "row"  # split on dim 1 (a row-parallel weight)
SWIGLU = "swiglu"  # split on dim 0 in two halves: each rank's gate rows, then its up rows
VOCAB = "vocab"  # split on dim 0, padded to a multiple of the ranks: cut to the vocabulary
WHOLE = "whole"  # the same on every tensor-parallel rank (norms, a row-parallel bias)
EXTRA = "extra"  # a module's _extra_state: Transformer Engine's bytes, kept from rank 0


@dataclass(frozen=True)
class Rule:
    pattern: re.Pattern[str]
    split: str
    swiglu_split: str | None = None  # the split instead when the run used SwiGLU


def _rule(pattern: str, split: str, swiglu_split: str | None = None) -> Rule:
    return Rule(re.compile(pattern + r"$"), split, swiglu_split)


# the module path inside a layer ("self_attention.linear_qkv.weight") or
# outside one ("embedding.word_embeddings.weight")
_LINEAR = r"(?:\.weight|\.bias)"
RULES: tuple[Rule, ...] = (
    _rule(r"embedding\.word_embeddings\.weight", VOCAB),
    _rule(r"embedding\.position_embeddings\.weight", WHOLE),
    _rule(r"output_layer\.weight", VOCAB),
    _rule(r"output_layer\.bias", VOCAB),
    _rule(r"(?:decoder|encoder)\.final_(?:layer)?norm\.(?:weight|bias)", WHOLE),
    _rule(r"layer\.(?:input_layernorm|pre_mlp_layernorm|pre_cross_attn_layernorm)"
          r"\.(?:weight|bias)", WHOLE),
    # Transformer Engine's norms fused into the linear layer after them
    _rule(r"layer\..*\.layer_norm_(?:weight|bias)", WHOLE),
    _rule(r"layer\.self_attention\.(?:q|k)_layernorm\.(?:weight|bias)", WHOLE),
    _rule(r"layer\.self_attention\.linear_qkv" + _LINEAR, COLUMN),
    _rule(r"layer\.self_attention\.linear_proj\.weight", ROW),
    _rule(r"layer\.self_attention\.linear_proj\.bias", WHOLE),
    # the dense MLP, the shared experts and each expert (SequentialMLP's and
    # TEGroupedMLP's names: ``experts.local_experts.<e>.linear_fc1``,
    # ``experts.linear_fc1.weight<e>``)
    _rule(r"layer\.mlp(?:\.shared_experts|\.expert)?\.linear_fc1" + _LINEAR, COLUMN, SWIGLU),
    _rule(r"layer\.mlp(?:\.shared_experts|\.expert)?\.linear_fc2\.weight", ROW),
    _rule(r"layer\.mlp(?:\.shared_experts|\.expert)?\.linear_fc2\.bias", WHOLE),
    _rule(r"layer\.mlp\.shared_experts\.gate_weight", WHOLE),
    _rule(r"layer\.mlp\.router\.(?:weight|bias|expert_bias)", WHOLE),
    _rule(r".*\._extra_state", EXTRA),
)

# a layer's number (decoder.layers.3.) and an expert's number (local_experts.1.
# or linear_fc1.weight1), taken out of a name before the table is read
LAYER = re.compile(r"^(?P<stack>(?:decoder|encoder)\.layers)\.(?P<layer>\d+)\.(?P<rest>.*)$")
SEQUENTIAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(?P<expert>\d+)\.(?P<rest>.*)$")
GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(?P<rest>linear_fc[12]\.(?:weight|bias))"
                            r"(?P<expert>\d+)$")


@dataclass(frozen=True)
class Place:
    """Where a rank's tensor goes: its split, and its layer and expert
    numbers (local to the rank's stage and expert-parallel rank)."""

    split: str
    layer: int | None = None
    expert: int | None = None
    grouped: bool = False  # TEGroupedMLP's name (the expert's number at its end)


def place(name: str, swiglu: bool) -> Place | None:
    """How ``name`` (a key of a rank's ``model``) is split; None for a name
    the table does not know."""
    layer: int | None = None
    expert: int | None = None
    grouped = False
    rest = name
    m = LAYER.match(name)
    if m:
        layer, rest = int(m.group("layer")), m.group("rest")
        e = SEQUENTIAL_EXPERT.match(rest) or GROUPED_EXPERT.match(rest)
        if e:
            expert, grouped = int(e.group("expert")), e.re is GROUPED_EXPERT
            rest = "mlp.expert." + e.group("rest")
        rest = "layer." + rest
    for rule in RULES:
        if rule.pattern.match(rest):
            split = rule.swiglu_split if swiglu and rule.swiglu_split else rule.split
            return Place(split, layer, expert, grouped)
    return None


def renamed(name: str, layer: int | None, expert: int | None) -> str:
    """``name`` with its layer and expert numbers replaced by the whole
    model's (``decoder.layers.0.`` of stage 1 -> ``decoder.layers.2.``)."""
    m = LAYER.match(name)
    if m is None or layer is None:
        return name
    rest = m.group("rest")
    if expert is not None:
        e = SEQUENTIAL_EXPERT.match(rest)
        if e:
            rest = f"mlp.experts.local_experts.{expert}.{e.group('rest')}"
        else:
            g = GROUPED_EXPERT.match(rest)
            if g:
                rest = f"mlp.experts.{g.group('rest')}{expert}"
    return f"{m.group('stack')}.{layer}.{rest}"
