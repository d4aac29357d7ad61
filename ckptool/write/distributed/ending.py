"""How a rank of a distributed convert leaves when something failed: the
failure turned into one error, recorded for every rank, said once by rank
0, and every rank's exit code the failure's own.

- This rank's own error (bad input, a full disk, Ctrl-C, a bug) is
  recorded as the job's failure unless another came first.
- Rank 0 prints the first failure (naming the rank it came from), tells
  the others (``said``), and leaves last: under srun the store lives in its
  process.
- Every other rank waits for ``said`` and leaves with the failure's code
  and without a word; if rank 0 cannot speak (it is gone), the rank whose
  failure it was says it itself, and rank 0's own loss is said by its
  stand-in (``Coordinator.speaks``), true of the output.
- SIGTERM (torchrun or ``--workers`` stopping the job because one process
  exited; ``scancel``; a time limit) is said by rank 0 alone, at once: the
  launcher will not wait. What caused it, when known (a rank of this
  machine killed without a word), is said instead; rank 0 itself killed
  so, by its stand-in (true of the output: rank 0 may have committed it).
  Once a rank is leaving (``LEAVING``), a SIGTERM changes nothing: its
  ending is on its way.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable
from pathlib import Path

from ckptool.errors import EXIT_INTERRUPTED, EXIT_RANK_FAILED, CkptoolError
from ckptool.write.distributed.coordinate import Coordinator
from ckptool.write.distributed.lost import RESUME, STORE_ERRORS, Failure, committed
from ckptool.write.failures import is_output_error, output_error

Say = Callable[[CkptoolError], None]
EXIT_TERMINATED = 143  # 128 + SIGTERM, as a shell reports it
LEAVING = threading.Event()  # this process has begun to leave (its SIGTERM handler looks)
COMMITTED = threading.Event()  # this process (rank 0) put the output in place


class Quiet(CkptoolError):
    """This rank leaves without a word (rank 0 said why, or will not be heard)."""

    exit_code = EXIT_RANK_FAILED

    def __init__(self, code: int) -> None:
        super().__init__("")
        self.exit_code = code


class Terminated(CkptoolError):
    """SIGTERM: the launcher, the scheduler or a user stopped this process."""

    exit_code = EXIT_TERMINATED


def as_error(exc: BaseException, coord: Coordinator, target: str) -> CkptoolError | None:
    """``exc`` as the one-line error it is said as; None for a bug (its
    traceback is worth more than a line). This rank is leaving from here on."""
    LEAVING.set()
    if isinstance(exc, CkptoolError):
        return exc
    if isinstance(exc, KeyboardInterrupt):
        err = CkptoolError("interrupted", RESUME if coord.staged else "")
        err.exit_code = EXIT_INTERRUPTED
        return err
    if isinstance(exc, OSError) and is_output_error(exc, (Path(target),)):
        return output_error(Path(target), exc)
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return CkptoolError(f"{where}{exc.strerror or exc}",
                            "check that the path is readable, and free space")
    if isinstance(exc, STORE_ERRORS):  # a store call whose host is gone
        if coord.failure is None:
            coord.store_gone()
        return coord.stopped()
    return None


def leave(coord: Coordinator, err: CkptoolError, say: Say) -> CkptoolError:
    """What this rank raises for ``err``: ``Quiet`` everywhere once the
    failure is said."""
    LEAVING.set()
    coord.handled.set()
    if isinstance(err, Quiet):  # nothing to say (the --workers process says it)
        return err
    if isinstance(err, Terminated):
        return _terminated(coord, err, say)
    failure: Failure | None = None
    with contextlib.suppress(*STORE_ERRORS):  # the store may be gone with rank 0
        failure = coord.failure
        if failure is None or failure.rank == coord.rank:  # this rank's own
            failure = coord.fail(Failure(coord.rank, coord.node, err.message,
                                         _hint(err, coord), err.exit_code))
        if coord.rank == 0 and 0 not in coord.lost:
            if failure.message == err.message:  # its own, as raised (or every rank's)
                err.hint = failure.hint
                say(err)
            elif not failure.elsewhere:  # (else the launcher says it)
                say(failure.error(coord.size, prefix=failure.message != "interrupted"))
            coord.said()
            coord.wait_all_left()
            return Quiet(failure.code)
        if 0 not in coord.lost and coord.wait_said():
            coord.leave()
            return Quiet(failure.code)
        # rank 0 is gone: the rank whose failure it is says it; rank 0's own
        # loss, its stand-in (unless the launcher says it)
        if failure.rank == coord.rank or (0 in coord.lost and not failure.elsewhere and
                                          coord.speaks()):
            say(coord.last_word(failure))
        return Quiet(failure.code)
    # the store is gone (with rank 0, under srun): nobody to agree with
    failure = coord.failure or failure
    if failure is None:
        say(err)
        return Quiet(err.exit_code)
    mute = failure.rank < 0 or failure.rank in coord.lost  # (the launcher's store, rank 0)
    if failure.rank == coord.rank or (mute and not failure.elsewhere and
                                      coord.rank == _first_alive(coord)):
        say(coord.last_word(failure))
    return Quiet(failure.code)


def _first_alive(coord: Coordinator) -> int:
    """The rank that speaks where no store is left to agree on one."""
    return min((r for r in range(coord.size) if r not in coord.lost), default=coord.rank)


def _terminated(coord: Coordinator, err: Terminated, say: Say) -> CkptoolError:
    """SIGTERM: rank 0 says it, or what caused it where that is known (a
    failure heard, a rank of this machine killed without a word), true of
    the output (committed by now, or not)."""
    if coord.rank != 0:
        return _stand_in(coord, err, say)
    known: Failure | None = None
    with contextlib.suppress(*STORE_ERRORS):
        known = coord.failure or coord.died()
    if known is None:
        if coord.target is not None and committed(coord.target, coord.placed):
            err.message = f"stopped by SIGTERM after {coord.target} was committed"
            err.hint = f"the output is complete; check it with: ckptool verify {coord.target}"
        say(err)
    elif not known.elsewhere:
        say(coord.last_word(known))
    with contextlib.suppress(*STORE_ERRORS):
        coord.said()  # (no other rank says it in its stead)
    return Quiet(err.exit_code if known is None else known.code)


def _stand_in(coord: Coordinator, err: Terminated, say: Say) -> CkptoolError:
    """SIGTERM to a rank other than 0: the launcher stops the job because
    rank 0 died without a word (kill -9: it neither said anything nor ended
    the run)? Then its stand-in says so, true of the output (rank 0 may
    have committed it); else this rank leaves without a word."""
    known: Failure | None = None
    with contextlib.suppress(*STORE_ERRORS):
        if not coord.store.check(["said"]) and not coord.store.check(["outcome"]):
            known = coord.failure or coord.died()
    if known is None or known.rank != 0 or not known.gone or known.elsewhere:
        return Quiet(err.exit_code)
    speaks = False
    with contextlib.suppress(*STORE_ERRORS):
        speaks = coord.speaks()
    if not speaks:
        return Quiet(known.code)
    say(coord.last_word(known))
    return Quiet(known.code)


def _hint(err: CkptoolError, coord: Coordinator) -> str:
    """``err``'s hint, with the way to resume once the staging directory is there."""
    hint = err.hint
    if not coord.staged or err.exit_code == EXIT_INTERRUPTED:
        return hint
    said = r"(this is a bug in ckptool; )?nothing was (left half-written|written|committed)"
    # ("write elsewhere (nothing was left half-written)": the brackets go with it)
    hint = re.sub(rf"\s*\({said}\)|(;\s*)?{said}", "", hint).strip("; ")
    return f"{hint}; {RESUME}" if hint else RESUME
