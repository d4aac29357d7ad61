"""Progress bars: on stderr, only for writes that take over a second, never
with --quiet or when stderr is not a terminal."""

from __future__ import annotations

import io
import sys

import pytest

from ckptool.cli import common


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_updates(monkeypatch: pytest.MonkeyPatch, quiet: bool, tty: bool,
                seconds: list[float]) -> str:
    err = FakeTTY() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    # time.monotonic is shared with rich: a clock that never runs out
    ticks = iter(seconds)
    last = [0.0]

    def clock() -> float:
        last[0] = next(ticks, last[0] + 0.01)
        return last[0]

    monkeypatch.setattr(common.time, "monotonic", clock)
    with common.progress(quiet) as update:
        if update is not None:
            for done in (10, 20, 30):
                update(done, 30)
    return err.getvalue()


def test_bar_appears_after_a_second_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    out = run_updates(monkeypatch, quiet=False, tty=True,
                      seconds=[0.0, 0.2, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0])
    assert "writing" in out


def test_no_bar_for_fast_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_updates(monkeypatch, quiet=False, tty=True, seconds=[0.0, 0.1, 0.2, 0.3]) == ""


def test_no_bar_when_quiet_or_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_updates(monkeypatch, quiet=True, tty=True, seconds=[0.0, 5.0]) == ""
    assert run_updates(monkeypatch, quiet=False, tty=False, seconds=[0.0, 5.0]) == ""
