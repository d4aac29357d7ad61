"""DeepSpeed universal checkpoints (ds_to_universal's output), read without
DeepSpeed: the fp32 weights equal DeepSpeed's own zero_to_fp32 of the ZeRO
checkpoint they were converted from; inspected, converted, verified; what
cannot be placed refused by name. Fixtures: tests/fixtures/deepspeed_universal/
(made by DeepSpeed 0.19.8's ds_to_universal: make_universal.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CliResult
from safetensors import safe_open
from safetensors.torch import load_file

import ckptool
from ckptool.read.tensor_source import TensorValues

HERE = Path(__file__).resolve().parent
UC = HERE / "fixtures" / "deepspeed_universal"
DS = HERE / "fixtures" / "deepspeed"
TAG = "global_step2_universal"
FIXTURES = {"z2_fp32": 2, "z3_bf16": 3, "z2_vocab": 2}  # name: ZeRO stage


def reference(name: str) -> dict[str, torch.Tensor]:
    where = UC if (UC / f"{name}.reference.pt").exists() else DS
    return torch.load(where / f"{name}.reference.pt", weights_only=True)


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def values(path: Path) -> tuple[ckptool.Checkpoint, dict[str, torch.Tensor]]:
    ckpt = ckptool.open(path)
    with TensorValues(ckpt) as tv:
        out = {name: tv.values(t) for name, t in ckpt.state_dict().items()}
    for alias, kept in ckpt.aliases.items():
        out[alias] = out[kept]
    return ckpt, out


@pytest.mark.parametrize("name", list(FIXTURES))
def test_reads_as_deepspeed_consolidates(name: str) -> None:
    for path in (UC / name, UC / name / TAG):  # latest_universal's parent, or the folder
        ckpt, got = values(path)
        assert ckpt.format == "deepspeed-universal"
        assert ckpt.metadata["zero_stage"] == FIXTURES[name]
        assert ckpt.metadata["tag"] == TAG and ckpt.metadata["world_size"] == 2
        want = reference(name)
        assert sorted(got) == sorted(want)
        for key, tensor in want.items():
            assert same(got[key], tensor), key
        assert ckpt.aliases == {"head.weight": "emb.weight"}
    assert "deepspeed" not in sys.modules


def test_chunks_are_the_bytes_of_fp32_pt() -> None:
    ckpt = ckptool.open(UC / "z3_bf16")
    t = next(t for t in ckpt.tensors if t.key == "lin.weight")
    assert t.shape == (24, 8) and t.dtype == "float32"
    (c,) = t.chunks
    assert c.file == "zero/lin.weight/fp32.pt" and c.byte_length == 24 * 8 * 4
    with open(UC / "z3_bf16" / TAG / c.file, "rb") as f:
        f.seek(c.byte_offset)
        raw = f.read(c.byte_length)
    part = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(24, 8)
    assert torch.equal(part, reference("z3_bf16")["lin.weight"])


def test_universal_checkpoint_info_is_shown(run_cli: Callable[..., CliResult]) -> None:
    code, out, err = run_cli("inspect", str(UC / "z2_vocab"))
    assert code == 0, err
    flat = " ".join(out.split())
    assert "deepspeed-universal (ds_to_universal's output · ZeRO 2 · 2 ranks · float32 run · " \
        "tag global_step2_universal · DeepSpeed 0.19.8 · universal_checkpoint_info 0.2: " \
        "original_vocab_size, vocabulary_parameter_patterns" in flat
    assert "the vocabulary padding was cut by ds_to_universal (32 -> 30 rows" in flat
    assert "zero/emb.weight/fp32.pt" in flat and "fp32 weights" in flat
    assert "iteration = 2" in flat  # the client state
    code, out, err = run_cli("inspect", str(UC / "z2_vocab"), "--json")
    data = json.loads(out)
    assert data["format"] == "deepspeed-universal"
    info = data["metadata"]["universal_checkpoint_info"]
    assert info["original_vocab_size"] == 30
    keys = {t["key"]: t for t in data["tensors"]}
    assert keys["emb.weight"]["shape"] == [30, 8]


def test_inspect_without_info(run_cli: Callable[..., CliResult]) -> None:
    code, out, err = run_cli("inspect", str(UC / "z2_fp32"))
    assert code == 0, err
    flat = " ".join(out.split())
    assert "deepspeed-universal (ds_to_universal's output · ZeRO 2 · 2 ranks · float32 run · " \
        "tag global_step2_universal · DeepSpeed 0.19.8)" in flat
    assert "fp32 copies of the module's buffers, frozen and tied parameters" in flat
    assert "another checkpoint" not in flat  # its own files are not companions
    assert "epoch = 3" in flat


@pytest.mark.parametrize("name", ["z2_fp32", "z3_bf16", "z2_vocab"])
def test_convert_gives_the_reference(tmp_path: Path, name: str,
                                     run_cli: Callable[..., CliResult]) -> None:
    code, _out, err = run_cli("convert", str(UC / name), str(tmp_path / "m.safetensors"))
    assert code == 0, err
    st = load_file(tmp_path / "m.safetensors")
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        aliases = json.loads(f.metadata()["ckptool.aliases"])
    assert aliases == {"head.weight": "emb.weight"}
    for key, tensor in reference(name).items():
        assert same(st[aliases.get(key, key)], tensor), key


def test_verify(run_cli: Callable[..., CliResult]) -> None:
    code, out, err = run_cli("verify", str(UC / "z3_bf16"))
    assert code == 0, out + err
    assert "deepspeed-universal" in out and "24 files" in out


def copy(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    shutil.copytree(UC / name, d)
    return d


def test_a_missing_fp32_is_named(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    d = copy(tmp_path, "z2_fp32")
    (d / TAG / "zero" / "lin.weight" / "fp32.pt").unlink()
    code, out, err = run_cli("inspect", str(d))
    assert code == 3
    assert "the fp32 weights of lin.weight are missing" in err
    assert "zero/lin.weight/fp32.pt" in err
    code, out, err = run_cli("verify", str(d))
    assert code == 1, out + err
    assert "zero/lin.weight/fp32.pt: the fp32 weights of lin.weight are missing" in out


def test_a_copy_folder_without_fp32_is_named(tmp_path: Path,
                                             run_cli: Callable[..., CliResult]) -> None:
    d = copy(tmp_path, "z2_fp32")
    (d / TAG / "zero" / "buf" / "fp32.pt").unlink()
    (d / TAG / "zero" / "buf" / "exp_avg.pt").write_bytes(b"x")
    code, _out, err = run_cli("inspect", str(d))
    assert code == 3 and "zero/buf/fp32.pt" in err and "exp_avg.pt" in err


def test_a_shape_that_disagrees_is_refused(tmp_path: Path,
                                           run_cli: Callable[..., CliResult]) -> None:
    d = copy(tmp_path, "z2_fp32")
    other = d / TAG / "zero" / "out.weight" / "fp32.pt"
    shutil.copy(d / TAG / "zero" / "lin.weight" / "fp32.pt", other)
    code, _out, err = run_cli("inspect", str(d))
    assert code == 3
    assert "zero/out.weight/fp32.pt holds out.weight as [24, 8], but the model states' " \
        "param_shapes say [3, 24]" in err


def test_a_folder_of_no_parameter_is_refused(tmp_path: Path,
                                             run_cli: Callable[..., CliResult]) -> None:
    d = copy(tmp_path, "z3_bf16")
    shutil.copytree(d / TAG / "zero" / "lin.bias", d / TAG / "zero" / "stray.bias")
    code, _out, err = run_cli("inspect", str(d))
    assert code == 3 and "zero/stray.bias/ is no parameter the model states name" in err


def test_latest_universal_names_a_missing_folder(tmp_path: Path,
                                                 run_cli: Callable[..., CliResult]) -> None:
    d = copy(tmp_path, "z2_fp32")
    (d / "latest_universal").write_text("global_step9_universal")
    code, _out, err = run_cli("inspect", str(d))
    assert code == 3 and "latest_universal names 'global_step9_universal'" in err


def test_latest_keeps_the_zero_checkpoint(tmp_path: Path) -> None:
    """Beside a ``latest`` (DeepSpeed loads that one unless told otherwise),
    the ZeRO checkpoint is what the folder reads as."""
    d = copy(tmp_path, "z2_fp32")
    shutil.copytree(DS / "z2_fp32" / "global_step2", d / "global_step2")
    shutil.copy(DS / "z2_fp32" / "latest", d / "latest")
    assert ckptool.open(d).format == "deepspeed"
    assert ckptool.open(d / TAG).format == "deepspeed-universal"


def test_never_imports_deepspeed() -> None:
    script = ("import sys, ckptool; ckptool.open(sys.argv[1]); "
              "assert not any(m.startswith('deepspeed') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", script, str(UC / "z3_bf16")], check=True,
                   cwd=HERE.parent, env={**os.environ, "PYTHONPATH": str(HERE.parent)})


def test_diagnose_says_what_loads_it_and_points_at_convert(run_cli: Any) -> None:
    code, out, err = run_cli("diagnose", str(UC / "z2_fp32"))
    assert code == 1, err
    out = " ".join(out.split())
    assert "universal-checkpoint" in out and "load_universal" in out
    assert f"ckptool convert {UC / 'z2_fp32'} {UC / 'z2_fp32'}.pt" in out
    assert "UnpicklingError" not in out  # (torch.load is not its loader)
