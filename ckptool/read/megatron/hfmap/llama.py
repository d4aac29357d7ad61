"""The Llama map, and the parts of a Llama-like decoder the mixture of
experts maps share with it: the rotate-half rotary attention as separate q,
k, v and o projections, the SwiGLU MLP split into gate, up and down
projections, the rotary ``config.json`` entries (``rope_theta``,
``rope_scaling``) and the decoder's common ``config.json``.
"""

from __future__ import annotations

from typing import Any

from ckptool.read.megatron.hfmap.model import (
    POSITIONS,
    Builder,
    Layer,
    Model,
    embeddings,
    ffn_of,
    head,
    qkv_runs,
    refuse,
    role_of,
)


def attention_rope(b: Builder, m: Model, layer: Layer, prefix: str) -> None:
    """q, k, v and o projections of a Llama-like attention (separate Linear
    layers, heads in order, rotate-half rotary)."""
    per = m.heads // m.groups
    qkv = role_of(b, layer, "qkv.weight")
    sizes = {"q": m.heads * m.head_dim, "k": m.groups * m.head_dim, "v": m.groups * m.head_dim}
    for part in "qkv":
        runs = qkv_runs(m.groups, per, m.head_dim, part)
        b.out(f"{prefix}.{part}_proj.weight", qkv, (sizes[part], m.hidden), rows=runs)
        if m.qkv_bias:
            b.out(f"{prefix}.{part}_proj.bias", role_of(b, layer, "qkv.bias"), (sizes[part],),
                  rows=runs)
    b.out(f"{prefix}.o_proj.weight", role_of(b, layer, "proj.weight"),
          (m.hidden, m.heads * m.head_dim))


def glu(b: Builder, fc1: str, fc2: str, ffn: int, hidden: int,
        names: tuple[str, str, str], fc1_bias: str | None = None,
        fc2_bias: str | None = None) -> None:
    """A SwiGLU MLP: fc1's first half the gate, its second the up
    projection; fc2 the down projection."""
    gate, up, down = names
    b.out(f"{gate}.weight", fc1, (ffn, hidden), rows=((0, ffn),))
    if fc1_bias:
        b.out(f"{gate}.bias", fc1_bias, (ffn,), rows=((0, ffn),))
    b.out(f"{up}.weight", fc1, (ffn, hidden), rows=((ffn, 2 * ffn),))
    if fc1_bias:
        b.out(f"{up}.bias", fc1_bias, (ffn,), rows=((ffn, 2 * ffn),))
    b.out(f"{down}.weight", fc2, (hidden, ffn))
    if fc2_bias:
        b.out(f"{down}.bias", fc2_bias, (hidden,))



def check_swiglu(b: Builder, map_name: str, fc1: str, fc2: str) -> int:
    ffn = ffn_of(b, fc2)
    gated = b.shapes[b.need(fc1)][0] == 2 * ffn
    swiglu = b.args.get("swiglu")
    if swiglu is False or not gated:
        raise refuse(f"the {map_name} map needs a SwiGLU MLP; this model's is not "
                     f"({fc1} {list(b.shapes[fc1])})", "choose another map (gpt2?)")
    if swiglu is None:
        b.notes.append("swiglu not recorded: taken from the MLP's doubled linear_fc1")
    return ffn


def _rope_config(b: Builder, m: Model, map_name: str) -> dict[str, Any]:
    kind = b.arg("position_embedding_type", "rope")
    if kind != "rope":
        raise refuse(f"the {map_name} map needs rotary position embeddings; this model's are "
                     f"{kind!r}", "choose another map (gpt2 for learned_absolute)")
    if POSITIONS in b.shapes:
        raise refuse(f"the {map_name} map has no place for {POSITIONS}",
                     "choose another map (gpt2 for learned_absolute)")
    if b.number("rotary_percent", 1.0) != 1.0:
        raise refuse(f"rotary_percent {b.args['rotary_percent']}: the {map_name} map rotates "
                     "every dimension of a head", "convert it without --map")
    if b.args.get("no_rope_freq"):
        raise refuse("no_rope_freq: layers without rotary embeddings cannot be mapped",
                     "convert it without --map")
    config: dict[str, Any] = {"rope_theta": b.number("rotary_base", 10000)}
    interpolation = b.number("rotary_seq_len_interpolation_factor", 0.0)
    if b.args.get("use_rope_scaling"):
        if interpolation:
            raise refuse("both use_rope_scaling and rotary_seq_len_interpolation_factor",
                         "convert it without --map")
        # Megatron's RotaryEmbedding._apply_scaling: Llama 3's rule
        config["rope_scaling"] = {"rope_type": "llama3",
                                  "factor": b.number("rope_scaling_factor", 8.0),
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192}
    elif interpolation:
        # positions divided by the factor: HF's linear scaling
        config["rope_scaling"] = {"rope_type": "linear", "factor": interpolation}
    return config


def _max_positions(b: Builder) -> int:
    value = b.size("max_position_embeddings") or b.size("seq_length")
    if value is None:
        b.notes.append("max_position_embeddings not recorded: 4096")
        return 4096
    return value


def require_rmsnorm(m: Model, map_name: str) -> None:
    if m.norm != "RMSNorm":
        raise refuse(f"the {map_name} map needs RMSNorm; this model uses {m.norm}",
                     "choose another map (gpt2?)")


def decoder_config(b: Builder, m: Model, arch: str, model_type: str) -> dict[str, Any]:
    return {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": m.hidden,
        "num_attention_heads": m.heads,
        "num_key_value_heads": m.groups,
        "head_dim": m.head_dim,
        "num_hidden_layers": len(m.layers),
        "vocab_size": m.vocab,
        "max_position_embeddings": _max_positions(b),
        "rms_norm_eps": m.eps,
        "hidden_act": "silu",
        "tie_word_embeddings": m.tied,
        "torch_dtype": m.dtype,
        **_rope_config(b, m, model_type),
    }


def build_llama(b: Builder, m: Model) -> dict[str, Any]:
    require_rmsnorm(m, "llama")
    if m.qkv_bias != m.proj_bias:
        raise refuse("the model has biases on "
                     f"{'linear_qkv' if m.qkv_bias else 'linear_proj'} only: Llama's "
                     "attention_bias puts them on q, k, v and o alike",
                     "convert it without --map")
    embeddings(b, m, "model.embed_tokens.weight")
    ffn = 0
    mlp_bias = False
    for layer in m.layers:
        p = f"model.layers.{layer.index}"
        if "router.weight" in layer.roles or layer.experts:
            raise refuse(f"layer {layer.index} is a mixture of experts: the llama map has "
                         "dense MLPs only", "choose the mixtral or qwen2-moe map")
        b.out(f"{p}.input_layernorm.weight", role_of(b, layer, "attn_norm.weight"), (m.hidden,))
        attention_rope(b, m, layer, f"{p}.self_attn")
        if m.proj_bias:
            b.out(f"{p}.self_attn.o_proj.bias", role_of(b, layer, "proj.bias"), (m.hidden,))
        b.out(f"{p}.post_attention_layernorm.weight", role_of(b, layer, "mlp_norm.weight"),
              (m.hidden,))
        fc1, fc2 = role_of(b, layer, "fc1.weight"), role_of(b, layer, "fc2.weight")
        if layer.index == 0:
            ffn = check_swiglu(b, "llama", fc1, fc2)
        mlp_bias = "fc1.bias" in layer.roles
        glu(b, fc1, fc2, ffn, m.hidden,
            (f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj", f"{p}.mlp.down_proj"),
            layer.roles.get("fc1.bias"), layer.roles.get("fc2.bias"))
    head(b, m, "model.norm")
    config = decoder_config(b, m, "LlamaForCausalLM", "llama")
    config.update(intermediate_size=ffn, attention_bias=m.qkv_bias, mlp_bias=mlp_bias)
    return config
