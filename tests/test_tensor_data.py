"""Tensor bytes read by ckptool equal what torch.load gives: every format,
views with offsets, non-contiguous tensors, tied weights, many dtypes, big
endian archives; and every unreadable case is a clear error."""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import flatten, make_samples, saved_on
from safetensors.torch import save_file

import ckptool
from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.read.tensor_data import TensorData, iter_storage_chunks, read_storage, tensor_values

SAMPLES = Path(__file__).resolve().parent.parent / "samples"


# dtypes torch saves as untyped storages, which the legacy format cannot load
NEWER_DTYPES = ("f8", "f8_e5m2", "u16")


def rich_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 5, generator=g)
    tied = torch.randn(3, 2, generator=g)
    return {
        "f32": base,
        "view": base[1:, 2:],  # offset 7, strides (5, 1)
        "transposed": base.t(),  # non-contiguous view of the same storage
        "every_other": torch.arange(10.0)[::2],
        "tied_a": tied, "tied_b": tied,
        "bf16": torch.randn(3, 4, generator=g).bfloat16(),
        "fp16": torch.randn(5, generator=g).half(),
        "f64": torch.randn(2, 2, generator=g).double(),
        "f8": torch.tensor([0.5, -2.0, 448.0, 0.0]).to(torch.float8_e4m3fn),
        "f8_e5m2": torch.tensor([1.0, -3.0]).to(torch.float8_e5m2),
        "c64": torch.randn(3, dtype=torch.complex64, generator=g),
        "c128": torch.randn(2, 2, dtype=torch.complex128, generator=g),
        "bool": torch.tensor([True, False, True]),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 200, 255], dtype=torch.uint8),
        "i32": torch.tensor([[1, -2], [3, -4]], dtype=torch.int32),
        "i64": torch.tensor(2**40),  # a scalar
        "u16": torch.tensor([1, 65535], dtype=torch.uint16),
        "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
        "empty": torch.zeros(0, 3),
    }


def same(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Same dtype, shape, stride and bytes (NaN payloads included)."""
    theirs = theirs.detach()
    if (ours.dtype, ours.shape) != (theirs.dtype, theirs.shape):
        return False
    if ours.numel() and ours.stride() != theirs.stride():
        return False
    as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in (ours, theirs)]
    return torch.equal(*as_bytes)


def check_all_values(path: Path, theirs: dict[str, torch.Tensor]) -> ckptool.Checkpoint:
    ckpt = ckptool.open(path)
    assert {t.key for t in ckpt.tensors} == set(theirs)
    with TensorData(ckpt) as data:
        for t in ckpt.tensors:
            assert same(data.values(t), theirs[t.key]), t.key
    return ckpt


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_torch_save_values_match_torch_load(tmp_path: Path, zip_format: bool) -> None:
    path = tmp_path / "rich.pth"
    state = {k: v for k, v in rich_state().items() if zip_format or k not in NEWER_DTYPES}
    with saved_on("cuda:3"):  # the saved device does not matter for reading bytes
        torch.save(state, path, _use_new_zipfile_serialization=zip_format)
    theirs = flatten(torch.load(path, map_location="cpu"))
    ckpt = check_all_values(path, theirs)
    assert ckpt.locations == ["cuda:3"]
    by_key = {t.key: t for t in ckpt.tensors}
    assert by_key["view"].storage_offset == 7 and by_key["view"].storage == by_key["f32"].storage


def test_safetensors_values_match(tmp_path: Path) -> None:
    state = {k: v.contiguous() for k, v in rich_state().items()
             if k not in ("view", "transposed", "tied_b", "c128", "c64")}
    path = tmp_path / "rich.safetensors"
    save_file(state, str(path))
    check_all_values(path, state)


def test_torchscript_and_samples_match(tmp_path: Path) -> None:
    script = SAMPLES / "tinynet_script.pt"
    check_all_values(script, flatten(torch.jit.load(str(script), map_location="cpu")))
    make_samples.attribute_dict_class()  # lightning.ckpt pickles one; torch must import it
    for name in ("dataparallel_cuda2.pth", "lightning.ckpt", "finetuned_v2.pth"):
        path = SAMPLES / name
        check_all_values(path, flatten(torch.load(path, map_location="cpu", weights_only=False)))


def test_storage_bytes_and_chunks(tmp_path: Path) -> None:
    path = tmp_path / "s.pth"
    x = torch.arange(1000, dtype=torch.float32)
    torch.save({"x": x, "alone": torch.arange(5, dtype=torch.int16).untyped_storage()}, path)
    ckpt = ckptool.open(path)
    sid = next(t.storage for t in ckpt.tensors if t.key == "x")
    assert sid is not None
    whole = read_storage(path, ckpt, sid)
    assert whole == x.numpy().tobytes()
    chunks = list(iter_storage_chunks(path, ckpt, sid, chunk_size=999))
    assert [len(c) for c in chunks] == [999] * 4 + [4]
    assert b"".join(chunks) == whole
    alone = next(t for t in ckpt.tensors if t.key == "alone")
    assert alone.layout == "storage"  # a storage saved on its own: its bytes
    expected = torch.arange(5, dtype=torch.int16).numpy().tobytes()
    assert tensor_values(path, ckpt, alone).numpy().tobytes() == expected


def rewrite_zip(src: Path, dst: Path, data: Callable[[str, bytes], bytes] | None = None,
                byteorder: str | None = None, compress_data: bool = False) -> None:
    """Copy a torch zip record by record, transforming data records and byteorder."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            raw = zin.read(info)
            is_data = "/data/" in info.filename
            if is_data and data is not None:
                raw = data(info.filename, raw)
            if info.filename.endswith("/byteorder") and byteorder:
                raw = byteorder.encode()
            method = zipfile.ZIP_DEFLATED if is_data and compress_data else zipfile.ZIP_STORED
            zout.writestr(info.filename, raw, compress_type=method)


def test_big_endian_archive_is_byteswapped(tmp_path: Path) -> None:
    state = {"f32": torch.randn(3, 2), "c64": torch.randn(2, dtype=torch.complex64),
             "i16": torch.tensor([1, -2, 300], dtype=torch.int16), "u8": torch.arange(4).byte(),
             "bf16": torch.randn(5).bfloat16()}
    little = tmp_path / "little.pth"
    torch.save(state, little)
    # byte-swap unit of each record: the element, or each half of a complex
    units = {s.record: 4 if s.dtype == "complex64" else getattr(torch, s.dtype).itemsize
             for s in ckptool.open(little).storages.values()}

    def swap(name: str, raw: bytes) -> bytes:
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return t.view(-1, units[name]).flip(1).numpy().tobytes()

    big = tmp_path / "big.pth"
    rewrite_zip(little, big, data=swap, byteorder="big")
    assert ckptool.open(big).metadata["byteorder"] == "big"
    theirs = flatten(torch.load(big))  # torch swaps back on load: the file is right
    for key, value in state.items():
        assert torch.equal(theirs[key], value), key
    check_all_values(big, theirs)


def test_unreadable_cases_are_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "odd.pth"
    q = torch.quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.5, 0, torch.qint8)
    torch.save({"meta": torch.empty(3, device="meta"), "q": q, "ok": torch.ones(2)}, path)
    ckpt = ckptool.open(path)
    by_key = {t.key: t for t in ckpt.tensors}
    with TensorData(ckpt) as data:
        with pytest.raises(UnsupportedCheckpointError, match="meta tensor"):
            data.values(by_key["meta"])
        with pytest.raises(UnsupportedCheckpointError, match="quantized"):
            data.values(by_key["q"])
        assert torch.equal(data.values(by_key["ok"]), torch.ones(2))

    # a plain pickle's storages are read where the pickle holds their bytes;
    # protocols 0 to 2 spell bytes as text, which lies nowhere as it is
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps({"w": torch.ones(2)}, protocol=2))
    ck = ckptool.open(plain)
    with pytest.raises(UnsupportedCheckpointError, match="protocols 0 to 2"):
        tensor_values(plain, ck, ck.tensors[0])

    deflated = tmp_path / "deflated.pth"
    torch.save({"w": torch.zeros(1000)}, tmp_path / "src.pth")
    rewrite_zip(tmp_path / "src.pth", deflated, compress_data=True)
    ck = ckptool.open(deflated)
    with pytest.raises(UnsupportedCheckpointError, match="compressed"):
        tensor_values(deflated, ck, ck.tensors[0])


def test_file_changed_since_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.pth"
    torch.save({"w": torch.ones(4)}, path)
    ckpt = ckptool.open(path)
    with open(path, "ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(CorruptCheckpointError, match="changed since it was read"):
        tensor_values(path, ckpt, ckpt.tensors[0])
