"""The ``ranks`` line of a distributed convert's report says what holds, in
words that fit: one process is no "slowest", two figures that read alike are
one, and a resumed run that kept nothing does not claim "0 B kept"."""

from __future__ import annotations

from typing import Any

from ckptool.cli.fix_text import _ranks_line


def _rank(rank: int, written: int, kept: int = 0, seconds: float = 1.0,
          tensors: int = 3) -> dict[str, Any]:
    return {"rank": rank, "node": "vm", "bytes_written": written, "bytes_kept": kept,
            "seconds": seconds, "tensors": tensors}


def test_one_process_has_no_slowest() -> None:
    line = _ranks_line({"ranks": 1, "resumed": False, "per_rank": [_rank(0, 5_000_000)]})
    assert line == "1 process on 1 machine, 5.0 MB; took 1.0 s"


def test_shares_that_read_alike_are_said_once() -> None:
    line = _ranks_line({"ranks": 2, "resumed": False,
                        "per_rank": [_rank(0, 201_400_100), _rank(1, 201_400_900, seconds=2)]})
    assert line == "2 processes on 1 machine, 201.4 MB each; the slowest, rank 1, took 2.0 s"


def test_a_resume_that_kept_nothing_says_so_in_words() -> None:
    line = _ranks_line({"ranks": 2, "resumed": True,
                        "per_rank": [_rank(0, 1000), _rank(1, 3000)]})
    assert "0 B" not in line
    assert line.endswith("; an earlier run resumed, none of its bytes kept")
    line = _ranks_line({"ranks": 2, "resumed": True,
                        "per_rank": [_rank(0, 1000, kept=2000), _rank(1, 3000)]})
    assert line.endswith("; 2.0 kB kept from an earlier run, verified again")
