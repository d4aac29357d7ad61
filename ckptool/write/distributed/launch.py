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
failed of itself, before those stopped because it did. A SIGTERM to this
process stops the workers and is said here (``Terminated``). The launcher's
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
from typing import TYPE_CHECKING

from ckptool.errors import RankFailedError, UsageError
from ckptool.write.distributed.ending import Terminated
from ckptool.write.distributed.lost import RESUME, WORKERS, process_gone
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
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # the launcher's files (its error.json per rank) go where they are cleaned up
    _remove_stale(tempfile.gettempdir())
    with tempfile.TemporaryDirectory(prefix=f"{TEMP_PREFIX}{os.getpid()}-") as logs, _quiet(), \
            _environment(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                         CKPTOOL_DISTRIBUTED="1", **{WORKERS_SAY_SIGNALS: "1"}), \
            _handlers_restored():
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=uuid.uuid4().hex,
            # port 0: the agent's store takes a free port and tells the
            # workers (MASTER_PORT), as ``torchrun --standalone`` does
            rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
            rdzv_configs={"is_host": True}, max_restarts=0, monitor_interval=0.1,
            logs_specs=DefaultLogsSpecs(log_dir=logs), signals_to_handle=",".join(HANDLED))
        try:
            elastic_launch(config, sys.executable)(*_command, *argv)
        except ChildFailedError as exc:
            return _failed(exc, n)
        except SignalException as exc:
            signum = exc.sigval
        else:
            return 0
    # the workers were stopped (their rank 0 says nothing of it): said here
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    if output is not None and Staging(output, False).path.is_dir():
        hint = RESUME
    elif output is not None and os.path.lexists(output):  # committed, or there before
        hint = f"check what is there with: ckptool verify {output}"
    else:
        hint = "nothing was written; run the same command again"
    err = Terminated(f"stopped by {signal.Signals(signum).name}: the workers were stopped",
                     hint)
    err.exit_code = 128 + signum
    raise err


def _failed(exc: ChildFailedError, n: int) -> int:
    """The exit code of the worker whose failure is the cause, or
    RankFailedError for one that died of a signal.

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
    raise RankFailedError(
        f"rank {rank} of {n} was killed by {name}",
        hint="nothing was committed; run the same command again to resume: what was "
        "written and verified is kept")


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
def _handlers_restored() -> Iterator[None]:
    """The launcher installs its signal handlers for good: put back ours."""
    saved = {name: signal.getsignal(getattr(signal, name)) for name in HANDLED}
    try:
        yield
    finally:
        for name, handler in saved.items():
            if handler is not None:
                signal.signal(getattr(signal, name), handler)
