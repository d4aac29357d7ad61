"""Every dtype and layout torch.save writes, end to end: listed right,
built by ckptool.load and load_state_dict as torch.load(weights_only=True)
builds them, written right where a format holds them, refused with a hint
that works where it does not. Nothing here is hostile: a jagged nested
tensor names torch's own NestedTensor and dynamo's _DimRange, which
weights_only allows."""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckptool
from ckptool.cli import main

warnings.filterwarnings("ignore", category=UserWarning)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.layout != b.layout or type(a) is not type(b):
        return False
    if b.is_quantized:
        return a.qscheme() == b.qscheme() and torch.equal(a.int_repr(), b.int_repr()) and \
            torch.equal(a.dequantize(), b.dequantize())
    if b.is_nested:
        return all(torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind(), strict=True))
    if b.layout != torch.strided:
        return torch.equal(a.to_dense(), b.to_dense())
    return a.shape == b.shape and torch.equal(  # bytes: float4 and complex32 have no equal
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(4, 6, generator=g)
    return {
        "complex128": torch.randn(2, 3, dtype=torch.complex128, generator=g),
        "complex64": torch.randn(3, dtype=torch.complex64, generator=g),
        "complex32": torch.randn(3, dtype=torch.complex64, generator=g).to(torch.complex32),
        "qint8": torch.quantize_per_tensor(dense, 0.05, 3, torch.qint8),
        "quint8_channel": torch.quantize_per_channel(
            dense, torch.tensor([0.1, 0.2, 0.05, 0.1]), torch.tensor([0, 1, 2, 3]), 0,
            torch.quint8),
        "float4": torch.randint(0, 255, (4, 3), dtype=torch.uint8, generator=g).view(
            torch.float4_e2m1fn_x2),
        "e4m3": dense.to(torch.float8_e4m3fn), "e5m2": dense.to(torch.float8_e5m2),
        "e8m0": dense.abs().to(torch.float8_e8m0fnu),
        "coo": dense.relu().to_sparse(), "csr": dense.relu().to_sparse_csr(),
        "csc": dense.relu().to_sparse_csc(),
        "nested": torch.nested.nested_tensor([torch.ones(2, 3), torch.zeros(4, 3)]),
        "jagged": torch.nested.nested_tensor([torch.ones(2, 3), torch.arange(12.).view(4, 3)],
                                             layout=torch.jagged),
        "plain": dense,
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dtypes") / "all.pth"
    torch.save(tensors(), path)
    return path


def test_listed_right_and_nothing_hostile(saved: Path) -> None:
    ckpt = ckptool.open(saved)
    by_key = {t.key: t for t in ckpt.tensors}
    assert {k: by_key[k].dtype for k in ("complex32", "float4", "e8m0", "qint8")} == {
        "complex32": "complex32", "float4": "float4_e2m1fn_x2", "e8m0": "float8_e8m0fnu",
        "qint8": "qint8"}
    assert by_key["float4"].shape == (4, 3) and by_key["float4"].nbytes == 12
    assert (by_key["jagged"].layout, by_key["jagged"].shape) == ("jagged", (2,))
    assert (by_key["nested"].layout, by_key["nested"].shape) == ("nested", (2,))
    assert by_key["csc"].layout == "sparse_csc"
    assert ckpt.unsafe_globals == [] and not [g for g in ckpt.globals if g.category == "custom"]
    assert not ckpt.warnings  # every storage is some tensor's (a part's)


@pytest.mark.parametrize("mmap", [True, False])
def test_load_builds_what_torch_load_builds(saved: Path, mmap: bool) -> None:
    mine = ckptool.load(saved, mmap=mmap)
    theirs = torch.load(saved, weights_only=True)
    assert mine.keys() == theirs.keys()
    for key in theirs:
        assert same(mine[key], theirs[key]), key


def test_load_state_dict_builds_them_too(saved: Path) -> None:
    mine = ckptool.load_state_dict(saved)
    theirs = torch.load(saved, weights_only=True)
    assert mine.keys() == theirs.keys()
    assert all(same(mine[k], theirs[k]) for k in theirs)


def test_safetensors_holds_float8_and_float4_as_safetensors_writes_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """F4 counts 4-bit elements (the last size doubled): the safetensors
    library reads the output back, and ckptool reads the library's files."""
    small = {k: v for k, v in tensors().items() if k in ("float4", "e4m3", "e5m2", "e8m0",
                                                         "complex64", "plain")}
    torch.save(small, tmp_path / "s.pth")
    assert main(["convert", str(tmp_path / "s.pth"), str(tmp_path / "s.safetensors")]) == 0
    capsys.readouterr()
    back = load_file(tmp_path / "s.safetensors")
    assert all(same(back[k], small[k]) for k in small)
    raw = (tmp_path / "s.safetensors").read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    assert header["float4"]["dtype"] == "F4" and header["float4"]["shape"] == [4, 6]
    save_file(small, tmp_path / "theirs.safetensors")
    mine = ckptool.load_state_dict(tmp_path / "theirs.safetensors")
    assert all(same(mine[k], small[k]) for k in small)


@pytest.mark.parametrize(("key", "hint"), [
    ("complex128", "torch.view_as_real"), ("complex32", "torch.view_as_real"),
    ("qint8", "t.dequantize()"),
])
def test_what_safetensors_cannot_hold_is_refused_with_a_hint_that_works(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, hint: str) -> None:
    torch.save({key: tensors()[key], "plain": torch.ones(2)}, tmp_path / "x.pth")
    code = main(["convert", str(tmp_path / "x.pth"), str(tmp_path / "x.safetensors")])
    err = capsys.readouterr().err
    assert code == 3 and key in err and hint in err and "--dtype" not in err
    assert "keep the torch file" in err and not (tmp_path / "x.safetensors").exists()
    # the torch file does hold it: ckptool.load builds it
    assert same(ckptool.load(tmp_path / "x.pth")[key], tensors()[key])


def test_a_bad_f4_entry_is_refused(tmp_path: Path) -> None:
    header = json.dumps({"f": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}).encode()
    (tmp_path / "odd.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0")
    with pytest.raises(ckptool.CkptoolError, match="odd last dimension"):
        ckptool.open(tmp_path / "odd.safetensors")




def test_a_quantizer_torch_refuses_is_an_error_not_a_crash(tmp_path: Path) -> None:
    """The quantizer's numbers come from the file: where torch's own
    rebuild refuses them, ckptool says so (never a bare ValueError)."""
    import pickle
    import zipfile

    path = tmp_path / "q.pt"
    torch.save({"q": torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)}, path)
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        records = {n: z.read(n) for n in names}
    pkl = next(n for n in names if n.endswith("data.pkl"))
    data = records[pkl]
    # the pickled per-tensor quantizer (scheme, 0.1, 0) loses its zero point:
    # BINFLOAT 0.1, BININT1 0, TUPLE3 becomes BINFLOAT 0.1, TUPLE2
    patched = data.replace(pickle.dumps(0.1, 2)[2:-1] + b"K\x00\x87", pickle.dumps(0.1, 2)[2:-1]
                           + b"\x86")
    assert patched != data
    records[pkl] = patched
    with zipfile.ZipFile(path, "w") as z:
        for n in names:
            z.writestr(n, records[n])
    for build in (ckptool.load, ckptool.load_state_dict):
        with pytest.raises(ckptool.CkptoolError, match="quantizer torch refuses"):
            build(path)
