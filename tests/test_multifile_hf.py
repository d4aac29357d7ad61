"""Hugging Face sharded checkpoints, written by huggingface_hub's own
``save_torch_state_dict``: read as one checkpoint (one tensor per index key,
its shard, per-file sizes and counts), their values read back exactly, and
every way an index and its shards can disagree refused with the file named."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import CliResult
from helpers import saved_on

import ckptool
from ckptool.errors import CorruptCheckpointError
from ckptool.read.layouts.tensor_bytes import read_tensor, tensor_bytes

hub = pytest.importorskip("huggingface_hub")

INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


def state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    emb = torch.randn(1000, 16)  # 64 000 bytes: a shard of its own at 40KB
    return {"model.embed.weight": emb, "lm_head.weight": emb,  # tied
            "layers.0.w": torch.randn(300, 16),
            "layers.1.w": torch.randn(300, 16).to(torch.bfloat16),
            "layers.1.b": torch.arange(7, dtype=torch.int64)}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    out = {name: root / name for name in ("st", "bin", "cuda")}
    for folder in out.values():
        folder.mkdir()
    hub.save_torch_state_dict(state_dict(), out["st"], max_shard_size="40KB")
    hub.save_torch_state_dict(state_dict(), out["bin"], max_shard_size="40KB",
                              safe_serialization=False)
    with saved_on("cuda:1"):  # what a GPU box's save records
        hub.save_torch_state_dict(state_dict(), out["cuda"], max_shard_size="40KB",
                                  safe_serialization=False)
    return out


def copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def test_safetensors_shards_read_as_one_checkpoint(hf_dirs: dict[str, Path]) -> None:
    ckpt = ckptool.open(hf_dirs["st"])
    assert ckpt.format == "hf-safetensors" and ckpt.is_multifile
    index = json.loads((hf_dirs["st"] / INDEX).read_text())
    # the tied name huggingface_hub dropped is listed, in its twin's shard and storage
    tied = {"model.embed.weight": index["weight_map"]["lm_head.weight"]}
    assert {t.key: t.file for t in ckpt.tensors} == {**index["weight_map"], **tied}
    assert [f.role for f in ckpt.files] == ["index", "shard", "shard"]
    assert ckpt.file_size == sum(f.size for f in ckpt.files) == sum(
        p.stat().st_size for p in hf_dirs["st"].iterdir())
    assert [f.num_tensors for f in ckpt.files[1:]] == [1, 3]
    assert all(t.location is None for t in ckpt.tensors)  # safetensors records none
    by_key = {t.key: t for t in ckpt.tensors}
    assert by_key["model.embed.weight"].storage == by_key["lm_head.weight"].storage
    assert ckpt.aliases == {"model.embed.weight": "lm_head.weight"} and ckpt.entries == []
    assert ckpt.main_state_dict is not None and ckpt.main_state_dict.num_tensors == 5
    assert ckpt.total_bytes == index["metadata"]["total_size"]
    assert not ckpt.warnings


def test_an_index_file_reads_as_its_directory(hf_dirs: dict[str, Path]) -> None:
    by_dir = ckptool.open(hf_dirs["st"])
    by_index = ckptool.open(hf_dirs["st"] / INDEX)
    assert [(t.key, t.shape, t.file) for t in by_index.tensors] == [
        (t.key, t.shape, t.file) for t in by_dir.tensors]


def test_values_read_back_exactly(hf_dirs: dict[str, Path]) -> None:
    sd = state_dict()
    for name in ("st", "bin"):
        ckpt = ckptool.open(hf_dirs[name])
        for t in ckpt.tensors:
            assert torch.equal(read_tensor(ckpt, t), sd[t.key]), (name, t.key)
        t = next(t for t in ckpt.tensors if t.key == "layers.1.w")
        assert tensor_bytes(ckpt, t) == sd["layers.1.w"].view(torch.uint8).numpy().tobytes()


def test_torch_shards_keep_devices_and_sharing(hf_dirs: dict[str, Path]) -> None:
    ckpt = ckptool.open(hf_dirs["cuda"] / BIN_INDEX)
    assert ckpt.format == "hf-bin"
    assert {t.location for t in ckpt.tensors} == {"cuda:1"}
    tied = {t.key: t.storage for t in ckpt.tensors}
    assert tied["model.embed.weight"] == tied["lm_head.weight"] is not None
    assert len({s.file for s in ckpt.storages.values()}) == 2  # ids unique across shards
    assert all(s.id.startswith(f"{s.file}:") for s in ckpt.storages.values())
    assert [g.name for g in ckpt.globals if g.category == "unsafe"] == []


def test_cuda_saved_shards_give_the_device_finding(
        hf_dirs: dict[str, Path], run_cli: Callable[..., CliResult]) -> None:
    code, out, err = run_cli("diagnose", "--json", "--device-count", "0", str(hf_dirs["cuda"]))
    assert code == 1 and err == ""
    data = json.loads(out)
    assert "device-unavailable" in [f["code"] for f in data["findings"]]
    assert data["fix_command"] == (f"ckptool fix {hf_dirs['cuda']} --to cpu "
                                   f"-o {hf_dirs['cuda']}.fixed")


def test_inspect_json_and_text(hf_dirs: dict[str, Path],
                               run_cli: Callable[..., CliResult]) -> None:
    code, out, err = run_cli("inspect", "--json", str(hf_dirs["bin"]))
    assert code == 0 and err == ""
    data = json.loads(out)
    assert data["format"] == "hf-bin" and data["directory"] == str(hf_dirs["bin"])
    assert [f["path"] for f in data["files"]] == [
        BIN_INDEX, "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]
    assert data["files"][1] == {"path": "pytorch_model-00001-of-00002.bin", "role": "shard",
                                "format": "torch-zip", "size": data["files"][1]["size"],
                                "num_tensors": 2, "num_values": 0, "rank": None}
    tensor = data["tensors"][0]
    assert tensor["file"] == "pytorch_model-00001-of-00002.bin" and "chunks" not in tensor
    assert data["storages"][0]["file"] == tensor["file"]
    assert data["metadata"]["index"] == BIN_INDEX
    code, out, err = run_cli("inspect", str(hf_dirs["st"]))
    assert code == 0 and err == ""
    assert "hf-safetensors (index model.safetensors.index.json)" in out
    assert "model-00001-of-00002.safetensors" in out and "where" in out


def test_one_checkpoint_file_in_a_directory_is_that_file(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    hub.save_torch_state_dict({"w": torch.ones(2)}, tmp_path)  # model.safetensors, no index
    (tmp_path / "config.json").write_text("{}")
    ckpt = ckptool.open(tmp_path)
    assert ckpt.format == "safetensors" and ckpt.path == str(tmp_path / "model.safetensors")
    assert not ckpt.is_multifile
    code, out, _ = run_cli("fix", str(tmp_path), "--add-prefix", "m.", "--dry-run", "--json")
    assert code == 0 and json.loads(out)["output"] == str(tmp_path / "model.fixed.safetensors")


# -- layouts that do not hold together: exit 3, the file or key named ------

def edit_index(folder: Path, name: str, change: Callable[[dict], None]) -> None:
    path = folder / name
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_missing_shard(hf_dirs: dict[str, Path], tmp_path: Path,
                       run_cli: Callable[..., CliResult]) -> None:
    folder = copy(hf_dirs["st"], tmp_path)
    os.remove(folder / "model-00002-of-00002.safetensors")
    code, out, err = run_cli("inspect", str(folder))
    assert code == 3 and out == "" and "Traceback" not in err
    assert "model-00002-of-00002.safetensors is missing (named by " + INDEX in err


def test_key_stored_in_two_shards(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    folder = copy(hf_dirs["st"], tmp_path)
    from safetensors.torch import save_file
    save_file({"lm_head.weight": torch.zeros(2), "layers.0.w": torch.zeros(1)},
              folder / "model-00003-of-00003.safetensors")
    edit_index(folder, INDEX, lambda d: d["weight_map"].update(
        {"layers.0.w": "model-00003-of-00003.safetensors"}))
    with pytest.raises(CorruptCheckpointError,
                       match=r"layers.0.w is stored in two shards, model-00002-of-00002"):
        ckptool.open(folder)


def test_shard_with_tensors_the_index_does_not_list(hf_dirs: dict[str, Path],
                                                    tmp_path: Path) -> None:
    folder = copy(hf_dirs["bin"], tmp_path)
    edit_index(folder, BIN_INDEX, lambda d: d["weight_map"].pop("layers.0.w"))
    with pytest.raises(CorruptCheckpointError,
                       match="pytorch_model-00002-of-00002.bin holds 1 tensor that "
                             f"{BIN_INDEX} does not list: layers.0.w"):
        ckptool.open(folder)


def test_index_puts_a_key_in_the_wrong_shard(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    folder = copy(hf_dirs["st"], tmp_path)
    edit_index(folder, INDEX, lambda d: d["weight_map"].update(
        {"ghost.weight": "model-00001-of-00002.safetensors"}))
    with pytest.raises(CorruptCheckpointError, match=r"puts ghost.weight in model-00001"):
        ckptool.open(folder)


def test_index_naming_a_file_outside_its_directory(hf_dirs: dict[str, Path],
                                                   tmp_path: Path) -> None:
    folder = copy(hf_dirs["st"], tmp_path)
    edit_index(folder, INDEX, lambda d: d["weight_map"].update(
        {"lm_head.weight": "../model-00001-of-00002.safetensors"}))
    with pytest.raises(CorruptCheckpointError, match="outside the checkpoint's directory"):
        ckptool.open(folder)


def test_index_naming_a_key_twice(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    folder = copy(hf_dirs["st"], tmp_path)
    text = (folder / INDEX).read_text().replace(
        '"weight_map": {', '"weight_map": {"layers.0.w": "model-00001-of-00002.safetensors", ')
    (folder / INDEX).write_text(text)
    with pytest.raises(CorruptCheckpointError, match=r"names 'layers.0.w' twice"):
        ckptool.open(folder)


def test_two_indexes_read_the_safetensors_one(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    folder = copy(hf_dirs["st"], tmp_path)
    for path in hf_dirs["bin"].iterdir():
        shutil.copy(path, folder)
    ckpt = ckptool.open(folder)
    assert ckpt.format == "hf-safetensors" and ckpt.metadata["index"] == INDEX
    assert f"also holds {BIN_INDEX}" in ckpt.metadata["notes"][0]
    assert ckpt.warnings == []  # a note, not a problem: diagnose finds nothing in it
    assert not [f for f in ckptool.diagnose(ckpt).findings if f.code == "layout-warning"]
    assert ckptool.open(folder / BIN_INDEX).format == "hf-bin"  # unless named


def test_an_index_is_known_by_its_content(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    folder = copy(hf_dirs["st"], tmp_path)
    os.rename(folder / INDEX, folder / "weights.json")
    ckpt = ckptool.open(folder / "weights.json")
    assert ckpt.format == "hf-safetensors" and len(ckpt.tensors) == 5  # the tied name too
    from ckptool.read import dispatch
    dispatch.check(str(folder / "weights.json"))  # browse's first check lets it through
