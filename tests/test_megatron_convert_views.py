"""``convert --unstack-layers`` and ``convert --map``: a Megatron checkpoint's
stacked layers written one per layer, and its GPT model written as the
Hugging Face model transformers loads (names, q/k/v and gate/up split,
vocabulary cut, config.json), the same bytes on one process or many."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from megatron_builders import whole_model, write_legacy
from safetensors.torch import load_file

LLAMA_ARGS = {"num_attention_heads": 4, "num_query_groups": 2, "group_query_attention": True,
              "kv_channels": 4, "hidden_size": 16, "ffn_hidden_size": 24,
              "normalization": "RMSNorm", "untie_embeddings_and_output_weights": True,
              "position_embedding_type": "rope", "norm_epsilon": 1e-5, "vocab_size": 50,
              "max_position_embeddings": 64}


def _torch_dist(root: Path) -> dict[str, torch.Tensor]:
    """A torch_dist save directory whose layers are stacked; its tensors."""
    import argparse

    import torch.distributed.checkpoint as dcp

    folder = root / "iter_0000003"
    gen = torch.Generator().manual_seed(3)
    state = {"decoder.layers.self_attention.linear_qkv.weight": torch.randn(4, 32, 16,
                                                                           generator=gen),
             "decoder.layers.mlp.experts.linear_fc1.weight": torch.randn(4, 2, 48, 16,
                                                                        generator=gen),
             "embedding.word_embeddings.weight": torch.randn(64, 16, generator=gen)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder))
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    torch.save({"args": argparse.Namespace(num_layers=4, num_experts=2), "iteration": 3},
               folder / "common.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    return state


def test_unstack_layers_writes_one_tensor_per_layer_and_expert(tmp_path: Path,
                                                                 run_cli: Any) -> None:
    state = _torch_dist(tmp_path / "run")
    out = tmp_path / "layers.safetensors"
    code, text, err = run_cli("convert", str(tmp_path / "run"), str(out), "--unstack-layers")
    assert code == 0, err
    assert "the layers stacked in 2 tensors written one per layer (12 tensors)" in \
        " ".join(text.split())
    written = load_file(out)
    qkv = state["decoder.layers.self_attention.linear_qkv.weight"]
    fc1 = state["decoder.layers.mlp.experts.linear_fc1.weight"]
    for i in range(4):
        assert torch.equal(written[f"decoder.layers.{i}.self_attention.linear_qkv.weight"],
                           qkv[i])
        for e in range(2):
            name = f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight"
            assert torch.equal(written[name], fc1[i, e])
    assert torch.equal(written["embedding.word_embeddings.weight"],
                       state["embedding.word_embeddings.weight"])
    assert len(written) == 13


def test_map_llama_splits_qkv_and_swiglu_and_cuts_the_vocabulary(tmp_path: Path,
                                                                  run_cli: Any) -> None:
    full = whole_model()
    write_legacy(tmp_path / "run", full, **LLAMA_ARGS)
    out = tmp_path / "hf"
    code, _, err = run_cli("convert", str(tmp_path / "run"), str(out), "--map", "llama")
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_key_value_heads"], config["vocab_size"]) == (2, 50)
    written = load_file(out / "model.safetensors")
    qkv = full["decoder.layers.2.self_attention.linear_qkv.weight"]  # per group: q q k v
    groups = qkv.reshape(2, 4, 4, 16)  # (group, [q, q, k, v] rows of 4, ..)
    assert torch.equal(written["model.layers.2.self_attn.q_proj.weight"],
                       groups[:, :2].reshape(-1, 16))
    assert torch.equal(written["model.layers.2.self_attn.k_proj.weight"],
                       groups[:, 2].reshape(-1, 16))
    assert torch.equal(written["model.layers.2.self_attn.v_proj.weight"],
                       groups[:, 3].reshape(-1, 16))
    fc1 = full["decoder.layers.3.mlp.linear_fc1.weight"]
    assert torch.equal(written["model.layers.3.mlp.gate_proj.weight"], fc1[:24])
    assert torch.equal(written["model.layers.3.mlp.up_proj.weight"], fc1[24:])
    assert torch.equal(written["lm_head.weight"], full["output_layer.weight"][:50])
    assert torch.equal(written["model.embed_tokens.weight"],
                       full["embedding.word_embeddings.weight"][:50])


def test_map_on_two_processes_writes_the_same_bytes(tmp_path: Path, run_cli: Any) -> None:
    write_legacy(tmp_path / "run", whole_model(), **LLAMA_ARGS)
    one, two = tmp_path / "one", tmp_path / "two"
    assert run_cli("convert", str(tmp_path / "run"), str(one), "--map", "llama")[0] == 0
    code, _, err = run_cli("convert", str(tmp_path / "run"), str(two), "--map", "llama",
                           "--workers", "2", "-q")
    assert code == 0, err
    for name in ("model.safetensors", "config.json"):
        assert (one / name).read_bytes() == (two / name).read_bytes()


@pytest.mark.parametrize(("args", "message"), [
    (("--map", "llama"), "--map llama writes a Hugging Face directory"),
    (("--map", "t5"), "--map t5: ckptool maps Megatron GPT models to llama, gpt2")])
def test_map_refusals(tmp_path: Path, run_cli: Any, args: tuple[str, ...],
                      message: str) -> None:
    write_legacy(tmp_path / "run", whole_model(), **LLAMA_ARGS)
    out = tmp_path / ("x.safetensors" if args[1] == "llama" else "hf")
    code, _, err = run_cli("convert", str(tmp_path / "run"), str(out), *args)
    assert code == 2
    assert message in err
    assert not out.exists()


def test_unstack_layers_of_another_checkpoint_is_refused(tmp_path: Path,
                                                          run_cli: Any) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    code, _, err = run_cli("convert", str(tmp_path / "m.pt"), str(tmp_path / "o.safetensors"),
                           "--unstack-layers")
    assert code == 2
    assert "--unstack-layers reads a Megatron checkpoint" in err


LLAMA_RULES = """
[[rule]]
from = "embedding.word_embeddings.weight"
to = "model.embed_tokens.weight"
vocab = true

[[rule]]
from = "decoder.layers.{layer}.self_attention.linear_qkv.weight"
split = "qkv"
to = ["model.layers.{layer}.self_attn.q_proj.weight",
      "model.layers.{layer}.self_attn.k_proj.weight",
      "model.layers.{layer}.self_attn.v_proj.weight"]

[[rule]]
from = "decoder.layers.{layer}.self_attention.linear_proj.weight"
to = "model.layers.{layer}.self_attn.o_proj.weight"

[[rule]]
from = "decoder.layers.{layer}.mlp.linear_fc1.weight"
split = "halves"
to = ["model.layers.{layer}.mlp.gate_proj.weight", "model.layers.{layer}.mlp.up_proj.weight"]

[[rule]]
from = "decoder.layers.{layer}.mlp.linear_fc2.weight"
to = "model.layers.{layer}.mlp.down_proj.weight"

[[rule]]
from = "decoder.layers.{layer}.input_layernorm.weight"
to = "model.layers.{layer}.input_layernorm.weight"

[[rule]]
from = "decoder.layers.{layer}.pre_mlp_layernorm.weight"
to = "model.layers.{layer}.post_attention_layernorm.weight"

[[rule]]
from = "decoder.final_layernorm.weight"
to = "model.norm.weight"

[[rule]]
from = "output_layer.weight"
to = "lm_head.weight"
vocab = true

[config]
model_type = "llama"
"""


def test_a_rules_file_writes_what_the_built_in_map_writes(tmp_path: Path,
                                                          run_cli: Any) -> None:
    write_legacy(tmp_path / "run", whole_model(), **LLAMA_ARGS)
    (tmp_path / "rules.toml").write_text(LLAMA_RULES)
    code, _, err = run_cli("convert", str(tmp_path / "run"), str(tmp_path / "mine"), "--map",
                           str(tmp_path / "rules.toml"))
    assert code == 0, err
    assert run_cli("convert", str(tmp_path / "run"), str(tmp_path / "llama"), "--map",
                   "llama")[0] == 0
    mine, llama = load_file(tmp_path / "mine/model.safetensors"), load_file(
        tmp_path / "llama/model.safetensors")
    assert sorted(mine) == sorted(llama)
    assert all(torch.equal(mine[k], llama[k]) for k in mine)
    assert json.loads((tmp_path / "mine/config.json").read_text()) == {"model_type": "llama"}


@pytest.mark.parametrize(("edit", "message"), [
    (lambda r: r.replace('[[rule]]\nfrom = "decoder.final_layernorm.weight"\nto = '
                         '"model.norm.weight"\n', ""),
     "no rule takes decoder.final_layernorm.weight"),
    (lambda r: r + '\n[[rule]]\nfrom = "decoder.layers.{layer}.nothing"\nto = "x"\n',
     "rule for decoder.layers.{layer}.nothing matches no tensor"),
    (lambda r: r.replace('split = "halves"', 'split = "chunks:3"'),
     "split chunks:3 makes 3 tensors, and 'to' names 2"),
    (lambda r: r.replace('split = "qkv"', 'split = "qkv"\nheads = 8'),
     "is not a qkv of heads=8"),
    (lambda r: r.replace("[[rule]]", "[[rule]]]", 1), "is not valid TOML"),
])
def test_a_rules_file_s_mistakes_are_named(tmp_path: Path, run_cli: Any, edit: Any,
                                           message: str) -> None:
    write_legacy(tmp_path / "run", whole_model(), **LLAMA_ARGS)
    (tmp_path / "rules.toml").write_text(edit(LLAMA_RULES))
    code, _, err = run_cli("convert", str(tmp_path / "run"), str(tmp_path / "out"), "--map",
                           str(tmp_path / "rules.toml"))
    assert code == 2, err
    assert message in err
    assert not (tmp_path / "out").exists()


def test_unstack_on_two_processes_writes_the_bytes_of_one(tmp_path: Path,
                                                          run_cli: Any) -> None:
    _torch_dist(tmp_path / "run")
    one, two = tmp_path / "one", tmp_path / "two"
    assert run_cli("convert", str(tmp_path / "run"), str(one), "--unstack-layers",
                   "--max-shard-size", "4KB")[0] == 0
    code, _, err = run_cli("convert", str(tmp_path / "run"), str(two), "--unstack-layers",
                           "--max-shard-size", "4KB", "--workers", "2", "-q")
    assert code == 0, err
    names = sorted(p.name for p in one.iterdir())
    assert len(names) > 3 and names == sorted(p.name for p in two.iterdir())
    assert all((one / n).read_bytes() == (two / n).read_bytes() for n in names)
