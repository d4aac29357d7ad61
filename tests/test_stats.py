"""tensor_stats equals torch's own statistics of the loaded tensor, for every
dtype kind, NaN/Inf, views with offsets, 0-d, empty, expanded, and tensors
many chunks long; pieces stay bounded; cancelling stops it; unreadable
tensors are clear errors; importing ckptool.check.stats imports no torch."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import flatten
from safetensors.torch import save_file

import ckptool
from ckptool.check.stats import StatsCancelled, TensorStats, tensor_stats
from ckptool.errors import UnsupportedCheckpointError
from ckptool.model import TensorInfo
from ckptool.read.tensor_data import TensorData

NAN, INF = float("nan"), float("inf")
# dtypes the legacy (non-zip) format cannot save
ZIP_ONLY = ("f8", "f8_e5m2", "u16", "u64")
CHUNKS = [3, 1000, 1 << 22]


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(20, 30, generator=g)
    mixed = torch.randn(50, generator=g) * 4
    mixed[[3, 9, 17]] = NAN
    mixed[[5, 40]] = INF
    mixed[22] = -INF
    mixed[[0, 30]] = 0.0
    mixed[31] = -0.0
    bf16 = torch.randn(30, 40, generator=g).bfloat16()
    bf16[0, 0], bf16[7, 3] = INF, NAN
    fp16 = torch.randn(100, generator=g).half()
    fp16[50] = NAN
    c64 = torch.randn(40, dtype=torch.complex64, generator=g)
    c64[3] = torch.tensor(complex(NAN, 1.0))
    c64[4] = 0
    big = torch.randn(5000, 3, generator=g).double() * 10 + 3
    return {
        "mixed": mixed,
        "all_nan": torch.full((7,), NAN),
        "all_inf": torch.tensor([INF, -INF, INF]),
        "bf16": bf16,
        "fp16": fp16,
        "f64": torch.randn(6, 7, generator=g).double() * 1e6,
        "f8": torch.tensor([0.5, -2.0, 448.0, 0.0, NAN, 1.25]).to(torch.float8_e4m3fn),
        "f8_e5m2": torch.tensor([1.0, -3.0, INF, 0.0]).to(torch.float8_e5m2),
        "i64": torch.tensor([[2**40, -(2**50)], [0, 7], [-3, 123456789]]),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "i32": torch.randint(-1000, 1000, (12, 5), generator=g, dtype=torch.int32),
        "u8": torch.randint(0, 256, (300,), generator=g, dtype=torch.uint8),
        "u16": torch.tensor([1, 65535, 0], dtype=torch.uint16),
        "u64": torch.tensor([2**63 + 5, 3, 2**64 - 1], dtype=torch.uint64),
        "bool": torch.rand(40, generator=g) > 0.6,
        "c64": c64,
        "c128": torch.randn(5, 3, dtype=torch.complex128, generator=g),
        "base": base,
        "transposed": base.t(),  # non-contiguous view of base's storage
        "slice": base[3:, 5:20],  # storage offset 95, sharing base's storage
        "every_other": base[1::2, ::3],
        "scalar": torch.tensor(3.5),
        "scalar_int": torch.tensor(-7),
        "single": torch.tensor([2.5]),
        "empty": torch.zeros(0, 3),
        "expanded": torch.arange(4.0).expand(3, 4),  # stride (0, 1)
        "big": big,  # 15000 elements: many chunks at chunk_elems=1000
        "big_t": big.t(),
        "big_col": big[:, 1],  # stride 3
        "big_bf16": (torch.randn(70, 101, generator=g) * 3).bfloat16(),
    }


def expected(t: torch.Tensor) -> dict[str, Any]:
    """Every TensorStats field as torch computes it on the loaded tensor."""
    t = t.detach()
    numel = t.numel()
    integral = not (t.is_floating_point() or t.is_complex())
    wide = (t.to(torch.complex128).abs() if t.is_complex() else t.to(torch.float64)).reshape(-1)
    fin = wide[wide.isfinite()]
    out: dict[str, Any] = {
        "numel": numel, "finite": fin.numel(),
        "nan": int(wide.isnan().sum()),
        "posinf": int((wide == INF).sum()), "neginf": int((wide == -INF).sum()),
        "zeros": int((wide == 0).sum()),
        "mean": float(fin.mean()) if fin.numel() else None,
        "std": float(fin.std()) if fin.numel() > 1 else None,  # unbiased, torch's default
    }
    out["inf"] = out["posinf"] + out["neginf"]
    if integral and numel:
        ints = [int(x) for x in t.reshape(-1).tolist()]
        out["min"], out["max"] = min(ints), max(ints)
    else:
        out["min"] = float(fin.min()) if fin.numel() else None
        out["max"] = float(fin.max()) if fin.numel() else None
    if numel == 0:
        out["note"] = "empty tensor"
    elif t.dtype == torch.bool:
        out["note"] = f"bool: {int(t.sum())} true of {numel}"
    elif t.is_complex():
        out["note"] = "complex: statistics of the magnitude |z|"
    elif not fin.numel():
        out["note"] = "no finite value"
    else:
        out["note"] = None
    return out


def check(ours: TensorStats, theirs: torch.Tensor, key: str) -> None:
    want = expected(theirs)
    for name, value in want.items():
        got = getattr(ours, name)
        if name in ("mean", "std") and value is not None:
            assert got is not None and math.isclose(got, value, rel_tol=1e-9, abs_tol=1e-12), (
                key, name, got, value)
        else:
            assert got == value, (key, name, got, value)
        if name in ("min", "max") and value is not None:
            assert type(got) is type(value), (key, name, got)


def check_file(path: Path, chunk: int) -> ckptool.Checkpoint:
    ckpt = ckptool.open(path)
    theirs = flatten(torch.load(path, weights_only=True)) if ckpt.format != "safetensors" \
        else _load_safetensors(path)
    assert {t.key for t in ckpt.tensors} == set(theirs)
    with TensorData(ckpt) as data:
        for t in ckpt.tensors:
            check(tensor_stats(data, t, chunk_elems=chunk), theirs[t.key], t.key)
    return ckpt


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_zip_stats_match_torch(tmp_path: Path, chunk: int) -> None:
    path = tmp_path / "s.pth"
    torch.save(state(), path)
    ckpt = check_file(path, chunk)
    info = {t.key: t for t in ckpt.tensors}
    # the views really are views: shared storage, an offset, a transposed stride
    assert info["slice"].storage == info["base"].storage == info["transposed"].storage
    assert info["slice"].storage_offset == 3 * 30 + 5
    assert info["transposed"].stride == (1, 30)
    assert info["expanded"].stride == (0, 1)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_legacy_stats_match_torch(tmp_path: Path, chunk: int) -> None:
    path = tmp_path / "legacy.pth"
    torch.save({k: v for k, v in state().items() if k not in ZIP_ONLY}, path,
               _use_new_zipfile_serialization=False)
    assert check_file(path, chunk).format == "torch-legacy"


@pytest.mark.parametrize("chunk", [7, 1 << 22])
def test_safetensors_stats_match_torch(tmp_path: Path, chunk: int) -> None:
    path = tmp_path / "s.safetensors"
    keep = ("mixed", "bf16", "fp16", "f8", "i64", "u8", "bool", "c64", "big", "scalar",
            "empty", "all_nan")
    save_file({k: v.contiguous() for k, v in state().items() if k in keep}, path)
    assert check_file(path, chunk).format == "safetensors"


def test_stats_do_not_depend_on_chunking(tmp_path: Path) -> None:
    path = tmp_path / "s.pth"
    torch.save({"big": torch.randn(10_000, dtype=torch.float64) * 1e3 + 1e6}, path)
    ckpt = ckptool.open(path)
    with TensorData(ckpt) as data:
        results = [tensor_stats(data, ckpt.tensors[0], chunk_elems=c) for c in (1, 97, 10_000)]
    for r in results[1:]:
        assert (r.min, r.max, r.finite) == (results[0].min, results[0].max, results[0].finite)
        assert r.mean is not None and r.std is not None
        assert math.isclose(r.mean, results[0].mean or 0, rel_tol=1e-12)
        assert math.isclose(r.std, results[0].std or 0, rel_tol=1e-9)


class Spy(TensorData):
    """Records every piece read: (elements, storage elements spanned)."""

    def __init__(self, ckpt: ckptool.Checkpoint) -> None:
        super().__init__(ckpt)
        self.reads: list[tuple[int, int]] = []

    def values(self, tensor: TensorInfo) -> torch.Tensor:
        assert tensor.stride is not None
        span = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride, strict=True)) + 1
        self.reads.append((tensor.numel, span))
        return super().values(tensor)


@pytest.mark.parametrize("key", ["big", "big_t", "big_col", "big_bf16", "transposed",
                                 "every_other"])
def test_pieces_are_bounded_by_the_chunk(tmp_path: Path, key: str) -> None:
    path = tmp_path / "s.pth"
    torch.save(state(), path)
    ckpt = ckptool.open(path)
    tensor = next(t for t in ckpt.tensors if t.key == key)
    chunk = 1000 if key.startswith("big") else 37
    data = Spy(ckpt)
    with data:
        tensor_stats(data, tensor, chunk_elems=chunk)
    itemsize = torch.empty(0, dtype=getattr(torch, tensor.dtype)).element_size()
    assert sum(n for n, _ in data.reads) == tensor.numel
    assert all(n <= chunk and span * itemsize <= max(chunk * itemsize, chunk * 8)
               for n, span in data.reads), data.reads
    if key.startswith("big"):
        assert len(data.reads) >= tensor.numel // chunk  # many chunks really combined
        # contiguous-in-storage tensors are read in full chunks, not row by row
        assert len(data.reads) <= -(-tensor.numel * (3 if key == "big_col" else 1) // chunk) + 1


def test_cancelled_stops_between_chunks(tmp_path: Path) -> None:
    path = tmp_path / "s.pth"
    torch.save({"big": torch.randn(10_000)}, path)
    ckpt = ckptool.open(path)
    calls = 0

    def cancelled() -> bool:
        nonlocal calls
        calls += 1
        return calls > 3

    data = Spy(ckpt)
    with data:
        with pytest.raises(StatsCancelled):
            tensor_stats(data, ckpt.tensors[0], chunk_elems=1000, cancelled=cancelled)
        assert len(data.reads) == 3 and calls == 4
        # never cancelled: polled once per chunk
        calls = -1000
        stats = tensor_stats(data, ckpt.tensors[0], chunk_elems=1000, cancelled=cancelled)
        assert stats.finite == 10_000 and calls == -990


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_unreadable_tensors_are_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "odd.pth"
    torch.save({"meta": torch.empty(3, device="meta"),
                "q": torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8),
                "f4": torch.zeros(3, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}, path)
    ckpt = ckptool.open(path)
    why = {"meta": "meta tensor", "q": "quantized", "f4": "float4_e2m1fn_x2"}
    with TensorData(ckpt) as data:
        for t in ckpt.tensors:
            with pytest.raises(UnsupportedCheckpointError) as err:
                tensor_stats(data, t)
            assert why[t.key] in err.value.message and err.value.hint, t.key


def test_chunk_elems_must_be_positive(tmp_path: Path) -> None:
    path = tmp_path / "s.pth"
    torch.save({"x": torch.ones(3)}, path)
    ckpt = ckptool.open(path)
    with TensorData(ckpt) as data, pytest.raises(ValueError):
        tensor_stats(data, ckpt.tensors[0], chunk_elems=0)


def test_importing_stats_does_not_import_torch() -> None:
    code = ("import json, sys\nimport ckptool.check.stats\n"
            "print(json.dumps('torch' in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert json.loads(out.splitlines()[-1]) is False
