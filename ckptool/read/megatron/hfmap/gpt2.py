"""The GPT-2 map: LayerNorm with biases, learned absolute positions, one
fused ``c_attn`` of the query, key and value rows in that order and the
``Conv1D`` weights transposed, a plain (not gated) MLP.
"""

from __future__ import annotations

from typing import Any

from ckptool.read.megatron.hfmap.model import (
    POSITIONS,
    Builder,
    Model,
    embeddings,
    ffn_of,
    head,
    qkv_runs,
    refuse,
    role_of,
)


def build_gpt2(b: Builder, m: Model) -> dict[str, Any]:
    if m.norm != "LayerNorm":
        raise refuse(f"the gpt2 map needs LayerNorm; this model uses {m.norm}",
                     "choose the llama map")
    if m.groups != m.heads:
        raise refuse(f"the gpt2 map needs as many key/value heads as query heads; this model "
                     f"has {m.groups} for {m.heads}", "choose the llama map")
    if m.heads * m.head_dim != m.hidden:
        raise refuse(f"{m.heads} heads of {m.head_dim} are not hidden_size {m.hidden}: "
                     "GPT-2's attention needs them to be", "convert it without --map")
    if not (m.qkv_bias and m.proj_bias):
        raise refuse("the gpt2 map needs linear biases (add_bias_linear): GPT-2 has them",
                     "choose the llama map")
    kind = b.arg("position_embedding_type", "learned_absolute")
    if kind != "learned_absolute":
        raise refuse(f"the gpt2 map needs learned absolute positions; this model's are "
                     f"{kind!r}", "choose the llama map")
    if b.args.get("swiglu"):
        raise refuse("the gpt2 map needs a plain MLP; this model's is SwiGLU",
                     "choose the llama map")
    if b.args.get("squared_relu"):
        act = "relu2"
    elif b.args.get("openai_gelu") or (b.args.get("bias_gelu_fusion")
                                       and not b.args.get("use_te_activation_func")):
        act = "gelu_new"  # the tanh approximation (fused_bias_gelu's too: Megatron's default)
    else:
        act = "gelu"
    h = m.hidden
    embeddings(b, m, "transformer.wte.weight")
    pos = b.need(POSITIONS)
    positions = b.shapes[pos][0]
    b.out("transformer.wpe.weight", pos, (positions, h))
    q, k, v = (qkv_runs(m.groups, 1, m.head_dim, part) for part in "qkv")
    ffn = 0
    for layer in m.layers:
        p = f"transformer.h.{layer.index}"
        b.out(f"{p}.ln_1.weight", role_of(b, layer, "attn_norm.weight"), (h,))
        b.out(f"{p}.ln_1.bias", role_of(b, layer, "attn_norm.bias"), (h,))
        b.out(f"{p}.attn.c_attn.weight", role_of(b, layer, "qkv.weight"), (h, 3 * h),
              rows=q + k + v, transpose=True)
        b.out(f"{p}.attn.c_attn.bias", role_of(b, layer, "qkv.bias"), (3 * h,), rows=q + k + v)
        b.out(f"{p}.attn.c_proj.weight", role_of(b, layer, "proj.weight"), (h, h), transpose=True)
        b.out(f"{p}.attn.c_proj.bias", role_of(b, layer, "proj.bias"), (h,))
        b.out(f"{p}.ln_2.weight", role_of(b, layer, "mlp_norm.weight"), (h,))
        b.out(f"{p}.ln_2.bias", role_of(b, layer, "mlp_norm.bias"), (h,))
        fc1, fc2 = role_of(b, layer, "fc1.weight"), role_of(b, layer, "fc2.weight")
        ffn = ffn_of(b, fc2)
        if b.shapes[fc1][0] != ffn:
            raise refuse(f"{fc1} is {list(b.shapes[fc1])}: a gated MLP, which GPT-2 has not",
                         "choose the llama map")
        b.out(f"{p}.mlp.c_fc.weight", fc1, (h, ffn), transpose=True)
        b.out(f"{p}.mlp.c_fc.bias", role_of(b, layer, "fc1.bias"), (ffn,))
        b.out(f"{p}.mlp.c_proj.weight", fc2, (ffn, h), transpose=True)
        b.out(f"{p}.mlp.c_proj.bias", role_of(b, layer, "fc2.bias"), (h,))
    head(b, m, "transformer.ln_f", "transformer.ln_f.bias")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": m.vocab,
        "n_positions": positions,
        "n_embd": h,
        "n_layer": len(m.layers),
        "n_head": m.heads,
        "n_inner": ffn,
        "activation_function": act,
        "layer_norm_epsilon": m.eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "tie_word_embeddings": m.tied,
        "torch_dtype": m.dtype,
    }

