"""ByteChecker: bytes re-read in the background as they are written."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

from ckptool.write.bytecheck import ByteChecker


def test_reports_exactly_the_ranges_that_differ(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    data = os.urandom(1 << 20)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        checker = ByteChecker(fd)
        checker.check("good", 0, 4096, zlib.crc32(data[:4096]))
        checker.check("bad", 4096, 4096, zlib.crc32(data[4096:8192]) ^ 1)
        checker.check("tail", 8192, len(data) - 8192, zlib.crc32(data[8192:]))
        assert checker.finish() == ["bad"]
        assert checker.checked == 3
    finally:
        os.close(fd)


def test_a_range_past_the_end_fails(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        checker = ByteChecker(fd)
        checker.check("short", 50, 100, zlib.crc32(b"x" * 50))
        assert checker.finish() == ["short"]
    finally:
        os.close(fd)
