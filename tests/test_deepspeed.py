"""DeepSpeed ZeRO checkpoints, read without DeepSpeed: consolidated exactly as
DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint`` does (its
output is committed beside each fixture), converted into every layout,
inspected, diagnosed; and what does not hold together refused with exit 3."""

from __future__ import annotations

import itertools
import json
import os
import shlex
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import CliResult
from nets import DSTiny
from safetensors import safe_open
from safetensors.torch import load_file

import ckptool
from ckptool.read.tensor_source import TensorValues

HERE = Path(__file__).resolve().parent
DS = HERE / "fixtures" / "deepspeed"
FIXTURES = ["z1_fp32", "z2_fp32", "z3_fp32", "z2_bf16", "z3_bf16", "z3_ws1", "z2_ws3",
            "z1_ws4", "z3_bf16_ws4", "z2_align", "bf16opt", "lightning_z3.ckpt"]
STAGES = {"z1": 1, "z2": 2, "z3": 3, "bf": 1, "li": 3}
RANKS = {"z3_ws1": 1, "z2_ws3": 3, "z1_ws4": 4, "z3_bf16_ws4": 4, "z2_align": 3}


def reference(name: str) -> dict[str, torch.Tensor]:
    return torch.load(DS / f"{name}.reference.pt", weights_only=True)


def consolidated(path: Path) -> tuple[ckptool.Checkpoint, dict[str, torch.Tensor]]:
    ckpt = ckptool.open(path)
    sd = ckpt.state_dict()
    with TensorValues(ckpt) as values:
        out = {name: values.values(t) for name, t in sd.items()}
    for alias, kept in ckpt.aliases.items():
        out[alias] = out[kept]
    return ckpt, out


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("name", FIXTURES)
def test_consolidates_as_deepspeed_does(name: str) -> None:
    ckpt, got = consolidated(DS / name)
    want = reference(name)
    meta = ckpt.metadata
    assert meta["zero_stage"] == STAGES[name[:2]]
    assert meta["world_size"] == RANKS.get(name, 2)
    assert ckpt.format == "deepspeed" and "deepspeed" not in sys.modules
    for key, tensor in want.items():
        assert same(got[key], tensor), key
    extra = sorted(set(got) - set(want))
    # DeepSpeed leaves frozen parameters out at ZeRO 1 (no frozen_param_shapes):
    # ckptool keeps them, from the module, as the model held them
    assert extra == (["frozen.bias", "frozen.weight"] if name.startswith("z1") else [])
    prefix = "_forward_module." if name.startswith("lightning") else ""
    assert ckpt.aliases == {f"{prefix}head.weight": f"{prefix}emb.weight"}
    if extra:
        assert any("frozen parameter" in n for n in meta["notes"])


def test_frozen_parameters_kept_at_zero_1_are_the_modules() -> None:
    _, got = consolidated(DS / "z1_ws4")
    module = torch.load(DS / "z1_ws4" / "global_step2" / "mp_rank_00_model_states.pt",
                        weights_only=True)["module"]
    for key in ("frozen.weight", "frozen.bias"):
        assert same(got[key], module[key])


def test_the_tag_directory_reads_as_its_parent() -> None:
    top, _ = consolidated(DS / "z3_bf16")
    tag, got = consolidated(DS / "z3_bf16" / "global_step2")
    assert tag.metadata["tag"] == top.metadata["tag"] == "global_step2"
    assert [t.key for t in tag.tensors] == [t.key for t in top.tensors]
    for key, tensor in reference("z3_bf16").items():
        assert same(got[key], tensor)


def test_lightning_directory_is_recognised() -> None:
    ckpt = ckptool.open(DS / "lightning_z3.ckpt")
    assert ckpt.metadata["tag"] == "checkpoint"
    assert ckpt.main_state_dict is not None
    assert ckpt.main_state_dict.prefix == "_forward_module."
    entries = {e.key: e.value for e in ckpt.entries}
    assert entries["global_step"] == 2 and entries["hyper_parameters"]["hidden"] == 24


def test_runs_are_byte_ranges_of_the_partitions() -> None:
    ckpt = ckptool.open(DS / "z3_fp32")
    t = next(t for t in ckpt.tensors if t.key == "emb.weight")  # 256 elements, 2 ranks
    assert all(c.flat for c in t.chunks)
    assert sorted((c.rank, c.offsets, c.sizes) for c in t.chunks) == \
        [(0, (0,), (128,)), (1, (128,), (128,))]
    for c in t.chunks:
        assert c.byte_length == 128 * 4 and c.file.endswith("_optim_states.pt")
        with open(DS / "z3_fp32" / "global_step2" / c.file, "rb") as f:
            f.seek(c.byte_offset)
            raw = f.read(c.byte_length)
        part = torch.frombuffer(bytearray(raw), dtype=torch.float32)
        flat = reference("z3_fp32")["emb.weight"].reshape(-1)
        assert torch.equal(part, flat[c.offsets[0]:c.offsets[0] + 128])


# -- convert ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["z2_fp32", "z3_bf16_ws4", "bf16opt", "z2_align"])
def test_convert_into_one_file(tmp_path: Path, name: str,
                               run_cli: Callable[..., CliResult]) -> None:
    want = reference(name)
    code, out, err = run_cli("convert", str(DS / name), str(tmp_path / "m.safetensors"))
    assert code == 0, err
    st = load_file(tmp_path / "m.safetensors")
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        aliases = json.loads(f.metadata()["ckptool.aliases"])
    assert aliases == {"head.weight": "emb.weight"}
    for key, tensor in want.items():
        assert same(st[aliases.get(key, key)], tensor), key
    code, out, err = run_cli("convert", str(DS / name), str(tmp_path / "m.pt"))
    assert code == 0, err
    pt = torch.load(tmp_path / "m.pt", weights_only=True)
    for key, tensor in want.items():
        assert same(pt[key], tensor), key
    assert pt["head.weight"].data_ptr() == pt["emb.weight"].data_ptr()
    assert "what DeepSpeed keeps to resume training" in out


@pytest.mark.parametrize("fmt", ["hf", "hf-bin", "dcp"])
def test_convert_into_a_directory(tmp_path: Path, fmt: str,
                                  run_cli: Callable[..., CliResult]) -> None:
    want = reference("z3_fp32")
    dst = tmp_path / "out"
    code, _, err = run_cli("convert", str(DS / "z3_fp32"), str(dst), "--format", fmt,
                           "--max-shard-size" if fmt != "dcp" else "--quiet",
                           *(["2KB"] if fmt != "dcp" else []))
    assert code == 0, err
    got = consolidated(dst)[1]
    for key, tensor in want.items():
        assert same(got[key], tensor), key


def test_convert_casts(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    code, _, err = run_cli("convert", str(DS / "z3_fp32"), str(tmp_path / "m.safetensors"),
                           "--dtype", "bf16")
    assert code == 0, err
    st = load_file(tmp_path / "m.safetensors")
    for key, tensor in reference("z3_fp32").items():
        if key != "head.weight":
            want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
            assert same(st[key], want), key


def test_convert_module_weights(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    code, _, err = run_cli("convert", str(DS / "z2_bf16"), str(tmp_path / "m.pt"),
                           "--weights", "module")
    assert code == 0, err
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    module = torch.load(DS / "z2_bf16" / "global_step2" / "mp_rank_00_model_states.pt",
                        weights_only=True)["module"]
    assert set(got) == set(module)
    for key, tensor in module.items():
        assert same(got[key], tensor), key
    assert got["emb.weight"].dtype == torch.bfloat16


def test_module_weights_refused_where_there_are_none(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    code, _, err = run_cli("convert", str(DS / "z3_bf16"), str(tmp_path / "m.pt"),
                           "--weights", "module")
    assert code == 3 and "0-element placeholders" in err and "Traceback" not in err
    assert not (tmp_path / "m.pt").exists()
    single = tmp_path / "one.safetensors"
    code, _, _ = run_cli("convert", str(DS / "z2_fp32"), str(single))
    code, _, err = run_cli("convert", str(single), str(tmp_path / "x.pt"), "--weights",
                           "module")
    assert code == 2 and "DeepSpeed" in err


def test_fix_points_at_convert(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    code, _, err = run_cli("fix", str(DS / "z2_fp32"), "--strip-module", "-o",
                           str(tmp_path / "x"))
    assert code == 3 and "ckptool convert" in err and not (tmp_path / "x").exists()


# -- inspect and diagnose ----------------------------------------------------

def test_inspect(run_cli: Callable[..., CliResult]) -> None:
    code, out, err = run_cli("inspect", str(DS / "bf16opt"))
    assert code == 0, err
    out = " ".join(out.split())
    assert "ZeRO 1 · 2 ranks · bfloat16 run · tag global_step2 · BF16_Optimizer" in out
    assert "the fp32 master weights, consolidated" in out
    assert "epoch = 3" in out
    code, out, err = run_cli("inspect", str(DS / "z3_fp32"), "--json")
    data = json.loads(out)
    assert data["format"] == "deepspeed" and data["metadata"]["zero_stage"] == 3
    keys = {t["key"]: t for t in data["tensors"]}
    assert keys["lin.weight"]["chunks"][0]["flat"] is True
    # the optimizer states per rank: sizes only, under each file's name
    moments = [k for k in keys if k.startswith("<zero_pp_rank_1_mp_rank_00_optim_states.pt>")
               and k.endswith("exp_avg")]
    assert moments and all(keys[k]["nbytes"] for k in moments)
    # the partitions the state dict is made of are not listed twice
    assert not any("fp32_flat_groups" in k for k in keys)


def test_diagnose_prints_a_command_that_loads(tmp_path: Path,
                                              run_cli: Callable[..., CliResult]) -> None:
    src = tmp_path / "run.ckpt"
    shutil.copytree(DS / "lightning_z3.ckpt", src)
    code, out, err = run_cli("diagnose", str(src), "--model", f"{HERE}/nets.py:DSTiny",
                             "--json")
    assert code == 1, err
    report = json.loads(out)
    codes = [f["code"] for f in report["findings"]]
    assert codes[0] == "zero-checkpoint" and "key-prefix" in codes
    command = report["fix_command"]
    assert command.startswith(f"ckptool convert {src} ") and " && ckptool fix " in command
    for part in command.split(" && "):
        argv = shlex.split(part)
        assert argv[0] == "ckptool"
        code, _, err = run_cli(*argv[1:])
        assert code == 0, (part, err)
    model = DSTiny()
    model.load_state_dict(torch.load(report["fix_output"], weights_only=True), strict=True)
    assert torch.equal(model.lin.weight, reference("lightning_z3.ckpt")[
        "_forward_module.lin.weight"])


def test_diagnose_without_a_model(run_cli: Callable[..., CliResult]) -> None:
    code, out, _ = run_cli("diagnose", str(DS / "z3_fp32"))
    assert code == 1
    assert "zero-checkpoint" in out and "weights-only" not in out
    assert f"ckptool convert {DS / 'z3_fp32'} {DS / 'z3_fp32'}.pt" in out


# -- what does not hold together ---------------------------------------------

def copy(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(DS / name, dst)
    return dst


def refused(run_cli: Callable[..., CliResult], path: Path, tmp_path: Path,
            *words: str) -> str:
    out = tmp_path / "out.safetensors"
    code, _, err = run_cli("convert", str(path), str(out))
    assert code == 3, err
    assert "Traceback" not in err and not out.exists()
    assert not [p for p in tmp_path.iterdir() if ".partial" in p.name or p.name.startswith(".")]
    for word in words:
        assert word in err, err
    return err


def test_a_missing_rank_is_named(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    d = copy(tmp_path, "z2_bf16")
    (d / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    refused(run_cli, d, tmp_path, "rank 1", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    d = copy(tmp_path, "z3_fp32")
    (d / "global_step2" / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    refused(run_cli, d, tmp_path, "rank 1", "zero_pp_rank_1_mp_rank_00_model_states.pt")


def test_mixed_world_sizes(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    d = copy(tmp_path, "z2_fp32")
    ws3 = DS / "z2_ws3" / "global_step2"
    shutil.copy(ws3 / "zero_pp_rank_2_mp_rank_00_optim_states.pt", d / "global_step2")
    refused(run_cli, d, tmp_path, "disagree", "ZeRO 2, 2 ranks", "ZeRO 2, 3 ranks")
    # a leftover rank of an older save by the same number of ranks
    shutil.copy(d / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                d / "global_step2" / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    refused(run_cli, d, tmp_path, "rank(s) 2", "split over 2 ranks")


def test_mixed_saves(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    d = copy(tmp_path, "z3_fp32")
    name = d / "global_step2" / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    states = torch.load(name, weights_only=True)
    states["global_steps"] = 4
    torch.save(states, name)
    refused(run_cli, d, tmp_path, "different steps")
    # an optimizer that took another number of steps: the step value patched in place
    (tmp_path / "b").mkdir()
    d = copy(tmp_path / "b", "z2_fp32")
    name = d / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with zipfile.ZipFile(name) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
        assert info.file_size == 4
    with open(name, "r+b") as f:
        f.seek(info.header_offset + 26)
        nlen, xlen = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        f.seek(info.header_offset + 30 + nlen + xlen)
        assert torch.frombuffer(bytearray(f.read(4)), dtype=torch.float32).item() == 2.0
        f.seek(-4, os.SEEK_CUR)
        f.write(torch.tensor([3.0]).numpy().tobytes())
    refused(run_cli, d, tmp_path / "b", "different steps")


def test_latest_names_a_missing_tag(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    d = copy(tmp_path, "z2_fp32")
    (d / "latest").write_text("global_step9")
    refused(run_cli, d, tmp_path, "global_step9", "global_step2/")


def test_several_tags_without_latest(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    d = copy(tmp_path, "z2_fp32")
    (d / "latest").unlink()
    shutil.copytree(d / "global_step2", d / "global_step4")
    code, _, err = run_cli("inspect", str(d))
    assert code == 3 and "2 DeepSpeed checkpoints" in err and "global_step" in err
    shutil.rmtree(d / "global_step4")
    assert ckptool.open(d).metadata["tag"] == "global_step2"  # one: that one


def test_truncated_and_foreign_files(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    d = copy(tmp_path, "z3_fp32")
    name = d / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    name.write_bytes(name.read_bytes()[:2000])
    refused(run_cli, d, tmp_path, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (tmp_path / "c").mkdir()
    d = copy(tmp_path / "c", "z2_fp32")
    tp = d / "global_step2" / "mp_rank_01_model_states.pt"
    shutil.copy(d / "global_step2" / "mp_rank_00_model_states.pt", tp)
    refused(run_cli, d, tmp_path / "c", "model-parallel")
    tp.unlink()
    moe = d / "global_step2" / "layer_0_expert_0_mp_rank_00_model_states.pt"
    shutil.copy(d / "global_step2" / "mp_rank_00_model_states.pt", moe)
    refused(run_cli, d, tmp_path / "c",
            "1 MoE expert file, and the model states' num_experts is None")


def test_hostile_client_state_is_named_and_never_run(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    d = copy(tmp_path, "z2_fp32")
    name = d / "global_step2" / "mp_rank_00_model_states.pt"
    states = torch.load(name, weights_only=True)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    states["note"] = Payload()
    torch.save(states, name)
    code, out, _ = run_cli("inspect", str(d))
    assert "UNSAFE" in out and "system" in out and not marker.exists()
    # a flagged checkpoint is written from only when asked (--salvage): then
    # the weights come out; the payload stays behind, never run
    code, _, err = run_cli("convert", str(d), str(tmp_path / "m.safetensors"))
    assert code == 3 and "--salvage" in err and not (tmp_path / "m.safetensors").exists()
    code, out, _ = run_cli("convert", str(d), str(tmp_path / "m.safetensors"), "--salvage")
    assert code == 0 and not marker.exists()
    assert "note" in out  # left out, said
    written = ckptool.open(tmp_path / "m.safetensors")
    assert not written.unsafe_globals and "note" not in str(written.metadata)


def test_never_runs_deepspeed() -> None:
    script = ("import sys, ckptool; ckptool.open(sys.argv[1]); "
              "assert not any(m.startswith('deepspeed') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", script, str(DS / "z3_fp32")], check=True,
                   cwd=HERE.parent, env={**os.environ, "PYTHONPATH": str(HERE.parent)})


# -- the arithmetic, on its own ------------------------------------------------

def test_stage12_pieces_cross_ranks_and_skip_alignment() -> None:
    from ckptool.read.layouts import zero

    # one group over 2 ranks: a (5), 3 alignment, b (6); 14 elements, 7 a rank
    placed = zero.stage12([[7], [7]], [[("a", 5), ("b", 6)]], [[3, 0]], 2)
    assert placed["a"] == [zero.Piece(0, 0, 0, 5, 0)]
    assert placed["b"] == [zero.Piece(1, 0, 1, 6, 0)]
    placed = zero.stage12([[4], [3]], [[("a", 7)]], None, 2)
    assert placed["a"] == [zero.Piece(0, 0, 0, 4, 0), zero.Piece(1, 0, 0, 3, 4)]
    with pytest.raises(zero.LayoutError, match="past the end"):
        zero.stage12([[4], [2]], [[("a", 7)]], None, 2)
    with pytest.raises(zero.LayoutError, match="take 3 elements"):
        zero.stage12([[4], [4]], [[("a", 3)]], None, 2)  # 5 elements left over
    with pytest.raises(zero.LayoutError, match="alignment paddings"):
        zero.stage12([[4], [4]], [[("a", 7)]], [[0, 0]], 2)


def test_stage3_pieces_cross_sub_groups() -> None:
    from ckptool.read.layouts import zero

    # a (5) and b (3) over 2 ranks: 3 + 2 a rank, sub-groups of 4 and 1
    placed = zero.stage3([[4, 1], [4, 1]], [("a", 5), ("b", 3)], 2)
    assert placed["a"] == [zero.Piece(0, 0, 0, 3, 0), zero.Piece(1, 0, 0, 2, 3)]
    assert placed["b"] == [zero.Piece(0, 0, 3, 1, 0), zero.Piece(0, 1, 0, 1, 1),
                           zero.Piece(1, 0, 3, 1, 2)]
    with pytest.raises(zero.LayoutError, match="differ"):
        zero.stage3([[4, 1], [5]], [("a", 5), ("b", 3)], 2)
    with pytest.raises(zero.LayoutError, match="hold 6"):
        zero.stage3([[6], [6]], [("a", 5), ("b", 3)], 2)
    assert zero.frozen3("f", 5, [3, 3]) == [zero.Piece(0, 0, 0, 3, 0),
                                           zero.Piece(1, 0, 0, 2, 3)]


def test_a_trainer_directory_with_a_model_file_beside(tmp_path: Path) -> None:
    """HF Trainer's checkpoint-N/: its model file is read, as before, and the
    DeepSpeed checkpoint beside it named (as beside an index)."""
    d = copy(tmp_path, "z2_fp32")
    (d / "config.json").write_text("{}")
    shutil.copy(DS / "z2_fp32.reference.pt", d / "pytorch_model.bin")
    ckpt = ckptool.open(d)
    assert ckpt.format == "torch-zip"
    assert any("global_step2/" in n and "DeepSpeed" in n for n in ckpt.metadata["notes"])
    assert ckptool.open(d / "global_step2").format == "deepspeed"


def test_ordinary_directories_stay_what_they_were(tmp_path: Path) -> None:
    one = tmp_path / "one"
    one.mkdir()
    torch.save({"w": torch.ones(2)}, one / "best_model_states.pt")  # not DeepSpeed's name
    assert ckptool.open(one).format == "torch-zip"
    (one / "latest").write_text("100")  # names no directory
    assert ckptool.open(one).format == "torch-zip"


def test_zero_0_is_the_module() -> None:
    ckpt, got = consolidated(DS / "z0_fp32")
    assert ckpt.metadata["zero_stage"] == 0 and ckpt.metadata["world_size"] == 2
    want = reference("z0_fp32")
    assert set(got) == set(want)
    for key, tensor in want.items():
        assert same(got[key], tensor), key


def test_a_half_precision_buffer_is_read_as_float32(tmp_path: Path,
                                                    run_cli: Callable[..., CliResult]) -> None:
    d = copy(tmp_path, "z2_fp32")
    name = d / "global_step2" / "mp_rank_00_model_states.pt"
    states = torch.load(name, weights_only=True)
    states["module"]["buf"] = states["module"]["buf"].half() + 0.5
    torch.save(states, name)
    ckpt, got = consolidated(d)
    buf = next(t for t in ckpt.tensors if t.key == "buf")
    assert buf.dtype == "float32" and buf.chunks[0].dtype == "float16"
    assert same(got["buf"], states["module"]["buf"].float())  # DeepSpeed's .float()
    code, _, err = run_cli("convert", str(d), str(tmp_path / "m.safetensors"))
    assert code == 0, err
    assert same(load_file(tmp_path / "m.safetensors")["buf"], states["module"]["buf"].float())


def test_nvme_offloaded_partitions_are_refused(tmp_path: Path,
                                               run_cli: Callable[..., CliResult]) -> None:
    d = copy(tmp_path, "z3_fp32")
    (d / "global_step2" / "offloaded_tensors" / "rank0").mkdir(parents=True)
    refused(run_cli, d, tmp_path, "NVMe")


def test_devices_and_diff(run_cli: Callable[..., CliResult]) -> None:
    code, out, err = run_cli("devices", str(DS / "z3_fp32"))
    assert (code, err) == (0, "")
    assert "ckptool convert" in " ".join(out.split())
    code, out, err = run_cli("diff", str(DS / "z3_fp32"), str(DS / "z3_fp32.reference.pt"))
    out = " ".join(out.split())
    # head.weight (shared_params) is a tensor of the checkpoint, compared by its name
    assert code == 0 and "no differences" in out and "12 identical" in out, err


def test_browse() -> None:
    from test_multifile_views import drive, expect_stats

    app, text = drive(DS / "z3_bf16", "lin.weight")
    expect_stats(app.stats["lin.weight"], reference("z3_bf16")["lin.weight"])
    assert "2 runs in" in text and "consolidated from the ranks' partitions" in text
    assert "zero-checkpoint" in text


def test_an_hf_trainer_directory_names_its_deepspeed_checkpoint(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    d = copy(tmp_path, "z2_fp32")
    save_file({"w": torch.ones(2)}, d / "model.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"w": "model.safetensors"}}))
    ckpt = ckptool.open(d)
    assert ckpt.format == "hf-safetensors"
    assert any("global_step2/" in n and "DeepSpeed" in n for n in ckpt.metadata["notes"])


# -- crafted files: what a damaged or hostile directory cannot make ckptool do ----

def states(path: Path) -> dict[str, object]:
    """A DeepSpeed file as torch loads it, DeepSpeed's classes stood in for
    (``ds_stubs``): to edit and save again."""
    return torch.load(path, weights_only=False)


@pytest.mark.usefixtures("ds_stubs")
@pytest.mark.parametrize("paddings", [[[-300, 300, 0], [0, 0, 0, 0]], [[0, 0, 0]],
                                      [[True, 0, 0], [0, 0, 0, 0]]])
def test_bad_alignment_paddings(tmp_path: Path, paddings: list[list[int]],
                                run_cli: Callable[..., CliResult]) -> None:
    d = copy(tmp_path, "z2_fp32")
    name = d / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    sd = states(name)
    sd["optimizer_state_dict"]["param_alignment_paddings"] = paddings  # type: ignore[index]
    torch.save(sd, name)
    refused(run_cli, d, tmp_path, "fp32 partitions do not hold the parameters")


def test_a_fragment_that_is_not_dense(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    d = copy(tmp_path, "z3_fp32")
    name = d / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    sd = torch.load(name, weights_only=True)
    sd["frozen_param_fragments"]["frozen.bias"] = torch.zeros(8)[:1].expand(3)
    torch.save(sd, name)
    refused(run_cli, d, tmp_path, "frozen.bias", "dense fragment")


def test_a_cycle_in_a_file_is_read_once(tmp_path: Path) -> None:
    d = copy(tmp_path, "z3_fp32")
    name = d / "global_step2" / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    sd = torch.load(name, weights_only=True)
    loop: list[object] = []
    loop.append(loop)
    sd["loop"] = [loop, loop, {"again": loop}]
    torch.save(sd, name)
    subprocess.run([sys.executable, "-m", "ckptool", "inspect", str(d)], check=True,
                   timeout=60, cwd=HERE.parent, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(HERE.parent)})


def test_a_parameter_of_no_elements(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    d = copy(tmp_path, "z3_fp32")
    name = d / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    sd = torch.load(name, weights_only=True)
    sd["param_shapes"][0]["empty"] = torch.Size([0, 4])
    torch.save(sd, name)
    code, _, err = run_cli("convert", str(d), str(tmp_path / "m.safetensors"))
    assert code == 0, err
    got = load_file(tmp_path / "m.safetensors")
    assert got["empty"].shape == (0, 4) and same(got["lin.weight"],
                                                 reference("z3_fp32")["lin.weight"])


def test_zero_2_without_its_optimizer_states(tmp_path: Path,
                                             run_cli: Callable[..., CliResult]) -> None:
    d = copy(tmp_path, "z2_bf16")
    for f in (d / "global_step2").glob("*_optim_states.pt"):
        f.unlink()
    refused(run_cli, d, tmp_path, "ZeRO 2", "optimizer states are missing")


def test_diagnose_names_fresh_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    run_cli: Callable[..., CliResult]) -> None:
    src = tmp_path / "run.ckpt"
    shutil.copytree(DS / "lightning_z3.ckpt", src)
    (tmp_path / "run.fixed.pt").write_text("taken")
    _, out, _ = run_cli("diagnose", str(src), "--model", f"{HERE}/nets.py:DSTiny", "--json")
    report = json.loads(out)
    assert report["fix_output"] == str(tmp_path / "run.fixed.2.pt")
    monkeypatch.chdir(src)  # `diagnose .` from inside: the output goes beside it, not in it
    code, out, _ = run_cli("diagnose", ".", "--json")
    assert code == 1
    assert json.loads(out)["fix_command"].startswith(f"ckptool convert . {tmp_path / 'run.pt'} ")


def _zero_to_fp32_stage12(parts: list[list[torch.Tensor]], shapes: list[list[tuple[str, int]]],
                          paddings: list[list[int]]) -> dict[str, torch.Tensor]:
    """zero_to_fp32.py's ZeRO 1/2 reconstruction, as it is written there."""
    out = {}
    for g, names in enumerate(shapes):
        full = torch.cat([per_rank[g] for per_rank in parts])
        offset = 0
        for (name, numel), pad in zip(names, paddings[g], strict=True):
            out[name] = full.narrow(0, offset, numel)
            offset += numel + pad
    return out


def _zero_to_fp32_stage3(parts: list[list[torch.Tensor]], shapes: list[tuple[str, int]],
                         ws: int) -> dict[str, torch.Tensor]:
    """zero_to_fp32.py's ZeRO 3 reconstruction (GatheredTensor), as written there."""
    streams = [torch.cat(per_rank) if per_rank else torch.empty(0) for per_rank in parts]
    out, offset = {}, 0
    for name, numel in shapes:
        ps = -(-numel // ws)
        out[name] = torch.cat([s[offset:offset + ps] for s in streams])[:numel]
        offset += ps
    return out


@pytest.mark.parametrize("seed", range(200))
def test_zero_arithmetic_matches_zero_to_fp32(seed: int) -> None:
    """Random layouts (world sizes 1-5, empty partitions, padding beyond the
    last rank, sub-groups crossed, 0-element parameters): the pieces
    ``zero`` places are exactly the elements zero_to_fp32 takes."""
    import random

    from ckptool.read.layouts import zero

    rng = random.Random(seed)
    ws = rng.randint(1, 5)
    numels = [rng.choice([0, 1, 2, 3, 5, 7, 16, 31]) for _ in range(rng.randint(1, 6))]
    names = [(f"p{i}", n) for i, n in enumerate(numels)]

    def gather(pieces: list[zero.Piece], parts: list[list[torch.Tensor]],
               numel: int) -> torch.Tensor:
        out = torch.full((numel,), float("nan"))
        for p in pieces:
            out[p.at:p.at + p.count] = parts[p.rank][p.group][p.start:p.start + p.count]
        return out

    # ZeRO 1/2: one group, alignment paddings, padded to 2*ws, split evenly, the
    # padding taken off the end (each rank's saved partition is unpadded)
    pads = [rng.choice([0, 0, 1, 3]) for _ in names]
    pads[-1] = 0
    used = sum(numels) + sum(pads)
    aligned = -(-used // (2 * ws)) * (2 * ws)
    flat = torch.arange(aligned, dtype=torch.float32)
    size = aligned // ws
    parts12 = [[flat[r * size:min((r + 1) * size, used)]] for r in range(ws)]
    placed = zero.stage12([[len(p[0])] for p in parts12], [names], [pads], ws)
    want = _zero_to_fp32_stage12(parts12, [names], [pads])
    for name, numel in names:
        assert torch.equal(gather(placed[name], parts12, numel), want[name]), (seed, name)

    # ZeRO 3: each parameter split ceil(n/ws) a rank, each rank's stream cut into sub-groups
    per_rank = sum(-(-n // ws) for n in numels)
    cuts = sorted(rng.sample(range(1, per_rank), min(2, per_rank - 1))) if per_rank > 1 else []
    bounds = [0, *cuts, per_rank]
    streams = [torch.arange(per_rank, dtype=torch.float32) + 1000 * r for r in range(ws)]
    parts3 = [[s[a:b] for a, b in itertools.pairwise(bounds)] for s in streams]
    placed = zero.stage3([[len(g) for g in p] for p in parts3], names, ws)
    want = _zero_to_fp32_stage3(parts3, names, ws)
    for name, numel in names:
        assert torch.equal(gather(placed[name], parts3, numel), want[name]), (seed, name)
