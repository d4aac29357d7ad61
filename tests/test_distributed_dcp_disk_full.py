"""A DCP output of many processes on a filesystem that fills up: said once,
as the full disk it is (``no space left on device``), as one process says
it, not as torch's zip writer's ``unexpected pos`` "likely a bug". (torch
hands each rank's error to every rank pickled, which drops the ``OSError``
behind it.)

Both ranks are ckptool with the filesystem made full (``FULL``): a write
to a ``.distcp`` file fails with ENOSPC after its first 4 kB, as a full
disk's does, and the filesystem says it has no room left.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

FULL = """
import errno, os, shutil
from collections import namedtuple
from contextlib import contextmanager
from torch.distributed.checkpoint import filesystem

class Full:
    def __init__(self, f):
        self.f, self.n = f, 0
    def write(self, data):
        self.n += memoryview(data).nbytes
        if self.n > 4096:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.f.write(data)
    def __getattr__(self, name):
        return getattr(self.f, name)

real = filesystem.FileSystem.create_stream
@contextmanager
def create_stream(self, path, mode):
    with real(self, path, mode) as f:
        yield Full(f) if str(path).endswith(".distcp") else f
filesystem.FileSystem.create_stream = create_stream
Usage = namedtuple("Usage", "total used free")
shutil.disk_usage = lambda path: Usage(1 << 30, 1 << 30, 0)
from ckptool.cli.main import entry
entry()
"""


def test_a_full_disk_is_said_once_as_one(tmp_path: Path) -> None:
    src, out = tmp_path / "w.pt", tmp_path / "dcp"
    g = torch.Generator().manual_seed(7)
    torch.save({f"w{i}": torch.randn(64, 64, generator=g) for i in range(6)}, src)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "CKPTOOL_")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CKPTOOL_DISTRIBUTED="1",
               SLURM_NTASKS="2", SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="2",
               SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="localhost", MASTER_PORT=port)
    tasks = [subprocess.Popen(
        [sys.executable, "-c", FULL, "convert", str(src), str(out), "--format", "dcp"],
        env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}, cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        done = [task.communicate(timeout=120) for task in tasks]
    finally:
        for task in tasks:
            if task.poll() is None:
                task.kill()
    assert [task.returncode for task in tasks] == [3, 3], done
    said = done[0][1].splitlines()
    assert len(said) == 2 and done[1][1] == "", done
    assert said[0].startswith(f"ckptool: error: cannot write {out}: no space left on device ")
    assert said[1].startswith("hint: free space on that filesystem, or write elsewhere; "
                              "nothing was committed; run the same command again to resume")
    assert not out.exists()
