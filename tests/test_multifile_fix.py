"""``fix`` on a directory of Hugging Face shards (written by huggingface_hub
itself): the same shards, renamed, cast and retargeted, the index rewritten,
written whole into a new directory that huggingface_hub loads strictly."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import CliResult
from helpers import saved_on

hub = pytest.importorskip("huggingface_hub")


def state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    emb = torch.randn(100, 16)
    return {"module.embed.weight": emb, "module.head.weight": emb,  # tied
            "module.l.w": torch.randn(300, 16), "module.l.b": torch.arange(7)}


def module_for(sd: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose state dict has ``sd``'s names (without module.)."""
    net = torch.nn.Module()
    net.l = torch.nn.Module()
    net.embed, net.head = torch.nn.Module(), torch.nn.Module()
    for name, value in sd.items():
        owner, last = name.removeprefix("module.").rsplit(".", 1)
        getattr(net, owner).register_buffer(last, torch.zeros_like(value))
    return net


@pytest.fixture
def shards(tmp_path: Path) -> dict[str, Path]:
    out = {"bins": tmp_path / "bins", "st": tmp_path / "st"}
    for folder in out.values():
        folder.mkdir()
    with saved_on("cuda:1"):  # saved on a GPU box
        hub.save_torch_state_dict(state_dict(), out["bins"], max_shard_size="10KB",
                                  safe_serialization=False)
    hub.save_torch_state_dict(state_dict(), out["st"], max_shard_size="10KB")
    return out


def test_torch_shards_fixed_as_one_file_would_be(shards: dict[str, Path], tmp_path: Path,
                                                 run_cli: Callable[..., CliResult]) -> None:
    out = tmp_path / "fixed"
    before = sorted(os.listdir(shards["bins"]))
    code, stdout, err = run_cli("fix", str(shards["bins"]), "--strip-module", "--to", "cpu",
                                "--dtype", "bf16", "-o", str(out), "--json")
    assert code == 0 and err == ""
    report = json.loads(stdout)
    assert report["output"] == str(out) and len(report["renamed"]) == 4
    assert sorted(os.listdir(out)) == before  # the same shards, the index rewritten
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    assert set(index["weight_map"]) == {"embed.weight", "head.weight", "l.w", "l.b"}
    assert index["metadata"]["total_size"] == 2 * (100 * 16 + 300 * 16) + 8 * 7
    net = module_for(state_dict())
    net.to(torch.bfloat16)
    hub.load_torch_model(net, out, strict=True, safe=False)
    want = state_dict()
    assert torch.equal(net.l.w, want["module.l.w"].to(torch.bfloat16))
    assert net.l.b.dtype == torch.int64 and torch.equal(net.l.b, want["module.l.b"])
    shard = out / index["weight_map"]["head.weight"]
    loaded = torch.load(shard, weights_only=True)  # loads here: no cuda:1 left
    assert loaded["head.weight"].data_ptr() == loaded["embed.weight"].data_ptr()
    assert sorted(os.listdir(shards["bins"])) == before  # the input is untouched


def test_safetensors_shards_keep_their_tie_in_the_index(shards: dict[str, Path],
                                                        run_cli: Callable[..., CliResult]) -> None:
    code, _, err = run_cli("fix", str(shards["st"]), "--strip-module", "-q")
    out = Path(f"{shards['st']}.fixed")
    assert code == 0 and err == "" and out.is_dir()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["head.weight"] == "embed.weight"
    net = module_for(state_dict())
    hub.load_torch_model(net, out, strict=False)
    assert torch.equal(net.embed.weight, state_dict()["module.embed.weight"])


def test_dropping_a_tied_tensor_keeps_its_other_name(shards: dict[str, Path], tmp_path: Path,
                                                     run_cli: Callable[..., CliResult]) -> None:
    out = tmp_path / "dropped"
    code, _, err = run_cli("fix", str(shards["bins"]), "--drop", "module.embed.weight",
                           "-o", str(out), "-q")
    assert code == 0 and err == ""
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    assert "module.embed.weight" not in index["weight_map"]
    loaded = torch.load(out / index["weight_map"]["module.head.weight"], map_location="cpu",
                        weights_only=True)
    assert torch.equal(loaded["module.head.weight"], state_dict()["module.embed.weight"])


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--extract"], 2, "state dict already"),
    (["--drop", "nope"], 2, "no tensor of that name"),
])
def test_what_fix_refuses_on_shards(shards: dict[str, Path], args: list[str], code: int,
                                    message: str, run_cli: Callable[..., CliResult]) -> None:
    got, out, err = run_cli("fix", str(shards["bins"]), *args)
    assert (got, out) == (code, "") and message in err and "Traceback" not in err
    assert not Path(f"{shards['bins']}.fixed").exists()


def test_safetensors_shards_have_no_device(shards: dict[str, Path],
                                           run_cli: Callable[..., CliResult]) -> None:
    code, _, err = run_cli("fix", str(shards["st"]), "--to", "cuda:0")
    assert code == 2 and "record no device" in err


def test_dry_run_writes_nothing(shards: dict[str, Path],
                                run_cli: Callable[..., CliResult]) -> None:
    code, out, _ = run_cli("fix", str(shards["bins"]), "--strip-module", "--dry-run", "--json")
    report = json.loads(out)
    assert code == 0 and report["dry_run"] and report["output"] == f"{shards['bins']}.fixed"
    assert len(report["renamed"]) == 4 and report["devices"] == []
    assert not Path(f"{shards['bins']}.fixed").exists()


def test_in_place_rewrites_each_shards_pickle_then_the_index(
        shards: dict[str, Path], run_cli: Callable[..., CliResult]) -> None:
    folder = shards["bins"]
    sizes = {n: (folder / n).stat().st_size for n in os.listdir(folder) if n.endswith(".bin")}
    code, out, err = run_cli("fix", str(folder), "--strip-module", "--to", "cpu", "--in-place",
                             "--json")
    report = json.loads(out)
    assert code == 0 and err == "" and report["metadata_only"] and report["output"] == str(folder)
    for name, size in sizes.items():  # a new pickle appended, the tensor bytes in place
        assert (folder / name).stat().st_size > size
    index = json.loads((folder / "pytorch_model.bin.index.json").read_text())
    assert set(index["weight_map"]) == {"embed.weight", "head.weight", "l.w", "l.b"}
    net = module_for(state_dict())
    hub.load_torch_model(net, folder, strict=True, safe=False)
    assert torch.equal(net.l.w, state_dict()["module.l.w"])


def test_in_place_on_safetensors_shards_keeps_the_index_readable(
        shards: dict[str, Path], run_cli: Callable[..., CliResult]) -> None:
    folder = shards["st"]
    code, _, err = run_cli("fix", str(folder), "--strip-module", "--in-place", "-q")
    assert code == 0 and err == ""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["metadata"]["head.weight"] == "embed.weight"
    assert "head.weight" not in index["weight_map"]  # not stored: safetensors cannot share
    code, out, _ = run_cli("inspect", "--json", str(folder))
    assert code == 0
    tensors = {t["key"]: t for t in json.loads(out)["tensors"]}
    assert set(tensors) == {"embed.weight", "head.weight", "l.w", "l.b"}  # the tie listed
    assert tensors["head.weight"]["storage"] == tensors["embed.weight"]["storage"]


def test_a_prefix_one_shard_has_alone_is_not_stripped(tmp_path: Path,
                                                      run_cli: Callable[..., CliResult]) -> None:
    folder = tmp_path / "mixed"
    folder.mkdir()
    sd = {"model.a": torch.randn(300, 16), "lm_head": torch.randn(300, 16)}
    hub.save_torch_state_dict(sd, folder, max_shard_size="10KB", safe_serialization=False)
    before = {n: (folder / n).read_bytes() for n in os.listdir(folder)}
    code, out, _ = run_cli("fix", str(folder), "--strip-module", "--in-place")
    assert code == 0 and "no module./_orig_mod./model. prefix found" in out
    assert {n: (folder / n).read_bytes() for n in os.listdir(folder)} == before


def test_in_place_refuses_to_drop_the_stored_name_of_a_tie(
        shards: dict[str, Path], run_cli: Callable[..., CliResult]) -> None:
    folder = shards["st"]
    before = {n: (folder / n).read_bytes() for n in os.listdir(folder)}
    code, out, err = run_cli("fix", str(folder), "--drop", "module.embed.weight", "--in-place")
    assert (code, out) == (2, "") and "module.head.weight is tied to module.embed.weight" in err
    assert "-o DIR" in err
    assert {n: (folder / n).read_bytes() for n in os.listdir(folder)} == before


def test_in_place_keeps_the_rest_of_the_index_metadata(
        shards: dict[str, Path], run_cli: Callable[..., CliResult]) -> None:
    folder = shards["st"]
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["metadata"]["format"] = "pt"
    path.write_text(json.dumps(index))
    assert run_cli("fix", str(folder), "--strip-module", "--in-place", "-q")[0] == 0
    metadata = json.loads(path.read_text())["metadata"]
    assert metadata["format"] == "pt" and metadata["head.weight"] == "embed.weight"
    assert "module.head.weight" not in metadata


def test_an_index_named_writes_its_directory_beside_it(
        shards: dict[str, Path], run_cli: Callable[..., CliResult]) -> None:
    """The default output of shards named by their index is a directory beside
    the input's, never a directory inside it named after the index."""
    folder = shards["st"]
    index = next(folder.glob("*.index.json"))
    code, _, err = run_cli("fix", str(index), "--add-prefix", "x.")
    assert (code, err) == (0, "")
    assert (folder.parent / f"{folder.name}.fixed").is_dir()
    assert not [p for p in folder.iterdir() if ".fixed" in p.name]
