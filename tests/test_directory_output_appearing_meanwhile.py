"""A one-process conversion into a directory never replaces an OUT that
another program made while it wrote (without ``--force``), nor removes a
directory that came to hold other files (with it): it says so, and the
other program's files stay."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from ckptool.errors import UsageError
from ckptool.write.convert.run import convert
from ckptool.write.outdir import AtomicDirectory


@pytest.fixture
def src(tmp_path: Path) -> Path:
    path = tmp_path / "model.pt"
    torch.save({f"w{i}": torch.ones(64, 64) * i for i in range(4)}, path)
    return path


def _appearing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Just before the commit another program makes OUT its own: a
    directory holding its file alone."""
    real = AtomicDirectory.commit

    def commit(self: AtomicDirectory) -> None:
        if self.target.exists():
            shutil.rmtree(self.target)
        self.target.mkdir()
        (self.target / "theirs.txt").write_text("theirs")
        real(self)

    monkeypatch.setattr(AtomicDirectory, "commit", commit)


def test_a_directory_made_meanwhile_is_kept(src: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "shards"
    _appearing(monkeypatch)
    with pytest.raises(UsageError, match="appeared while ckptool was writing it"):
        convert(str(src), str(out), fmt="hf")
    assert os.listdir(out) == ["theirs.txt"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".shards")]


def test_force_keeps_a_directory_that_came_to_hold_other_files(
        src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "shards"
    convert(str(src), str(out), fmt="hf")  # a checkpoint there, replaced by other files
    _appearing(monkeypatch)
    with pytest.raises(UsageError, match="holds no checkpoint"):
        convert(str(src), str(out), fmt="hf", force=True)
    assert (out / "theirs.txt").read_text() == "theirs"
