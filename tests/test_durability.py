"""When fix and convert wait for the disk: a new output is left to the
kernel's writeback (as cp and torch.save leave theirs) unless --fsync asks;
replacing a file, and --in-place, always wait."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import saved_on

from ckptool.cli import main
from ckptool.write import commit


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The descriptors os.fsync is called with (still fsynced for real)."""
    calls: list[int] = []
    real: Callable[[int], None] = os.fsync

    def counting(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    return calls


@pytest.fixture
def src(tmp_path: Path) -> Path:
    path = tmp_path / "m.pth"
    with saved_on("cuda:1"):
        torch.save({"module.w": torch.ones(3, 4), "module.b": torch.zeros(4)}, path)
    return path


def test_atomic_output_syncs_only_when_asked_or_replacing(tmp_path: Path,
                                                          fsyncs: list[int]) -> None:
    for name, fsync, existing in (("new", False, False), ("asked", True, False),
                                  ("replaced", False, True)):
        target = tmp_path / name
        if existing:
            target.write_bytes(b"old")
        with commit.AtomicOutput(target, force=existing, fsync=fsync) as out:
            out.file.write(b"new")
            assert out.durable == (fsync or existing)
            out.sync_in_background()
            out.commit()
        assert target.read_bytes() == b"new"
        # the file and its directory, or nothing
        assert len(fsyncs) == (2 if fsync or existing else 0), name
        fsyncs.clear()


@pytest.mark.parametrize("command", ["fix", "convert"])
def test_cli_fsync_flag(src: Path, command: str, fsyncs: list[int]) -> None:
    out = src.with_name("o.safetensors" if command == "convert" else "o.pth")
    args = [command, str(src), *(["--strip-module", "-o"] if command == "fix" else []),
            str(out), "-q"]
    assert main(args) == 0
    assert fsyncs == []
    out.unlink()
    assert main([*args, "--fsync"]) == 0
    assert len(fsyncs) >= 2  # the output, then its directory
    fsyncs.clear()
    assert main([*args, "--force"]) == 0  # replaces the file just written
    assert len(fsyncs) >= 2


def test_in_place_always_waits(src: Path, fsyncs: list[int]) -> None:
    assert main(["fix", str(src), "--in-place", "--strip-module", "--to", "cpu", "-q"]) == 0
    assert fsyncs
    assert list(torch.load(src)) == ["w", "b"]
