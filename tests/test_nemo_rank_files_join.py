"""NeMo 1's rank files (``tp_rank_XX_pp_rank_YYY/model_weights.ckpt``, in a
folder or a ``.nemo``) joined into one model as Megatron's are: the run's
sizes from ``model_config.yaml``, the merge rules of ``rules``. Built from
the rank files megatron-core itself wrote (TP 2 x PP 2, GQA, SwiGLU), so
the joined model is the TP 1 x PP 1 reference Megatron loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_nemo
from safetensors.torch import load_file

import ckptool
from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.read.archive import mounts
from ckptool.read.reader import open_checkpoint

FIXTURES = Path(__file__).parent / "fixtures"
MEGATRON = FIXTURES / "megatron"




def _reference() -> dict[str, torch.Tensor]:
    ref = torch.load(MEGATRON / "reference" / "model.pt", weights_only=True)
    return {k: v for k, v in ref.items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_nemo.from_megatron(MEGATRON / "legacy",
                                   tmp_path_factory.mktemp("nemo") / "run")


@pytest.mark.parametrize("packed", [False, True])
def test_the_ranks_join_into_what_megatron_loads(ranks: Path, tmp_path: Path,
                                                 packed: bool) -> None:
    path = make_nemo.tar_folder(ranks, tmp_path / "run.nemo") if packed else ranks
    joined, ref = ckptool.load(str(path)), _reference()
    mounts.unmount_all()
    assert sorted(joined) == sorted(ref)
    for key, value in ref.items():  # the vocabulary's padding kept: NeMo's config has no size
        assert torch.equal(joined[key], value), key


def test_inspect_says_nemo_and_the_run(ranks: Path, run_cli: Any) -> None:
    code, out, err = run_cli("inspect", str(ranks), "--json")
    assert code == 0, err
    doc = json.loads(out)
    meta = doc["metadata"]
    assert meta["megatron"]["format"] == "nemo-ranks"
    assert (meta["megatron"]["tensor_parallel"], meta["megatron"]["pipeline_parallel"]) == (2, 2)
    assert meta["nemo"]["version"] == 1
    code, out, err = run_cli("inspect", str(ranks))
    assert code == 0, err
    assert "NeMo 1 MegatronGPTModel · TP 2 x PP 2 · 4 layers" in out


def test_verify_and_a_missing_rank_file_named(ranks: Path, tmp_path: Path,
                                              run_cli: Any) -> None:
    code, out, err = run_cli("verify", str(ranks))
    assert code == 0, out + err
    run = tmp_path / "run"
    shutil.copytree(ranks, run)
    (run / "tp_rank_01_pp_rank_001" / "model_weights.ckpt").unlink()
    code, out, _ = run_cli("verify", str(run))
    assert code == 1 and "tp_rank_01_pp_rank_001/model_weights.ckpt" in out
    with pytest.raises(CorruptCheckpointError,
                       match=r"tp_rank_01_pp_rank_001/model_weights\.ckpt is missing"):
        open_checkpoint(str(run))


def test_a_rank_folder_gone_is_named_by_the_config(ranks: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(ranks, run)
    shutil.rmtree(run / "tp_rank_01_pp_rank_001")
    shutil.rmtree(run / "tp_rank_00_pp_rank_001")
    with pytest.raises(CorruptCheckpointError, match=r"tp_rank_00_pp_rank_001/model_weights"
                       r"\.ckpt, tp_rank_01_pp_rank_001/model_weights\.ckpt are missing \(the "
                       r"run was TP 2 x PP 2, its config says\)"):
        open_checkpoint(str(run))


def test_one_rank_of_a_tensor_parallel_run_is_not_read_as_the_model(tmp_path: Path) -> None:
    make_nemo.make("tp2", tmp_path)
    run = tmp_path / "one"
    shutil.copytree(tmp_path / "tp2_src", run)
    shutil.rmtree(run / "mp_rank_01")
    with pytest.raises(CorruptCheckpointError, match=r"mp_rank_01/model_weights\.ckpt is "
                       r"missing \(the run was TP 2 x PP 1, its config says\)"):
        open_checkpoint(str(run))


@pytest.mark.parametrize(("key", "value"), [("virtual_pipeline_model_parallel_size", "2"),
                                            ("activation", "geglu")])
def test_runs_the_rules_cannot_join_are_refused(ranks: Path, tmp_path: Path, key: str,
                                                value: str) -> None:
    run = tmp_path / "run"
    shutil.copytree(ranks, run)
    config = run / "model_config.yaml"
    lines = [f"{key}: {value}" if line.startswith(f"{key}:") else line
             for line in config.read_text().splitlines()]
    config.write_text("\n".join(lines) + "\n")
    with pytest.raises(UnsupportedCheckpointError, match=f"a run with {key}"):
        open_checkpoint(str(run))


def test_convert_and_map_llama(ranks: Path, tmp_path: Path, run_cli: Any) -> None:
    out = tmp_path / "whole.safetensors"
    code, _, err = run_cli("convert", str(ranks), str(out))
    assert code == 0, err
    written, ref = load_file(out), _reference()
    assert sorted(written) == sorted(ref)
    assert [k for k in ref if not torch.equal(written[k], ref[k])] == []
    hf = tmp_path / "hf"
    code, _, err = run_cli("convert", str(ranks), str(hf), "--map", "llama")
    assert code == 0, err
    config = json.loads((hf / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"],
            config["intermediate_size"], config["vocab_size"]) == (8, 2, 96, 256)
    mapped = load_file(hf / "model.safetensors")
    assert torch.equal(mapped["model.layers.3.mlp.down_proj.weight"],
                       ref["decoder.layers.3.mlp.linear_fc2.weight"])
    assert torch.equal(mapped["lm_head.weight"], ref["output_layer.weight"])


def test_a_configs_activation_settings_reach_the_maps() -> None:
    from ckptool.read.megatron.nemo import flat_yaml, megatron_args

    args = megatron_args(flat_yaml("activation: gelu\nbias_activation_fusion: true\n"
                                   "openai_gelu: false\nnormalization: layernorm1p\n"
                                   "num_attention_heads: 8\nnum_query_groups: 2\n"
                                   "share_embeddings_and_output_weights: true\n"))
    assert args["bias_gelu_fusion"] is True and args["openai_gelu"] is False
    assert args["swiglu"] is False and args["apply_layernorm_1p"] is True
    assert (args["group_query_attention"], args["num_query_groups"]) == (True, 2)
    assert args["untie_embeddings_and_output_weights"] is False
