"""torch.distributed.checkpoint directories, written by torch's own
``dcp.save``: in one process here, and by 4 ranks over gloo (DTensor rows,
columns, grids, replicated and empty chunks, a ShardedTensor with two chunks
per rank, FSDP2 with its optimizer), Lightning Fabric and accelerate in the
committed fixtures (tests/fixtures/multifile/make_multifile.py). Each reads as
one checkpoint with one tensor per flattened key, reassembles exactly as
torch's ``dcp_to_torch_save`` does, never runs its pickles, and a directory
that does not hold together fails with the file named."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import CliResult
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import ckptool
from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.read.layouts.tensor_bytes import read_tensor

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "multifile"
FOUR = FIXTURES / "dcp_4ranks"


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """dcp.save in one process (no process group): model, optimizer, values."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    out = tmp_path_factory.mktemp("dcp") / "single"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in one process"
        dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7,
                  "extra": {"name": "run1", "pair": (torch.ones(2), 5)},
                  "bf": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)},
                 checkpoint_id=out)
    return out


def reference(folder: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """torch's own consolidation, flattened by .metadata's planner paths."""
    out = tmp_path / "reference.pt"
    dcp_to_torch_save(folder, out)  # our own fixture: torch may unpickle it
    whole = torch.load(out, weights_only=False)
    with open(folder / ".metadata", "rb") as f:
        planner = pickle.load(f).planner_data
    flat = {}
    for fqn, path in planner.items():
        value: Any = whole
        for step in path:
            value = value[step]
        if isinstance(value, torch.Tensor):
            flat[fqn] = value
    return flat


def test_one_process_save(single: Path, tmp_path: Path) -> None:
    ckpt = ckptool.open(single)
    assert ckpt.format == "dcp" and ckpt.metadata["ranks"] == 1
    keys = [t.key for t in ckpt.tensors]
    assert keys[:2] == ["model.0.weight", "model.0.bias"]
    assert "optimizer.state.0.exp_avg" in keys and "bf" in keys
    w = next(t for t in ckpt.tensors if t.key == "model.0.weight")
    assert (w.shape, w.dtype, w.location, w.file) == ((3, 4), "float32", None, None)
    (chunk,) = w.chunks
    assert (chunk.file, chunk.rank, chunk.offsets, chunk.sizes) == ("__0_0.distcp", 0,
                                                                      (0, 0), (3, 4))
    entries = {e.key: e.value for e in ckpt.entries}
    assert entries["step"] == 7 and entries["extra.name"] == "run1"
    assert entries["optimizer.param_groups.0.lr"] == 0.001
    assert ckpt.main_state_dict is not None
    assert ckpt.main_state_dict.keys == ("model.0.weight", "model.0.bias", "model.1.weight",
                                         "model.1.bias")
    assert ckpt.main_state_dict.prefix == "model." and ckpt.metadata["state_dict_entry"] == "model"
    assert [g.category for g in ckpt.globals if g.category in ("unsafe", "custom")] == []
    expected = reference(single, tmp_path)
    chunked = [t for t in ckpt.tensors if t.chunks]
    assert {t.key for t in chunked} == set(expected)
    for t in chunked:
        assert torch.equal(read_tensor(ckpt, t), expected[t.key]), t.key


def test_four_ranks_reassemble_as_torch_does(tmp_path: Path) -> None:
    ckpt = ckptool.open(FOUR)
    assert ckpt.metadata["ranks"] == 4
    by_key = {t.key: t for t in ckpt.tensors}
    grid = by_key["dt.grid"]
    assert sorted((c.offsets, c.sizes) for c in grid.chunks) == [
        ((0, 0), (3, 4)), ((0, 4), (3, 4)), ((3, 0), (3, 4)), ((3, 4), (3, 4))]
    two = by_key["dt.two_per_rank"]
    assert sorted(c.rank for c in two.chunks) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert any(0 in c.sizes for c in by_key["dt.tiny"].chunks)  # empty chunks are real
    assert by_key["optim.state.fc.weight.exp_avg"].shape == (6, 4)
    data = [f for f in ckpt.files if f.role == "data"]
    assert sum(f.num_tensors for f in data) == sum(len(t.chunks) for t in ckpt.tensors)
    expected = reference(FOUR, tmp_path)
    assert {t.key for t in ckpt.tensors} == set(expected)
    for key, want in expected.items():
        got = read_tensor(ckpt, by_key[key])
        assert got.dtype == want.dtype and torch.equal(got, want), key
    entries = {e.key: e.value for e in ckpt.entries}
    assert entries["step"] == 12 and entries["epoch"] == 3
    assert entries["hparams.name"] == "tiny"


def test_lightning_and_accelerate_wrappers() -> None:
    lightning = ckptool.open(FIXTURES / "lightning_fsdp.ckpt")
    assert lightning.metadata["wrapper"] == "lightning" and lightning.metadata["ranks"] == 2
    entries = {e.key: e.value for e in lightning.entries}
    assert entries["<meta.pt>"] == {"step": 5, "hparams": {"lr": 0.01}}
    assert "extra" in [f.role for f in lightning.files]
    accelerate = ckptool.open(FIXTURES / "accelerate_fsdp")
    assert accelerate.metadata["wrapper"] == "accelerate"
    assert [f.path for f in accelerate.files if f.role == "metadata"] == [
        "pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"]
    keys = [t.key for t in accelerate.tensors]
    assert keys[0] == "model.0.weight" and "optimizer.state.0.weight.exp_avg" in keys
    assert accelerate.main_state_dict is not None
    assert accelerate.main_state_dict.num_tensors == 4
    chunk = accelerate.tensors[0].chunks[0]
    assert chunk.file.startswith("pytorch_model_fsdp_0/__")
    t = accelerate.tensors[0]
    assert read_tensor(accelerate, t).shape == t.shape


def test_inspect_json_and_text(run_cli: Callable[..., CliResult]) -> None:
    code, out, err = run_cli("inspect", "--json", str(FOUR))
    assert code == 0 and err == ""
    data = json.loads(out)
    assert data["format"] == "dcp" and data["bytes_by_location"] == {
        "unrecorded": data["total_bytes"]}
    assert data["files"][0] == {"path": ".metadata", "role": "metadata", "format": None,
                                "size": (FOUR / ".metadata").stat().st_size,
                                "num_tensors": 0, "num_values": 0, "rank": None}
    assert [f["rank"] for f in data["files"][1:]] == [0, 1, 2, 3]
    grid = next(t for t in data["tensors"] if t["key"] == "dt.grid")
    assert set(grid["chunks"][0]) == {"file", "rank", "offsets", "sizes", "byte_offset",
                                      "byte_length"}
    assert data["metadata"]["ranks"] == 4 and data["metadata"]["version"] == "1.0.0"
    code, out, err = run_cli("inspect", str(FOUR), "--filter", "dt.grid")
    assert code == 0 and err == ""
    assert "written by 4 ranks" in out and "4 chunks · ranks 0-3" in out


@pytest.mark.parametrize("command", ["diagnose", "devices"])
def test_reporting_commands_take_it(command: str, run_cli: Callable[..., CliResult]) -> None:
    code, out, err = run_cli(command, "--json", str(FOUR))
    assert code in (0, 1) and err == "" and json.loads(out)


def test_fix_writes_a_fixed_dcp_directory(tmp_path: Path,
                                          run_cli: Callable[..., CliResult]) -> None:
    out = tmp_path / "fixed"
    code, stdout, err = run_cli("fix", str(FOUR), "--add-prefix", "net.", "--dtype", "bf16",
                                "--drop", "step", "-o", str(out), "--json")
    assert code == 0 and err == ""
    report = json.loads(stdout)
    assert report["dropped"] == ["step"] and report["renamed"][0]["to"].startswith("model.net.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(FOUR, tmp_path / "ref.pt")
        dcp_to_torch_save(out, tmp_path / "got.pt")
    ref, got = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "got.pt")
    assert "step" not in got and got["epoch"] == ref["epoch"]  # the rest is kept whole
    assert set(got["model"]) == {f"net.{k}" for k in ref["model"]}  # inside the entry
    for key, value in ref["model"].items():
        want = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert torch.equal(got["model"][f"net.{key}"], want)
    assert got["optim"].keys() == ref["optim"].keys()


@pytest.mark.parametrize(("args", "message"), [
    (["--to", "cpu"], "DCP records no device"),
    (["--strip-module", "--in-place"], "--in-place on a torch.distributed.checkpoint"),
    (["--extract"], "--extract is convert's"),
    (["--drop", "nope"], "no tensor, value or entry of that name"),
])
def test_what_fix_refuses_on_dcp(args: list[str], message: str,
                                 run_cli: Callable[..., CliResult]) -> None:
    code, out, err = run_cli("fix", str(FOUR), *args)
    assert (code, out) == (2, "") and message in err and "Traceback" not in err
    assert not Path(f"{FOUR}.fixed").exists()


# -- hostile pickles: nothing runs, the call is reported -------------------

class RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_hostile_metadata_runs_nothing(single: Path, tmp_path: Path,
                                       run_cli: Callable[..., CliResult]) -> None:
    folder = tmp_path / "hostile"
    shutil.copytree(single, folder)
    marker = tmp_path / "ran"
    with open(folder / ".metadata", "rb") as f:
        md = pickle.load(f)
    md.storage_meta.modules = [RunsCode(marker)]  # a real Metadata, one field a payload
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(md, f)
    code, out, err = run_cli("inspect", str(folder))
    assert code == 0 and err == ""
    assert "UNSAFE      posix.system" in out
    code, out, _ = run_cli("inspect", "--json", str(folder))
    data = json.loads(out)
    assert data["unsafe_globals"] == ["posix.system"]
    assert data["num_tensors"] == len(ckptool.open(single).tensors)
    code, out, _ = run_cli("diagnose", "--json", str(folder))
    assert code == 1 and "unsafe-globals" in [f["code"] for f in json.loads(out)["findings"]]
    assert not marker.exists()


def test_metadata_that_is_only_a_payload(single: Path, tmp_path: Path,
                                         run_cli: Callable[..., CliResult]) -> None:
    folder = tmp_path / "payload"
    shutil.copytree(single, folder)
    marker = tmp_path / "ran"
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(RunsCode(marker), f)
    code, out, err = run_cli("inspect", "--json", str(folder))
    assert code == 0 and err == ""
    data = json.loads(out)
    assert data["unsafe_globals"] == ["posix.system"] and data["num_tensors"] == 0
    assert "not a torch.distributed.checkpoint Metadata" in data["warnings"][0]
    assert not marker.exists()


# -- directories that do not hold together: exit 3, the file named ---------

def broken(single: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "broken"
    shutil.copytree(single, folder)
    return folder


def test_missing_distcp(single: Path, tmp_path: Path,
                       run_cli: Callable[..., CliResult]) -> None:
    folder = broken(single, tmp_path)
    os.remove(folder / "__0_0.distcp")
    code, out, err = run_cli("inspect", str(folder))
    assert code == 3 and out == "" and "Traceback" not in err
    assert "__0_0.distcp is missing (named by .metadata)" in err


def test_truncated_distcp(single: Path, tmp_path: Path) -> None:
    folder = broken(single, tmp_path)
    data = (folder / "__0_0.distcp").read_bytes()
    (folder / "__0_0.distcp").write_bytes(data[: len(data) - 100])
    with pytest.raises(CorruptCheckpointError, match=r"__0_0.distcp is \d+ bytes long.*truncated"):
        ckptool.open(folder)


def edit_metadata(folder: Path, change: Callable[[Any], None]) -> None:
    with open(folder / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own fixture
    change(md)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(md, f)


def test_chunks_that_do_not_cover_a_tensor(tmp_path: Path) -> None:
    folder = tmp_path / "four"
    shutil.copytree(FOUR, folder)
    edit_metadata(folder, lambda md: md.state_dict_metadata["dt.grid"].chunks.pop())
    with pytest.raises(CorruptCheckpointError,
                       match=r"dt.grid is not whole: no chunk holds the element at \[3, 4\]"):
        ckptool.open(folder)


def test_overlapping_chunks(tmp_path: Path) -> None:
    folder = tmp_path / "four"
    shutil.copytree(FOUR, folder)

    def overlap(md: Any) -> None:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
        chunks = md.state_dict_metadata["dt.rows"].chunks
        first = chunks[0]
        moved = ChunkStorageMetadata(offsets=torch.Size([1, 0]), sizes=first.sizes)
        chunks.append(moved)
        md.storage_data[MetadataIndex("dt.rows", moved.offsets, 2)] = md.storage_data[
            MetadataIndex("dt.rows", first.offsets, 0)]
    edit_metadata(folder, overlap)
    with pytest.raises(CorruptCheckpointError, match=r"dt.rows is not whole: two of its chunks"):
        ckptool.open(folder)


def test_chunk_whose_bytes_are_not_an_archive(single: Path, tmp_path: Path) -> None:
    folder = broken(single, tmp_path)
    with open(folder / ".metadata", "rb") as f:
        md = pickle.load(f)
    items = {k.fqn: v for k, v in md.storage_data.items()}
    first = min((items[k] for k in md.state_dict_metadata if k in items and k != "bf"
                 and hasattr(md.state_dict_metadata[k], "chunks")), key=lambda i: i.offset)
    for info in (items["bf"], first):
        with open(folder / "__0_0.distcp", "r+b") as f:
            f.seek(info.offset)
            f.write(b"JUNK")
        if info is first:  # the first chunk of each file is checked as it is read
            with pytest.raises(CorruptCheckpointError, match=r"no torch.save archive at byte"):
                ckptool.open(folder)
        else:  # the others when their bytes are
            ckpt = ckptool.open(folder)
            t = next(t for t in ckpt.tensors if t.key == "bf")
            with pytest.raises(CorruptCheckpointError,
                               match=r"__0_0.distcp \(chunk of bf at \[0, 0\]\) holds no "):
                read_tensor(ckpt, t)


# -- what a directory is -------------------------------------------------

def test_directories_that_are_no_checkpoint(tmp_path: Path,
                                            run_cli: Callable[..., CliResult]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_cli("inspect", str(empty))
    assert code == 3 and "is an empty directory" in err
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "README.md").write_text("hi")
    (notes / "config.json").write_text("{}")
    code, _, err = run_cli("inspect", str(notes))
    assert code == 3 and "no checkpoint in it: it holds README.md, config.json" in err
    two = tmp_path / "two"
    two.mkdir()
    torch.save({"a": torch.ones(1)}, two / "a.pt")
    torch.save({"b": torch.ones(1)}, two / "b.pt")
    code, _, err = run_cli("inspect", str(two))
    assert code == 3 and "holding 2 checkpoint files (a.pt, b.pt)" in err
    code, _, err = run_cli("inspect", str(FIXTURES))
    assert code == 3 and "DCP checkpoint" in err and "Traceback" not in err


def test_safetensors_serialization_is_refused_clearly(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat

    out = tmp_path / "st_format"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(3)}, storage_writer=FileSystemWriter(
            out, serialization_format=SerializationFormat.SAFETENSORS))
    with pytest.raises(UnsupportedCheckpointError, match=r"SerializationFormat.SAFETENSORS"):
        ckptool.open(out)


def test_one_metadata_per_rank(tmp_path: Path) -> None:
    out = tmp_path / "nocoll"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"x": torch.ones(2), "s": 3}, checkpoint_id=out, use_collectives=False)
    assert sorted(os.listdir(out)) == ["__0.metadata", "__0_0.distcp"]
    ckpt = ckptool.open(out)
    assert ckpt.format == "dcp" and [t.key for t in ckpt.tensors] == ["x"]
    assert [(f.path, f.role) for f in ckpt.files] == [("__0.metadata", "metadata"),
                                                      ("__0_0.distcp", "data")]
    assert torch.equal(read_tensor(ckpt, ckpt.tensors[0]), torch.ones(2))


def test_hostile_value_runs_nothing(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    """A non-tensor value is a torch.save pickle inside a .distcp: one whose
    unpickling calls os.system, as dcp.save itself writes it."""
    marker = tmp_path / "ran"
    out = tmp_path / "hostile_value"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "callback": RunsCode(marker)}, checkpoint_id=out)
    code, out_text, err = run_cli("inspect", "--json", str(out))
    assert code == 0 and err == ""
    data = json.loads(out_text)
    assert data["unsafe_globals"] == ["posix.system"]
    unsafe = next(g for g in data["globals"] if g["name"] == "posix.system")
    assert unsafe["where"] == ["__0_0.distcp: callback"] and unsafe["uses"] == ["called"]
    assert not marker.exists()


def test_ranks_that_wrote_their_own_metadata(tmp_path: Path) -> None:
    """dcp.save(use_collectives=False) under torchrun: one __<rank>.metadata
    per rank, merged; the tensor every rank saved whole is read once."""
    folder = FIXTURES / "dcp_2ranks_nocollectives"
    ckpt = ckptool.open(folder)
    assert ckpt.metadata["ranks"] == 2 and len(ckpt.metadata["metadata_files"]) == 2
    assert any("more than one rank's .metadata" in n for n in ckpt.metadata["notes"])
    torch.manual_seed(0)
    want = {"rows": torch.randn(6, 4), "cols": torch.randn(3, 8), "repl": torch.randn(5)}
    out = tmp_path / "whole.pt"
    ckptool.convert(str(folder), str(out))
    got = torch.load(out, weights_only=True)
    assert got["step"] == 3 and got["model"].keys() == want.keys()
    assert all(torch.equal(got["model"][k], v) for k, v in want.items())


def test_fix_keeps_what_it_cannot_write_back_unless_dropped(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    """A value that is not plain data (an argparse.Namespace) cannot go back
    through torch's writer: fix refuses until it is dropped, and --drop takes
    a whole entry (the optimizer state) too."""
    import argparse

    folder = tmp_path / "ns"
    state = {"model": {"w": torch.ones(2, 2)}, "optim": {"m": torch.zeros(2)},
             "args": argparse.Namespace(lr=0.1), "step": 5}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=folder, no_dist=True)
    code, out, err = run_cli("fix", str(folder), "--dtype", "bf16", "-o", str(tmp_path / "a"))
    assert (code, out) == (2, "") and "args is not plain data" in err and "--drop args" in err
    code, _, err = run_cli("fix", str(folder), "--dtype", "bf16", "--drop", "args",
                           "--drop", "optim", "-o", str(tmp_path / "b"), "-q")
    assert (code, err) == (0, "")
    got = {t.key for t in ckptool.open(tmp_path / "b").tensors}
    assert got == {"model.w"}
    assert [e.key for e in ckptool.open(tmp_path / "b").entries] == ["step"]


def test_fix_of_a_lightning_directory_keeps_its_meta_pt(tmp_path: Path,
                                                        run_cli: Callable[..., CliResult]) -> None:
    src = FIXTURES / "lightning_fsdp.ckpt"
    out = tmp_path / "fixed.ckpt"
    code, _, err = run_cli("fix", str(src), "--dtype", "bf16", "-o", str(out), "-q")
    assert (code, err) == (0, "")
    assert (out / "meta.pt").read_bytes() == (src / "meta.pt").read_bytes()
    assert ckptool.open(out).metadata.get("wrapper") == "lightning"
