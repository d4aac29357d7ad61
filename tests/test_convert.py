"""ckptool convert: torch <-> safetensors, nothing silently dropped, tied
weights surviving a round trip, every format of input."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import flip_record_byte, make_samples, saved_on
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import ckptool
from ckptool.cli import main
from ckptool.errors import OutputError

SAMPLES = Path(__file__).resolve().parent.parent / "samples"


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied weights: one storage, two names


def test_round_trip_keeps_tied_weights_and_loads_strictly(tmp_path: Path) -> None:
    model = Tied()
    src, st, back = tmp_path / "m.pth", tmp_path / "m.safetensors", tmp_path / "back.pth"
    with saved_on("cuda:1"):
        torch.save({"model": model.state_dict(), "epoch": 4}, src)
    assert main(["convert", str(src), str(st), "-q"]) == 0
    with safe_open(str(st), "pt") as f:
        assert sorted(f.keys()) == ["emb.weight"]  # written once
        meta = f.metadata()
    assert json.loads(meta["ckptool.aliases"]) == {"head.weight": "emb.weight"}
    assert json.loads(meta["ckptool.entries"]) == {"epoch": 4}
    assert main(["convert", str(st), str(back), "-q"]) == 0
    sd = torch.load(back, weights_only=True)
    fresh = Tied()
    assert str(fresh.load_state_dict(sd, strict=True)) == "<All keys matched successfully>"
    assert sd["emb.weight"].untyped_storage().data_ptr() == (
        sd["head.weight"].untyped_storage().data_ptr())
    assert torch.equal(sd["emb.weight"], model.emb.weight)


@pytest.mark.parametrize("sample", ["dataparallel_cuda2.pth", "legacy_compiled_ddp.pth",
                                    "tinynet_script.pt", "lightning.ckpt",
                                    "whole_model_cuda1.pth"])
def test_every_torch_format_converts(tmp_path: Path, sample: str) -> None:
    out = tmp_path / "out.safetensors"
    assert main(["convert", str(SAMPLES / sample), str(out), "-q"]) == 0
    got = load_file(str(out))
    source = ckptool.open(SAMPLES / sample).state_dict()
    assert sorted(got) == sorted(source)
    assert all(tuple(got[k].shape) == t.shape for k, t in source.items())


def test_views_and_odd_dtypes(tmp_path: Path) -> None:
    base = torch.arange(12.0).reshape(3, 4)
    sd = {"base": base, "row": base[1], "t": base.t(), "bf": torch.ones(2, dtype=torch.bfloat16),
          "f8": torch.zeros(3, dtype=torch.float8_e5m2), "u16": torch.arange(3).to(torch.uint16)}
    src, out = tmp_path / "v.pth", tmp_path / "v.safetensors"
    torch.save(sd, src)
    assert main(["convert", str(src), str(out), "-q"]) == 0
    got = load_file(str(out))
    for k, v in sd.items():
        assert torch.equal(got[k].float(), v.float()), k


def test_left_out_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dp.safetensors"
    assert main(["convert", str(SAMPLES / "dataparallel_cuda2.pth"), str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kept_entries"] == ["epoch", "optimizer/param_groups", "args"]
    assert data["left_out"] == [
        "6 tensors outside 'state_dict' (e.g. optimizer/state/0/momentum_buffer)"]
    meta = safe_open(str(out), "pt").metadata()
    assert json.loads(meta["ckptool.entries"])["args"] == {
        "arch": "tinynet", "lr": 0.1, "batch_size": 64}


def test_non_plain_entries_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, out = tmp_path / "m.pth", tmp_path / "m.safetensors"
    torch.save({"state_dict": make_samples.TinyNet().state_dict(),
                "when": argparse.Namespace(path=Path("/tmp"))}, src)
    assert main(["convert", str(src), str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["left_out"] == ["when (argparse.Namespace)"]


def test_safetensors_to_torch(tmp_path: Path) -> None:
    src, out = tmp_path / "w.safetensors", tmp_path / "w.pt"
    tensors = {"a": torch.randn(3, 2), "b": torch.zeros(4, dtype=torch.float8_e4m3fn)}
    save_file(tensors, str(src))
    assert main(["convert", str(src), str(out), "-q"]) == 0
    got = torch.load(out, weights_only=True, mmap=True)
    assert torch.equal(got["a"], tensors["a"]) and got["b"].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize(("args", "code", "message"), [
    (["samples/tinynet.safetensors", "x.safetensors"], 2, "already safetensors"),
    (["samples/lightning.ckpt", "x.pth"], 2, "already a torch checkpoint"),
    (["samples/lightning.ckpt", "x.onnx"], 2, "cannot tell the output format"),
    (["README.md", "x.safetensors"], 3, "not a checkpoint"),
])
def test_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                code: int, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(SAMPLES.parent)
    assert main(["convert", args[0], str(tmp_path / args[1])]) == code
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_force(tmp_path: Path) -> None:
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"mine")
    assert main(["convert", str(SAMPLES / "lightning.ckpt"), str(out)]) == 2
    assert out.read_bytes() == b"mine"
    assert main(["convert", str(SAMPLES / "lightning.ckpt"), str(out), "--force", "-q"]) == 0


def test_a_failed_conversion_leaves_no_threads(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The browser stays running after a failed write: no checker or reader
    thread may outlive the run."""
    import threading

    from ckptool.write import copy
    from ckptool.write.convert import run as convert

    src = tmp_path / "m.pth"
    torch.save({"a": torch.randn(100, 100), "b": torch.randn(50)}, src)

    def full(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(copy, "copy_pieces", full)
    monkeypatch.setattr(copy.Copier, "_pwrite", full)
    before = {t.name for t in threading.enumerate()}
    for _ in range(3):
        with pytest.raises(OutputError, match="no space left on device"):
            convert.convert(str(src), str(tmp_path / "o.safetensors"))
    leftover = [t.name for t in threading.enumerate()
                if t.name.startswith("ckptool-") and t.name not in before]
    assert not leftover, leftover
    assert {t.name for t in threading.enumerate()} <= before | {"MainThread"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pth"]


@pytest.mark.parametrize("args", [["--format", "dcp"], ["--dtype", "bf16"],
                                  ["--format", "hf-bin", "--dtype", "fp16"]])
def test_a_damaged_record_is_never_cast_or_rewritten_into_plausible_bytes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    """A copy is checked by the record's CRC as it is copied; a tensor made
    anew (cast, or handed to torch's DCP writer) is checked before."""
    src = tmp_path / "w.pt"
    torch.save({"a": torch.randn(64, 64), "b": torch.randn(64, 64)}, src)
    flip_record_byte(src, "w/data/1")
    out = tmp_path / ("out.safetensors" if args == ["--dtype", "bf16"] else "out")
    assert main(["convert", str(src), str(out), *args]) == 3
    err = capsys.readouterr().err
    assert "storage 1 of" in err and "does not match its own checksum" in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["w.pt"]
