"""The zip layer: ckptool's writer produces archives that zipfile and torch
accept (64-byte aligned payloads, ZIP64 when needed), and its reader agrees
with zipfile on every member."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch

from ckptool.read.ziparchive import ZipArchive, ZipError
from ckptool.write import zipwriter


def rewrite(src: Path, dst: Path) -> None:
    """Copy every record of ``src`` through ZipWriter, in chunks."""
    with zipfile.ZipFile(src) as zin, open(dst, "wb") as f:
        writer = zipwriter.ZipWriter(f)
        for info in zin.infolist():
            data = zin.read(info.filename)
            writer.write_record(info.filename, (data[i:i + 7] for i in range(0, len(data), 7)))
        writer.close()


def check_archive(path: Path) -> None:
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        assert zf.testzip() is None
        ours = ZipArchive(f, path.stat().st_size)
        assert list(ours.members) == zf.namelist()
        for info in zf.infolist():
            member = ours.members[info.filename]
            assert (member.size, member.crc, member.header_offset) == (
                info.file_size, info.CRC, info.header_offset)
            assert ours.data_offset(member) % zipwriter.ALIGNMENT == 0
            assert ours.read(info.filename, 1 << 20) == zf.read(info.filename)


def test_rewritten_torch_file_loads(tmp_path: Path) -> None:
    src, dst = tmp_path / "src.pth", tmp_path / "dst.pth"
    sd = {"w": torch.randn(5, 3), "b": torch.arange(7)}
    torch.save(sd, src)
    rewrite(src, dst)
    check_archive(dst)
    for kwargs in ({}, {"mmap": True}):
        loaded = torch.load(dst, weights_only=True, **kwargs)
        assert all(torch.equal(loaded[k], sd[k]) for k in sd)


def test_zip64_records_both_ways(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a 4 GiB record is too big for a test: lower the writer's limit so that
    # every size and offset takes the ZIP64 path the same way
    monkeypatch.setattr(zipwriter, "_LIMIT", 16)
    src, dst = tmp_path / "src.pth", tmp_path / "zip64.pth"
    sd = {"w": torch.randn(8)}
    torch.save(sd, src)
    rewrite(src, dst)
    raw = dst.read_bytes()
    assert b"PK\x06\x06" in raw and b"PK\x06\x07" in raw  # ZIP64 end records
    check_archive(dst)
    assert torch.equal(torch.load(dst, weights_only=True)["w"], sd["w"])


@pytest.mark.parametrize("cut", [0, 10, 100, -1])
def test_truncated_archive_is_an_error(tmp_path: Path, cut: int) -> None:
    src = tmp_path / "src.pth"
    torch.save({"w": torch.ones(3)}, src)
    data = src.read_bytes()[: cut if cut >= 0 else len(src.read_bytes()) + cut]
    with pytest.raises(ZipError):
        ZipArchive(io.BytesIO(data), len(data))
