"""A framework folder holding its model in more than one form is read as its
loader reads it: the folders under fixtures/frameworks/loader_choice were
written by transformers, diffusers and peft, each form with other values, and
expected.json records which one from_pretrained loaded (make_loader_choice.py).
ckptool reads that one (its values, not only its name) and lists the others
by what they are: the model in another format, a variant of it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import CliResult
from safetensors.torch import load_file

import ckptool
from ckptool.read.layouts import loaders

HERE = Path(__file__).parent / "fixtures" / "frameworks" / "loader_choice"
EXPECTED = json.loads((HERE / "expected.json").read_text())
FOLDERS = sorted(k for k in EXPECTED if k != "versions")


def stored(folder: Path, name: str) -> dict[str, torch.Tensor]:
    """The tensors of a weights file, or of the shards an index names."""
    if name.endswith(".json"):
        out: dict[str, torch.Tensor] = {}
        for shard in sorted(set(json.loads((folder / name).read_text())["weight_map"].values())):
            out.update(stored(folder, shard))
        return out
    if name.endswith(".safetensors"):
        return load_file(folder / name)
    return torch.load(folder / name, weights_only=True)


def read_by_default(name: str) -> tuple[str, str | None]:
    """What the loader reads of folder ``name`` as from_pretrained(dir) is
    called; where that fails (only a variant is there), the variant it reads
    when asked, and the variant."""
    loads = EXPECTED[name]["loads"]
    if not loads[""].startswith("OSError"):
        return loads[""], None
    (variant, file), = ((v, f) for v, f in loads.items() if v)
    return file, variant


@pytest.mark.parametrize("name", FOLDERS)
def test_the_folder_reads_what_its_loader_reads(name: str) -> None:
    folder = HERE / name
    file, variant = read_by_default(name)
    ckpt = ckptool.open(folder)
    read = ckpt.metadata.get("index") if ckpt.is_multifile else Path(ckpt.path).name
    assert read == file
    want = stored(folder, file)
    got = ckptool.load_state_dict(folder)
    assert want.keys() <= got.keys()  # and the tied lm_head the loader ties again
    assert all(torch.equal(got[k], want[k]) for k in want)
    notes = " ".join(ckpt.metadata.get("notes", ()))
    assert (f"only when asked (variant={variant!r})" in notes) == (variant is not None)


@pytest.mark.parametrize("name", FOLDERS)
def test_the_other_forms_are_listed_by_what_they_are(name: str) -> None:
    folder = HERE / name
    file, _ = read_by_default(name)
    ckpt = ckptool.open(folder)
    assert ckpt.framework is not None
    roles = {c.path: c.role for c in ckpt.framework.companions}
    for other, loaded in EXPECTED[name]["loads"].items():
        if other and loaded != file:  # a variant's files
            variant_files = [n for n in EXPECTED[name]["files"] if f".{other}" in n]
            assert variant_files and all(
                roles[n].startswith(f"variant {other} of the model") for n in variant_files)
    for n in EXPECTED[name]["files"]:
        parsed = loaders.parse(n)
        if parsed is not None and parsed.variant is None and n != file \
                and n not in {f.path for f in ckpt.files}:
            assert "(not read: " in roles[n], (n, roles[n])


def test_the_reviewers_repro(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    """model.safetensors beside .bin shards: transformers loads
    model.safetensors, so a zeroed model.safetensors is what it loads."""
    from safetensors.torch import save_file

    folder = tmp_path / "model"
    shutil.copytree(HERE / "transformers_st_and_bin", folder)
    zeros = {k: torch.zeros_like(v) for k, v in load_file(folder / "model.safetensors").items()}
    save_file(zeros, folder / "model.safetensors", metadata={"format": "pt"})
    got = ckptool.load_state_dict(folder)
    assert all(not got[k].any() for k in zeros)
    code, out, _ = run_cli("inspect", str(folder))
    assert code == 0 and "format      safetensors" in out
    assert "transformers' from_pretrained loads model.safetensors first" in " ".join(out.split())


@pytest.mark.parametrize(("name", "index"), [
    ("transformers_variants", "model.safetensors.index.fp16.json"),
    ("diffusers_variants", "diffusion_pytorch_model.safetensors.index.fp16.json"),
    ("diffusers_variants_legacy", "diffusion_pytorch_model.safetensors.fp16.index.json"),
])
def test_a_variant_index_named_is_read(name: str, index: str) -> None:
    ckpt = ckptool.open(HERE / name / index)
    assert ckpt.metadata["index"] == index
    assert EXPECTED[name]["loads"]["fp16"] == index
    assert {t.dtype for t in ckpt.tensors} == {"float16"}


def test_only_several_variants_is_refused_with_the_choice(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    folder = tmp_path / "model"
    shutil.copytree(HERE / "transformers_variant_only", folder)
    shutil.copy(folder / "model.fp16.safetensors", folder / "model.bf16.safetensors")
    code, out, err = run_cli("inspect", str(folder))
    assert code == 3 and out == ""
    error, hint = err.splitlines()
    assert error == (f"ckptool: error: {folder} holds the model only as variants (bf16, fp16) "
                     "and no plain model.safetensors: transformers' from_pretrained loads one "
                     "only when asked (variant=...), so ckptool cannot tell which one is the "
                     "model")
    assert hint == f"hint: name one: ckptool inspect {folder / 'model.bf16.safetensors'}"


def test_the_file_config_json_names_is_read(tmp_path: Path) -> None:
    """transformers loads config.json's transformers_weights before any
    other name (here: the fp16 variant's index)."""
    folder = tmp_path / "model"
    shutil.copytree(HERE / "transformers_variants", folder)
    config = json.loads((folder / "config.json").read_text())
    config["transformers_weights"] = "model.safetensors.index.fp16.json"
    (folder / "config.json").write_text(json.dumps(config))
    ckpt = ckptool.open(folder)
    assert ckpt.metadata["index"] == "model.safetensors.index.fp16.json"
    assert any("transformers_weights" in n for n in ckpt.metadata["notes"])


@pytest.mark.parametrize(("files", "read"), [
    # transformers: a single file before its index, safetensors before .bin
    (["model.safetensors", "pytorch_model.bin.index.json"], "model.safetensors"),
    (["model.safetensors.index.json", "pytorch_model.bin"], "model.safetensors.index.json"),
    (["pytorch_model.bin", "pytorch_model.bin.index.json"], "pytorch_model.bin"),
    (["model.safetensors", "model.fp16.safetensors"], "model.safetensors"),
    # diffusers: its index before its single file; a .bin index last
    (["diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json"],
     "diffusion_pytorch_model.safetensors.index.json"),
    (["diffusion_pytorch_model.bin", "diffusion_pytorch_model.bin.index.json"],
     "diffusion_pytorch_model.bin"),
    (["adapter_model.bin", "adapter_model.safetensors"], "adapter_model.safetensors"),
])
def test_each_loaders_order(files: list[str], read: str) -> None:
    choice = loaders.choose(files)
    assert choice is not None and choice.name == read and choice.needs == ()
