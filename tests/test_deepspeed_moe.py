"""DeepSpeed native MoE checkpoints (``deepspeed.moe.layer.MoE``), as
DeepSpeed 0.19.8's own ``save_checkpoint`` wrote them
(tests/fixtures/deepspeed_moe): the experts joined under their global ids,
from the fp32 partitions of their expert-parallel ranks (ZeRO 1/2) or from
the expert files (ZeRO 0), equal to the model DeepSpeed's
``load_checkpoint`` puts back; what is missing or mixed named."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptool
from ckptool.errors import CorruptCheckpointError
from ckptool.read.reader import open_checkpoint

MOE = Path(__file__).parent / "fixtures" / "deepspeed_moe"
VARIANTS = ["w1_ep1_z1", "w2_ep1_z1", "w2_ep2_z2", "w2_ep2_z2_bf16", "w2_ep2_z0"]
EXPERT = "moe1.deepspeed_moe.experts.deepspeed_experts.3.2.weight"


def _reference(variant: str) -> dict[str, torch.Tensor]:
    return torch.load(MOE / f"{variant}.reference.pt", weights_only=True)


def _copy(tmp_path: Path, variant: str) -> Path:
    shutil.copytree(MOE / variant, tmp_path / variant)
    return tmp_path / variant / "global_step2"


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_experts_join_into_what_deepspeed_loads(variant: str) -> None:
    joined, ref = ckptool.load(str(MOE / variant)), _reference(variant)
    assert sorted(joined) == sorted(ref)
    for key, value in ref.items():  # (bf16 run: the fp32 masters, the module's when cast)
        assert torch.equal(joined[key].to(value.dtype), value), key
    names = list(joined)  # each layer's experts after its gate, as the model orders them
    assert names.index("moe0.deepspeed_moe.gate.wg.weight") + 1 == names.index(
        "moe0.deepspeed_moe.experts.deepspeed_experts.0.0.weight")


def test_inspect_lists_the_expert_files_and_says_moe(run_cli: Any) -> None:
    code, out, err = run_cli("inspect", str(MOE / "w2_ep2_z2"))
    assert code == 0, err
    assert "layer_0_expert_0_mp_rank_00_model_states.pt · 3.4 kB · expert states" in out
    assert "MoE: 8 expert files of 2 layers" in out
    code, out, err = run_cli("inspect", str(MOE / "w2_ep2_z2"), "--json")
    doc = json.loads(out)
    assert doc["metadata"]["expert_files"] == 8
    assert "num_experts" not in {e["key"] for e in doc["entries"]}  # DeepSpeed's, not client


@pytest.mark.parametrize("variant", ["w2_ep2_z2", "w2_ep2_z0"])
def test_verify_and_convert(variant: str, tmp_path: Path, run_cli: Any) -> None:
    code, out, err = run_cli("verify", str(MOE / variant))
    assert code == 0, out + err
    dest = tmp_path / "model.safetensors"
    code, _, err = run_cli("convert", str(MOE / variant), str(dest))
    assert code == 0, err
    written, ref = load_file(dest), _reference(variant)
    assert sorted(written) == sorted(ref)
    assert [k for k in ref if not torch.equal(written[k], ref[k])] == []


def test_two_workers_write_the_bytes_of_one(tmp_path: Path, run_cli: Any) -> None:
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    assert run_cli("convert", str(MOE / "w2_ep2_z2"), str(one))[0] == 0
    code, _, err = run_cli("convert", str(MOE / "w2_ep2_z2"), str(two), "--workers", "2")
    assert code == 0, err
    assert one.read_bytes() == two.read_bytes()


def test_the_module_weights_are_refused_they_hold_no_expert(tmp_path: Path,
                                                            run_cli: Any) -> None:
    code, _, err = run_cli("convert", str(MOE / "w2_ep2_z2"), str(tmp_path / "o.safetensors"),
                           "--weights", "module")
    assert code == 3
    assert "module holds no expert" in err and not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("variant", ["w2_ep2_z2", "w2_ep2_z0"])
def test_a_missing_expert_file_is_named(variant: str, tmp_path: Path, run_cli: Any) -> None:
    tag = _copy(tmp_path, variant)
    (tag / "layer_1_expert_3_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"layer_1_expert_3_mp_rank_00_model_"
                       r"states\.pt is missing \(num_experts says \[4, 4\]\)"):
        open_checkpoint(str(tag))
    code, out, _ = run_cli("verify", str(tag))
    assert code == 1, out
    assert "layer_1_expert_3_mp_rank_00_model_states.pt" in out


def test_experts_the_partitions_hold_and_no_file_does_are_named(tmp_path: Path) -> None:
    tag = _copy(tmp_path, "w2_ep2_z2")
    path = tag / "layer_1_expert_3_mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    del state[EXPERT]
    torch.save(state, path)
    with pytest.raises(CorruptCheckpointError, match=f"no expert file holds {EXPERT}"):
        open_checkpoint(str(tag))


def test_expert_files_of_another_save_are_refused(tmp_path: Path) -> None:
    tag = _copy(tmp_path, "w2_ep2_z2")
    path = tag / "layer_1_expert_3_mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    state[EXPERT] = torch.zeros(3, 3)
    torch.save(state, path)
    with pytest.raises(CorruptCheckpointError, match=r"is \[3, 3\] in layer_1_expert_3"):
        open_checkpoint(str(tag))


def test_a_payload_in_an_expert_file_is_named_and_never_run(tmp_path: Path,
                                                            run_cli: Any) -> None:
    tag = _copy(tmp_path, "w2_ep2_z2")
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    path = tag / "layer_0_expert_0_mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    state["note"] = Payload()
    torch.save(state, path)
    code, out, err = run_cli("inspect", str(tag))
    assert code == 0, err
    assert "UNSAFE" in out and "system" in out and not marker.exists()


def test_a_zero_0_save_of_no_expert_file_is_refused(tmp_path: Path) -> None:
    tag = _copy(tmp_path, "w2_ep2_z0")
    for path in tag.glob("layer_*_expert_*"):
        path.unlink()  # (the module holds no expert: the model would lack them all)
    with pytest.raises(CorruptCheckpointError, match=r"layer_0_expert_0_mp_rank_00_model_"
                       r"states\.pt, .* are missing \(num_experts says \[4, 4\]\)"):
        open_checkpoint(str(tag))
