"""How the ranks of a distributed convert hear of each other, through the
rendezvous store (a key-value store every rank reaches; no collective call
that could hang on a rank that is gone).

- ``plan/<rank>``: the plan's fingerprint each rank computed (rank 0
  compares them).
- ``ready``: set by rank 0 once the staging directory is prepared.
- ``beat/<rank>``: ``<count> <bytes done>``, refreshed by each rank's beat
  thread: rank 0 sums the bytes into one progress bar, and takes a rank
  whose count stops moving for ``CKPTOOL_RANK_TIMEOUT`` seconds (default
  60) for lost (killed, or its machine gone).
- ``failed``: the first failure, ``{"rank", "node", "message", "hint",
  "code"}``; later ones do not replace it. Every rank's beat thread watches
  for it: the work in hand stops at its next chunk (``abort``), and a rank
  stuck in a call that cannot be interrupted leaves after a grace period.
- ``done/<rank>`` (its report) and the ``ndone`` counter; ``outcome``:
  ``committed`` or ``failed``, set by rank 0 last.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptool.errors import EXIT_RANK_FAILED, CkptoolError, RankFailedError

BEAT = 0.25  # seconds between beats, and between rank 0's looks at them
GRACE = 5.0  # a rank told to stop that has not stopped by then leaves at once
LINGER = 0.5  # a failed rank's wait, once rank 0 took its failure, before it leaves
Progress = Callable[[int, int], None]


def lost_after() -> float:
    return float(os.environ.get("CKPTOOL_RANK_TIMEOUT", "60"))


@dataclass
class Failure:
    rank: int
    node: str
    message: str
    hint: str
    code: int

    def error(self, size: int) -> RankFailedError:
        err = RankFailedError(f"rank {self.rank} of {size} ({self.node}): {self.message}",
                              self.hint)
        err.exit_code = self.code
        return err


class Coordinator:
    """One rank's side of the conversation; ``start()`` its beat thread."""

    def __init__(self, store: Any, rank: int, size: int, node: str) -> None:
        self.store, self.rank, self.size, self.node = store, rank, size, node
        self.done_bytes = 0  # this rank's bytes written (its copier's progress)
        self.total = 0  # the whole job's (rank 0's bar)
        self.progress: Progress | None = None  # rank 0's bar
        self.stopping = threading.Event()  # a failure is known: stop working
        self._quit = threading.Event()
        self._thread: threading.Thread | None = None
        self._beats = 0
        self._seen: dict[int, tuple[str, float]] = {}  # rank 0: last beat, when it changed
        self.failure: Failure | None = None
        self.staged = False  # the staging directory is prepared: a re-run resumes
        self.handled = threading.Event()  # the main thread has taken the failure up
        self.lost: set[int] = set()  # ranks that stopped beating

    # -- the beat thread -------------------------------------------------------

    def start(self) -> Coordinator:
        self._thread = threading.Thread(target=self._run, name="ckptool-beat", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._quit.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        stopped_at: float | None = None
        while not self._quit.wait(BEAT):
            try:
                self._beat()
                if self.rank == 0:
                    self._watch()
                elif self.failure is None and self.store.check(["failed"]):
                    self.failure = self._failure()
                    self.stopping.set()
            except (RuntimeError, OSError):  # the store is gone: rank 0's machine with it
                self.failure = Failure(0, "?", "the rendezvous store stopped answering (rank 0 "
                                       "or its machine is gone)", _RESUME, EXIT_RANK_FAILED)
                self.stopping.set()
            if self.stopping.is_set() and not self.handled.is_set():
                stopped_at = stopped_at or time.monotonic()
                if time.monotonic() - stopped_at > GRACE:  # stuck in a collective call
                    os._exit(self.failure.code if self.rank == 0 and self.failure
                             else EXIT_RANK_FAILED)

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(f"beat/{self.rank}", f"{self._beats} {self.done_bytes}")

    def _watch(self) -> None:
        """Rank 0: the bar, failures, and ranks that stopped beating."""
        now = time.monotonic()
        done = 0
        for r in range(self.size):
            raw = self.store.get(f"beat/{r}").decode() if r == self.rank or self.store.check(
                [f"beat/{r}"]) else ""
            count, _, nbytes = raw.partition(" ")
            done += int(nbytes or 0)
            last = self._seen.get(r)
            if last is None or last[0] != count:
                self._seen[r] = (count, now)
            elif now - last[1] > lost_after() and not self.store.check([f"done/{r}"]):
                self.lost.add(r)
                self.fail(Failure(r, "?", f"stopped answering for {lost_after():.0f} s "
                                  "(killed, or its machine was lost)", _RESUME,
                                  EXIT_RANK_FAILED))
        if self.progress is not None and self.total:
            self.progress(min(done, self.total), self.total)
        if self.failure is None and self.store.check(["failed"]):
            self.failure = self._failure()
            self.stopping.set()

    # -- what the main thread says and waits for -------------------------------

    def fail(self, failure: Failure) -> None:
        """Record a failure (the first one stays), and stop."""
        self.store.compare_set("failed", "", json.dumps(failure.__dict__))
        self.failure = self._failure()
        self.stopping.set()

    def _failure(self) -> Failure:
        return Failure(**json.loads(self.store.get("failed")))

    def check(self) -> None:
        """Raise if a failure is known (called between pieces of work, and by
        the copy's progress callback: the copy stops at its next chunk)."""
        if self.stopping.is_set():
            raise self.stopped()

    def stopped(self) -> CkptoolError:
        """The error this rank leaves with once another one failed."""
        failure = self.failure or self._failure()
        return failure.error(self.size)

    def heard_from(self, rank: int, exc: CkptoolError) -> CkptoolError:
        """The error to leave with when a collective call said that ``rank``
        failed: its own record of why, once it arrives (or ``exc``)."""
        deadline = time.monotonic() + GRACE
        while self.failure is None and time.monotonic() < deadline:
            if self.store.check(["failed"]):
                self.failure = self._failure()
                self.stopping.set()
            else:
                time.sleep(BEAT / 5)
        if self.failure is None:
            self.fail(Failure(rank, "?", exc.message, _RESUME, EXIT_RANK_FAILED))
        return self.stopped()

    def publish(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def wait_for(self, key: str) -> str:
        """The value of ``key`` once some rank sets it; a failure raises."""
        while not self.store.check([key]):
            self.check()
            time.sleep(BEAT / 5)
        return str(self.store.get(key).decode())

    def gather(self, prefix: str) -> list[str]:
        """Rank 0: every rank's ``prefix/<rank>``, once all have set it."""
        return [self.wait_for(f"{prefix}/{r}") for r in range(self.size)]

    def finished(self, report: dict[str, Any]) -> None:
        self.store.set(f"done/{self.rank}", json.dumps(report))
        self.store.add("ndone", 1)

    def wait_all_finished(self) -> list[dict[str, Any]]:
        """Rank 0: every rank's report, once every rank has finished its share."""
        while self.store.add("ndone", 0) < self.size:
            self.check()
            time.sleep(BEAT / 5)
        return [json.loads(self.store.get(f"done/{r}")) for r in range(self.size)]

    def leave(self) -> None:
        """A rank other than 0: it has heard the outcome and needs the store no more."""
        self.store.add("left", 1)

    def wait_all_left(self) -> None:
        """Rank 0: the others heard the outcome (the store may live in this
        process, and leave with it). A rank gone already is not waited for long."""
        deadline = time.monotonic() + GRACE
        while self.store.add("left", 0) < self.size - 1 - len(self.lost) and \
                time.monotonic() < deadline:
            time.sleep(BEAT / 5)

    def acknowledge(self) -> None:
        """Rank 0 took the failure up, to say it: the failed rank may leave."""
        self.store.set("ack", "1")

    def wait_acknowledged(self) -> bool:
        """A failed rank: whether rank 0 said so (else it says so itself)."""
        deadline = time.monotonic() + GRACE
        while time.monotonic() < deadline:
            try:
                if self.store.check(["ack"]):
                    # a launcher stops every rank once one has left: rank 0
                    # gets that long to print what it raises
                    time.sleep(LINGER)
                    return True
            except (RuntimeError, OSError):
                return False
            time.sleep(BEAT / 5)
        return False


_RESUME = ("nothing was committed; run the same command again to resume: what was written "
           "and verified is kept")
RESUME = _RESUME
