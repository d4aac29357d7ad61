"""Rank 0 lost: hung (SIGSTOP) or killed, before or after it committed the
output. Every other rank watches rank 0's beat (and, under srun, the store
that lives in rank 0's process, whose calls may never return once it is
stopped); one rank says what happened, once, and what it says of the output
is true: "nothing was committed" only when nothing was.

The srun cases are real processes: rank 0 is ckptool with one step of its
own replaced (``RANK0``), so that it stops or dies at that very point.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptool.errors import CkptoolError, RankFailedError
from ckptool.write.distributed import world
from ckptool.write.distributed.ending import Quiet
from ckptool.write.distributed.run import convert as convert_rank

ROOT = Path(__file__).resolve().parent.parent
HOST = socket.gethostname()
WAIT = 60  # seconds: a rank that hangs fails the test after this

# rank 0 as ckptool, but for one step: at it, it sends itself a signal
RANK0 = """
import os, signal, sys
from ckptool.write.distributed import coordinate
where, sig = sys.argv.pop(1), getattr(signal, sys.argv.pop(1))
real = getattr(coordinate.Coordinator, where)
def step(self, *args):
    if where != "publish" or args[0] == "outcome":
        os.kill(os.getpid(), sig)
    return real(self, *args)
setattr(coordinate.Coordinator, where, step)
from ckptool.cli.main import entry
entry()
"""


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hung") / "w.pt"
    g = torch.Generator().manual_seed(5)
    torch.save({f"w{i}": torch.randn(256, 256, generator=g) for i in range(8)}, path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def srun_pair(src: Path, out: Path, where: str, sig: str) -> list[subprocess.Popen[str]]:
    """Two tasks of an srun step (its environment set by hand); rank 0 sends
    itself ``sig`` at ``Coordinator.<where>``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "CKPTOOL_")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CKPTOOL_DISTRIBUTED="1",
               CKPTOOL_RANK_TIMEOUT="3", SLURM_NTASKS="2", SLURM_STEP_ID="0",
               SLURM_STEP_NUM_TASKS="2", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="localhost",
               MASTER_PORT=str(free_port()))
    args = ["convert", str(src), str(out)]
    first = [sys.executable, "-c", RANK0, where, sig]
    return [subprocess.Popen([*(first if r == 0 else [sys.executable, "-m", "ckptool"]), *args],
                             env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(2)]


def rank1_after(tasks: list[subprocess.Popen[str]]) -> tuple[int, str]:
    """Rank 1's exit code and stderr; rank 0 killed, whatever it was doing."""
    try:
        _, err = tasks[1].communicate(timeout=WAIT)
    finally:
        for task in tasks:
            if task.poll() is None:
                task.kill()
            task.communicate()
    return tasks[1].returncode, err


def test_rank_0_hung_with_the_store_alive(src: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun: the store is its agent's and answers; rank 0 joined, beat
    once, and stands still. Rank 1 says so after CKPTOOL_RANK_TIMEOUT
    (it waited for rank 0 forever before)."""
    import torch.distributed as dist

    from ckptool.write.distributed.coordinate import Coordinator

    monkeypatch.setenv("CKPTOOL_RANK_TIMEOUT", "1")
    store = dist.HashStore()
    hung = Coordinator(world.alone_with(store, 0, 2).store, 0, 2, "node0")
    hung.store.set("pid/0", f"{os.getpid()} node0")
    hung._beat()
    said: list[CkptoolError] = []
    out: list[Any] = []

    def rank1() -> None:
        try:
            out.append(convert_rank(world.alone_with(store, 1, 2), str(src),
                                    str(tmp_path / "o.safetensors"), say=said.append))
        except Quiet as exc:
            out.append(exc.exit_code)

    thread = threading.Thread(target=rank1, daemon=True)
    thread.start()
    thread.join(WAIT)
    assert out == [4]
    assert len(said) == 1 and isinstance(said[0], RankFailedError)
    assert said[0].message == "rank 0 of 2 (node0): stopped answering for 1 s (killed, " \
        "stopped, or its machine was lost)"
    assert said[0].hint.startswith("nothing was committed; run the same command again")


def test_rank_0_stopped_with_the_store_in_it(src: Path, tmp_path: Path) -> None:
    """srun: the store lives in rank 0's process; stopped (SIGSTOP), a call
    to it never returns. Rank 1 says so once CKPTOOL_RANK_TIMEOUT passed."""
    out = tmp_path / "o.safetensors"
    code, err = rank1_after(srun_pair(src, out, "wait_all_finished", "SIGSTOP"))
    assert (code, err.splitlines()) == (4, [
        f"ckptool: error: rank 0 of 2 ({HOST}): the rendezvous store it held stopped "
        "answering for 3 s (killed, stopped, or its machine was lost)",
        "hint: nothing was committed; run the same command again to resume: what was written "
        "and verified is kept"]), err
    assert not out.exists()


def test_rank_0_killed_before_the_commit(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.safetensors"
    code, err = rank1_after(srun_pair(src, out, "wait_all_finished", "SIGKILL"))
    assert (code, err.splitlines()) == (4, [
        f"ckptool: error: rank 0 of 2 ({HOST}): the rendezvous store it held went away "
        "(killed, stopped, or its machine was lost)",
        "hint: nothing was committed; run the same command again to resume: what was written "
        "and verified is kept"]), err
    assert not out.exists()


def test_rank_0_killed_just_after_the_commit(src: Path, tmp_path: Path) -> None:
    """OUT renamed into place, then rank 0 killed before it told the others:
    OUT is complete, and rank 1 says so (a re-run would only find it there)."""
    out = tmp_path / "o.safetensors"
    code, err = rank1_after(srun_pair(src, out, "publish", "SIGKILL"))
    assert (code, err.splitlines()) == (4, [
        f"ckptool: error: rank 0 of 2 was lost after it committed {out}: the output is "
        "complete", f"hint: no re-run is needed; check it with: ckptool verify {out}"]), err
    assert out.exists()
