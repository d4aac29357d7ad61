"""Checkpoints Megatron itself wrote (megatron-core 0.16.1 on CPU:
``tests/fixtures/megatron/make_megatron.py``): a GPT with GQA and SwiGLU
under TP 2 x PP 2 as ``torch_dist`` and as legacy rank files, and torch_dist
runs with a virtual pipeline and with experts. What ckptool makes of them is
compared with what Megatron's own ``dist_checkpointing.load`` put in a
TP 1 x PP 1 model (``reference*/model.pt``); nothing of Megatron is imported."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptool
from ckptool.read.reader import open_checkpoint

HERE = Path(__file__).parent / "fixtures" / "megatron"


def _reference(variant: str = "") -> dict[str, torch.Tensor]:
    ref = torch.load(HERE / f"reference{variant}" / "model.pt", weights_only=True)
    return {k: v for k, v in ref.items() if isinstance(v, torch.Tensor)}


def test_inspect_diagnose_verify_of_the_torch_dist_run(run_cli: Any) -> None:
    run = str(HERE / "torch_dist")
    code, out, err = run_cli("inspect", run)
    assert code == 0, err
    out = " ".join(out.split())
    assert "Megatron-core torch_dist" in out
    assert "megatron torch_dist · iteration 10 · TP 2 x PP 2 · 4 layers" in out
    assert "globals only tensor and plain-data types" in out
    code, out, err = run_cli("verify", run)
    assert code == 0, out + err
    code, out, err = run_cli("inspect", run, "--json")
    assert code == 0, err
    meta = json.loads(out)["metadata"]["megatron"]
    assert meta["args"]["num_query_groups"] == 2 and meta["args"]["swiglu"] is True
    ckpt = open_checkpoint(run)
    shapes = {t.key: t.shape for t in ckpt.tensors}
    assert shapes["decoder.layers.self_attention.linear_qkv.weight"] == (4, 96, 64)
    assert shapes["decoder.layers.mlp.linear_fc1.weight"] == (4, 192, 64)
    code, out, err = run_cli("diagnose", run)
    assert code in (0, 1), err
    assert not any(m == "megatron" or m.startswith("megatron.") for m in sys.modules)


@pytest.mark.parametrize("variant", ["", "_vpp", "_moe"])
def test_unstacked_torch_dist_is_what_megatron_loads(tmp_path: Path, run_cli: Any,
                                                      variant: str) -> None:
    out = tmp_path / "layers.safetensors"
    code, _, err = run_cli("convert", str(HERE / f"torch_dist{variant}"), str(out),
                           "--unstack-layers")
    assert code == 0, err
    written, ref = load_file(out), _reference(variant)
    assert sorted(written) == sorted(ref)
    assert [k for k in ref if not torch.equal(written[k], ref[k])] == []


# NullTokenizer: args.vocab_size and its end-of-document id
@pytest.mark.parametrize(("variant", "vocab"), [("", 251), ("_vpp", 61), ("_moe", 61)])
def test_legacy_rank_files_join_into_what_megatron_loads(variant: str, vocab: int) -> None:
    joined, ref = ckptool.load(str(HERE / f"legacy{variant}")), _reference(variant)
    assert sorted(joined) == sorted(ref)
    for key, value in ref.items():
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            value = value[:vocab]  # the vocabulary without Megatron's padding (args.vocab_size)
        assert torch.equal(joined[key], value), key


def test_a_deleted_rank_file_is_named(tmp_path: Path, run_cli: Any) -> None:
    import shutil

    run = tmp_path / "legacy"
    shutil.copytree(HERE / "legacy", run)
    (run / "iter_0000010" / "mp_rank_01_001" / "model_optim_rng.pt").unlink()
    code, out, _ = run_cli("verify", str(run))
    assert code == 1
    assert "mp_rank_01_001/model_optim_rng.pt" in out
    code, _, err = run_cli("inspect", str(run))
    assert code == 3 and "mp_rank_01_001/model_optim_rng.pt is missing" in err


@pytest.mark.parametrize("run", ["torch_dist", "legacy"])
def test_map_llama_writes_the_hugging_face_model(tmp_path: Path, run_cli: Any,
                                                 run: str) -> None:
    out = tmp_path / "hf"
    code, _, err = run_cli("convert", str(HERE / run), str(out), "--map", "llama")
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"],
            config["vocab_size"], config["intermediate_size"]) == (8, 2, 251, 96)
    written, ref = load_file(out / "model.safetensors"), _reference()
    qkv = ref["decoder.layers.1.self_attention.linear_qkv.weight"].reshape(2, 6, 8, 64)
    assert torch.equal(written["model.layers.1.self_attn.q_proj.weight"],
                       qkv[:, :4].reshape(64, 64))
    assert torch.equal(written["model.layers.1.self_attn.v_proj.weight"],
                       qkv[:, 5].reshape(16, 64))
    fc1 = ref["decoder.layers.2.mlp.linear_fc1.weight"]
    assert torch.equal(written["model.layers.2.mlp.up_proj.weight"], fc1[96:])
