"""Manifests of ``ckptool verify`` (issue 28): a tensor's digest is the sha256
of its logical bytes and the same in every layout real writers make (torch
zip and legacy, safetensors, Hugging Face shards, DCP of one process and of
4 ranks, per-rank DTensor files, torch's HF storage writer, DeepSpeed);
a manifest written then checked is clean, and a flipped byte, a renamed
tensor, a file added or removed are each named; a conversion changes the
files and no tensor's digest."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import struct
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import flatten
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import ckptool
from ckptool.check.verify import digest, manifest
from ckptool.check.verify.digest import tensor_digest
from ckptool.errors import UsageError
from ckptool.read.tensor_source import TensorValues

CliResult = tuple[int, str, str]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
MULTI = FIXTURES / "multifile"


def sha(t: torch.Tensor) -> str:
    """The digest computed the plain way, from a contiguous copy."""
    raw = t.resolve_conj().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def state_dict() -> dict[str, torch.Tensor]:
    """A tensor of each kind every writer here takes."""
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(5, 7, generator=g),
        "h": torch.randn(3, 4, generator=g).half(),
        "bf": torch.randn(4, 3, generator=g).bfloat16(),
        "f64": torch.randn(3, generator=g).double(),
        "i": torch.arange(10),
        "i8": torch.arange(-4, 4, dtype=torch.int8),
        "u8": torch.arange(200, 206, dtype=torch.uint8),
        "mask": torch.tensor([True, False, True, True]),
        "f8": torch.randn(2, 3, generator=g).to(torch.float8_e4m3fn),
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(2.5),
    }


def digests(path: Path | str) -> dict[str, str | None]:
    return {k: e["digest"] for k, e in manifest.tensor_entries(ckptool.open(path)).items()}


def values_digests(path: Path | str) -> dict[str, str]:
    """Each tensor's digest from its values as ckptool reads them (never a
    file range): the other way of computing it must agree."""
    ckpt = ckptool.open(path)
    with TensorValues(ckpt) as source:
        return {t.key: tensor_digest(source.values(t)) for t in ckpt.tensors}


# -- the digest ----------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 5),
    lambda: torch.randn(4, 5).t(),  # not contiguous
    lambda: torch.arange(20.0)[::3],  # a strided vector
    lambda: torch.randn(3, 4, 5).permute(2, 0, 1)[1:],
    lambda: torch.tensor(7, dtype=torch.int16),  # a scalar
    lambda: torch.zeros(0, 4),
    lambda: torch.tensor([True, False, True]),
    lambda: torch.randn(6).bfloat16(),
    lambda: torch.randn(6).to(torch.float8_e5m2),
    lambda: torch.randn(3, dtype=torch.complex64).conj(),  # a lazy conjugate
], ids=["f32", "transposed", "strided", "permuted", "scalar", "empty", "bool", "bf16", "f8",
        "conj"])
def test_digest_is_the_sha256_of_the_logical_bytes(make: Callable[[], torch.Tensor]) -> None:
    t = make()
    assert tensor_digest(t) == sha(t)


def test_digest_in_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors longer than a block, contiguous or not, hash block by block."""
    monkeypatch.setattr(digest, "BLOCK", 40)
    for t in (torch.randn(7, 9), torch.randn(9, 7).t(), torch.arange(50.0)[::2],
              torch.randn(2, 100).t()):
        assert tensor_digest(t) == sha(t)
    assert digest.digest_bytes([b"ab", memoryview(b"c")]) == \
        "sha256:" + hashlib.sha256(b"abc").hexdigest()
    assert tensor_digest(torch.zeros(0)) == "sha256:" + hashlib.sha256().hexdigest()


def test_digest_refuses_a_sparse_tensor() -> None:
    with pytest.raises(TypeError, match="dense"):
        tensor_digest(torch.eye(3).to_sparse())


# -- the same digest in every layout ---------------------------------------

@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``state_dict()`` saved by every writer (torch's views beside it in the
    torch files: a transposed view and a row of ``w``'s storage)."""
    import huggingface_hub as hub

    root = tmp_path_factory.mktemp("layouts")
    sd = state_dict()
    views = sd | {"wt": sd["w"].t(), "row": sd["w"][2]}
    paths = {"zip": root / "m.pt", "legacy": root / "legacy.pt",
             "safetensors": root / "m.safetensors", "hf": root / "hf", "dcp": root / "dcp"}
    paths["hf"].mkdir()
    torch.save(views, paths["zip"])
    torch.save(views, paths["legacy"], _use_new_zipfile_serialization=False)
    save_file(sd, paths["safetensors"])
    hub.save_torch_state_dict(sd, paths["hf"], max_shard_size=100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in one process"
        dcp.save(sd, checkpoint_id=paths["dcp"])
    return paths


@pytest.mark.parametrize("kind", ["zip", "legacy", "safetensors", "hf", "dcp"])
def test_same_digest_in_every_layout(kind: str, layouts: dict[str, Path]) -> None:
    sd = state_dict()
    want = {k: sha(v) for k, v in sd.items()}
    if kind in ("zip", "legacy"):
        want |= {"wt": sha(sd["w"].t()), "row": sha(sd["w"][2])}
    if kind == "hf":
        assert len(list(layouts["hf"].glob("*.safetensors"))) > 2
    got = digests(layouts[kind])
    assert got == want
    assert values_digests(layouts[kind]) == want


def _nested(whole: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        whole = whole[step]
    return whole


@pytest.mark.parametrize("name", ["dcp_4ranks", "lightning_fsdp.ckpt"])
def test_same_digest_from_dcp_of_many_ranks(name: str, tmp_path: Path) -> None:
    """DTensors sharded over a 2x2 CPU mesh by 4 ranks (rows, columns, a
    grid, uneven, empty chunks, a ShardedTensor), FSDP through Lightning:
    each tensor's digest is that of torch's own consolidation."""
    folder = MULTI / name
    ref = tmp_path / "ref.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(folder, ref)  # our own fixture: torch may unpickle it
    whole = torch.load(ref, weights_only=False)
    with open(folder / ".metadata", "rb") as f:
        planner = pickle.load(f).planner_data
    got = digests(folder)
    assert len(got) > 10 and None not in got.values()
    for key, value in got.items():
        assert value == sha(_nested(whole, planner[key])), key


def test_same_digest_from_ranks_without_collectives() -> None:
    """dcp.save(use_collectives=False) by 2 ranks, a .metadata each (values
    from the seed its maker used)."""
    torch.manual_seed(0)
    want = {"rows": torch.randn(6, 4), "cols": torch.randn(3, 8), "repl": torch.randn(5)}
    got = digests(MULTI / "dcp_2ranks_nocollectives")
    assert got == {f"model.{k}": sha(v) for k, v in want.items()}


@pytest.mark.parametrize("folder", [
    "multifile/per_rank_dtensor/placements_ws2", "multifile/per_rank_dtensor/mesh2d_ws4",
    "multifile/per_rank_dtensor/fsdp2_ws2", "multifile/per_rank_dtensor/optim_ws2",
    "multifile/hf_storage/distributed", "multifile/hf_storage/fqn_map",
    "deepspeed/z1_fp32", "deepspeed/z3_bf16_ws4"])
def test_same_digest_from_other_distributed_writers(folder: str) -> None:
    """Per-rank ``torch.save`` of DTensors, torch's HF storage writer over
    ranks, DeepSpeed ZeRO partitions: digests of the reference's tensors."""
    path = FIXTURES / folder
    reference = path.parent / ("reference.pt" if "hf_storage" in folder
                               else f"{path.name}.reference.pt")
    want = {k: sha(v) for k, v in flatten(torch.load(reference, weights_only=False)).items()}
    got = digests(path)
    common = got.keys() & want.keys()
    assert len(common) >= min(len(got), 4)
    assert {k: got[k] for k in common} == {k: want[k] for k in common}


# -- writing and checking --------------------------------------------------

def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


def _found(problems: list[Any]) -> set[tuple[str, str | None, str | None]]:
    return {(p.kind, p.file, p.tensor) for p in problems}


@pytest.mark.parametrize("kind", ["zip", "safetensors", "hf", "dcp"])
def test_manifest_written_then_checked_is_clean(kind: str, layouts: dict[str, Path],
                                                tmp_path: Path) -> None:
    ckpt = ckptool.open(layouts[kind])
    dest = tmp_path / "manifest.json"
    written = manifest.write_manifest(ckpt, str(dest), jobs=2)
    on_disk = json.loads(dest.read_text())
    assert on_disk == written
    assert set(on_disk) == {"ckptool_manifest", "tool", "created", "layout", "path", "files",
                            "tensors"}
    assert on_disk["ckptool_manifest"] == 1 and on_disk["tool"] == f"ckptool {ckptool.__version__}"
    assert on_disk["layout"] == ckpt.format and on_disk["created"].endswith("+00:00")
    root = Path(manifest.root_of(ckpt))
    for name, entry in on_disk["files"].items():
        data = (root / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if kind == "zip":  # one file: not the others in its folder
        assert list(on_disk["files"]) == ["m.pt"]
    if kind == "dcp":
        assert {".metadata", "__0_0.distcp"} <= set(on_disk["files"])
    if kind == "hf":
        assert "model.safetensors.index.json" in on_disk["files"]
    assert on_disk["tensors"]["bf"] == {"dtype": "bfloat16", "shape": [4, 3],
                                        "digest": sha(state_dict()["bf"])}
    assert manifest.check_manifest(ckpt, str(dest), jobs=2) == []
    assert manifest.check_manifest(ckpt, str(dest), jobs=1, every_tensor=True) == []
    assert sorted(os.listdir(tmp_path)) == ["manifest.json"]  # nothing left beside it


def test_manifest_inside_the_checkpoint_is_not_one_of_its_files(layouts: dict[str, Path],
                                                                tmp_path: Path) -> None:
    folder = tmp_path / "dcp"
    shutil.copytree(layouts["dcp"], folder)
    dest = folder / "manifest.json"
    written = manifest.write_manifest(ckptool.open(folder), str(dest), jobs=2)
    assert "manifest.json" not in written["files"]
    written = manifest.write_manifest(ckptool.open(folder), str(dest), jobs=2)  # replaced
    assert "manifest.json" not in written["files"]
    assert manifest.check_manifest(ckptool.open(folder), str(dest), jobs=2) == []


def test_a_flipped_byte_in_safetensors_names_the_file_and_the_tensor(
        layouts: dict[str, Path], tmp_path: Path) -> None:
    """safetensors has no checksum: only the manifest sees this."""
    path = tmp_path / "m.safetensors"
    shutil.copy(layouts["safetensors"], path)
    dest = tmp_path / "m.manifest.json"
    manifest.write_manifest(ckptool.open(path), str(dest), jobs=2)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    start = json.loads(data[8:8 + n])["w"]["data_offsets"][0]
    _flip(path, 8 + n + start + 9)
    problems = manifest.check_manifest(ckptool.open(path), str(dest), jobs=2)
    assert _found(problems) == {("manifest-file", "m.safetensors", None),
                                ("manifest-tensor", "m.safetensors", "w")}
    assert all("\n" not in p.message for p in problems)
    assert "values differ from the manifest" in problems[1].message


def test_a_flipped_byte_in_dcp_of_4_ranks_names_the_rank_file_and_the_tensor(
        tmp_path: Path) -> None:
    """A chunk of a DTensor sharded over a 2x2 mesh, in rank 2's file."""
    folder = tmp_path / "dcp"
    shutil.copytree(MULTI / "dcp_4ranks", folder)
    dest = tmp_path / "manifest.json"
    manifest.write_manifest(ckptool.open(folder), str(dest), jobs=2)
    ckpt = ckptool.open(folder)
    grid = next(t for t in ckpt.tensors if t.key == "dt.grid")
    chunk = next(c for c in grid.chunks if c.file == "__2_0.distcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(folder, tmp_path / "ref.pt")
    whole = torch.load(tmp_path / "ref.pt", weights_only=False)["dt"]["grid"]
    box = whole[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))]
    raw = box.contiguous().numpy().tobytes()
    at = (folder / chunk.file).read_bytes().find(raw)
    assert at > 0
    _flip(folder / chunk.file, at + 2)
    problems = manifest.check_manifest(ckptool.open(folder), str(dest), jobs=2)
    assert _found(problems) == {("manifest-file", "__2_0.distcp", None),
                                ("manifest-tensor", "__2_0.distcp", "dt.grid")}


def test_a_flipped_byte_in_a_one_process_dcp(layouts: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "dcp"
    shutil.copytree(layouts["dcp"], folder)
    dest = tmp_path / "manifest.json"
    manifest.write_manifest(ckptool.open(folder), str(dest), jobs=1)
    raw = state_dict()["h"].numpy().tobytes()
    data_file = folder / "__0_0.distcp"
    at = data_file.read_bytes().find(raw)
    assert at > 0
    _flip(data_file, at + 1)
    for every in (False, True):
        problems = manifest.check_manifest(ckptool.open(folder), str(dest), 2, every)
        assert _found(problems) == {("manifest-file", "__0_0.distcp", None),
                                    ("manifest-tensor", "__0_0.distcp", "h")}


def test_a_renamed_tensor(layouts: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    sd = state_dict()
    save_file(sd, path)
    dest = tmp_path / "manifest.json"
    manifest.write_manifest(ckptool.open(path), str(dest), jobs=2)
    sd["w2"] = sd.pop("w")
    save_file(sd, path)
    problems = manifest.check_manifest(ckptool.open(path), str(dest), jobs=2)
    assert _found(problems) == {("manifest-file", "m.safetensors", None),
                                ("manifest-missing", None, "w"),
                                ("manifest-extra", "m.safetensors", "w2")}


def test_a_tensor_of_another_shape_or_dtype(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torch.save({"a": torch.zeros(2, 3), "b": torch.ones(4)}, path)
    dest = tmp_path / "manifest.json"
    manifest.write_manifest(ckptool.open(path), str(dest), jobs=2)
    torch.save({"a": torch.zeros(3, 2), "b": torch.ones(4).half()}, path)
    problems = manifest.check_manifest(ckptool.open(path), str(dest), jobs=2)
    assert {(p.kind, p.tensor) for p in problems if p.tensor} == {("manifest-tensor", "a"),
                                                                   ("manifest-tensor", "b")}
    assert "float16 [4], the manifest says float32 [4]" in problems[-1].message


def test_a_file_added_and_a_file_removed(layouts: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    shutil.copytree(layouts["hf"], folder)
    dest = tmp_path / "manifest.json"
    manifest.write_manifest(ckptool.open(folder), str(dest), jobs=2)
    (folder / "notes.txt").write_text("added\n")
    problems = manifest.check_manifest(ckptool.open(folder), str(dest), jobs=2)
    assert _found(problems) == {("manifest-extra", "notes.txt", None)}  # no tensor read

    trainer = tmp_path / "checkpoint-2"
    shutil.copytree(FIXTURES / "frameworks" / "trainer_checkpoint" / "checkpoint-2", trainer)
    written = manifest.write_manifest(ckptool.open(trainer), str(dest), jobs=2)
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "config.json"} <= set(
        written["files"])
    (trainer / "scheduler.pt").unlink()
    problems = manifest.check_manifest(ckptool.open(trainer), str(dest), jobs=2)
    assert _found(problems) == {("manifest-missing", "scheduler.pt", None)}


def test_a_missing_rank_file_when_the_checkpoint_does_not_open(tmp_path: Path) -> None:
    folder = tmp_path / "dcp"
    shutil.copytree(MULTI / "dcp_4ranks", folder)
    dest = tmp_path / "manifest.json"
    manifest.write_manifest(ckptool.open(folder), str(dest), jobs=2)
    (folder / "__3_0.distcp").unlink()
    (folder / "__4_0.distcp").write_bytes(b"junk")
    problems = manifest.check_files(str(folder), str(dest), 2, sorted(os.listdir(folder)))
    assert _found(problems) == {("manifest-missing", "__3_0.distcp", None),
                                ("manifest-extra", "__4_0.distcp", None)}


@pytest.mark.parametrize(("src", "fmt"), [("safetensors", "m.pt"), ("dcp", "m.safetensors"),
                                          ("zip", "hf")])
def test_a_conversion_changes_the_files_not_the_tensors(
        src: str, fmt: str, layouts: dict[str, Path], tmp_path: Path,
        run_cli: Callable[..., CliResult]) -> None:
    out = tmp_path / fmt
    code, _, err = run_cli("convert", str(layouts[src]), str(out), "-q")
    assert code == 0, err
    before = manifest.write_manifest(ckptool.open(layouts[src]), str(tmp_path / "a.json"), 2)
    after = manifest.write_manifest(ckptool.open(out), str(tmp_path / "b.json"), 2)
    shared = {k: v for k, v in before["tensors"].items() if k in after["tensors"]}
    assert len(shared) >= len(state_dict()) and shared == {
        k: after["tensors"][k] for k in shared}
    assert not {e["sha256"] for e in before["files"].values()} & {
        e["sha256"] for e in after["files"].values()}
    # checked against the other's manifest: every file differs (a warning:
    # another layout), no tensor does (only those left out are missing)
    problems = manifest.check_manifest(ckptool.open(out), str(tmp_path / "a.json"), jobs=2)
    assert all(p.severity == "warning" for p in problems if p.tensor is None)
    assert "its tensors are compared one for one" in problems[0].message
    assert {p.kind for p in problems if p.tensor} <= {"manifest-missing", "manifest-extra"}
    assert all(p.tensor is None or p.tensor not in shared for p in problems)


def test_a_tensor_whose_values_cannot_be_read_is_recorded_without_digest(
        tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torch.save({"sparse": torch.eye(3).to_sparse(), "w": torch.ones(2)}, path)
    dest = tmp_path / "manifest.json"
    written = manifest.write_manifest(ckptool.open(path), str(dest), jobs=2)
    entry = written["tensors"]["sparse"]
    assert entry["digest"] is None and "sparse" in entry["unread"]
    assert written["tensors"]["w"]["digest"] == sha(torch.ones(2))
    assert manifest.check_manifest(ckptool.open(path), str(dest), jobs=2) == []


def test_write_refuses_to_replace_a_file_of_the_checkpoint(layouts: dict[str, Path]) -> None:
    path = layouts["safetensors"]
    before = path.read_bytes()
    with pytest.raises(UsageError, match="is a file of the checkpoint"):
        manifest.write_manifest(ckptool.open(path), str(path), jobs=1)
    assert path.read_bytes() == before


GOOD = {"ckptool_manifest": 1, "files": {"m.pt": {"size": 1, "sha256": "0" * 64}},
        "tensors": {"w": {"dtype": "float32", "shape": [2], "digest": "sha256:" + "a" * 64}}}


@pytest.mark.parametrize(("content", "message"), [
    (b"\x00\x01 not json", "is not a ckptool manifest: it is not JSON"),
    (b"[1, 2]", "has no ckptool_manifest field"),
    (b'{"files": {}}', "has no ckptool_manifest field"),
    (json.dumps(GOOD | {"ckptool_manifest": 7}).encode(), "manifest of version 7, newer"),
    (json.dumps(GOOD | {"ckptool_manifest": "1"}).encode(), "unknown version '1'"),
    (json.dumps(GOOD | {"files": []}).encode(), "files and tensors must be objects"),
    (json.dumps(GOOD | {"files": {"../etc/passwd": {"size": 1, "sha256": "0" * 64}}}).encode(),
     "is not a relative path inside the checkpoint"),
    (json.dumps(GOOD | {"files": {"m.pt": {"size": -1, "sha256": "0" * 64}}}).encode(),
     "needs a size and a sha256"),
    (json.dumps(GOOD | {"tensors": {"w": {"dtype": "float32", "shape": [2],
                                          "digest": "md5:00"}}}).encode(),
     "tensor 'w' needs a dtype, a shape and a digest"),
])
def test_a_bad_manifest_is_a_one_line_usage_error(content: bytes, message: str,
                                                  tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    with pytest.raises(UsageError) as caught:
        manifest.check_manifest(ckptool.open(tmp_path / "m.pt"), str(path), jobs=1)
    assert message in caught.value.message and "\n" not in caught.value.message
    assert caught.value.exit_code == 2


def test_a_manifest_that_is_not_there(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"cannot read the manifest .*No such file"):
        manifest.read_manifest(str(tmp_path / "none.json"))


def test_a_single_file_renamed_is_checked_under_its_new_name(tmp_path: Path) -> None:
    """last.ckpt renamed epoch=3.ckpt after its manifest was written: the
    same bytes, a warning, no problem."""
    from ckptool.check.verify.manifest import check_manifest, write_manifest
    from ckptool.read.reader import open_checkpoint

    first = tmp_path / "last.ckpt"
    torch.save({"w": torch.arange(12.0)}, first)
    write_manifest(open_checkpoint(str(first)), str(tmp_path / "m.json"), 1)
    moved = first.rename(tmp_path / "epoch=3.ckpt")
    problems = check_manifest(open_checkpoint(str(moved)), str(tmp_path / "m.json"), 1)
    assert [(p.severity, p.file) for p in problems] == [("warning", "epoch=3.ckpt")]
    assert "last.ckpt" in problems[0].message
    data = bytearray(moved.read_bytes())
    data[-100] ^= 1
    moved.write_bytes(bytes(data))
    problems = check_manifest(open_checkpoint(str(moved)), str(tmp_path / "m.json"), 1)
    assert any(p.severity == "error" and p.file == "epoch=3.ckpt" for p in problems)
