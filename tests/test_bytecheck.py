"""ByteChecker: each range's CRC taken from the very bytes handed over to be
written (a mapping of the input, a buffer), on the checker's own thread;
nothing is read back from the output."""

from __future__ import annotations

import mmap
import os
import threading
import zlib
from pathlib import Path

import pytest

from ckptool.write import bytecheck
from ckptool.write.bytecheck import ByteChecker, Ranges


def _pieces(data: bytearray, size: int) -> list[tuple[int, int]]:
    return [(at, min(size, len(data) - at)) for at in range(0, len(data), size)]


def test_only_the_ranges_whose_bytes_differ_fail(tmp_path: Path) -> None:
    data = bytearray(os.urandom(300_000))
    # at output offset 1000: a good range, one whose expected CRC is wrong,
    # bytes nobody checks, a range with no CRC to compare (its CRC is kept)
    ranges = Ranges([("good", 1000, 100_000, zlib.crc32(data[:100_000])),
                     ("bad", 101_000, 50_000, zlib.crc32(data[100_000:150_000]) ^ 1),
                     ("unchecked", 151_000, 50_000, None),
                     ("last", 201_000, 100_000, zlib.crc32(data[200_000:]))])
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with ByteChecker(fd) as checker:
            # pieces that cut across the ranges, as a span's pieces do
            events = [checker.take(1000 + at, data, at, n, ranges)
                      for at, n in _pieces(data, 70_000)]
            assert all(event.wait(5) for event in events)
        assert checker.failed == ["bad"]
        assert checker.checked == 3
        assert ranges.crcs[2] == zlib.crc32(data[150_000:200_000])
    finally:
        os.close(fd)


def test_a_mapping_of_the_input_is_checked_where_it_lies(tmp_path: Path) -> None:
    data = os.urandom(3 * mmap.ALLOCATIONGRANULARITY + 123)
    (tmp_path / "in").write_bytes(data)
    with open(tmp_path / "in", "rb") as f:
        window = mmap.mmap(f.fileno(), len(data), access=mmap.ACCESS_COPY)
        ranges = Ranges([("all", 0, len(data) - 100, zlib.crc32(data[100:]))])
        with ByteChecker(f.fileno()) as checker:
            checker.take(0, window, 100, len(data) - 100, ranges).wait(5)
        assert checker.failed == [] and checker.checked == 1


def test_an_error_fails_its_ranges_and_the_checker_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = bytecheck.crc_buffer
    calls: list[int] = []

    def once_broken(buf: bytearray, start: int, end: int, crc: int = 0) -> int:
        calls.append(end - start)
        if len(calls) == 1:
            raise ValueError("simulated")
        return real(buf, start, end, crc)

    monkeypatch.setattr(bytecheck, "crc_buffer", once_broken)
    data = bytearray(b"x" * 1000)
    first = Ranges([("first", 0, 1000, zlib.crc32(data))])
    second = Ranges([("second", 1000, 1000, zlib.crc32(data) ^ 1)])  # still checked
    checker = ByteChecker(-1)
    assert checker.take(0, data, 0, 1000, first).wait(5)
    assert checker.take(1000, data, 0, 1000, second).wait(5)
    assert checker.finish() == ["first", "second"]
    assert checker.problem == "ValueError: simulated"


def test_cancel_drops_what_is_queued_and_releases_every_writer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    seen: list[int] = []
    real = bytecheck.crc_buffer

    def waiting(buf: bytearray, start: int, end: int, crc: int = 0) -> int:
        gate.wait(5)
        seen.append(start)
        return real(buf, start, end, crc)

    monkeypatch.setattr(bytecheck, "crc_buffer", waiting)
    data = bytearray(2000)
    checker = ByteChecker(-1)
    ranges = Ranges([(f"r{i}", i * 100, 100, 0) for i in range(20)])
    events = [checker.take(i * 100, data, i * 100, 100, ranges) for i in range(20)]
    threading.Timer(0.2, gate.set).start()
    checker.cancel()
    assert all(event.is_set() for event in events)  # no writer waits forever
    assert len(seen) <= 1  # at most the piece it had started on


def test_the_observer_sees_every_byte_written_in_order() -> None:
    seen: list[tuple[int, bytes]] = []
    data = bytearray(os.urandom(10_000))
    ranges = Ranges([("span", 100, 10_000, zlib.crc32(data))])
    with ByteChecker(-1, observe=lambda at, view: seen.append((at, bytes(view)))) as checker:
        checker.wrote(0, b"h" * 100, 0, 100)  # a header, written before the span
        for at, n in _pieces(data, 3000):
            checker.take(100 + at, data, at, n, ranges)
        checker.wrote(10_100, b"tail", 0, 4)
    assert checker.failed == []
    assert b"".join(b for _, b in seen) == b"h" * 100 + bytes(data) + b"tail"
    assert [at for at, _ in seen] == [0, 100, 3100, 6100, 9100, 10_100]


def test_writeback_is_started_only_for_durable_outputs(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, b"x" * 8192, 0)
        quick, durable = ByteChecker(fd), ByteChecker(fd, durable=True)
        assert quick._writeback is None
        assert durable._writeback is not None or not hasattr(os, "sync_file_range")
        for checker in (quick, durable):
            checker.written(0, 8192)
            assert checker.finish() == []
    finally:
        os.close(fd)
