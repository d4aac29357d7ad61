"""A writer killed with ``kill -9`` whose parent has not reaped it yet (a
zombie: ``timeout -s KILL`` under a PID 1 that reaps nothing) runs no more:
its leftovers are litter the next run removes, as those of a reaped one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ckptool.read.layouts.journal_format import alive


def test_a_zombie_is_not_alive() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        for _ in range(200):  # dead, and not reaped: a zombie
            with open(f"/proc/{child.pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    break
            time.sleep(0.01)
        assert not alive(child.pid)
    finally:
        child.wait()
    assert not alive(child.pid)


def test_this_process_is_alive() -> None:
    assert alive(os.getpid())
