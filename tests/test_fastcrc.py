"""fastcrc: zip's CRC-32 of file ranges through mmap windows, libdeflate or
zlib (``ckptool verify`` reads with it; ByteChecker's tests are in
test_bytecheck.py)."""

from __future__ import annotations

import ctypes
import itertools
import os
import random
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptool.write import fastcrc


@pytest.fixture(params=["libdeflate", "zlib"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    fastcrc._libdeflate.cache_clear()
    if request.param == "zlib":
        monkeypatch.setenv("CKPTOOL_NO_LIBDEFLATE", "1")
    elif fastcrc._libdeflate() is None:
        pytest.skip("libdeflate is not installed on this machine")
    assert fastcrc.backend() == request.param
    yield request.param
    fastcrc._libdeflate.cache_clear()


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[bytes, int]:
    data = random.Random(3).randbytes(1 << 20) + b"tail"
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    yield data, fd
    os.close(fd)


def test_ranges_match_zlib(backend: str, data_file: tuple[bytes, int],
                           monkeypatch: pytest.MonkeyPatch) -> None:
    data, fd = data_file
    # small windows and a small threshold, so that one file exercises ranges
    # inside a window, across windows, longer than a window, big and small
    monkeypatch.setattr(fastcrc, "WINDOW", 64 << 10)
    monkeypatch.setattr(fastcrc, "_SMALL", 4 << 10)
    rng = random.Random(5)
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(data) + 1), rng.randint(2, 40)))
        ranges = [(a, b - a) for a, b in itertools.pairwise(cuts)]
        ranges += [(cuts[0], 0)]  # an empty range
        ranges.sort()
        assert fastcrc.crc_file_ranges(fd, ranges) == [zlib.crc32(data[o:o + n])
                                                       for o, n in ranges]
    assert fastcrc.crc_file_range(fd, 0, len(data)) == zlib.crc32(data)
    assert fastcrc.crc_file_range(fd, 7, len(data) - 7) == zlib.crc32(data[7:])


def test_a_range_past_the_end_is_an_error(backend: str, data_file: tuple[bytes, int]) -> None:
    data, fd = data_file
    with pytest.raises(OSError):
        fastcrc.crc_file_ranges(fd, [(0, 10), (len(data) - 5, 10)])


def test_a_library_that_answers_wrongly_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    class Wrong:
        def __init__(self, name: str) -> None:
            self.libdeflate_crc32 = ctypes.CFUNCTYPE(ctypes.c_uint32)(lambda *a: 0)

    fastcrc._libdeflate.cache_clear()
    monkeypatch.delenv("CKPTOOL_NO_LIBDEFLATE", raising=False)
    monkeypatch.setattr(fastcrc.ctypes, "CDLL", Wrong)
    try:
        assert fastcrc._libdeflate() is None
        assert fastcrc.backend() == "zlib"
    finally:
        fastcrc._libdeflate.cache_clear()


def test_an_empty_range_at_a_page_aligned_end_needs_no_mapping(tmp_path: Path) -> None:
    path = tmp_path / "page.bin"
    path.write_bytes(b"z" * 8192)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert fastcrc.crc_file_ranges(fd, [(8192, 0)]) == [0]
        assert fastcrc.crc_file_ranges(fd, [(0, 8192), (8192, 0)]) == [
            zlib.crc32(b"z" * 8192), 0]
    finally:
        os.close(fd)
