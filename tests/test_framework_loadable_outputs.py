"""What ckptool writes into a framework's folder is what its loader reads, and
``diagnose`` never says "no problems" about a folder its loader cannot read
(issue 34, item 6). The real loaders' side (PEFT, diffusers, transformers
loading each output, failing on each flagged folder, and loading what each
printed fix writes) is fixtures/frameworks/check_loadable_outputs.py; here,
without those libraries, what ckptool writes and says."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import CliResult
from safetensors.torch import load_file, save_file

import ckptool
from ckptool.check.diagnosis import Finding, diagnose
from ckptool.check.gpus.machine import Machine
from ckptool.write.convert.run import convert

FW = Path(__file__).parent / "fixtures" / "frameworks"
CPU = Machine((), False, None, "none", "no GPU")


def codes(path: Path) -> dict[str, Finding]:
    return {f.code: f for f in diagnose(ckptool.open(str(path)), CPU).findings}


# --- convert: a PEFT adapter is one file; diffusers' .bin shards need a flag

def test_a_peft_adapter_split_into_shards_is_refused(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    code, out, err = run_cli("convert", str(FW / "peft_lora"), str(tmp_path / "out"),
                             "--format", "hf", "--max-shard-size", "1KB")
    assert code == 2 and out == ""
    assert "PEFT's from_pretrained loads one file only (adapter_model.safetensors" in err
    assert "hint: leave out --max-shard-size" in err
    assert not (tmp_path / "out").exists()


def test_a_peft_adapter_is_one_file_when_the_limit_fits_or_is_left_out(tmp_path: Path) -> None:
    for name, limit in (("fits", 10_000), ("default", None)):
        convert(str(FW / "peft_lora"), str(tmp_path / name), fmt="hf", max_shard_size=limit)
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {
            p.name for p in (tmp_path / name).iterdir()}
        assert not list((tmp_path / name).glob("adapter_model*-of-*"))
        assert load_file(tmp_path / name / "adapter_model.safetensors").keys() == load_file(
            FW / "peft_lora" / "adapter_model.safetensors").keys()


def test_diffusers_bin_shards_say_the_flag_their_loader_needs(tmp_path: Path) -> None:
    out = tmp_path / "unet_bin"
    result = convert(str(FW / "diffusers_ddpm" / "unet"), str(out), fmt="hf-bin",
                     max_shard_size=100_000)
    assert (out / "diffusion_pytorch_model.bin.index.json").is_file()
    assert [n for n in result.notes if "use_safetensors=False" in n] == [
        "diffusers' from_pretrained reads diffusion_pytorch_model.bin.index.json only when "
        f"told use_safetensors=False: load the output with UNet2DModel.from_pretrained("
        f"{str(out)!r}, use_safetensors=False) (--format hf writes safetensors shards, which "
        "it reads as they are)"]
    # one .bin file, safetensors shards: read as they are, nothing to say
    for name, fmt, limit in (("one", "hf-bin", None), ("st", "hf", 100_000)):
        plain = convert(str(FW / "diffusers_ddpm" / "unet"), str(tmp_path / name), fmt=fmt,
                        max_shard_size=limit)
        assert not [n for n in plain.notes if "use_safetensors" in n]


# --- fix DIR -o OUT: a folder, its configs beside the weights

@pytest.mark.parametrize("out", ["fixed/", "fixed"])
def test_fix_of_a_model_folder_writes_a_folder(tmp_path: Path, out: str,
                                               run_cli: Callable[..., CliResult]) -> None:
    code, stdout, err = run_cli("fix", str(FW / "llama_tied"), "--dtype", "bf16",
                                "-o", str(tmp_path / out))
    assert code == 0, err
    folder = tmp_path / "fixed"
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]
    config = json.loads((folder / "config.json").read_text())  # says the dtype cast to
    assert config == {**json.loads((FW / "llama_tied" / "config.json").read_text()),
                      "dtype": "bfloat16"}
    weights = load_file(folder / "model.safetensors")
    assert weights.keys() == load_file(FW / "llama_tied" / "model.safetensors").keys()
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    said = " ".join(stdout.split())
    assert "is a folder: wrote model.safetensors, the file transformers' from_pretrained " \
           "loads" in said
    assert "copied config.json, generation_config.json from" in said
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing left over
    assert run_cli("diagnose", str(folder))[0] == 0


def test_fix_into_a_folder_json_dry_run_and_existing(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    out = tmp_path / "out"
    code, stdout, _ = run_cli("fix", str(FW / "peft_lora"), "--dtype", "fp16", "-o", str(out),
                              "--dry-run", "--json")
    report = json.loads(stdout)
    assert code == 0 and report["output"] == str(out) and report["dry_run"]
    assert not out.exists()
    assert run_cli("fix", str(FW / "peft_lora"), "--dtype", "fp16", "-o", str(out))[0] == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapter_config.json",
                                                     "adapter_model.safetensors"]
    code, _, err = run_cli("fix", str(FW / "peft_lora"), "-o", str(out), "--dtype", "bf16")
    assert code == 2 and "already exists" in err
    code, _, err = run_cli("fix", str(FW / "peft_lora"), "-o", str(out), "--dtype", "bf16",
                           "--force")
    assert code == 0, err
    assert {t.dtype for t in load_file(out / "adapter_model.safetensors").values()} == {
        torch.bfloat16}


def test_fix_output_named_as_a_file_is_a_file_and_a_file_into_a_slash_is_a_folder(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    assert run_cli("fix", str(FW / "llama_tied"), "--dtype", "bf16",
                   "-o", str(tmp_path / "x.safetensors"))[0] == 0
    assert (tmp_path / "x.safetensors").is_file()
    assert run_cli("fix", str(FW / "llama_tied" / "model.safetensors"), "--dtype", "bf16",
                   "-o", str(tmp_path / "d") + "/")[0] == 0
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]


# --- diagnose: a folder its framework's loader cannot read

def _peft_shards(folder: Path) -> None:
    folder.mkdir()
    shutil.copy(FW / "peft_lora" / "adapter_config.json", folder)
    tensors = load_file(FW / "peft_lora" / "adapter_model.safetensors")
    names = sorted(tensors)
    parts = {"adapter_model-00001-of-00002.safetensors": names[:4],
             "adapter_model-00002-of-00002.safetensors": names[4:]}
    for file, keys in parts.items():
        save_file({k: tensors[k] for k in keys}, folder / file, {"format": "pt"})
    (folder / "adapter_model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in parts.items() for k in ks}}))


def test_peft_shards_cannot_be_loaded_and_the_fix_writes_one_file(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    _peft_shards(tmp_path / "adapter")
    found = codes(tmp_path / "adapter")["framework-cannot-load"]
    assert found.severity == "error"
    assert found.message == (
        f"PEFT's from_pretrained cannot load {tmp_path / 'adapter'}/: it reads "
        "adapter_model.safetensors or adapter_model.bin (one file: never an index or shards), "
        "and the folder holds the weights as adapter_model.safetensors.index.json and its "
        "2 shards")
    assert found.fix == f"ckptool convert {tmp_path / 'adapter'} {tmp_path / 'adapter'}.fixed " \
                        "--format hf"
    code, out, _ = run_cli("diagnose", str(tmp_path / "adapter"))
    assert code == 1 and "no problems" not in out
    assert run_cli(*found.fix.split()[1:])[0] == 0
    assert sorted(p.name for p in (tmp_path / "adapter.fixed").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]  # one file
    assert "framework-cannot-load" not in codes(tmp_path / "adapter.fixed")


def test_diffusers_bin_shards_need_use_safetensors_false(tmp_path: Path) -> None:
    convert(str(FW / "diffusers_ddpm" / "unet"), str(tmp_path / "u"), fmt="hf-bin",
            max_shard_size=100_000)
    found = codes(tmp_path / "u")["framework-load-flag"]
    assert found.severity == "warning"
    assert "reads diffusion_pytorch_model.bin.index.json only when told " \
           "use_safetensors=False" in found.message
    assert found.snippet == f"UNet2DModel.from_pretrained({str(tmp_path / 'u')!r}, " \
                            "use_safetensors=False)"
    assert found.fix == f"ckptool convert {tmp_path / 'u'} {tmp_path / 'u'}.fixed --format hf"


@pytest.mark.parametrize(("source", "config", "weights", "loader"), [
    ("diffusers_ddpm/unet", "config.json", "diffusion_pytorch_model.safetensors",
     "diffusers' from_pretrained"),
    ("llama_tied", "config.json", "model.safetensors", "transformers' from_pretrained"),
])
def test_weights_under_a_name_the_loader_never_looks_for(
        tmp_path: Path, source: str, config: str, weights: str, loader: str) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(FW / source / config, folder)
    other = "model.safetensors" if "diffusion" in weights else "weights.safetensors"
    shutil.copy(FW / source / weights, folder / other)
    found = codes(folder)["framework-cannot-load"]
    assert found.message.startswith(f"{loader} cannot load {folder}/: it reads ")
    assert found.message.endswith(f"and the folder holds the weights as {other}")


@pytest.mark.parametrize("folder", ["llama_tied", "llama_tied_bin", "llama_tied_bin_sharded",
                                    "peft_lora", "diffusers_ddpm/unet",
                                    "diffusers_ddpm/unet_bin", "bert", "gpt2"])
def test_folders_their_loader_reads_get_no_such_finding(folder: str) -> None:
    assert not {"framework-cannot-load", "framework-load-flag"} & set(codes(FW / folder))


def test_a_variant_only_folder_is_no_problem(tmp_path: Path) -> None:
    folder = tmp_path / "v"
    folder.mkdir()
    shutil.copy(FW / "llama_tied" / "config.json", folder)
    shutil.copy(FW / "llama_tied" / "model.safetensors", folder / "model.fp16.safetensors")
    assert "framework-cannot-load" not in codes(folder)  # loads with variant="fp16"
