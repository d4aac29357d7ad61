"""The Megatron-core -> transformers maps (ckptool.read.megatron.hfmap):
tiny Megatron state dicts built by hand from known HF-style weights (the
query, key and value rows interleaved per query group, SwiGLU's gate and up
halves stacked), planned, applied, and compared with the weights they came
from."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ckptool.errors import UnsupportedCheckpointError
from ckptool.read.megatron import hfmap

H, D, FFN, V, VPAD = 32, 4, 24, 50, 64


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def interleave(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Megatron's linear_qkv rows from HF's q, k, v (weights or biases):
    per query group, its query heads' rows, then its key rows, then its value rows."""
    rest = q.shape[1:]
    parts = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def run(name: str, sd: dict[str, torch.Tensor], args: dict[str, Any]) -> tuple[
        dict[str, torch.Tensor], hfmap.Plan]:
    plan = hfmap.plan(name, {k: tuple(t.shape) for k, t in sd.items()}, args)
    out = {}
    for d in plan.tensors:
        assert d.key not in out, d.key
        out[d.key] = d.apply(sd[d.source])
        assert tuple(out[d.key].shape) == d.shape(tuple(sd[d.source].shape))
    return out, plan


def check(out: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> None:
    assert sorted(out) == sorted(truth)
    for k, t in truth.items():
        assert torch.equal(out[k], t), k


def llama_args(heads: int = 8, groups: int = 2, **kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(
        num_layers=2, hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=heads,
        num_query_groups=groups, group_query_attention=groups != heads, kv_channels=D,
        swiglu=True, normalization="RMSNorm", norm_epsilon=1e-6,
        position_embedding_type="rope", rotary_base=500000, rotary_percent=1.0,
        max_position_embeddings=128, seq_length=64, vocab_size=V, padded_vocab_size=VPAD,
        tokenizer_type="TikTokenizer",
        untie_embeddings_and_output_weights=True, add_bias_linear=False, add_qkv_bias=False,
        params_dtype="torch.bfloat16", bf16=True)
    args.update(kw)
    return args


def llama_pair(heads: int = 8, groups: int = 2, layers: int = 2, te: bool = False,
               tied: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(Megatron state dict, the HF Llama tensors it holds, padding rows cut)."""
    emb, out = rand(VPAD, H), rand(VPAD, H)
    hf = {"model.embed_tokens.weight": emb[:V], "model.norm.weight": rand(H)}
    mg = {"embedding.word_embeddings.weight": emb, "decoder.final_layernorm.weight":
          hf["model.norm.weight"]}
    if not tied:
        hf["lm_head.weight"] = out[:V]
        mg["output_layer.weight"] = out
    for i in range(layers):
        p, m = f"model.layers.{i}", f"decoder.layers.{i}"
        q, k, v = rand(heads * D, H), rand(groups * D, H), rand(groups * D, H)
        gate, up, down = rand(FFN, H), rand(FFN, H), rand(H, FFN)
        n1, n2, o = rand(H), rand(H), rand(H, heads * D)
        hf.update({f"{p}.self_attn.q_proj.weight": q, f"{p}.self_attn.k_proj.weight": k,
                   f"{p}.self_attn.v_proj.weight": v, f"{p}.self_attn.o_proj.weight": o,
                   f"{p}.mlp.gate_proj.weight": gate, f"{p}.mlp.up_proj.weight": up,
                   f"{p}.mlp.down_proj.weight": down, f"{p}.input_layernorm.weight": n1,
                   f"{p}.post_attention_layernorm.weight": n2})
        mg.update({f"{m}.self_attention.linear_qkv.weight": interleave(q, k, v, groups),
                   f"{m}.self_attention.linear_proj.weight": o,
                   f"{m}.mlp.linear_fc1.weight": torch.cat([gate, up]),
                   f"{m}.mlp.linear_fc2.weight": down})
        if te:
            mg[f"{m}.self_attention.linear_qkv.layer_norm_weight"] = n1
            mg[f"{m}.mlp.linear_fc1.layer_norm_weight"] = n2
            for part in ("self_attention.linear_qkv", "self_attention.linear_proj",
                         "mlp.linear_fc1", "mlp.linear_fc2"):
                mg[f"{m}.{part}._extra_state"] = torch.zeros(0)
        else:
            mg[f"{m}.input_layernorm.weight"] = n1
            mg[f"{m}.pre_mlp_layernorm.weight"] = n2
    return mg, hf


@pytest.mark.parametrize(("heads", "groups"), [(8, 2), (8, 8), (8, 1)])
def test_llama_attention_rows_follow_the_query_groups(heads: int, groups: int) -> None:
    mg, hf = llama_pair(heads, groups)
    out, plan = run("llama", mg, llama_args(heads, groups))
    check(out, hf)
    c = plan.config
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama"
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (heads, groups, D)
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (H, FFN, 2)
    assert (c["vocab_size"], c["rms_norm_eps"], c["rope_theta"]) == (V, 1e-6, 500000.0)
    assert c["tie_word_embeddings"] is False and c["torch_dtype"] == "bfloat16"
    assert c["attention_bias"] is False and c["mlp_bias"] is False
    assert c["hidden_act"] == "silu" and c["max_position_embeddings"] == 128
    keys = [d.key for d in plan.tensors]
    assert keys[0] == "model.embed_tokens.weight" and keys[-1] == "lm_head.weight"
    assert keys[-2] == "model.norm.weight"
    assert keys.index("model.layers.0.mlp.down_proj.weight") < keys.index(
        "model.layers.1.input_layernorm.weight")


def test_llama_gqa_is_read_from_the_shapes_when_args_say_little() -> None:
    mg, hf = llama_pair(8, 2)
    out, plan = run("llama", mg, {"num_attention_heads": 8, "vocab_size": V,
                                  "tokenizer_type": "TikTokenizer"})
    check(out, hf)
    assert plan.config["num_key_value_heads"] == 2 and plan.config["head_dim"] == D
    assert plan.config["intermediate_size"] == FFN
    assert any("swiglu not recorded" in n for n in plan.notes)


def test_vocabulary_padding_cut_and_kept() -> None:
    mg, _ = llama_pair()
    _, plan = run("llama", mg, llama_args())
    assert f"vocabulary padding cut: {VPAD} -> {V} rows" in plan.notes
    emb = next(d for d in plan.tensors if d.key == "model.embed_tokens.weight")
    assert emb.rows == ((0, V),)
    out, plan = run("llama", mg, llama_args(vocab_size=None))
    assert out["model.embed_tokens.weight"].shape == (VPAD, H)
    assert out["lm_head.weight"].shape == (VPAD, H) and plan.config["vocab_size"] == VPAD
    assert any("the tokenizer's vocabulary size is not in args" in n for n in plan.notes)
    # the null tokenizer's end-of-document id follows args.vocab_size: one row more
    _, plan = run("llama", mg, llama_args(vocab_size=V - 1, tokenizer_type="NullTokenizer"))
    emb = next(d for d in plan.tensors if d.key == "model.embed_tokens.weight")
    assert emb.rows == ((0, V),)
    # another tokenizer's size is its own files': args.vocab_size is not it
    _, plan = run("llama", mg, llama_args(tokenizer_type="HuggingFaceTokenizer"))
    emb = next(d for d in plan.tensors if d.key == "model.embed_tokens.weight")
    assert emb.rows == ()


def test_tied_embeddings_have_no_lm_head() -> None:
    mg, hf = llama_pair(tied=True)
    out, plan = run("llama", mg, llama_args(untie_embeddings_and_output_weights=False))
    check(out, hf)
    assert "lm_head.weight" not in out and plan.config["tie_word_embeddings"] is True


def test_transformer_engine_fused_norm_names() -> None:
    mg, hf = llama_pair(te=True)
    assert any(k.endswith("_extra_state") for k in mg)
    out, _ = run("llama", mg, llama_args())
    check(out, hf)


def test_llama_biases() -> None:
    mg, hf = llama_pair(groups=2)
    for i in range(2):
        p, m = f"model.layers.{i}", f"decoder.layers.{i}"
        q, k, v = rand(8 * D), rand(2 * D), rand(2 * D)
        gate, up, down, o = rand(FFN), rand(FFN), rand(H), rand(H)
        hf.update({f"{p}.self_attn.q_proj.bias": q, f"{p}.self_attn.k_proj.bias": k,
                   f"{p}.self_attn.v_proj.bias": v, f"{p}.self_attn.o_proj.bias": o,
                   f"{p}.mlp.gate_proj.bias": gate, f"{p}.mlp.up_proj.bias": up,
                   f"{p}.mlp.down_proj.bias": down})
        mg.update({f"{m}.self_attention.linear_qkv.bias": interleave(q, k, v, 2),
                   f"{m}.self_attention.linear_proj.bias": o,
                   f"{m}.mlp.linear_fc1.bias": torch.cat([gate, up]),
                   f"{m}.mlp.linear_fc2.bias": down})
    out, plan = run("llama", mg, llama_args(add_bias_linear=True))
    check(out, hf)
    assert plan.config["attention_bias"] is True and plan.config["mlp_bias"] is True
    # qkv biases alone (Qwen2's) cannot be Llama's: attention_bias covers o_proj too
    for i in range(2):
        del mg[f"decoder.layers.{i}.self_attention.linear_proj.bias"]
    with pytest.raises(UnsupportedCheckpointError, match="linear_qkv only"):
        run("llama", mg, llama_args(add_bias_linear=True))


def test_an_unknown_tensor_is_refused_by_name() -> None:
    mg, _ = llama_pair()
    mg["decoder.layers.1.self_attention.q_layernorm.weight"] = rand(D)
    with pytest.raises(UnsupportedCheckpointError,
                       match=r"decoder\.layers\.1\.self_attention\.q_layernorm\.weight"):
        run("llama", mg, llama_args())
    mg, _ = llama_pair()
    mg["decoder.layers.0.self_attention.core_attention.rotary.inv_freq"] = rand(2)
    mg["something.else"] = rand(3)
    with pytest.raises(UnsupportedCheckpointError, match=r"something\.else"):
        run("llama", mg, llama_args())


@pytest.mark.parametrize(("change", "match"), [
    ({"rotary_interleaved": True}, "rotary_interleaved"),
    ({"normalization": "LayerNorm"}, "RMSNorm"),
    ({"swiglu": False}, "SwiGLU"),
    ({"rotary_percent": 0.5}, "rotary_percent"),
    ({"position_embedding_type": "learned_absolute"}, "learned_absolute"),
    ({"kv_channels": 8}, "kv_channels"),
    ({"num_layers": 3}, "num_layers"),
    ({"num_attention_heads": None}, "num_attention_heads"),
    ({"num_query_groups": 4}, "num_query_groups"),
])
def test_llama_refusals(change: dict[str, Any], match: str) -> None:
    mg, _ = llama_pair()
    with pytest.raises(UnsupportedCheckpointError, match=match):
        run("llama", mg, llama_args(**change))


def test_a_wrong_size_fails_before_reading() -> None:
    mg, _ = llama_pair()
    shapes = {k: tuple(t.shape) for k, t in mg.items()}
    shapes["decoder.layers.1.mlp.linear_fc2.weight"] = (H, FFN + 2)
    with pytest.raises(UnsupportedCheckpointError, match="linear_fc"):
        hfmap.plan("llama", shapes, llama_args())
    with pytest.raises(UnsupportedCheckpointError, match="no map"):
        hfmap.plan("bert", shapes, llama_args())


def test_rope_scaling() -> None:
    mg, _ = llama_pair()
    _, plan = run("llama", mg, llama_args(use_rope_scaling=True, rope_scaling_factor=32.0))
    assert plan.config["rope_scaling"] == {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def gpt2_pair(layers: int = 2, heads: int = 4) -> tuple[
        dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    d, ffn, npos = H // heads, 4 * H, 16
    emb, wpe, lnf, lnfb = rand(VPAD, H), rand(npos, H), rand(H), rand(H)
    hf = {"transformer.wte.weight": emb[:V], "transformer.wpe.weight": wpe,
          "transformer.ln_f.weight": lnf, "transformer.ln_f.bias": lnfb}
    mg = {"embedding.word_embeddings.weight": emb, "embedding.position_embeddings.weight": wpe,
          "decoder.final_layernorm.weight": lnf, "decoder.final_layernorm.bias": lnfb}
    for i in range(layers):
        p, m = f"transformer.h.{i}", f"decoder.layers.{i}"
        c_attn, c_attn_b = rand(H, 3 * H), rand(3 * H)  # Conv1D: [in, out]; out = [q | k | v]
        q, k, v = c_attn.t().split(H)
        qb, kb, vb = c_attn_b.split(H)
        assert d * heads == H
        t = {f"{p}.ln_1.weight": rand(H), f"{p}.ln_1.bias": rand(H),
             f"{p}.attn.c_attn.weight": c_attn, f"{p}.attn.c_attn.bias": c_attn_b,
             f"{p}.attn.c_proj.weight": rand(H, H), f"{p}.attn.c_proj.bias": rand(H),
             f"{p}.ln_2.weight": rand(H), f"{p}.ln_2.bias": rand(H),
             f"{p}.mlp.c_fc.weight": rand(H, ffn), f"{p}.mlp.c_fc.bias": rand(ffn),
             f"{p}.mlp.c_proj.weight": rand(ffn, H), f"{p}.mlp.c_proj.bias": rand(H)}
        hf.update(t)
        mg.update({
            f"{m}.self_attention.linear_qkv.layer_norm_weight": t[f"{p}.ln_1.weight"],
            f"{m}.self_attention.linear_qkv.layer_norm_bias": t[f"{p}.ln_1.bias"],
            f"{m}.self_attention.linear_qkv.weight": interleave(q, k, v, heads),
            f"{m}.self_attention.linear_qkv.bias": interleave(qb, kb, vb, heads),
            f"{m}.self_attention.linear_proj.weight": t[f"{p}.attn.c_proj.weight"].t(),
            f"{m}.self_attention.linear_proj.bias": t[f"{p}.attn.c_proj.bias"],
            f"{m}.mlp.linear_fc1.layer_norm_weight": t[f"{p}.ln_2.weight"],
            f"{m}.mlp.linear_fc1.layer_norm_bias": t[f"{p}.ln_2.bias"],
            f"{m}.mlp.linear_fc1.weight": t[f"{p}.mlp.c_fc.weight"].t(),
            f"{m}.mlp.linear_fc1.bias": t[f"{p}.mlp.c_fc.bias"],
            f"{m}.mlp.linear_fc2.weight": t[f"{p}.mlp.c_proj.weight"].t(),
            f"{m}.mlp.linear_fc2.bias": t[f"{p}.mlp.c_proj.bias"]})
    return mg, hf


def gpt2_args(**kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(
        num_layers=2, hidden_size=H, ffn_hidden_size=4 * H, num_attention_heads=4,
        normalization="LayerNorm", norm_epsilon=1e-5, position_embedding_type="learned_absolute",
        max_position_embeddings=16, vocab_size=V, padded_vocab_size=VPAD,
        tokenizer_type="TikTokenizer",
        untie_embeddings_and_output_weights=False, add_bias_linear=True, swiglu=False)
    args.update(kw)
    return args


def test_gpt2_c_attn_regrouped_and_transposed() -> None:
    mg, hf = gpt2_pair()
    out, plan = run("gpt2", mg, gpt2_args())
    check(out, hf)
    c_attn = next(d for d in plan.tensors if d.key == "transformer.h.0.attn.c_attn.weight")
    assert c_attn.transpose and len(c_attn.rows) == 12  # 4 heads x (q, k, v)
    c = plan.config
    assert c["architectures"] == ["GPT2LMHeadModel"] and c["tie_word_embeddings"] is True
    assert (c["n_embd"], c["n_head"], c["n_layer"], c["n_inner"], c["n_positions"]) == (
        H, 4, 2, 4 * H, 16)
    assert c["activation_function"] == "gelu" and c["vocab_size"] == V
    with pytest.raises(UnsupportedCheckpointError, match="RMSNorm"):
        run("gpt2", *llama_pair()[:1], llama_args())


def moe_pair(experts: int = 4, layers: int = 2, grouped: bool = False, shared: int = 0,
             qkv_bias: bool = False, dense: tuple[int, ...] = (),
             hf_names: str = "mixtral") -> tuple[
        dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A Megatron MoE model (GQA 8/2) and its Mixtral or Qwen2-MoE tensors."""
    mg, hf = llama_pair(8, 2, layers)
    hf = {k: t for k, t in hf.items() if ".mlp." not in k}
    mg = {k: t for k, t in mg.items() if ".mlp." not in k}
    eff = 8
    for i in range(layers):
        p, m = f"model.layers.{i}", f"decoder.layers.{i}"
        if qkv_bias:
            q, k, v = rand(8 * D), rand(2 * D), rand(2 * D)
            mg[f"{m}.self_attention.linear_qkv.bias"] = interleave(q, k, v, 2)
            hf.update({f"{p}.self_attn.q_proj.bias": q, f"{p}.self_attn.k_proj.bias": k,
                       f"{p}.self_attn.v_proj.bias": v})
        if i in dense:
            g, u, dn = rand(FFN, H), rand(FFN, H), rand(H, FFN)
            hf.update({f"{p}.mlp.gate_proj.weight": g, f"{p}.mlp.up_proj.weight": u,
                       f"{p}.mlp.down_proj.weight": dn})
            mg.update({f"{m}.mlp.linear_fc1.weight": torch.cat([g, u]),
                       f"{m}.mlp.linear_fc2.weight": dn})
            continue
        router = rand(experts, H)
        mg[f"{m}.mlp.router.weight"] = router
        block = f"{p}.block_sparse_moe" if hf_names == "mixtral" else f"{p}.mlp"
        hf[f"{block}.gate.weight"] = router
        for e in range(experts):
            g, u, dn = rand(eff, H), rand(eff, H), rand(H, eff)
            if hf_names == "mixtral":
                names = [f"{block}.experts.{e}.{w}.weight" for w in ("w1", "w3", "w2")]
            else:
                names = [f"{block}.experts.{e}.{w}.weight"
                         for w in ("gate_proj", "up_proj", "down_proj")]
            hf.update(dict(zip(names, (g, u, dn), strict=True)))
            if grouped:
                mg[f"{m}.mlp.experts.linear_fc1.weight{e}"] = torch.cat([g, u])
                mg[f"{m}.mlp.experts.linear_fc2.weight{e}"] = dn
                mg[f"{m}.mlp.experts.linear_fc1._extra_state"] = torch.zeros(0)
            else:
                mg[f"{m}.mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.cat([g, u])
                mg[f"{m}.mlp.experts.local_experts.{e}.linear_fc2.weight"] = dn
        if shared:
            g, u, dn, gate = rand(shared, H), rand(shared, H), rand(H, shared), rand(1, H)
            hf.update({f"{p}.mlp.shared_expert.gate_proj.weight": g,
                       f"{p}.mlp.shared_expert.up_proj.weight": u,
                       f"{p}.mlp.shared_expert.down_proj.weight": dn,
                       f"{p}.mlp.shared_expert_gate.weight": gate})
            mg.update({f"{m}.mlp.shared_experts.linear_fc1.weight": torch.cat([g, u]),
                       f"{m}.mlp.shared_experts.linear_fc2.weight": dn,
                       f"{m}.mlp.shared_experts.gate_weight": gate})
        # the pre-MLP norm of a MoE layer is its own module
        hf[f"{p}.post_attention_layernorm.weight"] = mg[f"{m}.pre_mlp_layernorm.weight"]
    return mg, hf


def moe_args(**kw: Any) -> dict[str, Any]:
    return llama_args(**{"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 8, **kw})


@pytest.mark.parametrize("grouped", [False, True])
def test_mixtral_experts_in_both_namings(grouped: bool) -> None:
    mg, hf = moe_pair(grouped=grouped)
    out, plan = run("mixtral", mg, moe_args())
    check(out, hf)
    c = plan.config
    assert c["architectures"] == ["MixtralForCausalLM"] and c["model_type"] == "mixtral"
    assert (c["num_local_experts"], c["num_experts_per_tok"], c["intermediate_size"]) == (4, 2, 8)
    keys = [d.key for d in plan.tensors]
    assert keys.index("model.layers.0.block_sparse_moe.experts.3.w2.weight") < keys.index(
        "model.layers.1.input_layernorm.weight")


def test_mixtral_refusals() -> None:
    mg, _ = moe_pair()
    with pytest.raises(UnsupportedCheckpointError, match="pre_softmax"):
        run("mixtral", mg, moe_args(moe_router_pre_softmax=True))
    with pytest.raises(UnsupportedCheckpointError, match="sigmoid"):
        run("mixtral", mg, moe_args(moe_router_score_function="sigmoid"))
    with pytest.raises(UnsupportedCheckpointError, match="moe_router_topk"):
        run("mixtral", mg, moe_args(moe_router_topk=None))
    with pytest.raises(UnsupportedCheckpointError, match="mixture of experts"):
        run("llama", mg, moe_args())
    mg, _ = moe_pair(shared=16)
    with pytest.raises(UnsupportedCheckpointError, match=r"shared_experts\.gate_weight"):
        run("mixtral", mg, moe_args())
    mg, _ = moe_pair()
    del mg["decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"]
    with pytest.raises(UnsupportedCheckpointError, match="expert 2 has no linear_fc2"):
        run("mixtral", mg, moe_args())


@pytest.mark.parametrize("grouped", [False, True])
def test_qwen2_moe_shared_experts(grouped: bool) -> None:
    mg, hf = moe_pair(grouped=grouped, shared=16, qkv_bias=True, hf_names="qwen2-moe", layers=3,
                      dense=(0,))
    args = moe_args(add_qkv_bias=True, moe_shared_expert_intermediate_size=16,
                    moe_shared_expert_gate=True, moe_router_pre_softmax=True, num_layers=3)
    # Qwen2-MoE's attention needs heads x head_dim == hidden
    out, plan = run("qwen2-moe", mg, args)
    check(out, hf)
    c = plan.config
    assert c["architectures"] == ["Qwen2MoeForCausalLM"] and c["model_type"] == "qwen2_moe"
    assert (c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]) == (4, 2, 8)
    assert c["shared_expert_intermediate_size"] == 16 and c["qkv_bias"] is True
    assert c["mlp_only_layers"] == [0] and c["intermediate_size"] == FFN
    assert c["norm_topk_prob"] is False
    _, plan = run("qwen2-moe", mg, {**args, "moe_router_pre_softmax": False})
    assert plan.config["norm_topk_prob"] is True
    with pytest.raises(UnsupportedCheckpointError, match="query/key/value biases"):
        run("mixtral", *moe_pair(qkv_bias=True)[:1], moe_args())
    mg, _ = moe_pair(hf_names="qwen2-moe")
    with pytest.raises(UnsupportedCheckpointError, match="no shared experts"):
        run("qwen2-moe", mg, moe_args())


def test_layer_of_and_ignored() -> None:
    assert hfmap.layer_of("decoder.layers.12.mlp.linear_fc1.weight") == 12
    assert hfmap.layer_of("embedding.word_embeddings.weight") is None
    assert hfmap.ignored("decoder.layers.0.mlp.linear_fc1._extra_state")
    assert hfmap.ignored("decoder.layers.0.self_attention.core_attention.rotary.inv_freq")
    assert not hfmap.ignored("decoder.layers.0.mlp.linear_fc1.weight")
    assert set(hfmap.MAPS) == {"llama", "gpt2", "mixtral", "qwen2-moe"}
