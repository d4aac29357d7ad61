"""Where this process stands among the processes of a distributed convert,
and joining them.

``detect`` reads what the launcher said in the environment: ``torchrun`` (or
``convert --workers N``, whose workers torch's elastic agent starts),
any other ``env://`` launcher (``RANK``/``WORLD_SIZE``), or SLURM's ``srun``
without torchrun (``SLURM_PROCID``/``SLURM_NTASKS``). It imports no torch.
``join`` rendezvouses with the others through ``torch.distributed`` (public
API: ``rendezvous("env://")``, then a gloo process group) and hands back a
``World``: this rank, the number of ranks, and a key-value store all share.
``alone_with`` makes a ``World`` of threads over one store, for tests.

Under SLURM the rendezvous is rank 0's host and a port derived from the job
id exactly as Lightning's ``SLURMEnvironment`` does
(``src/lightning/fabric/plugins/environments/slurm.py``, ``main_port``: the
last four characters of ``SLURM_JOB_ID`` plus 15000, 12910 without a job id,
``MASTER_PORT`` when set), so that a job launched for Lightning and one for
ckptool agree. Where Lightning takes the first host of ``SLURM_NODELIST`` with
two regular expressions (``resolve_root_node_address``), ``expand_nodelist``
expands the list as ``scontrol show hostnames`` does.
"""

from __future__ import annotations

import atexit
import os
import re
import socket
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from itertools import product
from typing import Any

from ckptool.errors import UsageError

# Lightning's SLURMEnvironment.main_port: job id's last 4 digits + 15000
SLURM_PORT_BASE = 15000
SLURM_PORT_WITHOUT_JOB = 12910


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

    ``RANK`` set: torchrun (``TORCHELASTIC_RUN_ID`` set too; a Launch even for
    one process) or another env:// launcher (one process is a plain one).
    Else ``SLURM_PROCID`` with ``SLURM_NTASKS`` > 1: a task of ``srun``; one
    task is a plain process, so that ckptool run by hand inside an allocation
    is not distributed. Malformed values are a UsageError naming the variable.
    """
    node = environ.get("SLURMD_NODENAME") or socket.gethostname()
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
            raise UsageError("MASTER_ADDR is not set: RANK and WORLD_SIZE are, but not where "
                             "rank 0 listens",
                             hint="set MASTER_ADDR to rank 0's host and MASTER_PORT to a free "
                             "port on it, or launch with torchrun")
        port = _port(environ, "MASTER_PORT", None)
        return Launch(rank, size, local_rank, launcher, addr, port, node)
    if "SLURM_PROCID" not in environ or "SLURM_NTASKS" not in environ:
        return None
    size = _number(environ, "SLURM_NTASKS", None, low=1,
                   hint="run ckptool under srun, which sets it to the number of tasks")
    rank = _rank(environ, "SLURM_PROCID", size, "SLURM_NTASKS")
    if size == 1:
        return None
    local_rank = _number(environ, "SLURM_LOCALID", 0, low=0)
    addr = environ.get("MASTER_ADDR", "").strip() or _first_host(environ)
    port = _port(environ, "MASTER_PORT", _slurm_port(environ))
    return Launch(rank, size, local_rank, "slurm", addr, port, node)


def expand_nodelist(text: str) -> list[str]:
    """The host names of a SLURM node list, as ``scontrol show hostnames``
    gives them: ``node[01-03,07],gpu-a,rack[1-2]-n[3-4]`` is node01, node02,
    node03, node07, gpu-a, rack1-n3, rack1-n4, rack2-n3, rack2-n4. A range
    keeps the width of its low end (``[08-10]``: 08, 09, 10). ValueError for
    what is no node list (an unclosed bracket, a range that runs backwards).
    """
    hosts: list[str] = []
    for word in _split_top(text.strip()):
        parts = re.split(r"(\[[^\[\]]*\])", word)
        if any(c in part for part in parts[::2] for c in "[]"):
            raise ValueError(f"unbalanced brackets in {word!r}")
        choices = [[part] if i % 2 == 0 else _expand_group(part[1:-1], word)
                   for i, part in enumerate(parts)]
        hosts.extend("".join(pick) for pick in product(*choices))
    if not hosts:
        raise ValueError("no host in the node list")
    return hosts


@dataclass
class World:
    """This rank among ``size`` ranks, and the store they share."""

    rank: int
    size: int
    store: Any  # a torch.distributed Store; a PrefixStore "ckptool/" over the rendezvous's
    launch: Launch | None
    node: str
    _owns_group: bool = field(default=False, repr=False)

    def close(self) -> None:
        """Destroy the process group if this World made it; again, nothing."""
        if not self._owns_group:
            return
        self._owns_group = False
        atexit.unregister(self.close)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def join(launch: Launch, timeout: float = 1800.0) -> World:
    """Rendezvous with the other ranks and make the gloo process group.

    A failure to meet them (nobody listening within ``timeout`` seconds, the
    port taken) is a one-line UsageError naming MASTER_ADDR:MASTER_PORT and
    the launcher. UsageError rather than InputError: nothing read was wrong,
    it is how the processes were launched (their address, their port, their
    number) that needs changing, as for any other command-line mistake.
    """
    if launch.launcher == "slurm":
        for name, value in (("MASTER_ADDR", launch.master_addr),
                            ("MASTER_PORT", launch.master_port), ("RANK", launch.rank),
                            ("WORLD_SIZE", launch.size), ("LOCAL_RANK", launch.local_rank)):
            os.environ.setdefault(name, str(value))
    import torch.distributed as dist

    wait = timedelta(seconds=timeout)
    where = f"{launch.master_addr}:{launch.master_port}"
    # c10d logs each failed try with its C++ stack on fd 2, beside the
    # exception it raises: held back, and said as one line if it fails
    with _stderr_held():
        try:
            store, rank, size = next(dist.rendezvous("env://", timeout=wait))
        except (RuntimeError, ValueError) as exc:
            raise _meeting_failed(launch, where, exc, timeout) from None
        try:
            dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank,
                                    world_size=size, timeout=wait)
        except (RuntimeError, ValueError) as exc:
            raise UsageError(
                f"rank {rank} of {size} met the others at {where} ({launch.launcher}) but "
                f"gloo could not connect them: {_first_line(exc)}",
                hint="gloo connects every pair of ranks on the interface this host's name "
                "resolves to: set GLOO_SOCKET_IFNAME to the network interface the machines "
                "share (e.g. eth0)") from None
    world = World(rank, size, dist.PrefixStore("ckptool", store), launch, launch.node,
                  _owns_group=True)
    # a process that exits with its gloo group alive aborts in the C++
    # teardown ("terminate called without an active exception", exit 134)
    atexit.register(world.close)
    return world


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
        raise UsageError(f"{said}: expected a whole number"
                         f"{f' of at least {low}' if low else ''}",
                         hint=hint or f"unset {name} or set it as the launcher would")
    return int(text)


def _rank(environ: Mapping[str, str], name: str, size: int, size_name: str) -> int:
    rank = _number(environ, name, None, low=0, hint=f"{name} numbers this process from 0 to "
                   f"{size_name} - 1: launch with torchrun or srun, which set it")
    if rank >= size:
        raise UsageError(f"{name}={rank} is not below {size_name}={size}",
                         hint=f"{name} numbers this process from 0 to {size_name} - 1: "
                         "check what the launcher set")
    return rank


def _port(environ: Mapping[str, str], name: str, default: int | None) -> int:
    port = _number(environ, name, default, low=1,
                   hint=f"set {name} to a free TCP port (1-65535) on rank 0's host")
    if port > 65535:
        raise UsageError(f"{name}={port} is no TCP port",
                         hint=f"set {name} to a free TCP port (1-65535) on rank 0's host")
    return port


def _slurm_port(environ: Mapping[str, str]) -> int:
    """Lightning's port: the last 4 characters of the job id plus 15000."""
    job = environ.get("SLURM_JOB_ID", "").strip()
    if not job:
        return SLURM_PORT_WITHOUT_JOB
    if not job[-4:].isdigit():
        raise UsageError(f"SLURM_JOB_ID={job!r}: expected a number, to derive the rendezvous "
                         "port from", hint="set MASTER_PORT to a free port on rank 0's host")
    return int(job[-4:]) + SLURM_PORT_BASE


def _first_host(environ: Mapping[str, str]) -> str:
    for name in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        text = environ.get(name, "").strip()
        if text:
            try:
                return expand_nodelist(text)[0]
            except ValueError as exc:
                raise UsageError(f"{name}={text!r} is no SLURM node list: {exc}",
                                 hint="set MASTER_ADDR to rank 0's host") from None
    raise UsageError("SLURM_JOB_NODELIST is not set: SLURM_NTASKS says this is one of several "
                     "tasks, but not where rank 0 listens",
                     hint="run ckptool under srun inside an allocation, or set MASTER_ADDR")


def _split_top(text: str) -> Iterator[str]:
    """Words of a node list: split at commas and spaces outside brackets."""
    depth, start = 0, 0
    for i, char in enumerate(text + ","):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError("nested brackets")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("a ']' without its '['")
        elif (char == "," or char.isspace()) and depth == 0:
            if text[start:i]:
                yield text[start:i]
            start = i + 1
    if depth:
        raise ValueError("a '[' without its ']'")


def _expand_group(inner: str, word: str) -> list[str]:
    """``01-03,07`` -> 01, 02, 03, 07."""
    values: list[str] = []
    for item in inner.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", item)
        if not match:
            raise ValueError(f"[{inner}] in {word!r} is not numbers and ranges")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"the range {item.strip()} in {word!r} runs backwards")
        values.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return values


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
        hint = (f"start all {launch.size} processes (within {timeout:g} s of each other) with "
                f"the same MASTER_ADDR and MASTER_PORT, where rank 0 runs and the others can "
                f"reach it")
    return UsageError(f"rank {launch.rank} of {launch.size} could not meet the others at "
                      f"{where} ({launch.launcher}): {said}", hint=hint)


@contextmanager
def _stderr_held() -> Iterator[None]:
    """fd 2 into a temporary file while torch connects: written back once it
    succeeded, dropped when it failed (the error says it in one line)."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr at all: nothing to hold
        yield
        return
    try:
        with tempfile.TemporaryFile() as kept:
            os.dup2(kept.fileno(), 2)
            failed = True
            try:
                yield
                failed = False
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                if not failed:
                    kept.seek(0)
                    with os.fdopen(os.dup(2), "wb") as out:
                        out.write(kept.read())
    finally:
        os.close(saved)
