"""Who started this ckptool: the launcher (directly, or through programs
that run a command for it), or a process of the job it launched (a training
script running ``ckptool`` as a subprocess, which passes on its ``RANK`` or
``SLURM_PROCID``). Read from ``/proc`` (Linux only).

Walking up from the parent, the processes that hold the same rank variable
with the same value are the job's; the first that does not is the launcher
(torchrun's agent, ``slurmstepd``). Each of the job's processes on the way
must be a wrapper: a shell, a program named for running another (``env``,
``flock``, ``strace``, ``apptainer``...), or one whose command line holds
ckptool's own arguments (``uv run ckptool convert A B``, ``conda run ...``:
it was told to run this very command). A Python process that is none of
these is a training script: ckptool is then no rank of the job. Any other
program is something ckptool cannot judge, and says so (``Ambiguous``)
rather than guess: N plain conversions of one output, racing, are never
right, and neither is a plain process waiting for N - 1 peers.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# programs that run the command they are given: looked through
WRAPPERS = frozenset({
    "sh", "bash", "dash", "zsh", "ksh", "fish", "env", "time", "timeout", "nice", "nohup",
    "stdbuf", "numactl", "taskset", "flock", "strace", "ltrace", "setsid", "ionice", "chrt",
    "prlimit", "unshare", "nsenter", "xargs", "valgrind", "perf", "nsys", "apptainer",
    "singularity", "starter", "starter-suid", "Apptainer runtime parent",
    "Singularity runtime parent", "uv", "uvx", "conda", "mamba", "micromamba", "pixi",
    "poetry", "pipenv", "hatch", "rye"})
PYTHON = re.compile(r"(python|pypy)[0-9.]*[a-z]*")
DEPTH = 16  # ancestors looked at, at most


@dataclass(frozen=True)
class Ambiguous:
    """A process that holds this one's rank variable, and is neither a known
    wrapper nor a Python process: ``command`` (its program), ``pid``."""

    command: str
    pid: int


def started_by_a_rank(environ: Mapping[str, str],
                      args: Sequence[str] | None = None) -> bool | Ambiguous:
    """True when a process of the job started this one; False when the
    launcher did (past wrappers), or when ``/proc`` cannot tell; an
    ``Ambiguous`` for a program in between that ckptool cannot judge.
    ``args``: this process's arguments (``sys.argv[1:]``)."""
    name = "RANK" if "RANK" in environ else "SLURM_PROCID" if "SLURM_PROCID" in environ \
        else None
    if name is None:
        return False
    mine = f"{name}={environ[name]}".encode()
    args = list(sys.argv[1:] if args is None else args)
    pid = os.getppid()
    for _ in range(DEPTH):
        seen = _process(pid)
        if seen is None:  # gone, or another user's: as before, a rank
            return False
        command, theirs, parent = seen
        if mine not in theirs:
            return False  # the launcher: every process below it is a wrapper
        program = os.path.basename(command[0]) if command else ""
        if program not in WRAPPERS and not _runs(command, args):
            if PYTHON.fullmatch(program):
                return True
            return Ambiguous(program or "?", pid)
        pid = parent
    return False


def _process(pid: int) -> tuple[list[str], list[bytes], int] | None:
    """(command line, environment, parent's pid) of ``pid``; None if unreadable."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = [a.decode(errors="replace") for a in f.read().split(b"\0")[:-1]]
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
        with open(f"/proc/{pid}/stat", "rb") as f:
            parent = int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return command, environ, parent


def _runs(command: list[str], args: list[str]) -> bool:
    """Whether ``command`` holds ``args`` in a row, after its program: it was
    given this process's own command to run."""
    n = len(args)
    if n == 0:
        return False
    return any(command[i:i + n] == args for i in range(1, len(command) - n + 1))
