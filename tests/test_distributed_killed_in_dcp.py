"""A rank killed inside the one ``dcp.save`` of every rank (a DCP output):
the others hear of it from gloo ("connection closed by peer", which names
no rank). The rank that died is named (its process is gone from this
machine), never the rank that heard it; under ``--workers`` it is said
once, by the ``--workers`` process (``rank 1 of 2 was killed by SIGKILL``),
and the workers add nothing.

Rank 1 is ckptool with one step replaced (``KILLED``): once torch has
written its file, it kills itself (kill -9). Rank 0 holds SIGTERM back, as
a rank busy in a collective call hears gloo before the launcher's SIGTERM.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import clean_env

from ckptool.errors import RankFailedError
from ckptool.write.distributed import launch

ROOT = Path(__file__).resolve().parent.parent
HOST = socket.gethostname()

KILLED = """
import os, signal, sys
if os.environ.get("RANK", os.environ.get("SLURM_PROCID")) == "1":
    from ckptool.write.distributed import dcpshare
    def record(self, plan, results):
        os.kill(os.getpid(), signal.SIGKILL)
    dcpshare.RankFile.record = record
else:
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
from ckptool.cli.main import entry
entry()
"""


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dcpkill") / "w.pt"
    g = torch.Generator().manual_seed(6)
    torch.save({f"w{i}": torch.randn(128, 128, generator=g) for i in range(6)}, path)
    return path


def test_srun_names_the_rank_that_died(src: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    out = tmp_path / "dcp"
    tasks = [subprocess.Popen(
        [sys.executable, "-c", KILLED, "convert", str(src), str(out), "--format", "dcp"],
        env={**clean_env(), "CKPTOOL_DISTRIBUTED": "1", "SLURM_PROCID": str(r),
             "SLURM_LOCALID": str(r), "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
             "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "4242",
             "SLURM_JOB_NODELIST": "localhost", "MASTER_PORT": port},
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        done = [task.communicate(timeout=120) for task in tasks]
    finally:
        for task in tasks:
            if task.poll() is None:
                task.kill()
    assert [task.returncode for task in tasks] == [4, -9], done
    assert done[0][1].splitlines() == [
        f"ckptool: error: rank 1 of 2 ({HOST}): was killed (its process is gone: kill -9, or "
        "the OOM killer)",
        "hint: nothing was committed; run the same command again to resume: what was written "
        "and verified is kept"], done[0][1]
    assert not out.exists()


def test_workers_say_it_once(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capfd: pytest.CaptureFixture[str]) -> None:
    for name, value in clean_env().items():
        monkeypatch.setenv(name, value)
    for name in ("RANK", "SLURM_PROCID", "TORCHELASTIC_RUN_ID", "CKPTOOL_RANK_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "dcp"
    with pytest.raises(RankFailedError) as caught:
        launch.run_workers(2, ["convert", str(src), str(out), "--format", "dcp"],
                           _command=["-c", KILLED])
    assert caught.value.message == "rank 1 of 2 was killed by SIGKILL"
    assert capfd.readouterr().err == ""  # the workers said nothing more
    assert not out.exists()
