"""fastcrc: zip's CRC-32 of file ranges through mmap windows, libdeflate or
zlib; and ByteChecker's batches, which use it."""

from __future__ import annotations

import ctypes
import itertools
import os
import random
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptool.write import fastcrc
from ckptool.write.bytecheck import ByteChecker


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


def test_checker_batches_report_the_ranges_that_differ(data_file: tuple[bytes, int]) -> None:
    data, fd = data_file
    checker = ByteChecker(fd)
    good = [(f"g{i}", i * 1000, 1000, zlib.crc32(data[i * 1000:(i + 1) * 1000]))
            for i in range(0, 50, 2)]
    bad = ("bad", 5000, 1000, zlib.crc32(data[5000:6000]) ^ 1)
    checker.check_many([*reversed(good), bad])  # any order: the checker sorts them
    checker.check_many([])
    checker.check("tail", len(data) - 4, 4, zlib.crc32(b"tail"))
    assert checker.finish() == ["bad"]
    assert checker.checked == len(good) + 2


def test_checker_starts_writeback_only_for_durable_outputs(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 8192)
    fd = os.open(path, os.O_RDWR)
    try:
        quick, durable = ByteChecker(fd), ByteChecker(fd, durable=True)
        assert quick._writeback is None
        assert durable._writeback is not None or not hasattr(os, "sync_file_range")
        for checker in (quick, durable):
            checker.check("all", 0, 8192, zlib.crc32(b"x" * 8192))
            assert checker.finish() == []
    finally:
        os.close(fd)


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


def test_any_error_fails_its_batch_and_the_checker_goes_on(
        data_file: tuple[bytes, int], monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptool.write import bytecheck

    data, fd = data_file
    real = bytecheck.crc_file_ranges
    calls: list[int] = []

    def once_broken(fd: int, ranges: list[tuple[int, int]], observe: object = None
                    ) -> list[int]:
        calls.append(len(ranges))
        if len(calls) == 1:
            raise ValueError("mmap offset is greater than file size")
        return real(fd, ranges)

    monkeypatch.setattr(bytecheck, "crc_file_ranges", once_broken)
    checker = ByteChecker(fd)
    checker.check("first", 0, 10, zlib.crc32(data[:10]))
    checker.check("second", 10, 10, zlib.crc32(data[10:20]) ^ 1)  # still checked
    assert checker.finish() == ["first", "second"]
    assert checker.problem == "ValueError: mmap offset is greater than file size"


def test_cancel_drops_what_is_queued(data_file: tuple[bytes, int],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptool.write import bytecheck

    _, fd = data_file
    gate = threading.Event()
    read: list[int] = []
    real = bytecheck.crc_file_ranges

    def waiting(fd: int, ranges: list[tuple[int, int]]) -> list[int]:
        gate.wait(5)
        read.append(len(ranges))
        return real(fd, ranges)

    monkeypatch.setattr(bytecheck, "crc_file_ranges", waiting)
    checker = ByteChecker(fd)
    for i in range(20):
        checker.check(f"r{i}", i * 100, 100, 0)
    threading.Timer(0.2, gate.set).start()
    checker.cancel()
    assert len(read) <= 1  # at most the batch it had started on
