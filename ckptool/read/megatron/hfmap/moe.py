"""The mixture of experts maps: Mixtral and Qwen2-MoE. Owns the router
(``mlp.router.weight``, its score function and top-k renormalisation), the
experts of a layer (``SequentialMLP`` and ``TEGroupedMLP`` names) and
Qwen2-MoE's gated shared experts and dense ``mlp_only_layers``.
"""

from __future__ import annotations

from typing import Any

from ckptool.read.megatron.hfmap.llama import (
    attention_rope,
    check_swiglu,
    decoder_config,
    glu,
    require_rmsnorm,
)
from ckptool.read.megatron.hfmap.model import (
    Builder,
    Layer,
    Model,
    embeddings,
    ffn_of,
    head,
    refuse,
    role_of,
)


def _router(b: Builder, map_name: str) -> bool:
    """Whether the top-k routing weights sum to one (Mixtral always;
    Qwen2-MoE's norm_topk_prob): softmax over the top-k logits, not the top-k
    of a softmax over all (``moe_router_pre_softmax``); refuses what the HF
    blocks cannot do."""
    score = b.arg("moe_router_score_function", "softmax")
    if score != "softmax":
        raise refuse(f"the router's score function is {score!r}: the {map_name} map needs "
                     "softmax", "convert it without --map")
    scaling = b.args.get("moe_router_topk_scaling_factor")
    if scaling not in (None, 1, 1.0):
        raise refuse(f"moe_router_topk_scaling_factor {scaling}: the {map_name} map has none",
                     "convert it without --map")
    if b.args.get("moe_router_num_groups") or b.args.get("moe_router_group_topk"):
        raise refuse(f"group-limited routing: the {map_name} map has none",
                     "convert it without --map")
    if b.args.get("moe_apply_probs_on_input"):
        raise refuse(f"moe_apply_probs_on_input: the routing weight scales each token before "
                     f"the expert's SwiGLU; the {map_name} map's block scales its output",
                     "convert it without --map")
    if b.args.get("moe_router_enable_expert_bias"):
        raise refuse(f"router expert bias: the {map_name} map has none",
                     "convert it without --map")
    return not b.args.get("moe_router_pre_softmax")


def _experts(b: Builder, layer: Layer, hidden: int) -> tuple[int, int]:
    """The number of experts of a layer and their MLP width."""
    router = role_of(b, layer, "router.weight")
    if len(b.shapes[router]) != 2 or b.shapes[router][1] != hidden:
        raise refuse(f"{router} is {list(b.shapes[router])}, not [experts, {hidden}]")
    count = b.shapes[router][0]
    want = b.size("num_experts")
    if want is not None and want != count:
        raise refuse(f"args say num_experts {want}, {router} routes to {count}",
                     "a merged checkpoint with every expert parallel rank is needed")
    numbers = sorted({e for e, _ in layer.experts})
    if numbers != list(range(count)):
        raise refuse(f"layer {layer.index} has experts {numbers[:3]}... not 0 to {count - 1}",
                     "a merged checkpoint with every expert parallel rank is needed")
    fc2 = layer.experts.get((0, "linear_fc2.weight"))
    if fc2 is None:
        raise refuse(f"layer {layer.index} expert 0 has no linear_fc2 weight")
    return count, ffn_of(b, fc2)


def _expert(b: Builder, layer: Layer, e: int, part: str) -> str:
    name = layer.experts.get((e, part))
    if name is None:
        raise refuse(f"layer {layer.index} expert {e} has no {part}",
                     "a merged checkpoint with every expert parallel rank is needed")
    return name


def _moe_common(b: Builder, m: Model, map_name: str) -> None:
    require_rmsnorm(m, map_name)
    if m.proj_bias or b.args.get("add_bias_linear"):
        raise refuse(f"the model has linear biases (add_bias_linear): the {map_name} map has none",
                     "convert it without --map")
    if b.args.get("swiglu") is False:
        raise refuse(f"the {map_name} map needs SwiGLU experts; this model's are not",
                     "convert it without --map")


def build_mixtral(b: Builder, m: Model) -> dict[str, Any]:
    _moe_common(b, m, "mixtral")
    if m.qkv_bias:
        raise refuse("the model has query/key/value biases: Mixtral's attention has none",
                     "choose the qwen2-moe map")
    if not _router(b, "mixtral"):
        raise refuse("moe_router_pre_softmax: Mixtral renormalises the top-k routing "
                     "weights, Megatron's pre-softmax router does not",
                     "choose the qwen2-moe map, or convert it without --map")
    embeddings(b, m, "model.embed_tokens.weight")
    count = ffn = 0
    seen: list[tuple[int, int]] = []
    for layer in m.layers:
        p = f"model.layers.{layer.index}"
        if "router.weight" not in layer.roles:
            raise refuse(f"layer {layer.index} is dense: every Mixtral layer is a mixture "
                         "of experts", "choose the qwen2-moe map (mlp_only_layers)")
        b.out(f"{p}.input_layernorm.weight", role_of(b, layer, "attn_norm.weight"), (m.hidden,))
        attention_rope(b, m, layer, f"{p}.self_attn")
        b.out(f"{p}.post_attention_layernorm.weight", role_of(b, layer, "mlp_norm.weight"),
              (m.hidden,))
        count, ffn = _same_width(b, layer, seen, _experts(b, layer, m.hidden))
        b.out(f"{p}.block_sparse_moe.gate.weight", layer.roles["router.weight"],
              (count, m.hidden))
        for e in range(count):
            glu(b, _expert(b, layer, e, "linear_fc1.weight"),
                _expert(b, layer, e, "linear_fc2.weight"), ffn, m.hidden,
                (f"{p}.block_sparse_moe.experts.{e}.w1", f"{p}.block_sparse_moe.experts.{e}.w3",
                 f"{p}.block_sparse_moe.experts.{e}.w2"))
    head(b, m, "model.norm")
    config = decoder_config(b, m, "MixtralForCausalLM", "mixtral")
    config.update(intermediate_size=ffn, num_local_experts=count,
                  num_experts_per_tok=_topk(b, count), sliding_window=None)
    return config


def _same_width(b: Builder, layer: Any, seen: list[tuple[int, int]],
                found: tuple[int, int]) -> tuple[int, int]:
    """A layer's (experts, width): the same in every MoE layer, as the HF
    config's one ``num_experts`` and width say (``seen``: the first's)."""
    if not seen:
        seen.append(found)
    first = seen[0]
    if found != first:
        raise refuse(f"layer {layer.index} has {found[0]} experts {found[1]} wide, an earlier "
                     f"MoE layer {first[0]} of {first[1]}: the config has one size for all",
                     "convert it without --map")
    return found


def _topk(b: Builder, count: int) -> int:
    topk = b.size("moe_router_topk")
    if topk is None:
        raise refuse("args has no moe_router_topk",
                     "the number of experts per token cannot be told from the shapes")
    if topk > count:
        raise refuse(f"moe_router_topk {topk} is not between 1 and {count} experts")
    return topk


def build_qwen2_moe(b: Builder, m: Model) -> dict[str, Any]:
    _moe_common(b, m, "qwen2-moe")
    if m.heads * m.head_dim != m.hidden:
        raise refuse(f"{m.heads} heads of {m.head_dim} are not hidden_size {m.hidden}: "
                     "Qwen2-MoE's attention needs them to be", "convert it without --map")
    renormalise = _router(b, "qwen2-moe")
    embeddings(b, m, "model.embed_tokens.weight")
    count = ffn = shared = 0
    seen: list[tuple[int, int]] = []
    dense: list[int] = []
    dense_ffn: int | None = None
    for layer in m.layers:
        p = f"model.layers.{layer.index}"
        b.out(f"{p}.input_layernorm.weight", role_of(b, layer, "attn_norm.weight"), (m.hidden,))
        attention_rope(b, m, layer, f"{p}.self_attn")
        b.out(f"{p}.post_attention_layernorm.weight", role_of(b, layer, "mlp_norm.weight"),
              (m.hidden,))
        if "router.weight" not in layer.roles:
            fc1, fc2 = role_of(b, layer, "fc1.weight"), role_of(b, layer, "fc2.weight")
            width = check_swiglu(b, "qwen2-moe", fc1, fc2)
            if dense_ffn is not None and width != dense_ffn:
                raise refuse(f"the dense layers' MLPs are {dense_ffn} and {width} wide")
            dense_ffn = width
            dense.append(layer.index)
            glu(b, fc1, fc2, width, m.hidden,
                (f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj", f"{p}.mlp.down_proj"))
            continue
        count, ffn = _same_width(b, layer, seen, _experts(b, layer, m.hidden))
        b.out(f"{p}.mlp.gate.weight", layer.roles["router.weight"], (count, m.hidden))
        for e in range(count):
            glu(b, _expert(b, layer, e, "linear_fc1.weight"),
                _expert(b, layer, e, "linear_fc2.weight"), ffn, m.hidden,
                (f"{p}.mlp.experts.{e}.gate_proj", f"{p}.mlp.experts.{e}.up_proj",
                 f"{p}.mlp.experts.{e}.down_proj"))
        if "shared_fc1.weight" not in layer.roles:
            raise refuse(f"layer {layer.index} has no shared experts "
                         "(mlp.shared_experts.linear_fc1): every Qwen2-MoE block has one",
                         "choose the mixtral map")
        if "shared_gate.weight" not in layer.roles:
            raise refuse(f"layer {layer.index}'s shared experts have no gate "
                         "(moe_shared_expert_gate): Qwen2-MoE's always has one",
                         "convert it without --map")
        width = ffn_of(b, role_of(b, layer, "shared_fc2.weight"))
        if shared and width != shared:
            raise refuse(f"the shared experts are {shared} and {width} wide in different "
                         "layers: the config has one shared_expert_intermediate_size",
                         "convert it without --map")
        shared = width
        glu(b, layer.roles["shared_fc1.weight"], layer.roles["shared_fc2.weight"],
            shared, m.hidden, (f"{p}.mlp.shared_expert.gate_proj",
                               f"{p}.mlp.shared_expert.up_proj",
                               f"{p}.mlp.shared_expert.down_proj"))
        b.out(f"{p}.mlp.shared_expert_gate.weight", layer.roles["shared_gate.weight"],
              (1, m.hidden))
    if count == 0:
        raise refuse("no layer has experts (mlp.router.weight)", "choose the llama map")
    head(b, m, "model.norm")
    config = decoder_config(b, m, "Qwen2MoeForCausalLM", "qwen2_moe")
    config.pop("head_dim")
    intermediate = dense_ffn if dense_ffn is not None else b.size("ffn_hidden_size", ffn)
    config.update(intermediate_size=intermediate, moe_intermediate_size=ffn,
                  shared_expert_intermediate_size=shared, num_experts=count,
                  num_experts_per_tok=_topk(b, count), norm_topk_prob=renormalise,
                  decoder_sparse_step=1, mlp_only_layers=dense, qkv_bias=m.qkv_bias,
                  use_sliding_window=False)
    return config

