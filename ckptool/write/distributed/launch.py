"""``convert --workers N``: N processes of ``python -m ckptool ...`` on this
machine, started by torch's own elastic launcher (what ``torchrun
--standalone --nproc-per-node N`` runs), not by a process pool of ours.

The workers find themselves as torchrun's do (``world.detect``: with
``CKPTOOL_DISTRIBUTED=1``, whatever this process inherited), inherit its
stdout and stderr, and say their own errors. Here: the launcher's log kept
quiet, ``OMP_NUM_THREADS=1`` unless the user set it (as torchrun does), and
the outcome turned into ckptool's: 0 when all succeeded, else the failure
that is the cause (``_failed``): ``RankFailedError`` for a worker killed by a
signal (nothing it could say itself), else the exit code of the worker that
failed of itself, before those stopped because it did; true of the
output, which rank 0 may have committed before a worker was lost (rank 0
records what it will commit in a file of this process's, ``lost.PLACED``).
A SIGTERM to this process stops the workers and is said here
(``Terminated``), before they started too. The launcher's
files live in ``TMPDIR/ckptool-workers-<pid>-*``; those of a process killed
before it removed them go with the next run.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any

from ckptool.errors import RankFailedError, UsageError
from ckptool.write.distributed.ending import Terminated
from ckptool.write.distributed.lost import (
    PLACED,
    RESUME,
    WORKERS,
    Identity,
    committed,
    complete,
    process_gone,
    told,
)
from ckptool.write.distributed.staging import Staging

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

# what torch's launcher registers its handler for and never puts back
# (``TORCHELASTIC_SIGNALS_TO_HANDLE``: it stops the workers, then raises)
HANDLED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
# the loggers of the agent, its rendezvous and its process contexts
QUIET = ("torch.distributed.elastic", "torch.distributed.launcher")
WORKER_COMMAND = ("-m", "ckptool")
# set for the workers: this process says how a worker killed by a signal
# ended, so their rank 0 need not say that the launcher stopped it
WORKERS_SAY_SIGNALS = WORKERS
# the launcher's own files go into TMPDIR/ckptool-workers-<pid>-*, removed
# at the end; one left by a process killed (kill -9) by the next run
TEMP_PREFIX = "ckptool-workers-"
# how long the launcher waits after its SIGTERM before its SIGKILL
# (``PContext.close(timeout=30)``)
STOP_GRACE = 30
Handler = Any  # what signal.getsignal returns


def run_workers(n: int, argv: Sequence[str], *, output: str | None = None,
                _command: Sequence[str] = WORKER_COMMAND) -> int:
    """Run ``python -m ckptool *argv`` as ``n`` ranks; their exit code.

    ``_command`` replaces ``-m ckptool`` for the tests (a worker that kills
    itself). A Ctrl-C stops the workers and is a KeyboardInterrupt here; a
    SIGTERM (or SIGHUP, SIGQUIT) stops them and is a ``Terminated`` error,
    its hint true of ``output`` (resumable, there, or not written).
    """
    if n < 1:
        raise UsageError(f"--workers {n}: expected at least 1 worker process",
                         hint="--workers N starts N processes on this machine")
    with _said_before_the_workers() as saved:
        return _launch(n, argv, output, _command, saved)


def _launch(n: int, argv: Sequence[str], output: str | None, command: Sequence[str],
            saved: dict[str, Handler]) -> int:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # the launcher's files (its error.json per rank) go where they are cleaned up
    _remove_stale(tempfile.gettempdir())
    with tempfile.TemporaryDirectory(prefix=f"{TEMP_PREFIX}{os.getpid()}-") as logs, _quiet(), \
            _environment(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                         CKPTOOL_DISTRIBUTED="1", **{WORKERS_SAY_SIGNALS: "1"},
                         **{PLACED: os.path.join(logs, "placed")}), \
            _handlers_restored(saved):
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=uuid.uuid4().hex,
            # port 0: the agent's store takes a free port and tells the
            # workers (MASTER_PORT), as ``torchrun --standalone`` does
            rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
            rdzv_configs={"is_host": True}, max_restarts=0, monitor_interval=0.1,
            logs_specs=DefaultLogsSpecs(log_dir=logs), signals_to_handle=",".join(HANDLED))
        try:
            elastic_launch(config, sys.executable)(*command, *argv)
        except ChildFailedError as exc:
            return _failed(exc, n, output, told(os.path.join(logs, "placed")))
        except SignalException as exc:
            signum = exc.sigval
        else:
            return 0
        placed = told(os.path.join(logs, "placed"))
    # the workers were stopped (their rank 0 says nothing of it): said here
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    how = f"stopped by {signal.Signals(signum).name}"
    if output is not None and committed(output, placed):
        err = Terminated(f"{how} after {output} was committed: the workers were stopped",
                         f"the output is complete; check it with: ckptool verify {output}")
    elif output is not None and Staging(output, False).path.is_dir():
        err = Terminated(f"{how}: the workers were stopped", RESUME)
    elif output is not None and os.path.lexists(output):  # there before: not replaced
        err = Terminated(f"{how}: the workers were stopped",
                         f"nothing was committed: {output} is the one there before; run the "
                         "same command again")
    else:
        err = Terminated(f"{how}: the workers were stopped",
                         "nothing was written; run the same command again")
    err.exit_code = 128 + signum
    raise err


@contextmanager
def _said_before_the_workers() -> Iterator[dict[str, Handler]]:
    """Until the launcher takes the signals over, as it starts the workers:
    a SIGTERM (SIGHUP, SIGQUIT) is a ``Terminated`` error, said, not a silent
    end. Yields the handlers it replaced, put back at the end."""
    def early(signum: int, frame: FrameType | None) -> None:
        err = Terminated(f"stopped by {signal.Signals(signum).name} before the workers started",
                         "nothing was written; run the same command again")
        err.exit_code = 128 + signum
        raise err

    names = [name for name in HANDLED if name != "SIGINT"]  # (Ctrl-C: KeyboardInterrupt)
    saved = {name: signal.getsignal(getattr(signal, name)) for name in HANDLED}
    try:
        for name in names:
            signal.signal(getattr(signal, name), early)
        yield saved
    finally:
        _restore(saved)


def _failed(exc: ChildFailedError, n: int, output: str | None = None,
            placed: Identity | None = None) -> int:
    """The exit code of the worker whose failure is the cause, or
    RankFailedError for one that died of a signal: true of ``output``,
    which rank 0 may have committed (``placed``) before a worker was lost.

    By cause, not time (the others fail within the same second, and may be
    seen first): a death by a signal other than SIGTERM and SIGINT (kill -9,
    the OOM killer: it says nothing, its peers do); then an exit code of the
    worker's own; then 130 (interrupted); then 4 (stopped because another
    rank failed); last 143 and SIGTERM, with which the launcher stops the
    rest, or its SIGKILL for one still running ``STOP_GRACE`` seconds later.
    Among equals, the first the launcher saw.
    """
    failures = exc.failures
    first = min(failure.timestamp for failure in failures.values())

    def cause(failure: ProcessFailure) -> int:
        code = failure.exitcode
        if code == -signal.SIGKILL and failure.timestamp - first >= STOP_GRACE:
            return 4  # the launcher's own SIGKILL after its SIGTERM
        if code < 0 and code not in (-signal.SIGTERM, -signal.SIGINT):
            return 0
        return {130: 2, -signal.SIGINT: 2, 4: 3, 143: 4, -signal.SIGTERM: 4}.get(code, 1)

    # sorted() keeps the order seen among equals
    rank, failure = sorted(failures.items(),
                           key=lambda item: (cause(item[1]), item[1].timestamp))[0]
    code = failure.exitcode
    if code >= 0:
        return int(code)
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if output is not None and committed(output, placed):
        raise complete(f"rank 0 of {n} was lost after it committed {output}" if rank == 0 else
                       f"rank {rank} of {n} was killed by {name} after rank 0 committed "
                       f"{output}", output)
    raise RankFailedError(f"rank {rank} of {n} was killed by {name}", hint=RESUME)


def _remove_stale(folder: str) -> None:
    """The launcher's folders of ``convert --workers`` processes that ended
    without removing them (killed): this user's, whose process is gone."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        pid = entry.name[len(TEMP_PREFIX):].partition("-")[0]
        if not entry.name.startswith(TEMP_PREFIX) or not pid.isdigit():
            continue
        try:
            mine = entry.is_dir(follow_symlinks=False) and \
                entry.stat(follow_symlinks=False).st_uid == os.getuid()
        except OSError:
            continue
        if mine and process_gone(int(pid)):
            shutil.rmtree(entry.path, ignore_errors=True)


@contextmanager
def _quiet() -> Iterator[None]:
    """The agent logs each step at INFO and WARNING (and a worker's failure
    at ERROR): noise to a user of the CLI, who hears the outcome from us."""
    saved = []
    for name in QUIET:
        logger = logging.getLogger(name)
        sink = logging.NullHandler()
        saved.append((logger, logger.propagate, sink))
        logger.propagate = False
        logger.addHandler(sink)  # (else logging's last resort prints WARNINGs)
    try:
        yield
    finally:
        for logger, propagate, sink in saved:
            logger.removeHandler(sink)
            logger.propagate = propagate


@contextmanager
def _environment(**values: str) -> Iterator[None]:
    """os.environ as the workers inherit it; as it was, afterwards (the
    launcher sets ``TORCHELASTIC_SIGNALS_TO_HANDLE`` there too)."""
    names = [*values, "TORCHELASTIC_SIGNALS_TO_HANDLE"]
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def _handlers_restored(saved: dict[str, Handler]) -> Iterator[None]:
    """The launcher installs its signal handlers for good: put back ``saved``
    (those this process had before ``run_workers``)."""
    try:
        yield
    finally:
        _restore(saved)


def _restore(saved: dict[str, Handler]) -> None:
    for name, handler in saved.items():
        if handler is not None:
            signal.signal(getattr(signal, name), handler)
