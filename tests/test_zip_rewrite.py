"""The rewritten zip's layout (ckptool.write.formats.torch_zip) and its copy
(ckptool.write.copy): storage records first, each
run copied page-congruent, the pickle and small records after them, the
central directory in the source's order; every byte of it re-read."""

from __future__ import annotations

import os
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import saved_on

import ckptool
from ckptool.cli import main
from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.read.ziparchive import ZipArchive
from ckptool.write import copy
from ckptool.write.fix import run as fix
from ckptool.write.fix.plan import FixOptions
from ckptool.write.formats import torch_zip
from ckptool.write.layout import Data, Made, Span


def training_file(path: Path, tag: str = "cuda:2", big: bool = True) -> dict[str, torch.Tensor]:
    """module.-prefixed float and int tensors, an optimizer, a shared storage;
    over 1 MiB of them unless not ``big`` (the size from which copies are
    padded to be page-congruent)."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(1400 if big else 64, 300, generator=gen)
    sd = {"module.a.weight": w, "module.a.bias": torch.randn(300, generator=gen),
          "module.a.steps": torch.tensor(3), "module.view": w[1:3],
          "module.b.weight": torch.randn(5000, generator=gen).to(torch.float16)}
    with saved_on(tag):
        torch.save({"epoch": 1, "state_dict": sd,
                    "optimizer": {"state": {0: {"m": torch.ones(7)}}}}, path)
    return {k.removeprefix("module."): v for k, v in sd.items()}


def records(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (local header offset, data offset), in central-directory order."""
    with open(path, "rb") as f:
        archive = ZipArchive(f, os.path.getsize(path))
        return {n: (m.header_offset, archive.data_offset(m)) for n, m in archive.members.items()}


def torch_loads(path: Path) -> dict[str, Any]:
    tags: set[str] = set()

    def record(storage: Any, location: str) -> Any:
        tags.add(location)
        return storage

    plain = torch.load(path, map_location=record)
    mapped = torch.load(path, map_location="cpu", mmap=True)
    assert plain.keys() == mapped.keys()
    return {"obj": plain, "mmap": mapped, "tags": tags}


def test_layout_storages_first_congruent_and_readable_by_everyone(tmp_path: Path) -> None:
    src, out = tmp_path / "m.pth", tmp_path / "o.pth"
    want = training_file(src)
    result = fix.fix(str(src), FixOptions(strip_module=True, to="cuda:0"), str(out))
    assert result.verified_storages == len(ckptool.open(src).storages)
    before, after = records(src), records(out)
    names = list(before)
    assert list(after) == names  # the directory keeps torch's order: data.pkl first
    root = names[0].split("/")[0]
    storage_names = [n for n in names if n.startswith(f"{root}/data/")]
    # physically, every storage record comes before the pickle and small records
    assert max(after[n][0] for n in storage_names) < min(
        after[n][0] for n in names if n not in storage_names)
    for name in storage_names:  # copied page-congruent, torch's 64-byte alignment kept
        assert (after[name][1] - before[name][1]) % 4096 == 0
        assert after[name][1] % 64 == 0
    assert zipfile.ZipFile(out).testzip() is None  # every CRC, by an independent reader
    loaded = torch_loads(out)
    assert loaded["tags"] == {"cuda:0"}
    for sd in (loaded["obj"]["state_dict"], loaded["mmap"]["state_dict"]):
        assert list(sd) == list(want)
        for key, tensor in want.items():
            assert torch.equal(sd[key], tensor), key
    assert sd["view"].untyped_storage().data_ptr() == sd["a.weight"].untyped_storage().data_ptr()


def test_casts_in_the_middle_of_the_records_break_the_runs(tmp_path: Path) -> None:
    src, out = tmp_path / "m.pth", tmp_path / "o.pth"
    want = training_file(src)
    fix.fix(str(src), FixOptions(strip_module=True, to="cpu", dtype="bfloat16"), str(out))
    assert zipfile.ZipFile(out).testzip() is None
    sd = torch.load(out)["state_dict"]
    for key, tensor in want.items():
        if tensor.is_floating_point():
            assert sd[key].dtype == torch.bfloat16
            assert torch.equal(sd[key], tensor.to(torch.bfloat16)), key
        else:
            assert torch.equal(sd[key], tensor), key


def test_dropped_records_are_left_out(tmp_path: Path) -> None:
    src, out = tmp_path / "m.pth", tmp_path / "o.pth"
    training_file(src)
    fix.fix(str(src), FixOptions(drop=("optimizer",)), str(out))
    assert len(ckptool.open(out).storages) == len(ckptool.open(src).storages) - 1
    assert len(records(out)) == len(records(src)) - 1
    assert zipfile.ZipFile(out).testzip() is None
    assert "optimizer" not in torch.load(out, map_location="cpu")


def test_a_zip_rewritten_by_python_without_descriptors_or_alignment(tmp_path: Path) -> None:
    """Records that do not follow torch's layout are copied one by one."""
    src, rezipped, out = tmp_path / "m.pth", tmp_path / "z.pth", tmp_path / "o.pth"
    want = training_file(src)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(rezipped, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))  # stored, no descriptor
    assert any(d % 64 for _, d in records(rezipped).values())  # not aligned any more
    assert main(["fix", str(rezipped), "--strip-module", "--to", "cpu", "-o", str(out),
                 "-q"]) == 0
    assert all(d % 64 == 0 for name, (_, d) in records(out).items() if "/data/" in name)
    assert zipfile.ZipFile(out).testzip() is None
    sd = torch.load(out)["state_dict"]
    assert all(torch.equal(sd[k], v) for k, v in want.items())


def test_damage_between_copied_records_is_caught(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The local headers copied inside a span are checked too, not only the
    data: a byte of the second record's local header that the copy reads
    otherwise than the layout did is written, and caught."""
    from ckptool.write import mapcopy

    src, out = tmp_path / "m.pth", tmp_path / "o.pth"
    training_file(src)
    real_layout = torch_zip.lay_out_storages
    real_pieces = mapcopy.pieces
    second: list[int] = []  # the input offset of a byte of that header

    def laid_out(*args: Any) -> torch_zip.Storages:
        storages = real_layout(*args)
        span = next(s for s in storages.segments if isinstance(s, Span))
        second.append(storages.pieces[1].header + 31 - (span.at - span.src))
        return storages

    def damaged(fd: int, offset: int, size: int) -> Iterator[mapcopy.Piece]:
        pos = offset
        for buffer, start, n in real_pieces(fd, offset, size):
            piece = bytearray(buffer[start:start + n])
            if pos <= second[-1] < pos + n:
                piece[second[-1] - pos] ^= 0xFF
            yield piece, 0, n
            pos += n

    monkeypatch.setattr(torch_zip, "lay_out_storages", laid_out)
    monkeypatch.setattr(mapcopy, "pieces", damaged)
    with pytest.raises(CorruptCheckpointError, match="header"):
        fix.fix(str(src), FixOptions(strip_module=True), str(out))
    assert not out.exists()
    assert os.listdir(tmp_path) == ["m.pth"]


def test_records_no_tensor_uses_are_kept_as_they_are(tmp_path: Path) -> None:
    src, out = tmp_path / "m.pth", tmp_path / "o.pth"
    want = training_file(src)
    with zipfile.ZipFile(src, "a") as z:
        root = z.namelist()[0].split("/")[0]
        z.writestr(f"{root}/data/orphan", b"not referenced by the pickle")
    assert main(["fix", str(src), "--strip-module", "-o", str(out), "-q"]) == 0
    assert f"{root}/data/orphan" in records(out)
    assert zipfile.ZipFile(out).read(f"{root}/data/orphan") == b"not referenced by the pickle"
    sd = torch.load(out, map_location="cpu")["state_dict"]
    assert all(torch.equal(sd[k], v) for k, v in want.items())


def test_a_compressed_storage_record_is_refused(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    src, deflated = tmp_path / "m.pth", tmp_path / "d.pth"
    training_file(src)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(deflated, "w") as zout:
        for info in zin.infolist():
            method = zipfile.ZIP_DEFLATED if "/data/0" in info.filename else zipfile.ZIP_STORED
            zout.writestr(info.filename, zin.read(info.filename), method)
    os.remove(src)
    assert main(["fix", str(deflated), "--strip-module", "-o", str(tmp_path / "o.pth")]) == 3
    err = capsys.readouterr().err
    assert "compressed" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == ["d.pth"]


def test_layout_of_a_torch_file(tmp_path: Path) -> None:
    src = tmp_path / "m.pth"
    training_file(src)
    with open(src, "rb") as f:
        archive = ZipArchive(f, os.path.getsize(src))
        members = torch_zip.storage_members(archive, "m/")
        storages = torch_zip.lay_out_storages(f.fileno(), archive, members, {})
    # torch writes its records back to back: our header, one span, the last descriptor
    assert [type(s) for s in storages.segments] == [Data, Span, Data]
    header, span, trailer = storages.segments
    assert [p.key for p in storages.pieces] == sorted(members, key=int)
    assert header.at == 0 and span.at == len(header.data) and (span.at - span.src) % 4096 == 0
    # each record, and each gap between records
    assert isinstance(span, Span) and len(span.checks) == 2 * len(storages.pieces) - 1
    assert trailer.at == span.at + span.size == storages.end - trailer.size
    with open(src, "rb") as f:
        archive = ZipArchive(f, os.path.getsize(src))
        casts = {"1": (8, lambda: b"\0" * 8)}
        storages = torch_zip.lay_out_storages(f.fileno(), archive, members, casts)
    # the first record alone, the cast one alone (made, then its descriptor), the rest
    assert [type(s) for s in storages.segments] == [Data, Span, Data, Data, Made, Made,
                                                    Data, Span, Data]
    assert storages.pieces[1].made is storages.segments[4] and storages.pieces[1].size == 8


def test_small_copies_keep_torchs_alignment_without_page_padding(tmp_path: Path) -> None:
    src, out = tmp_path / "m.pth", tmp_path / "o.pth"
    training_file(src, big=False)
    fix.fix(str(src), FixOptions(strip_module=True), str(out))
    after = records(out)
    first = min(after.values())
    assert first[0] == 0 and first[1] < 128  # a header padded to 64 bytes, not to a page
    assert all(d % 64 == 0 for name, (_, d) in after.items() if "/data/" in name)
    assert abs(out.stat().st_size - src.stat().st_size) < 200  # the keys got shorter


def test_refused_input_after_the_copy_started_leaves_nothing(tmp_path: Path) -> None:
    """A zip whose records look right but whose pickle is damaged: the early
    copy has started when the read fails."""
    src = tmp_path / "m.pth"
    training_file(src)
    broken = tmp_path / "b.pth"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(broken, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("data.pkl"):
                data = data[: len(data) // 2]
            zout.writestr(info.filename, data)
    shutil.move(broken, tmp_path / "in.pth")
    os.remove(src)
    with pytest.raises((CorruptCheckpointError, UnsupportedCheckpointError)):
        fix.fix(str(tmp_path / "in.pth"), FixOptions(strip_module=True),
                    str(tmp_path / "o.pth"))
    assert os.listdir(tmp_path) == ["in.pth"]


def test_a_refusal_stops_the_copy_without_reading_the_rest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused after the early copy started: nothing more is written or
    checked than what was copied when the refusal came (and the pieces the
    checker had taken ahead of the writer)."""
    from ckptool.write import bytecheck, mapcopy

    src, out = tmp_path / "m.pth", tmp_path / "o.pth"
    gen = torch.Generator().manual_seed(0)
    torch.save({"state_dict": {f"module.w{i}": torch.randn(64 * 1024, generator=gen)
                               for i in range(40)}}, src)
    monkeypatch.setattr(mapcopy, "PIECE", 256 << 10)
    written: list[int] = []
    real_write = copy.Copier._pwrite

    def slow(self: copy.Copier, data: bytes | memoryview, at: int) -> None:
        import time

        time.sleep(0.02)  # the read and the refusal come while the copy is at work
        real_write(self, data, at)
        written.append(len(data))

    monkeypatch.setattr(copy.Copier, "_pwrite", slow)
    taken: list[int] = []
    real_take = bytecheck.ByteChecker.take

    def counting(self: bytecheck.ByteChecker, at: int, buffer: Any, start: int, size: int,
                 ranges: bytecheck.Ranges) -> Any:
        taken.append(size)
        return real_take(self, at, buffer, start, size, ranges)

    monkeypatch.setattr(bytecheck.ByteChecker, "take", counting)
    monkeypatch.setattr(fix, "refuse_unsafe", _refuse)
    with pytest.raises(UnsupportedCheckpointError, match="refused"):
        fix.fix(str(src), FixOptions(strip_module=True), str(out))
    assert sum(written) < os.path.getsize(src) // 2  # the copy was stopped early...
    # ...and nothing unwritten was checked, but the pieces taken ahead
    assert sum(taken) <= sum(written) + (copy.AHEAD + 1) * (256 << 10)
    assert os.listdir(tmp_path) == ["m.pth"]


def _refuse(names: list[str]) -> None:
    raise UnsupportedCheckpointError("refused", "for the test")


def test_records_with_zip64_descriptors_still_copy_as_one_run(tmp_path: Path) -> None:
    """torch writes 8-byte-size descriptors for records past 4 GiB, whatever
    their size: those runs must still copy in one piece."""
    import struct
    import zlib

    from ckptool.write.bytecheck import ByteChecker
    from ckptool.write.zipwriter import ZipWriter, local_header

    path = tmp_path / "z.zip"
    blobs = [os.urandom(5000 + i) for i in range(3)]
    with open(path, "wb") as f:
        writer = ZipWriter(f)
        for i, blob in enumerate(blobs):
            name = f"z/data/{i}"
            header = local_header(name.encode(), writer.pos)
            offset = writer.pos
            crc = zlib.crc32(blob)
            f.write(header + blob + struct.pack("<IIQQ", 0x08074B50, crc, len(blob), len(blob)))
            writer.add_existing(name, offset, len(blob), crc, 0x0808,
                                offset + len(header))
            writer.pos = f.tell()
        writer.close()
    with open(path, "rb") as f:
        archive = ZipArchive(f, os.path.getsize(path))
        storages = torch_zip.lay_out_storages(
            f.fileno(), archive, torch_zip.storage_members(archive, "z/"), {})
        assert [type(s) for s in storages.segments] == [Data, Span, Data]
        out = os.open(tmp_path / "o.bin", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with ByteChecker(out) as checker:
                copy.write(out, checker, storages.segments)
                assert checker.finish() == []
                assert checker.checked == 2 * len(blobs) - 1  # each record, each header
            for piece, blob in zip(storages.pieces, blobs, strict=True):
                assert os.pread(out, piece.size, piece.data) == blob
        finally:
            os.close(out)


def test_a_damaged_storage_is_refused_when_cast_too(tmp_path: Path) -> None:
    """A copy is checked against the input's own CRCs; a cast must be as well."""
    src, out = tmp_path / "m.pth", tmp_path / "o.pth"
    training_file(src, big=False)
    with open(src, "rb") as f:
        archive = ZipArchive(f, os.path.getsize(src))
        at = archive.data_offset(archive.members["m/data/0"]) + 10
    with open(src, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptCheckpointError, match="its own checksum"):
        fix.fix(str(src), FixOptions(dtype="bfloat16"), str(out))
    assert os.listdir(tmp_path) == ["m.pth"]


def test_a_tensor_with_python_attributes_is_written_back(tmp_path: Path) -> None:
    """torch saves ``t.tag = 7`` through _rebuild_from_type_v2(func, ...): the
    function is an argument, written by its name."""
    src, out = tmp_path / "m.pth", tmp_path / "o.pth"
    t = torch.arange(6.0)
    t.tag = 7  # type: ignore[attr-defined]
    torch.save({"module.t": t}, src)
    fix.fix(str(src), FixOptions(strip_module=True), str(out))
    got = torch.load(out)  # weights_only: the attribute is plain data
    assert torch.equal(got["t"], t) and got["t"].tag == 7


def test_an_input_written_while_it_is_copied_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy checks and writes the input's bytes from a mapping of it: a
    write to the input while it is copied (the same bytes, even) refuses
    the output, which would otherwise hold bytes of two versions."""
    from ckptool.write import mapcopy

    src, out = tmp_path / "m.pth", tmp_path / "o.pth"
    training_file(src)
    real_pieces = mapcopy.pieces

    def rewritten(fd: int, offset: int, size: int) -> Iterator[mapcopy.Piece]:
        for i, piece in enumerate(real_pieces(fd, offset, size)):
            yield piece
            if i == 0:  # a writer rewrites a byte of the input, unchanged
                with open(src, "r+b") as f:
                    byte = os.pread(f.fileno(), 1, offset)
                    os.pwrite(f.fileno(), byte, offset)

    monkeypatch.setattr(mapcopy, "PIECE", 4096)
    monkeypatch.setattr(mapcopy, "pieces", rewritten)
    with pytest.raises(CorruptCheckpointError, match="changed while"):
        fix.fix(str(src), FixOptions(strip_module=True), str(out))
    assert os.listdir(tmp_path) == ["m.pth"]
