"""Where this process stands among the processes of a distributed convert,
and joining them.

``detect`` reads what the launcher said in the environment (no torch):
``torchrun`` (or ``convert --workers N``: torch's elastic agent), another
``env://`` launcher (``RANK``/``WORLD_SIZE``), or a step of SLURM's ``srun``
without torchrun; ``CKPTOOL_DISTRIBUTED=0`` says "a plain process" whatever
they say, and a ckptool that a training script runs (inheriting its
``RANK``...) is one too (``ancestry``, which looks through wrappers such
as ``flock`` or ``uv run`` between the launcher and ckptool). A malformed
variable is a ``LaunchError``; ``quiet_rank``: whether this process leaves
a usage error to rank 0 to say. ``join`` meets the others
(``torch.distributed.rendezvous("env://")``, every rank counted in on its
store) and hands back a ``World``: this rank, the number of ranks, a
key-value store all share, scoped to the attempt (torchrun
``--max-restarts`` keeps one store for all). ``World.ensure_group`` makes the
gloo group only ``dcp.save`` needs; the other outputs coordinate through the
store. A rank left waiting says so on stderr after 10 s, then every minute,
and gives up after ``CKPTOOL_JOIN_TIMEOUT`` seconds (1800). ``alone_with``:
a ``World`` of threads over one store, for tests.

srun(1), OUTPUT ENVIRONMENT VARIABLES: a task of a step has ``SLURM_STEP_ID``
("the step ID of the current job"), ``SLURM_STEP_NUM_TASKS`` ("number of
processes in the step"), ``SLURM_STEP_NODELIST`` ("list of nodes allocated to
the step"), first here (a step may use part of the allocation); a salloc
shell or a batch script has ``SLURM_PROCID=0``, the job's ``SLURM_NTASKS``,
no step, and is one process. Rank 0's host and the port are Lightning's
(``SLURMEnvironment.main_port``, ``src/lightning/fabric/plugins/
environments/slurm.py``: the job id's last four characters plus 15000, 12910
without one, ``MASTER_PORT`` when set), so that ckptool and a Lightning job
agree; ``expand_nodelist`` expands a node list as ``scontrol show hostnames``
does, where Lightning uses two regular expressions.
"""

from __future__ import annotations

import atexit
import os
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ckptool.errors import UsageError
from ckptool.write.distributed import ancestry
from ckptool.write.distributed.coordinate import seconds
from ckptool.write.distributed.nodelist import expand_nodelist  # (world.expand_nodelist)
from ckptool.write.distributed.quietly import saying_waiting, stderr_held

# Lightning's SLURMEnvironment.main_port: job id's last 4 digits + 15000
SLURM_PORT_BASE = 15000
SLURM_PORT_WITHOUT_JOB = 12910
JOIN_TIMEOUT = 1800.0  # seconds, unless CKPTOOL_JOIN_TIMEOUT says otherwise
SAY_WAITING_AFTER, SAY_WAITING_EVERY = 10.0, 60.0  # seconds


# the variables a launcher sets apart for each process: an error in one of
# them is that process's own, which rank 0 may not share
PER_RANK = frozenset({"RANK", "SLURM_PROCID", "LOCAL_RANK", "SLURM_LOCALID"})


class LaunchError(UsageError):
    """What the launcher's variables say is malformed. ``shared``: every
    process of the launch sees the same error (it names no variable set per
    process), so rank 0 alone need say it."""

    def __init__(self, message: str, hint: str = "", *, shared: bool = True) -> None:
        super().__init__(message, hint)
        self.shared = shared


@dataclass(frozen=True)
class Launch:
    """What the environment says about this process, before joining."""

    rank: int
    size: int
    local_rank: int
    launcher: str  # "torchrun", "env" or "slurm"
    master_addr: str  # where rank 0's rendezvous listens
    master_port: int
    node: str  # this machine's hostname


def detect(environ: Mapping[str, str] = os.environ) -> Launch | None:
    """The launch this process is part of, or None for a plain process.

    ``CKPTOOL_DISTRIBUTED=0``: None (1 or unset: look; else a UsageError).
    ``RANK`` set: torchrun (``TORCHELASTIC_RUN_ID`` set too; a Launch even for
    one process) or another env:// launcher (one process is a plain one).
    Else ``SLURM_PROCID`` in an srun step (``SLURM_STEP_ID``) of more than one
    task (``SLURM_STEP_NUM_TASKS``, else ``SLURM_NTASKS``): one task is a
    plain process. Malformed values are a UsageError naming the variable.
    """
    opted = environ.get("CKPTOOL_DISTRIBUTED", "").strip()
    if opted not in ("", "0", "1"):
        raise LaunchError(f"CKPTOOL_DISTRIBUTED={opted!r}: expected 0 or 1",
                          hint="CKPTOOL_DISTRIBUTED=0 runs ckptool as one plain process "
                          "whatever the launcher's variables (RANK, SLURM_PROCID) say")
    if opted == "0":
        return None
    node = environ.get("SLURMD_NODENAME") or socket.gethostname()
    if environ is os.environ and opted != "1" and _started_by_a_rank(environ):
        return None  # a training script's subprocess: its variables are the script's
    if "RANK" in environ:
        launcher = "torchrun" if environ.get("TORCHELASTIC_RUN_ID") else "env"
        size = _number(environ, "WORLD_SIZE", None, low=1, hint="set WORLD_SIZE to the "
                       "number of processes, as torchrun does")
        rank = _rank(environ, "RANK", size, "WORLD_SIZE")
        if size == 1 and launcher == "env":
            return None
        local_rank = _number(environ, "LOCAL_RANK", 0, low=0)
        addr = environ.get("MASTER_ADDR", "").strip()
        if not addr:
            raise LaunchError("MASTER_ADDR is not set: RANK and WORLD_SIZE are, but not where "
                             "rank 0 listens",
                             hint="set MASTER_ADDR to rank 0's host and MASTER_PORT to a free "
                             "port on it, or launch with torchrun")
        port = _port(environ, "MASTER_PORT", None)
        return Launch(rank, size, local_rank, launcher, addr, port, node)
    tasks = next((n for n in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if n in environ), "")
    if "SLURM_PROCID" not in environ or not tasks or \
            not re.fullmatch(r"[0-9]+", environ.get("SLURM_STEP_ID", "").strip()):
        return None  # no srun step: a salloc shell, a batch script, no SLURM
    size = _number(environ, tasks, None, low=1,
                   hint="run ckptool under srun, which sets it to the number of tasks")
    rank = _rank(environ, "SLURM_PROCID", size, tasks)
    if size == 1:
        return None
    local_rank = _number(environ, "SLURM_LOCALID", 0, low=0)
    addr = environ.get("MASTER_ADDR", "").strip() or _first_host(environ)
    port = _port(environ, "MASTER_PORT", _slurm_port(environ))
    return Launch(rank, size, local_rank, "slurm", addr, port, node)


def _started_by_a_rank(environ: Mapping[str, str]) -> bool:
    """Whether one of the job's processes (a training script) started this
    one rather than the launcher (``ancestry``); a program in between that
    ckptool cannot judge is a LaunchError saying how to decide."""
    found = ancestry.started_by_a_rank(environ)
    if not isinstance(found, ancestry.Ambiguous):
        return found
    name = "RANK" if "RANK" in environ else "SLURM_PROCID"
    raise LaunchError(f"{name} is set, but ckptool cannot tell whether the launcher started it "
                      f"(through {found.command!r}, pid {found.pid}) or one of the job's "
                      "processes runs it",
                      hint="set CKPTOOL_DISTRIBUTED=1 if the launcher started this ckptool on "
                      "each process (through that program), CKPTOOL_DISTRIBUTED=0 if one of "
                      "the job's processes runs it alone")


def quiet_rank(err: UsageError | None = None, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process leaves a usage error (``err``; None: one of the
    command line) unsaid, as rank 0 says it: it is a rank other than 0 of a
    launch, and the error is one every rank meets alike."""
    if isinstance(err, LaunchError) and not err.shared:
        return False
    try:
        found = detect(environ)
    except LaunchError as exc:  # (then the rank from its variable alone)
        if not exc.shared:
            return False
        name = "RANK" if "RANK" in environ else "SLURM_PROCID"
        text = environ.get(name, "").strip()
        return environ.get("CKPTOOL_DISTRIBUTED", "").strip() != "0" and \
            text.isdigit() and int(text) > 0
    return found is not None and found.rank != 0


@dataclass
class World:
    """This rank among ``size`` ranks, and the store they share."""

    rank: int
    size: int
    store: Any  # a torch.distributed Store: PrefixStore "ckptool/attempt{n}" over the rendezvous's
    launch: Launch | None
    node: str
    _group_store: Any = field(default=None, repr=False)  # "pg/attempt{n}"; None: alone_with
    _timeout: float = field(default=JOIN_TIMEOUT, repr=False)
    _owns_group: bool = field(default=False, repr=False)

    def ensure_group(self) -> None:
        """Make the gloo process group over the store, once: collective, every
        rank calls it at the same point. A group made already (by this World,
        or by the program that runs ckptool) is the one. A failure to connect
        is a one-line UsageError."""
        import torch.distributed as dist

        if self._owns_group or dist.is_initialized():
            return
        if self._group_store is None or self.launch is None:
            raise AssertionError("a World of alone_with has no process group: run its ranks "
                                 "as processes (join) for a DCP output")
        where = f"{self.launch.master_addr}:{self.launch.master_port}"
        with stderr_held():
            try:
                dist.init_process_group("gloo", store=self._group_store, rank=self.rank,
                                        world_size=self.size,
                                        timeout=timedelta(seconds=self._timeout))
            except (RuntimeError, ValueError) as exc:
                raise UsageError(
                    f"rank {self.rank} of {self.size} met the others at {where} "
                    f"({self.launch.launcher}) but gloo could not connect them: "
                    f"{_first_line(exc)}",
                    hint="gloo connects every pair of ranks on the interface this host's "
                    "name resolves to: set GLOO_SOCKET_IFNAME to the network interface the "
                    "machines share (e.g. eth0)") from None
        self._owns_group = True
        # a process that exits with its gloo group alive aborts in the C++
        # teardown ("terminate called without an active exception", exit 134)
        atexit.register(self.close)

    def close(self) -> None:
        """Destroy the process group if this World made it; again, nothing."""
        if not self._owns_group:
            return
        self._owns_group = False
        atexit.unregister(self.close)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def join(launch: Launch, timeout: float | None = None) -> World:
    """Meet the other ranks: the rendezvous, then every rank counted in on the
    store (its keys, and the group's, scoped to the attempt of torchrun).

    ``timeout`` (seconds): ``CKPTOOL_JOIN_TIMEOUT``'s unless given. A failure
    to meet them (not all there in time, the port taken) is a one-line
    UsageError naming MASTER_ADDR:MASTER_PORT and the launcher: UsageError
    rather than InputError, as nothing read was wrong; it is how the
    processes were launched (their address, port, number) that needs
    changing, as for any other command-line mistake.
    """
    if timeout is None:
        timeout = join_timeout()
    attempt = _number(os.environ, "TORCHELASTIC_RESTART_COUNT", 0, low=0)
    if launch.launcher == "slurm":
        for name, value in (("MASTER_ADDR", launch.master_addr),
                            ("MASTER_PORT", launch.master_port), ("RANK", launch.rank),
                            ("WORLD_SIZE", launch.size), ("LOCAL_RANK", launch.local_rank)):
            os.environ.setdefault(name, str(value))
    if "torch" not in sys.modules:  # read once, as libc10 loads: no C++ stack dumps
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # when rank 0's store goes
    import torch.distributed as dist

    wait = timedelta(seconds=timeout)
    where = f"{launch.master_addr}:{launch.master_port}"
    # c10d logs each failed try with its C++ stack on fd 2, beside the
    # exception it raises: held back, and said as one line if it fails
    others = f"{launch.size - 1} process{'es' if launch.size > 2 else ''}"
    waiting = f"ckptool: waiting for {others} at {where} ({launch.launcher}) ..."
    with stderr_held() as say, saying_waiting(say, waiting, SAY_WAITING_AFTER,
                                              SAY_WAITING_EVERY):
        try:
            store, rank, size = next(dist.rendezvous("env://", timeout=wait))
            scoped = dist.PrefixStore(f"ckptool/attempt{attempt}", store)
            if scoped.add("world/arrived", 1) == size:
                scoped.set("world/met", "1")
            scoped.wait(["world/met"], wait)
        except (RuntimeError, ValueError) as exc:
            raise _meeting_failed(launch, where, exc, timeout) from None
    return World(rank, size, scoped, launch, launch.node,
                 _group_store=dist.PrefixStore(f"pg/attempt{attempt}", store), _timeout=timeout)


def join_timeout(environ: Mapping[str, str] = os.environ) -> float:
    """``CKPTOOL_JOIN_TIMEOUT`` in seconds (a positive number), else 1800."""
    return seconds("CKPTOOL_JOIN_TIMEOUT", JOIN_TIMEOUT, "how long a process waits for the "
                   "others to start", environ)


def alone_with(store: Any, rank: int, size: int) -> World:
    """A World over ``store`` (one ``dist.HashStore()`` that ranks running as
    threads share) without a process group: for tests."""
    import torch.distributed as dist

    return World(rank, size, dist.PrefixStore("ckptool", store), None, socket.gethostname())


def _number(environ: Mapping[str, str], name: str, default: int | None, *, low: int,
            hint: str = "") -> int:
    text = environ.get(name, "").strip()
    if not text and default is not None:
        return default
    if not re.fullmatch(r"\d+", text) or int(text) < low:
        said = f"{name}={text!r}" if text else f"{name} is not set"
        raise LaunchError(f"{said}: expected a whole number"
                          f"{f' of at least {low}' if low else ''}",
                          hint=hint or f"unset {name} or set it as the launcher would",
                          shared=name not in PER_RANK)
    return int(text)


def _rank(environ: Mapping[str, str], name: str, size: int, size_name: str) -> int:
    rank = _number(environ, name, None, low=0, hint=f"{name} numbers this process from 0 to "
                   f"{size_name} - 1: launch with torchrun or srun, which set it")
    if rank >= size:
        raise LaunchError(f"{name}={rank} is not below {size_name}={size}",
                          hint=f"{name} numbers this process from 0 to {size_name} - 1: "
                          "check what the launcher set", shared=False)
    return rank


def _port(environ: Mapping[str, str], name: str, default: int | None) -> int:
    port = _number(environ, name, default, low=1,
                   hint=f"set {name} to a free TCP port (1-65535) on rank 0's host")
    if port > 65535:
        raise LaunchError(f"{name}={port} is no TCP port",
                          hint=f"set {name} to a free TCP port (1-65535) on rank 0's host")
    return port


def _slurm_port(environ: Mapping[str, str]) -> int:
    """Lightning's port: the last 4 characters of the job id plus 15000."""
    job = environ.get("SLURM_JOB_ID", "").strip()
    if not job:
        return SLURM_PORT_WITHOUT_JOB
    if not job[-4:].isdigit():
        raise LaunchError(f"SLURM_JOB_ID={job!r}: expected a number, to derive the "
                          "rendezvous port from",
                          hint="set MASTER_PORT to a free port on rank 0's host")
    return int(job[-4:]) + SLURM_PORT_BASE


def _first_host(environ: Mapping[str, str]) -> str:
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        text = environ.get(name, "").strip()
        if text:
            try:
                return expand_nodelist(text)[0]
            except ValueError as exc:
                raise LaunchError(f"{name}={text!r} is no SLURM node list: {exc}",
                                  hint="set MASTER_ADDR to rank 0's host") from None
    raise LaunchError("SLURM_STEP_NODELIST is not set: SLURM_PROCID says this is one of "
                      "several tasks, but not where rank 0 listens",
                      hint="run ckptool under srun inside an allocation, or set MASTER_ADDR")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _meeting_failed(launch: Launch, where: str, exc: BaseException,
                    timeout: float) -> UsageError:
    said = _first_line(exc)
    if "EADDRINUSE" in said or "address already in use" in said.lower():
        hint = (f"another program listens on port {launch.master_port}: set MASTER_PORT to "
                "a free port" + (" (under SLURM it comes from the job id, and jobs sharing a "
                                 "node can collide)" if launch.launcher == "slurm" else ""))
    else:
        hint = (f"start all {launch.size} processes (within {timeout:g} s of each other: "
                f"CKPTOOL_JOIN_TIMEOUT) with the same MASTER_ADDR and MASTER_PORT, where rank "
                f"0 runs and the others can reach it")
    return UsageError(f"rank {launch.rank} of {launch.size} could not meet the others at "
                      f"{where} ({launch.launcher}): {said}", hint=hint)
