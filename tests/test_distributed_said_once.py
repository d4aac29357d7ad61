"""One message, said once, and true, however the processes of a distributed
convert end: a usage error (a bad option, a bad ``SLURM_STEP_NODELIST``)
is said by rank 0 alone, the others exiting 2 without a word (but a
variable set for one process is that process's to say); a SIGTERM that
reaches a rank while it is leaving changes nothing (the launcher stops
the job once a process exits); a SIGTERM to ``convert --workers N`` is
said.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import pytest
from helpers import clean_env

from ckptool.errors import CkptoolError
from ckptool.write.distributed import launch

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "samples" / "dcp_tinynet"


def task_env(rank: int, port: int = 9, **extra: str) -> dict[str, str]:
    """A task of an srun step of two."""
    return {**clean_env(), "CKPTOOL_DISTRIBUTED": "1", "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank), "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
            "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "4242",
            "SLURM_STEP_NODELIST": "localhost", "MASTER_PORT": str(port), **extra}


def ckptool(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "ckptool", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    return done.returncode, done.stderr


@pytest.mark.parametrize(("args", "extra", "said"), [
    (["--format", "bogus"], {}, "ckptool: error: Invalid value for '--format': 'bogus'"),
    ([], {"SLURM_STEP_NODELIST": "n[2-"}, "ckptool: error: SLURM_STEP_NODELIST='n[2-' is no "
     "SLURM node list"),
    (["--max-shard-size", "big", "--format", "hf"], {},
     "ckptool: error: --max-shard-size 'big' is not a size"),
])
def test_a_usage_error_is_said_by_rank_0_alone(tmp_path: Path, args: list[str],
                                               extra: dict[str, str], said: str) -> None:
    argv = ["convert", str(SAMPLE), str(tmp_path / "out"), *args]
    code, err = ckptool(argv, task_env(0, **extra))
    assert code == 2 and err.startswith(said) and len(err.splitlines()) == 2, err
    assert ckptool(argv, task_env(1, **extra)) == (2, "")


def test_a_variable_of_one_process_is_its_own_to_say(tmp_path: Path) -> None:
    code, err = ckptool(["convert", str(SAMPLE), str(tmp_path / "out")],
                        task_env(1, SLURM_LOCALID="x"))
    assert code == 2 and err.startswith("ckptool: error: SLURM_LOCALID='x': "), err


# rank 1 as ckptool, but the launcher's SIGTERM comes as it has just left
LEAVES_THEN_TERM = """
import os, signal
from ckptool.write.distributed import ending, run
real = ending.leave
def leave(coord, err, say):
    quiet = real(coord, err, say)
    os.kill(os.getpid(), signal.SIGTERM)
    return quiet
run.ending.leave = leave
from ckptool.cli.main import entry
entry()
"""


def test_a_sigterm_while_leaving_adds_nothing(tmp_path: Path) -> None:
    """OUT exists: rank 0 says so; rank 1 leaves, and torchrun (rank 0 has
    exited) stops it with SIGTERM on its way out: nothing more is said."""
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"taken")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["convert", str(SAMPLE), str(out)]
    tasks = [subprocess.Popen([sys.executable, *(["-m", "ckptool"] if r == 0 else
                                                 ["-c", LEAVES_THEN_TERM]), *args],
                              env=task_env(r, port), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        done = [task.communicate(timeout=60) for task in tasks]
    finally:
        for task in tasks:
            if task.poll() is None:
                task.kill()
    assert [task.returncode for task in tasks] == [2, 2], done
    assert "already exists" in done[0][1] and len(done[0][1].splitlines()) == 2, done
    assert done[1][1] == "", done


SLEEPS = """
import os, pathlib, sys, time
pathlib.Path(sys.argv[1], os.environ["RANK"]).touch()
time.sleep(60)
"""


class Stopped(Exception):
    """This test's own SIGTERM handler ran (the launcher gave the signal back)."""


def test_a_sigterm_to_the_workers_process_is_said(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in clean_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_SIGNALS_TO_HANDLE", raising=False)

    def handler(signum: int, frame: FrameType | None) -> None:
        raise Stopped

    before = signal.signal(signal.SIGTERM, handler)

    def stop() -> None:
        deadline = time.monotonic() + 60
        while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=stop, daemon=True)
    thread.start()
    try:
        with pytest.raises(CkptoolError) as caught:
            launch.run_workers(2, [str(tmp_path)], _command=["-c", SLEEPS])
    finally:
        signal.signal(signal.SIGTERM, before)
    assert caught.value.message == "stopped by SIGTERM: the workers were stopped"
    assert caught.value.exit_code == 143
    assert caught.value.hint == "nothing was written; run the same command again"
