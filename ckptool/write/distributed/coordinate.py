"""How the ranks of a distributed convert hear of each other, through the
rendezvous store (a key-value store every rank reaches; no collective call
that could hang on a rank that is gone).

- ``plan/<rank>``: ``<fingerprint> <host>``, the plan each rank computed
  (rank 0 compares them) and where the rank runs.
- ``ready``: set by rank 0 once the staging directory is prepared.
- ``beat/<rank>``: ``<count> <bytes done>``, refreshed by each rank's beat
  thread: rank 0 sums the bytes into one progress bar, and takes a rank
  whose count stops moving for ``CKPTOOL_RANK_TIMEOUT`` seconds (default
  60) for lost (killed, or its machine gone).
- ``failed``: the first failure, ``{"rank", "node", "message", "hint",
  "code"}``; later ones do not replace it. Every rank's beat thread watches
  for it: the work in hand stops at its next chunk, and a rank stuck in a
  call that cannot be interrupted leaves after a grace period.
- ``said``: rank 0 has printed the failure. Every other rank waits for it
  (for a grace period) before it leaves, so that a launcher that stops the
  whole job once one process exits (torchrun, ``--workers``) does not stop
  rank 0 before it speaks; each leaves with the failure's own exit code.
- ``done/<rank>`` (its report) and the ``ndone`` counter; ``outcome``
  (``committed``), set by rank 0 last; ``left``: the ranks that heard the
  end (under srun the store lives in rank 0's process, which leaves last).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ckptool.errors import EXIT_RANK_FAILED, CkptoolError, RankFailedError, UsageError

GRACE = 5.0  # a rank told to stop that has not stopped by then leaves at once
Progress = Callable[[int, int], None]
RESUME = ("nothing was committed; run the same command again to resume: what was written "
          "and verified is kept")
STORE_ERRORS = (RuntimeError, OSError)  # what a store call raises when its host is gone


def beat_every(size: int) -> float:
    """Seconds between beats: rank 0 reads every rank's beat in one request,
    and a thousand ranks need not refresh theirs four times a second."""
    return max(0.25, size / 2000)


def seconds(name: str, default: float, what: str,
            environ: Mapping[str, str] = os.environ) -> float:
    """The positive number of seconds in variable ``name`` (``what`` it is,
    for the hint), else ``default``; anything else is a UsageError."""
    text = environ.get(name, "").strip()
    if not text:
        return default
    if not re.fullmatch(r"\d+(\.\d*)?|\.\d+", text) or float(text) <= 0:
        raise UsageError(f"{name}={text!r}: expected a number of seconds above 0",
                         hint=f"{name} is {what} (default {default:g})")
    return float(text)


def lost_after() -> float:
    """``CKPTOOL_RANK_TIMEOUT`` in seconds, else 60."""
    return seconds("CKPTOOL_RANK_TIMEOUT", 60, "the seconds after which a rank that stopped "
                   "answering is taken for lost")


@dataclass
class Failure:
    rank: int
    node: str
    message: str
    hint: str
    code: int

    def error(self, size: int, prefix: bool = True) -> RankFailedError:
        said = f"rank {self.rank} of {size} ({self.node}): {self.message}" if prefix \
            else self.message
        err = RankFailedError(said, self.hint)
        err.exit_code = self.code
        return err


class Coordinator:
    """One rank's side of the conversation; ``start()`` its beat thread."""

    def __init__(self, store: Any, rank: int, size: int, node: str) -> None:
        self.store, self.rank, self.size, self.node = store, rank, size, node
        self.beat = beat_every(size)
        self.lost_after = lost_after()
        self.done_bytes = 0  # this rank's bytes written (its copier's progress)
        self.total = 0  # the whole job's (rank 0's bar)
        self.progress: Progress | None = None  # rank 0's bar
        self.say: Callable[[CkptoolError], None] | None = None  # rank 0: print an error
        self.stopping = threading.Event()  # a failure is known: stop working
        self.handled = threading.Event()  # the main thread has taken the failure up
        self.staged = False  # the staging directory is prepared: a re-run resumes
        self.nodes: dict[int, str] = {}  # rank 0: each rank's host, from its plan
        self.lost: set[int] = set()  # ranks that stopped beating
        self.failure: Failure | None = None
        self._quit = threading.Event()
        self._thread: threading.Thread | None = None
        self._beats = 0
        self._seen: dict[int, tuple[bytes, float]] = {}  # rank 0: last beat, when it changed

    # -- the beat thread -------------------------------------------------------

    def start(self) -> Coordinator:
        self._beat()  # there before rank 0 first looks for it
        self._thread = threading.Thread(target=self._run, name="ckptool-beat", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._quit.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        stopped_at: float | None = None
        while not self._quit.wait(self.beat):
            try:
                self._beat()
                if self.rank == 0:
                    self._watch()
                if self.failure is None and self.store.check(["failed"]):
                    self._heard()
            except STORE_ERRORS:  # the store is gone: rank 0's machine with it
                if self.failure is None:
                    self.failure = Failure(0, "?", "the rendezvous store stopped answering "
                                           "(rank 0 or its machine is gone)", RESUME,
                                           EXIT_RANK_FAILED)
                self.stopping.set()
            if self.stopping.is_set() and not self.handled.is_set():
                stopped_at = stopped_at or time.monotonic()
                if time.monotonic() - stopped_at > GRACE:  # stuck in a collective call
                    self._leave_now()

    def _leave_now(self) -> None:
        """The main thread cannot be reached (inside a collective call that
        waits for a rank that is gone): rank 0 says why, and every rank leaves."""
        failure = self.failure
        if self.rank == 0 and failure is not None and self.say is not None:
            self.say(failure.error(self.size, prefix=failure.rank != 0))
        os._exit(failure.code if failure is not None else EXIT_RANK_FAILED)

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(f"beat/{self.rank}", f"{self._beats} {self.done_bytes}")

    def _watch(self) -> None:
        """Rank 0: the bar, and ranks that stopped beating (one request for all)."""
        now = time.monotonic()
        beats = self.store.multi_get([f"beat/{r}" for r in range(self.size)])
        done = 0
        for r, raw in enumerate(beats):
            count, _, nbytes = bytes(raw).partition(b" ")
            done += int(nbytes or 0)
            last = self._seen.get(r)
            if last is None or last[0] != count:
                self._seen[r] = (count, now)
            elif now - last[1] > self.lost_after and r not in self.lost and \
                    not self.store.check([f"done/{r}"]):
                self.lost.add(r)
                self.fail(Failure(r, self.nodes.get(r, "?"),
                                  f"stopped answering for {self.lost_after:.0f} s (killed, or "
                                  "its machine was lost)", RESUME, EXIT_RANK_FAILED))
        if self.progress is not None and self.total:
            self.progress(min(done, self.total), self.total)

    def _heard(self) -> None:
        self.failure = Failure(**json.loads(self.store.get("failed")))
        self.stopping.set()

    # -- what the main thread says and waits for -------------------------------

    def fail(self, failure: Failure) -> Failure:
        """Record a failure (the first one recorded stays), and stop; returns the first."""
        self.store.compare_set("failed", "", json.dumps(failure.__dict__))
        self._heard()
        assert self.failure is not None
        return self.failure

    def check(self) -> None:
        """Raise if a failure is known (called between pieces of work, and by
        the copy's progress callback: the copy stops at its next chunk)."""
        if self.stopping.is_set():
            raise self.stopped()

    def stopped(self) -> CkptoolError:
        """The error this rank leaves with once a failure is known."""
        if self.failure is None:
            self._heard()
        assert self.failure is not None
        return self.failure.error(self.size)

    def publish(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def wait_for(self, key: str) -> str:
        """The value of ``key`` once some rank sets it; a failure raises.
        Waits in the store (one request per beat), not by polling."""
        while True:
            try:
                self.store.wait([key], timedelta(seconds=self.beat))
                return str(self.store.get(key).decode())
            except STORE_ERRORS:
                if not self.store.check([key]):  # a timeout: look for a failure, again
                    self.check()
                    continue
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
            time.sleep(self.beat / 2)
        return [json.loads(raw) for raw in
                self.store.multi_get([f"done/{r}" for r in range(self.size)])]

    def said(self) -> None:
        """Rank 0 has printed the failure: the others may leave."""
        self.store.set("said", "1")

    def wait_said(self) -> bool:
        """A rank other than 0: whether rank 0 printed the failure in time
        (twice the grace period: rank 0 may be stuck in a collective call
        for one, and speak once it gives up on it)."""
        deadline = time.monotonic() + 2 * GRACE
        while time.monotonic() < deadline:
            try:
                if self.store.check(["said"]):
                    return True
            except STORE_ERRORS:
                return False
            time.sleep(0.05)
        return False

    def leave(self) -> None:
        """A rank other than 0: it has heard the end and needs the store no more."""
        self.store.add("left", 1)

    def wait_all_left(self) -> None:
        """Rank 0: the others heard the end (the store may live in this
        process, and leave with it). A rank gone already is not waited for long."""
        deadline = time.monotonic() + GRACE
        while self.store.add("left", 0) < self.size - 1 - len(self.lost) and \
                time.monotonic() < deadline:
            time.sleep(0.05)

    def heard_from(self, rank: int | None, exc: CkptoolError) -> CkptoolError:
        """The error to leave with when a collective call said that a rank
        failed (``rank``, if it said which): that rank's own record of why,
        once it arrives; else ``exc``, recorded for that rank."""
        deadline = time.monotonic() + GRACE
        while self.failure is None and time.monotonic() < deadline:
            if self.store.check(["failed"]):
                self._heard()
            else:
                time.sleep(0.05)
        if self.failure is None:
            self.fail(Failure(rank if rank is not None else self.rank,
                              self.nodes.get(rank, "?") if rank is not None else self.node,
                              exc.message, RESUME, EXIT_RANK_FAILED))
        return self.stopped()
