"""``verify`` of a DCP directory whose ``.metadata`` is damaged (issue 35
item 12): deleted, it is the one problem, and the ``.distcp`` files are
still checked archive by archive (an intact one is whole: no false "bad
ZIP64 end record"; a flipped byte or a cut in one is found in it); a byte
changed inside ``.metadata`` is a pickle that does not parse, not a file
cut short, which a ``.metadata`` cut short is."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from ckptool.check.verify.problems import Report
from ckptool.check.verify.structure import check
from ckptool.read.layouts.embedded import Window
from ckptool.read.ziparchive import ZipArchive

FOUR_RANKS = Path(__file__).resolve().parent / "fixtures" / "multifile" / "dcp_4ranks"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``dcp.save({"model": sd})`` by two writer threads: two .distcp files."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    folder = tmp_path_factory.mktemp("dcp") / "step100"
    torch.manual_seed(0)
    sd = {"embed.weight": torch.randn(64, 16), "layer.weight": torch.randn(16, 16),
          "layer.bias": torch.randn(16), "head.weight": torch.randn(4, 16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": sd}, storage_writer=FileSystemWriter(str(folder), thread_count=2))
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__0_1.distcp"]
    return folder


def copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def found(report: Report) -> list[tuple[str, str | None]]:
    return [(p.kind, p.file) for p in report.problems]


def _items(folder: Path, file: str) -> list[tuple[int, int]]:
    """Where ``.metadata`` puts the items of ``file``: (offset, length)."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(folder)).read_metadata().storage_data
    return sorted((s.offset, s.length) for s in storage.values() if s.relative_path == file)


def _tensor_byte(folder: Path, file: str) -> int:
    """A byte of a tensor's data in ``file``'s last item."""
    start, length = _items(folder, file)[-1]
    with open(folder / file, "rb") as f:
        archive = ZipArchive(Window(f, start, length), length)  # type: ignore[arg-type]
        member = next(m for m in archive.members.values() if m.name.endswith("data/0"))
        return start + archive.data_offset(member) + 5


@pytest.mark.parametrize("which", ["threads", "ranks"])
def test_a_deleted_metadata_is_the_one_problem(saved: Path, tmp_path: Path, which: str) -> None:
    folder = copy(saved if which == "threads" else FOUR_RANKS, tmp_path)
    whole = check(str(folder), 1)
    assert whole.ok, whole.problems
    (folder / ".metadata").unlink()
    report = check(str(folder), 1)
    assert found(report) == [("missing-file", ".metadata")]
    message = report.problems[0].message
    assert message.startswith("the file is missing") and str(folder) not in message
    assert report.layout == "dcp"
    assert {f["name"] for f in report.files} == {p.name for p in folder.glob("*.distcp")}
    assert report.bytes_checked == whole.bytes_checked  # every record's CRC-32, still


def test_data_files_are_checked_without_their_metadata(saved: Path, tmp_path: Path) -> None:
    folder = copy(saved, tmp_path)
    at = _tensor_byte(folder, "__0_1.distcp")
    (folder / ".metadata").unlink()
    data = bytearray((folder / "__0_1.distcp").read_bytes())
    data[at] ^= 0x01
    (folder / "__0_1.distcp").write_bytes(bytes(data))
    report = check(str(folder), 1)
    assert found(report) == [("missing-file", ".metadata"), ("crc", "__0_1.distcp")]
    assert "does not match its CRC-32" in report.problems[1].message
    with open(folder / "__0_0.distcp", "r+b") as f:
        f.truncate(os.path.getsize(folder / "__0_0.distcp") - 100)
    assert ("truncated", "__0_0.distcp") in found(check(str(folder), 1))


def test_a_flipped_byte_in_metadata_is_no_truncation(saved: Path, tmp_path: Path) -> None:
    folder = copy(saved, tmp_path)
    data = (folder / ".metadata").read_bytes()
    kinds = set()
    for at in range(16, len(data) - 16, 23):  # past the frame's length, before its end
        changed = bytearray(data)
        changed[at] ^= 0x55
        (folder / ".metadata").write_bytes(bytes(changed))
        kinds |= {p.kind for p in check(str(folder), 1).problems if p.file == ".metadata"}
    assert "pickle" in kinds and "truncated" not in kinds, kinds
    for size in (10, len(data) // 2, len(data) - 1):
        (folder / ".metadata").write_bytes(data[:size])
        assert found(check(str(folder), 1)) == [("truncated", ".metadata")], size
