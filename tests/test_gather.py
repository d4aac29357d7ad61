"""gather.copy_pieces: scattered source ranges to ascending destination
offsets, read ahead on a thread."""

from __future__ import annotations

import os
import random
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptool.write import gather


@pytest.fixture
def files(tmp_path: Path) -> Iterator[tuple[bytes, int, int, Path]]:
    data = random.Random(11).randbytes(3 << 20)
    (tmp_path / "src").write_bytes(data)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_RDWR | os.O_CREAT, 0o600)
    yield data, src, dst, tmp_path / "dst"
    os.close(src)
    os.close(dst)


def scattered(data_len: int, count: int, seed: int, max_size: int,
              max_gap: int) -> list[tuple[int, int, int]]:
    """Pieces in source order with gaps between them, packed in the output."""
    rng = random.Random(seed)
    pieces, src, dst = [], 0, 100
    for _ in range(count):
        src += rng.randint(0, max_gap)
        size = rng.randint(0, max_size)
        if src + size > data_len:
            break
        pieces.append((src, size, dst))
        src += size
        dst += size
    return pieces


def expected(data: bytes, pieces: list[tuple[int, int, int]]) -> bytes:
    return b"".join(data[s:s + n] for s, n, _ in pieces)


@pytest.mark.parametrize(("count", "max_size", "max_gap"), [
    (200, 40_000, 300),  # many pieces per buffer, small gaps read along
    (40, 300_000, 200_000),  # gaps too far apart to read along
    (6, 1 << 20, 64),  # pieces longer than a buffer (buffer shrunk below)
])
def test_copies_every_piece_and_reports_each_once_in_order(
        files: tuple[bytes, int, int, Path], monkeypatch: pytest.MonkeyPatch,
        count: int, max_size: int, max_gap: int) -> None:
    data, src, dst, path = files
    monkeypatch.setattr(gather, "BUFFER", 256 << 10)
    pieces = scattered(len(data), count, count, max_size, max_gap)
    seen: list[tuple[int, int | None]] = []
    gather.copy_pieces(src, dst, pieces, lambda i, crc: seen.append((i, crc)))
    assert seen == [(i, zlib.crc32(data[s:s + n])) for i, (s, n, _) in enumerate(pieces)]
    assert path.read_bytes()[100:] == expected(data, pieces)


def test_every_pieces_crc_comes_from_the_buffer_written(
        files: tuple[bytes, int, int, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The CRC is taken from the read-ahead buffer, pieces longer than a
    buffer too, and the bytes shown as written are those of the file."""
    data, src, dst, path = files
    monkeypatch.setattr(gather, "BUFFER", 64 << 10)
    pieces = scattered(len(data), 40, 5, 200_000, 300)
    seen: dict[int, int] = {}
    shown: list[tuple[int, bytes]] = []
    gather.copy_pieces(src, dst, pieces, seen.__setitem__,
                       lambda at, view: shown.append((at, view.tobytes())))
    assert seen == {i: zlib.crc32(data[s:s + n]) for i, (s, n, _) in enumerate(pieces)}
    out = path.read_bytes()
    assert [at for at, _ in shown] == sorted(at for at, _ in shown)
    assert all(out[at:at + len(b)] == b for at, b in shown)
    assert sum(len(b) for _, b in shown) == sum(n for _, n, _ in pieces)


def test_more_tiny_pieces_than_one_write_takes(files: tuple[bytes, int, int, Path]) -> None:
    data, src, dst, path = files
    pieces = [(i * 7, 4, 100 + i * 4) for i in range(3000)]  # > IOV_MAX per buffer
    gather.copy_pieces(src, dst, pieces)
    assert path.read_bytes()[100:] == expected(data, pieces)


def test_without_pwritev(files: tuple[bytes, int, int, Path],
                         monkeypatch: pytest.MonkeyPatch) -> None:
    data, src, dst, path = files
    monkeypatch.delattr(os, "pwritev")
    pieces = scattered(len(data), 50, 1, 50_000, 500)
    gather.copy_pieces(src, dst, pieces)
    assert path.read_bytes()[100:] == expected(data, pieces)


def test_a_source_that_ends_early_is_an_error(files: tuple[bytes, int, int, Path]) -> None:
    data, src, dst, _ = files
    pieces = [(0, 1000, 0), (len(data) - 10, 100, 1000)]
    with pytest.raises(EOFError, match="ends 90 bytes early"):
        gather.copy_pieces(src, dst, pieces)


def test_a_failing_write_stops_the_reader(files: tuple[bytes, int, int, Path],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    data, src, _, _ = files
    monkeypatch.setattr(gather, "BUFFER", 64 << 10)
    pieces = scattered(len(data), 400, 2, 30_000, 10)
    done: list[int] = []
    with pytest.raises(OSError):  # a bad descriptor: EBADF
        gather.copy_pieces(src, -1, pieces, lambda i, crc: done.append(i))
    assert done == []
