"""ckptool fix: every option, checked against what torch loads from the
output (plain torch.load on this CPU-only machine, strict load_state_dict)."""

from __future__ import annotations

import argparse
import hashlib
import json
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import disk_full_lines, make_samples, saved_on

import ckptool
from ckptool.cli import main
from ckptool.read import dispatch
from ckptool.read.resolve import faithful
from ckptool.write import repickle

SAMPLES = Path(__file__).resolve().parent.parent / "samples"


def dp_checkpoint(path: Path, tag: str = "cuda:2", legacy: bool = False) -> dict[str, Any]:
    """A DataParallel state dict (real _metadata) inside a training checkpoint."""
    torch.manual_seed(0)
    net = make_samples.TinyNet()
    sd = torch.nn.DataParallel(net).state_dict()
    ckpt = {"epoch": 7, "state_dict": sd, "optimizer": {"state": {0: {"m": torch.ones(3)}}},
            "args": argparse.Namespace(lr=0.1, arch="tinynet")}
    with saved_on(tag):
        torch.save(ckpt, path, _use_new_zipfile_serialization=not legacy)
    return {k.removeprefix("module."): v for k, v in sd.items()}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load(path: Path) -> Any:
    return torch.load(path, weights_only=False)  # no map_location: the tags must be cpu


def strict_load(sd: dict[str, torch.Tensor]) -> None:
    assert str(make_samples.TinyNet().load_state_dict(sd, strict=True)) == (
        "<All keys matched successfully>")


@pytest.mark.parametrize("legacy", [False, True])
def test_strip_module_and_retarget_loads_with_plain_torch_load(
        tmp_path: Path, legacy: bool, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "model.pth"
    want = dp_checkpoint(src, legacy=legacy)
    before = sha(src)
    assert main(["fix", str(src), "--strip-module", "--to", "cpu"]) == 0
    out = tmp_path / "model.fixed.pth"
    assert "wrote" in capsys.readouterr().out
    assert sha(src) == before  # the input is never modified
    fixed = load(out)
    strict_load(fixed["state_dict"])
    assert all(torch.equal(fixed["state_dict"][k], v) for k, v in want.items())
    assert fixed["epoch"] == 7 and fixed["args"].lr == 0.1
    assert torch.equal(fixed["optimizer"]["state"][0]["m"], torch.ones(3))
    assert list(fixed["state_dict"]._metadata)[:2] == ["", "conv"]
    assert ckptool.open(out).format == ("torch-legacy" if legacy else "torch-zip")


def test_to_cuda_rewrites_every_tag_without_a_gpu(tmp_path: Path) -> None:
    src = tmp_path / "m.pth"
    dp_checkpoint(src, tag="cpu")
    assert main(["fix", str(src), "--to", "cuda:0", "-o", str(tmp_path / "o.pth")]) == 0
    out = ckptool.open(tmp_path / "o.pth")
    assert set(out.bytes_by_location) == {"cuda:0"}
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(tmp_path / "o.pth", weights_only=False)  # as on any CPU-only machine
    moved = torch.load(tmp_path / "o.pth", map_location="cpu", weights_only=False)
    assert torch.equal(moved["optimizer"]["state"][0]["m"], torch.ones(3))


def test_map_moves_only_the_named_tag(tmp_path: Path) -> None:
    src = tmp_path / "m.pth"
    with saved_on("cuda:2"):
        torch.save({"a": torch.ones(2)}, tmp_path / "a.pth")
    # one file with two tags: write each half under its own tag, then merge
    tags = iter(["cuda:2", "cuda:1"])
    original = torch.serialization.location_tag
    torch.serialization.location_tag = lambda s: next(tags)  # type: ignore[assignment]
    try:
        torch.save({"a": torch.ones(2), "b": torch.zeros(3)}, src)
    finally:
        torch.serialization.location_tag = original
    out = tmp_path / "o.pth"
    assert main(["fix", str(src), "--map", "cuda:2=cpu", "-o", str(out)]) == 0
    by_key = {t.key: t.location for t in ckptool.open(out).tensors}
    assert by_key == {"a": "cpu", "b": "cuda:1"}


def test_extract_lightning_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "weights.pth"
    assert main(["fix", str(SAMPLES / "lightning.ckpt"), "--extract", "--strip-module",
                 "-o", str(out)]) == 0
    sd = torch.load(out, weights_only=True)
    strict_load(sd)
    assert isinstance(sd, dict) and "epoch" not in sd


def test_extract_named_path_and_drop(tmp_path: Path) -> None:
    src = tmp_path / "m.pth"
    dp_checkpoint(src, tag="cpu")
    out = tmp_path / "o.pth"
    assert main(["fix", str(src), "--drop", "optimizer", "--drop", "args", "-o", str(out)]) == 0
    assert sorted(load(out)) == ["epoch", "state_dict"]
    only = tmp_path / "only.pth"
    assert main(["fix", str(src), "--extract", "optimizer/state/0", "-o", str(only)]) == 0
    assert list(torch.load(only, weights_only=True)) == ["m"]


def test_strip_add_prefix_and_rename(tmp_path: Path) -> None:
    src = tmp_path / "m.pth"
    dp_checkpoint(src, tag="cpu")
    out = tmp_path / "o.pth"
    assert main(["fix", str(src), "--strip-prefix", "module.", "--rename", r"^fc\.=head.",
                 "--add-prefix", "net.", "-o", str(out)]) == 0
    keys = list(load(out)["state_dict"])
    assert keys[0] == "net.conv.weight" and "net.head.weight" in keys


def test_dtype_casts_floating_tensors_only(tmp_path: Path) -> None:
    src = tmp_path / "m.pth"
    want = dp_checkpoint(src, tag="cpu")
    out = tmp_path / "o.pth"
    assert main(["fix", str(src), "--strip-module", "--dtype", "bf16", "-o", str(out)]) == 0
    sd = load(out)["state_dict"]
    for k, v in want.items():
        expected = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert sd[k].dtype == expected.dtype and torch.equal(sd[k], expected), k


def test_views_tied_weights_and_odd_dtypes_survive(tmp_path: Path) -> None:
    base = torch.arange(24.0).reshape(4, 6)
    tensors = {"base": base, "row": base[1], "t": base.t(), "tied": base,
               "f8": torch.zeros(4, dtype=torch.float8_e4m3fn), "u16": torch.arange(3).to(
                   torch.uint16), "bf": torch.ones(2, dtype=torch.bfloat16)}
    src = tmp_path / "m.pth"
    with saved_on("cuda:1"):
        torch.save(tensors, src)
    out = tmp_path / "o.pth"
    assert main(["fix", str(src), "--to", "cpu", "--add-prefix", "x.", "-o", str(out)]) == 0
    got = torch.load(out, weights_only=True)
    for k, v in tensors.items():
        assert torch.equal(got[f"x.{k}"].float(), v.float()), k
        assert got[f"x.{k}"].stride() == v.stride()
    ptr = got["x.base"].untyped_storage().data_ptr()
    assert got["x.row"].untyped_storage().data_ptr() == ptr
    assert got["x.tied"].untyped_storage().data_ptr() == ptr


def test_unchanged_plan_reproduces_the_pickle_byte_for_byte(tmp_path: Path) -> None:
    for sample in ("dataparallel_cuda2.pth", "lightning.ckpt", "whole_model_cuda1.pth",
                   "hostile_runs_code.pth"):
        with faithful():
            raw = dispatch.read(str(SAMPLES / sample))
        with zipfile.ZipFile(SAMPLES / sample) as zf:
            original = zf.read(f"{raw.metadata['archive_root']}/data.pkl")
        written = repickle.dumps(raw.root, lambda ref: tuple([*ref.pid]), judge=False)
        assert written == original, sample


def test_the_plain_value_shortcut_writes_the_same_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Repickler.save dispatches plain values at once; the generic path must
    give the same bytes, memo and batching included, for every sample and a
    tree with every plain kind."""
    shared = ("shared", 1)
    odd = {"ints": [0, 1, 255, 256, 65535, 65536, -1, 2**31, -(2**31) - 1, 2**64, -(2**70)],
           "floats": [0.0, -1.5, float("inf"), 1e-300], "text": ["", "é", "\u2603", "x" * 300],
           "bytes": [b"", b"\x00\xff" * 200], "flags": [True, False, None],
           "big": list(range(2500)), "wide": {f"k{i}": i for i in range(2500)},
           "nested": ((), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), [[[]]], {}),
           "again": [shared, shared, [shared]], "w": torch.ones(3)}
    path = tmp_path / "odd.pth"
    torch.save(odd, path)
    files = [path, *(SAMPLES / s for s in ("dataparallel_cuda2.pth", "lightning.ckpt",
                                            "whole_model_cuda1.pth", "hostile_runs_code.pth"))]
    for file in files:
        with faithful():
            raw = dispatch.read(str(file))
        fast = repickle.dumps(raw.root, lambda ref: tuple([*ref.pid]), judge=False)
        monkeypatch.setattr(repickle.Repickler, "plain_shortcut", False)
        slow = repickle.dumps(raw.root, lambda ref: tuple([*ref.pid]), judge=False)
        monkeypatch.setattr(repickle.Repickler, "plain_shortcut", True)
        assert fast == slow, file.name
    with zipfile.ZipFile(path) as zf:
        assert fast != b"" and zf.read("odd/data.pkl") == repickle.dumps(
            formats_read_faithful(path).root, lambda ref: tuple([*ref.pid]), judge=False)


def formats_read_faithful(path: Path) -> Any:
    with faithful():
        return dispatch.read(str(path))


def test_bytes_and_other_plain_values_survive_a_fix(tmp_path: Path) -> None:
    """At protocol 2 torch writes bytes as codecs.encode(...): the faithful read
    keeps that call (a stand-in), and the rewrite writes it back."""
    src, out = tmp_path / "m.pth", tmp_path / "o.pth"
    entries = {"blob": b"\x00\x01binary", "big": 2**70, "pi": 3.25, "name": "é", "none": None}
    torch.save({"state_dict": {"module.w": torch.ones(2)}, **entries}, src)
    assert main(["fix", str(src), "--strip-module", "-o", str(out), "-q"]) == 0
    got = torch.load(out, weights_only=False)
    assert {k: got[k] for k in entries} == entries
    assert torch.equal(got["state_dict"]["w"], torch.ones(2))


def test_output_loads_with_weights_only_and_mmap(tmp_path: Path) -> None:
    src = tmp_path / "m.pth"
    dp_checkpoint(src, tag="cuda:3")
    out = tmp_path / "o.pth"
    assert main(["fix", str(src), "--extract", "--strip-module", "--to", "cpu",
                 "-o", str(out)]) == 0
    for kwargs in ({}, {"mmap": True}):
        strict_load(torch.load(out, weights_only=True, **kwargs))


def test_dry_run_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")
    src = tmp_path / "m.pth"
    dp_checkpoint(src)
    assert main(["fix", str(src), "--strip-module", "--to", "cpu", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "(dry run: nothing written)" in out
    assert "module.conv.weight → conv.weight" in out
    assert "10 storages cuda:2 → cpu" in out
    assert f"would write {tmp_path / 'm.fixed.pth'}" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pth"]


def test_json_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "m.pth"
    dp_checkpoint(src)
    assert main(["fix", str(src), "--strip-module", "--to", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["dry_run"] is False and data["output"].endswith("m.fixed.pth")
    assert data["renamed"][0] == {"from": "module.conv.weight", "to": "conv.weight"}
    assert data["devices"] == [{"from": "cuda:2", "to": "cpu", "storages": 10}]
    assert data["verified_storages"] == 10


def test_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    src = tmp_path / "m.pth"
    dp_checkpoint(src)
    out = tmp_path / "o.pth"
    out.write_bytes(b"keep me")
    assert main(["fix", str(src), "--to", "cpu", "-o", str(out)]) == 2
    assert out.read_bytes() == b"keep me"
    assert main(["fix", str(src), "--to", "cpu", "-o", str(out), "--force"]) == 0
    assert ckptool.open(out).locations == ["cpu"]


def test_in_place_metadata_only(tmp_path: Path) -> None:
    src = tmp_path / "m.pth"
    want = dp_checkpoint(src)
    size = src.stat().st_size
    assert main(["fix", str(src), "--strip-module", "--to", "cpu", "--in-place", "-q"]) == 0
    fixed = load(src)
    strict_load(fixed["state_dict"])
    assert all(torch.equal(fixed["state_dict"][k], v) for k, v in want.items())
    assert src.stat().st_size < size * 2  # appended a pickle, not a copy
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pth"]


def test_in_place_with_a_cast_rewrites_atomically(tmp_path: Path) -> None:
    src = tmp_path / "m.pth"
    dp_checkpoint(src, tag="cpu")
    assert main(["fix", str(src), "--dtype", "fp16", "--in-place", "-q"]) == 0
    assert load(src)["state_dict"]["module.conv.weight"].dtype == torch.float16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pth"]


def test_unsafe_globals_are_refused_unless_removed(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A flagged file is written from only with --salvage, and then only
    without what it flags (a salvaged output is re-read and must be clean)."""
    out = tmp_path / "o.pth"
    hostile = str(SAMPLES / "hostile_runs_code.pth")
    for args in (["-o", str(out)], ["--drop", "callback", "-o", str(out)],
                 ["--salvage", "-o", str(out)]):
        assert main(["fix", hostile, *args]) == 3, args
        assert "posix.system" in capsys.readouterr().err
        assert not out.exists() and list(tmp_path.iterdir()) == []
    assert main(["fix", hostile, "--drop", "callback", "--salvage", "-o", str(out)]) == 0
    assert ckptool.open(out).unsafe_globals == []


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--to", "cuda 0"], 2, "not a torch device"),
    (["--map", "cuda:2"], 2, "A=B"),
    (["--rename", "(=x"], 2, "bad --rename"),
    (["--drop", "nope"], 2, "no entry 'nope'"),
    (["--extract", "nope"], 2, "no entry 'nope'"),
    (["--in-place", "-o", "x.pth"], 2, "--in-place and -o"),
])
def test_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                     code: int, message: str) -> None:
    src = tmp_path / "m.pth"
    dp_checkpoint(src)
    assert main(["fix", str(src), *args]) == code
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pth"]


def test_whole_module_needs_extract_for_renames(tmp_path: Path) -> None:
    src = SAMPLES / "whole_model_cuda1.pth"
    out = tmp_path / "o.pth"
    assert main(["fix", str(src), "--add-prefix", "m.", "-o", str(out)]) == 2
    assert main(["fix", str(src), "--extract", "--to", "cpu", "-o", str(out)]) == 0
    sd = torch.load(out, weights_only=True)
    assert isinstance(sd, OrderedDict)
    strict_load({k: v.float() if v.is_floating_point() else v for k, v in sd.items()})


def test_safetensors_renames_drops_and_casts(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = tmp_path / "m.safetensors", tmp_path / "o.safetensors"
    tensors = {"module.w": torch.randn(3, 2), "module.b": torch.randn(3),
               "module.n": torch.tensor(4)}
    save_file(tensors, str(src), metadata={"note": "kept"})
    assert main(["fix", str(src), "--strip-module", "--drop", "module.b", "--dtype", "bf16",
                 "-o", str(out), "-q"]) == 0
    with safe_open(str(out), "pt") as f:
        assert sorted(f.keys()) == ["n", "w"] and f.metadata() == {"note": "kept"}
        assert torch.equal(f.get_tensor("w"), tensors["module.w"].to(torch.bfloat16))
        assert torch.equal(f.get_tensor("n"), tensors["module.n"])


def test_safetensors_has_no_device_to_retarget(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fix", str(SAMPLES / "tinynet.safetensors"), "--to", "cuda:0",
                 "-o", str(tmp_path / "o.safetensors")]) == 2
    assert "record no device" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["writer", "copy_thread"])
def test_disk_full_is_one_clean_error_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], where: str) -> None:
    from ckptool.write import copy
    from ckptool.write.fix import run as fix

    src = tmp_path / "m.pth"
    dp_checkpoint(src)

    def full(*args: Any) -> Any:
        raise OSError(28, "No space left on device")

    if where == "writer":
        monkeypatch.setattr(fix, "_finish_zip", full)
    else:  # the storage copy runs on its own thread: its error reaches the CLI
        monkeypatch.setattr(copy.Copier, "_pwrite", full)
        monkeypatch.setattr(copy, "copy_pieces", full)
    assert main(["fix", str(src), "--to", "cpu"]) == 3
    captured = capsys.readouterr()
    assert captured.out == ""
    assert disk_full_lines(captured.err, tmp_path / "m.fixed.pth",
                           "hint: free space on that filesystem, or write elsewhere (nothing "
                           "was left half-written)"), captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pth"]


def test_an_input_replaced_while_it_is_read_is_refused(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer re-saving the file (by rename) while fix reads it: the bytes of
    one version must not be written under the pickle of another."""
    from ckptool.read.formats import torch_zip
    from ckptool.write.fix import run as fix

    src, newer = tmp_path / "m.pth", tmp_path / "newer.pth"
    dp_checkpoint(src)
    dp_checkpoint(newer, tag="cuda:1")
    real = torch_zip.read_archive

    def read_then_replace(archive: Any) -> Any:
        raw = real(archive)
        if newer.exists():
            newer.replace(src)  # the new version lands after the read
        return raw

    monkeypatch.setattr(torch_zip, "read_archive", read_then_replace)
    with pytest.raises(ckptool.CkptoolError, match="changed while ckptool was reading it"):
        fix.fix(str(src), ckptool.FixOptions(strip_module=True, to="cpu"),
                    str(tmp_path / "o.pth"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pth"]
