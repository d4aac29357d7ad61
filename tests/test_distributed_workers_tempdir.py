"""``convert --workers N`` keeps the launcher's files in
``TMPDIR/ckptool-workers-<pid>-*`` and removes them as it ends; a process
killed before it could (kill -9) leaves its folder, which the next run
removes: this user's, whose process is gone, and nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ckptool.write.distributed import launch

ROOT = Path(__file__).resolve().parent.parent


def test_a_killed_runs_folder_is_removed_by_the_next(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("CKPTOOL_DISTRIBUTED", "0")
    monkeypatch.delenv("TORCHELASTIC_SIGNALS_TO_HANDLE", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    killed = tmp_path / f"ckptool-workers-{gone.stdout.strip()}-x1y2"
    (killed / "run" / "attempt_0" / "0").mkdir(parents=True)
    running = tmp_path / f"ckptool-workers-{os.getppid()}-a3b4"  # a live process's
    running.mkdir()
    other = tmp_path / "ckptool-workers-notes"  # no pid: not a run's
    other.mkdir()
    assert launch.run_workers(1, ["--version"]) == 0
    assert capfd.readouterr().out == "ckptool, version 0.1.0\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([running.name, other.name])
