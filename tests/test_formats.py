"""Each format, read by ckptool, against what torch itself loads from the
same file: keys, shapes, dtypes, strides, offsets, storage sharing and
saved location tags."""

from __future__ import annotations

import argparse
import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import check_against_torch, saved_on
from safetensors.torch import save_file
from torch import nn

import ckptool


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.conv(x)).mean((2, 3)))


def odd_tensors() -> dict[str, Any]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    out: dict[str, Any] = {
        "base": base,
        "view_row": base[1],  # offset view into the same storage
        "transposed": base.t(),  # non-contiguous
        "tied": base,  # same tensor twice
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        "fp16": torch.ones(2, 2, dtype=torch.float16),
        "f8e4m3": torch.zeros(5, dtype=torch.float8_e4m3fn),
        "f8e5m2": torch.zeros(5, dtype=torch.float8_e5m2),
        "c64": torch.zeros(2, dtype=torch.complex64),
        "c128": torch.zeros(2, dtype=torch.complex128),
        "bool": torch.tensor([True, False]),
        "i8": torch.zeros(3, dtype=torch.int8),
        "u16": torch.zeros(3, dtype=torch.uint16),
        "u32": torch.zeros(3, dtype=torch.uint32),
        "u64": torch.zeros(3, dtype=torch.uint64),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
        "param": nn.Parameter(torch.ones(2)),
        "qint8": torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8),
    }
    return out


def test_zip_odd_dtypes_views_and_sharing(tmp_path: Path) -> None:
    path = tmp_path / "odd.pth"
    torch.save(odd_tensors(), path)
    ckpt = check_against_torch(path)
    assert ckpt.format == "torch-zip"
    by_key = {t.key: t for t in ckpt.tensors}
    assert by_key["param"].is_parameter
    assert by_key["qint8"].layout == "quantized"
    assert by_key["view_row"].storage == by_key["base"].storage
    assert by_key["view_row"].storage_offset == 6


@pytest.mark.parametrize("name", ["my.model.v2.pth", "epoch27_val0.93.pt", "noext"])
def test_zip_root_folder_is_taken_from_the_file(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    torch.save({"w": torch.ones(2)}, path)
    ckpt = check_against_torch(path)
    assert ckpt.metadata["archive_root"] == zipfile.ZipFile(path).namelist()[0].split("/")[0]


def test_zip_saved_to_buffer_has_archive_root(tmp_path: Path) -> None:
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    path = tmp_path / "buf.bin"
    path.write_bytes(buf.getvalue())
    ckpt = check_against_torch(path)
    assert ckpt.metadata["archive_root"] == "archive"


def test_zip64_records(tmp_path: Path) -> None:
    src = tmp_path / "src.pth"
    torch.save({"w": torch.arange(10.0)}, src)
    path = tmp_path / "zip64.pth"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            with zout.open(info.filename, "w", force_zip64=True) as f:
                f.write(zin.read(info.filename))
    check_against_torch(path)


def test_old_record_set_without_format_version(tmp_path: Path) -> None:
    src = tmp_path / "src.pth"
    torch.save({"w": torch.ones(3)}, src)
    path = tmp_path / "old.pth"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            inner = info.filename.split("/", 1)[1]
            if inner in ("data.pkl", "version") or inner.startswith("data/"):
                zout.writestr(info.filename.replace("src/", "archive/"), zin.read(info.filename))
    ckpt = check_against_torch(path)
    assert ckpt.metadata["archive_root"] == "archive"


@pytest.mark.parametrize("tag", ["cpu", "cuda:2", "cuda:7", "mps", "xpu:1"])
def test_location_tags(tmp_path: Path, tag: str) -> None:
    path = tmp_path / "tagged.pth"
    with saved_on(tag):
        torch.save({"a": torch.ones(2), "b": torch.zeros(3, dtype=torch.int64)}, path)
    ckpt = ckptool.open(path)
    assert {t.location for t in ckpt.tensors} == {tag}
    assert ckpt.bytes_by_location == {tag: 8 + 24}


def test_legacy_format(tmp_path: Path) -> None:
    path = tmp_path / "legacy.pth"
    # torch itself cannot load untyped-storage dtypes (float8, uint16...) from
    # legacy files, so compare on the dtypes it round-trips
    tensors = {k: v for k, v in odd_tensors().items() if "8e" not in k and k[0] != "u"}
    with saved_on("cuda:1"):
        torch.save(tensors | {"nested": [{"x": torch.ones(1)}]}, path,
                   _use_new_zipfile_serialization=False)
    ckpt = check_against_torch(path)
    assert ckpt.format == "torch-legacy"
    assert {s.location for s in ckpt.storages.values()} == {"cuda:1"}


def test_torchscript_parameters_and_buffers(tmp_path: Path) -> None:
    path = tmp_path / "script.pt"
    torch.jit.script(Small()).save(str(path))
    ckpt = check_against_torch(path, script=True)
    assert ckpt.format == "torchscript"
    sd = ckpt.main_state_dict
    assert sd is not None and sd.kind == "module"
    assert set(sd.keys) == set(Small().state_dict())


def test_pickled_module_lists_its_state_dict(tmp_path: Path) -> None:
    model = Small()
    model.register_buffer("scratch", torch.ones(1), persistent=False)
    path = tmp_path / "whole.pth"
    with saved_on("cuda:1"):
        torch.save({"model": model, "epoch": 2}, path)
    ckpt = ckptool.open(path)
    sd = ckpt.main_state_dict
    assert sd is not None and sd.path == "model" and sd.kind == "module"
    assert list(sd.keys) == list(Small().state_dict())  # state_dict order, no "scratch"
    assert any(g.name.endswith("Small") and g.category == "custom" for g in ckpt.globals)


def test_safetensors_header_only(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    tensors = {"a": torch.ones(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16),
               "c": torch.zeros(2, dtype=torch.float8_e5m2)}
    save_file(tensors, str(path), metadata={"note": "hi"})
    ckpt = ckptool.open(path)
    assert ckpt.format == "safetensors"
    assert {t.key: (t.shape, t.dtype) for t in ckpt.tensors} == {
        "a": ((2, 3), "float32"), "b": ((4,), "bfloat16"), "c": ((2,), "float8_e5m2")}
    assert all(t.location is None for t in ckpt.tensors)
    assert ckpt.metadata["metadata"] == {"note": "hi"}


def test_plain_pickle_of_tensors_and_numpy(tmp_path: Path) -> None:
    path = tmp_path / "plain.pkl"
    with saved_on("cuda:3"):
        path.write_bytes(pickle.dumps({
            "w": torch.ones(2, 2), "arr": np.zeros((3, 4)), "step": np.int64(7),
        }, protocol=2))
    ckpt = ckptool.open(path)
    assert ckpt.format == "pickle"
    (w,) = ckpt.tensors
    assert (w.key, w.shape, w.dtype, w.location) == ("w", (2, 2), "float32", "cuda:3")
    entries = {e.key: e for e in ckpt.entries}
    assert entries["arr"].summary == "ndarray(3x4, f8)"
    assert entries["step"].value == 7


def test_checkpoint_with_wrappers_and_odd_values(tmp_path: Path) -> None:
    model = Small()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 2, 5, 5)).sum().backward()
    opt.step()
    path = tmp_path / "ckpt.pth"
    with saved_on("cuda:2"):
        torch.save({
            "epoch": 5, "best_acc": np.float64(0.91),
            "state_dict": {f"module.{k}": v for k, v in model.state_dict().items()},
            "optimizer": opt.state_dict(),
            "args": argparse.Namespace(lr=0.1, dims=[1, 2]),
            "sparse": torch.eye(3).to_sparse(),
        }, path)
    ckpt = ckptool.open(path)
    sd = ckpt.main_state_dict
    assert sd is not None and sd.path == "state_dict" and sd.prefix == "module."
    assert sd.num_tensors == len(model.state_dict())
    # as model.parameters() counts: the running statistics are buffers
    assert sd.num_parameters == sum(p.numel() for p in model.parameters())
    assert sd.num_buffers == sum(b.numel() for b in model.buffers())
    keys = {t.key for t in ckpt.tensors}
    assert "optimizer/state/0/exp_avg" in keys
    sparse = next(t for t in ckpt.tensors if t.key == "sparse")  # one tensor, its parts under it
    assert (sparse.layout, sparse.shape, sparse.nnz) == ("sparse_coo", (3, 3), 3)
    assert [p.key for p in sparse.parts] == ["sparse/indices", "sparse/values"]
    entries = {e.key: e for e in ckpt.entries}
    assert entries["epoch"].value == 5
    assert entries["best_acc"].value == pytest.approx(0.91)
    assert entries["args"].value == {"lr": 0.1, "dims": [1, 2]}
    assert ckpt.unsafe_globals == []


@pytest.mark.parametrize(("prefix", "wrapper"), [
    ("module.", "module."), ("_orig_mod.", "_orig_mod."),
    ("_orig_mod.module.", "_orig_mod.module."), ("module._orig_mod.", "module._orig_mod."),
    ("model.", "model."), ("base_model.model.", "base_model.model."),
    ("", ""), ("backbone.", ""),
])
def test_prefix_detection(tmp_path: Path, prefix: str, wrapper: str) -> None:
    path = tmp_path / "p.pth"
    torch.save({f"{prefix}{k}": v for k, v in Small().state_dict().items()}, path)
    sd = ckptool.open(path).main_state_dict
    assert sd is not None
    assert sd.prefix == wrapper
    assert sd.common_prefix == prefix


def test_main_state_dict_prefers_weights_over_ema_and_optimizer(tmp_path: Path) -> None:
    big = {f"l{i}.weight": torch.ones(10, 10) for i in range(3)}
    path = tmp_path / "c.pth"
    torch.save({"state_dict_ema": dict(big), "model": {"l0.weight": torch.ones(2)},
                "optimizer": {"state": {0: {"exp_avg": torch.ones(100, 100)}}}}, path)
    sd = ckptool.open(path).main_state_dict
    assert sd is not None and sd.path == "model"


def test_meta_tensors(tmp_path: Path) -> None:
    path = tmp_path / "meta.pth"
    torch.save({"w": torch.empty(3, 4, device="meta")}, path)
    (t,) = ckptool.open(path).tensors
    assert (t.shape, t.location, t.storage) == ((3, 4), "meta", None)
