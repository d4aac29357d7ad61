"""What a distributed convert says of OUT when it ends abnormally is true:
"committed" only when OUT is the very directory or file this run staged
(its inode), never an OUT that was there before (``--force``) or that
another program made; "nothing was committed" only when nothing was.

- rank 0 killed just after it committed OUT: under ``--workers`` the
  launching process says so (rank 0 recorded what it would commit in a
  file of that process's); under torchrun, rank 1, stopped by torchrun's
  SIGTERM, says it in rank 0's stead;
- a SIGTERM before rank 0 began is no commit, even onto an OUT there
  already; one after its commit is said as one;
- a SIGTERM to ``convert --workers`` before the workers start is said (it
  ended the process without a word).

Workers are ckptool with one step replaced (``KILLED``): rank 0 kills itself
(kill -9) just after (or before) ``Staging.commit``.
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
from typing import Any

import click
import pytest
import torch
from helpers import clean_env
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from ckptool.errors import CkptoolError, RankFailedError
from ckptool.write.distributed import launch, lost
from ckptool.write.distributed.coordinate import Coordinator
from ckptool.write.distributed.ending import Terminated
from ckptool.write.distributed.staging import Staging

ROOT = Path(__file__).resolve().parent.parent
HOST = socket.gethostname()

KILLED = """
import os, signal, sys
from ckptool.write.distributed import staging
when = os.environ["KILL_WHEN"]
real = staging.Staging.commit
def commit(self, *args):
    if when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    real(self, *args)
    os.kill(os.getpid(), signal.SIGKILL)
staging.Staging.commit = commit
sys.argv[0] = "ckptool"
from ckptool.cli.main import entry
entry()
"""


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lost_commit") / "w.pt"
    g = torch.Generator().manual_seed(7)
    torch.save({f"w{i}": torch.randn(128, 128, generator=g) for i in range(6)}, path)
    return path


@pytest.fixture
def workers_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in clean_env().items():
        monkeypatch.setenv(name, value)
    for name in ("RANK", "SLURM_PROCID", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_SIGNALS_TO_HANDLE",
                 "CKPTOOL_RANK_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(("name", "options"), [
    ("o.safetensors", []), ("o_hf", ["--format", "hf", "--max-shard-size", "40KB"])])
def test_workers_rank_0_killed_after_it_committed(
        src: Path, tmp_path: Path, name: str, options: list[str], workers_env: None,
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KILL_WHEN", "after")
    out = tmp_path / name
    with pytest.raises(RankFailedError) as caught:
        launch.run_workers(2, ["convert", str(src), str(out), *options], output=str(out),
                           _command=["-c", KILLED])
    assert (caught.value.message, caught.value.hint, caught.value.exit_code) == (
        f"rank 0 of 2 was lost after it committed {out}: the output is complete",
        f"no re-run is needed; check it with: ckptool verify {out}", 4)
    assert capfd.readouterr().err == ""  # the workers said nothing more
    assert out.exists()


def test_workers_rank_0_killed_at_the_commit_over_an_old_output(
        src: Path, tmp_path: Path, workers_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """--force over an OUT there already: killed before its commit, rank 0
    committed nothing, and OUT (the old one) is no proof of a commit."""
    monkeypatch.setenv("KILL_WHEN", "before")
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"the old one")
    with pytest.raises(RankFailedError) as caught:
        launch.run_workers(2, ["convert", str(src), str(out), "--force"], output=str(out),
                           _command=["-c", KILLED])
    assert caught.value.message == "rank 0 of 2 was killed by SIGKILL"
    assert caught.value.hint.startswith("nothing was committed; run the same command again")
    assert out.read_bytes() == b"the old one"


def test_torchrun_rank_0_killed_after_it_committed(src: Path, tmp_path: Path) -> None:
    """torchrun stops rank 1 (SIGTERM) once rank 0 died: rank 1 says it, once."""
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    out = tmp_path / "o.safetensors"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script),
         "convert", str(src), str(out)], capture_output=True, text=True, cwd=ROOT, timeout=120,
        env={**clean_env(), "CKPTOOL_DISTRIBUTED": "1", "KILL_WHEN": "after"})
    said = [line for line in done.stderr.splitlines() if line.startswith(("ckptool:", "hint:"))]
    assert said == [
        f"ckptool: error: rank 0 of 2 was lost after it committed {out}: the output is complete",
        f"hint: no re-run is needed; check it with: ckptool verify {out}"], done.stderr
    assert out.exists()


def _single_rank(src: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``convert --force`` as one process resuming a distributed run (the
    path torchrun's rank 0 takes); its exit code and what it said."""
    from ckptool.cli.convert_dist import run_distributed

    with pytest.raises(click.exceptions.Exit) as caught:
        run_distributed(None, str(src), str(out), True, False, True, {})
    return caught.value.exit_code, capsys.readouterr().err


def _sigterm(*args: Any) -> None:
    """Where the SIGTERM handler raises (``run_distributed``'s, under torchrun)."""
    raise Terminated("stopped by SIGTERM: the launcher or the scheduler stopped the job "
                     "(another process failed, or it was cancelled or ran out of time)",
                     lost.RESUME)


def test_a_sigterm_before_rank_0_began_is_no_commit(src: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"the old one")  # (and no staging directory)
    monkeypatch.setattr(Coordinator, "start", _sigterm)
    code, err = _single_rank(src, out, capsys)
    assert code == 143
    assert err.splitlines()[0].startswith("ckptool: error: stopped by SIGTERM: the launcher")
    assert "committed" not in err.splitlines()[0] and "complete" not in err
    assert out.read_bytes() == b"the old one"


def test_a_sigterm_after_the_commit_says_it(src: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"the old one")
    real = Coordinator.publish

    def publish(self: Coordinator, key: str, value: str) -> None:
        if key == "outcome":  # OUT is in place
            _sigterm()
        real(self, key, value)

    monkeypatch.setattr(Coordinator, "publish", publish)
    code, err = _single_rank(src, out, capsys)
    assert (code, err.splitlines()) == (143, [
        f"ckptool: error: stopped by SIGTERM after {out} was committed",
        f"hint: the output is complete; check it with: ckptool verify {out}"])
    assert out.read_bytes() != b"the old one"


class Stopped(Exception):
    """This test's own SIGTERM handler ran."""


def _stopped(signum: int, frame: FrameType | None) -> None:
    raise Stopped


def test_a_sigterm_before_the_workers_start_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    """(The launcher takes SIGTERM over only as it starts the workers; before,
    importing torch takes a second or more.)"""
    monkeypatch.setattr(launch, "_remove_stale",
                        lambda folder: os.kill(os.getpid(), signal.SIGTERM))
    before = signal.signal(signal.SIGTERM, _stopped)
    try:
        with pytest.raises(CkptoolError) as caught:
            launch.run_workers(2, ["--version"])
        assert signal.getsignal(signal.SIGTERM) is _stopped  # put back
    finally:
        signal.signal(signal.SIGTERM, before)
    assert (caught.value.message, caught.value.hint, caught.value.exit_code) == (
        "stopped by SIGTERM before the workers started",
        "nothing was written; run the same command again", 143)


# a worker: says it started (a file named for its rank), rank 0 records
# what it would commit (the file argv[2], when argv[3] says so), and waits
WAITS = """
import os, pathlib, sys, time
from ckptool.write.distributed import lost
if os.environ["RANK"] == "0" and sys.argv[3] == "committed":
    lost.tell_launcher(lost.identity(sys.argv[2]))
pathlib.Path(sys.argv[1], os.environ["RANK"]).touch()
time.sleep(60)
"""


@pytest.mark.parametrize("state", ["committed", "there before"])
def test_a_sigterm_to_the_workers_says_what_out_is(tmp_path: Path, state: str,
                                                   workers_env: None) -> None:
    started = tmp_path / "started"
    started.mkdir()
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"an output")

    def stop() -> None:
        deadline = time.monotonic() + 60
        while len(os.listdir(started)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.signal(signal.SIGTERM, _stopped)
    threading.Thread(target=stop, daemon=True).start()
    try:
        with pytest.raises(CkptoolError) as caught:
            launch.run_workers(2, [str(started), str(out), state], output=str(out),
                               _command=["-c", WAITS])
    finally:
        signal.signal(signal.SIGTERM, before)
    assert caught.value.exit_code == 143
    if state == "committed":
        assert (caught.value.message, caught.value.hint) == (
            f"stopped by SIGTERM after {out} was committed: the workers were stopped",
            f"the output is complete; check it with: ckptool verify {out}")
    else:
        assert (caught.value.message, caught.value.hint) == (
            "stopped by SIGTERM: the workers were stopped",
            f"nothing was committed: {out} is the one there before; run the same command "
            "again")


def _failure(rank: int, exitcode: int) -> ProcessFailure:
    made = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode,
                          error_file="/nonexistent/error.json")
    made.timestamp = 7
    return made


def test_a_worker_killed_after_the_commit_is_said_with_it(tmp_path: Path) -> None:
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"committed")
    exc = ChildFailedError("python", {1: _failure(1, -9), 0: _failure(0, -15)})
    with pytest.raises(RankFailedError) as caught:
        launch._failed(exc, 2, str(out), lost.identity(out))
    assert caught.value.message == (f"rank 1 of 2 was killed by SIGKILL after rank 0 "
                                    f"committed {out}: the output is complete")
    other = tmp_path / "other"
    other.write_bytes(b"another file")
    with pytest.raises(RankFailedError, match=r"^rank 1 of 2 was killed by SIGKILL$"):
        launch._failed(exc, 2, str(out), lost.identity(other))


def test_committed_is_the_staged_inode_and_nothing_else(tmp_path: Path) -> None:
    out = tmp_path / "o.safetensors"
    staging = Staging(str(out), False)
    staging.path.mkdir()
    staged = staging.placed("o.safetensors")
    staged.write_bytes(b"new")
    placed = lost.identity(staged)
    out.write_bytes(b"old")  # there before (--force), the staging directory beside it
    assert not lost.committed(str(out), placed)
    staged.unlink()
    staging.path.rmdir()  # (the staging directory gone: no proof of anything)
    assert not lost.committed(str(out), placed)
    assert not lost.committed(str(out), None)
    directory = Staging(str(tmp_path / "hf"), True)
    directory.path.mkdir()
    placed = lost.identity(directory.placed(""))
    os.rename(directory.path, tmp_path / "hf")  # what Staging.commit does
    assert lost.committed(str(tmp_path / "hf"), placed)
    link = tmp_path / "link.safetensors"
    link.symlink_to(tmp_path / "hf")  # (through a link: what it leads to)
    assert lost.committed(str(link), placed)


@pytest.mark.parametrize("rank0", ["said it and left", "killed", "killed after the commit"])
def test_a_sigterm_to_rank_1_speaks_only_for_a_rank_0_killed(
        tmp_path: Path, rank0: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun stops the rest (SIGTERM) once a process exited: rank 1
    speaks only where rank 0 died without a word, never after rank 0 said
    why it stopped (its own SIGTERM) and left."""
    import torch.distributed as dist

    from ckptool.write.distributed import ending

    monkeypatch.delenv(lost.WORKERS, raising=False)
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"committed")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    store = dist.HashStore()
    store.set("pid/0", f"{gone} node0")
    if rank0 == "said it and left":
        store.set("said", "1")
    coord = Coordinator(store, 1, 2, "node0", target=str(out))
    coord.pids[1], coord.nodes[1] = os.getpid(), "node0"
    coord.placed = lost.identity(out)
    coord._finished = rank0 == "killed after the commit"
    said: list[CkptoolError] = []
    left = ending.leave(coord, Terminated("stopped by SIGTERM", ""), said.append)
    assert isinstance(left, ending.Quiet)
    assert [s.message for s in said] == {
        "said it and left": [],
        "killed": ["rank 0 of 2 (node0): was killed (its process is gone: kill -9, or the OOM "
                   "killer)"],
        "killed after the commit": [f"rank 0 of 2 was lost after it committed {out}: the "
                                    "output is complete"]}[rank0]
    assert left.exit_code == (143 if rank0 == "said it and left" else 4)
