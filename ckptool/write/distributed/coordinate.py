"""How the ranks of a distributed convert hear of each other, through the
rendezvous store (a key-value store every rank reaches; no collective call
that could hang on a rank that is gone).

- ``plan/<rank>``: ``<fingerprint> <host>``, the plan each rank computed
  (rank 0 compares them) and where the rank runs.
- ``ready``: set by rank 0 once the staging directory is prepared.
- ``pid/<rank>``: ``<pid> <host>``, set as the rank starts: a rank that
  died on this machine is known by its process being gone.
- ``beat/<rank>``: ``<count> <bytes done>``, refreshed by each rank's beat
  thread: rank 0 sums the bytes into one progress bar, and takes a rank
  whose count stops moving for ``CKPTOOL_RANK_TIMEOUT`` seconds (default
  60) for lost (killed, stopped, or its machine gone). Every other rank
  watches rank 0's beat alike; and a store that stops answering for as
  long (under srun it lives in rank 0's process: SIGSTOP, a machine gone)
  is rank 0 lost too, seen by a watchdog thread, as a call to such a store
  may never return.
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
- ``stand-in``: once rank 0 is lost, the rank that says the failure in its
  stead (the first to claim it; rank 1 where the store went with rank 0).
  What it says is true of the output: that rank 0 committed it before it
  went, if it did (``lost.committed``).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from ckptool.errors import EXIT_RANK_FAILED, CkptoolError, UsageError
from ckptool.write.distributed.lost import (
    GRACE,
    RESUME,
    STORE_ERRORS,
    Failure,
    Identity,
    LostRanks,
)

Progress = Callable[[int, int], None]


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


class Coordinator(LostRanks):
    """One rank's side of the conversation; ``start()`` its beat thread and
    its watchdog. ``target``: the output (what is true of it once rank 0 is
    lost); ``say``: how this rank prints an error (rank 0, or a stand-in)."""

    def __init__(self, store: Any, rank: int, size: int, node: str,
                 target: str | None = None) -> None:
        self.store, self.rank, self.size, self.node = store, rank, size, node
        self.target = target
        self.beat = beat_every(size)
        self.lost_after = lost_after()
        self.done_bytes = 0  # this rank's bytes written (its copier's progress)
        self.total = 0  # the whole job's (rank 0's bar)
        self.progress: Progress | None = None  # rank 0's bar
        self.say: Callable[[CkptoolError], None] | None = None  # print an error
        self.stopping = threading.Event()  # a failure is known: stop working
        self.handled = threading.Event()  # the main thread has taken the failure up
        self.staged = False  # the staging directory is prepared: a re-run resumes
        self.placed: Identity | None = None  # what rank 0 will commit (``lost.identity``)
        self.nodes: dict[int, str] = {}  # each rank's host (rank 0: from its plan)
        self.pids: dict[int, int] = {}  # each rank's process, where known
        self.lost: set[int] = set()  # ranks that stopped beating, or are gone
        self.failure: Failure | None = None
        # under torchrun the store is its agent's; else rank 0 holds it
        self.store_in_rank0 = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        self._quit = threading.Event()
        self._threads: list[threading.Thread] = []
        self._beats = 0
        self._seen: dict[int, tuple[bytes, float]] = {}  # last beat of each rank watched
        self._answered = time.monotonic()  # the store's last answer to the beat thread
        self._finished = False  # this rank's share is written (the output may be committed)

    # -- the beat thread -------------------------------------------------------

    def start(self) -> Coordinator:
        self.store.set(f"pid/{self.rank}", f"{os.getpid()} {self.node}")
        self._beat()  # there before rank 0 first looks for it
        self._answered = time.monotonic()
        threads = [(self._run, "ckptool-beat")]
        if not _in_memory(self.store):  # (a store of threads in one process answers)
            threads.append((self._guard, "ckptool-watchdog"))
        for target, name in threads:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def close(self) -> None:
        self._quit.set()
        for thread in self._threads:
            thread.join()

    def _run(self) -> None:
        stopped_at: float | None = None
        while not self._quit.wait(self.beat):
            try:
                self._beat()
                self._watch()
                if self.failure is None and self.store.check(["failed"]):
                    self._heard()
                self._answered = time.monotonic()
            except STORE_ERRORS:  # the store is gone: rank 0's machine with it
                self.store_gone()
                self._answered = time.monotonic()  # (at once: no hang for the watchdog)
            if self.stopping.is_set() and not self.handled.is_set():
                stopped_at = stopped_at or time.monotonic()
                if time.monotonic() - stopped_at > GRACE:  # stuck in a collective call
                    self._leave_now()

    def _guard(self) -> None:
        """The watchdog: a store that has not answered the beat thread for
        ``lost_after`` seconds will not (its host is stopped, or its machine
        gone, and a call to it may never return): this rank leaves at once,
        the stand-in saying why. A pause of this process itself (SIGSTOP,
        Ctrl-Z) gives the store another ``lost_after`` once it runs again."""
        woke = time.monotonic()
        while not self._quit.wait(self.beat):
            now = time.monotonic()
            if now - woke > self.lost_after / 2:
                self._answered = now
            woke = now
            if now - self._answered > self.lost_after and not self._quit.is_set():
                self.store_gone(f"stopped answering for {self.lost_after:.0f} s")
                failure = self.failure
                alive = [r for r in range(self.size) if r not in self.lost]
                if self.say is not None and failure is not None and alive and \
                        self.rank == alive[0]:  # (no store to choose a stand-in by)
                    self.say(self.last_word(failure))
                os._exit(failure.code if failure is not None else EXIT_RANK_FAILED)

    def _leave_now(self) -> None:
        """The main thread cannot be reached (inside a collective call that
        waits for a rank that is gone): rank 0, or its stand-in, says why,
        and every rank leaves."""
        failure = self.failure
        if failure is not None and self.say is not None and not failure.elsewhere:
            try:
                speaks = self.speaks()
            except STORE_ERRORS:
                speaks = False
            if speaks:
                self.say(self.last_word(failure))
        os._exit(failure.code if failure is not None else EXIT_RANK_FAILED)

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(f"beat/{self.rank}", f"{self._beats} {self.done_bytes}")

    def _watch(self) -> None:
        """Rank 0: the bar, and ranks that stopped beating (one request for
        all). Another rank: rank 0's beat (once it is there)."""
        now = time.monotonic()
        if self.rank != 0:
            if 0 in self._seen or self.store.check(["beat/0"]):
                self._looked(0, bytes(self.store.get("beat/0")), now)
                self.node_of(0)  # (known before rank 0 is lost, with its store)
            return
        beats = self.store.multi_get([f"beat/{r}" for r in range(self.size)])
        done = 0
        for r, raw in enumerate(beats):
            done += int(bytes(raw).partition(b" ")[2] or 0)
            self._looked(r, bytes(raw), now)
        if self.progress is not None and self.total:
            self.progress(min(done, self.total), self.total)

    def _looked(self, r: int, raw: bytes, now: float) -> None:
        """Rank ``r``'s beat, just read: lost once it stood still too long
        (and the rank had not finished, nor rank 0 ended the run)."""
        count = raw.partition(b" ")[0]
        last = self._seen.get(r)
        if last is None or last[0] != count:
            self._seen[r] = (count, now)
        elif now - last[1] > self.lost_after and r not in self.lost and \
                not self.store.check([f"done/{r}" if r else "outcome"]):
            self.lost.add(r)
            self.fail(Failure(r, self.node_of(r), f"stopped answering for "
                              f"{self.lost_after:.0f} s (killed, stopped, or its machine was "
                              "lost)", RESUME, EXIT_RANK_FAILED, gone=True))

    def _heard(self) -> None:
        self.failure = Failure(**json.loads(self.store.get("failed")))
        if self.failure.gone:
            self.lost.add(self.failure.rank)
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
        Waits in the store (one request per beat), not by polling. (Rank 0's
        host is known by then: it had started before it set anything.)"""
        while True:
            try:
                self.store.wait([key], timedelta(seconds=self.beat))
            except STORE_ERRORS:
                if not self.store.check([key]):  # a timeout: look for a failure, again
                    self.check()
                    continue
            if self.rank != 0:
                self.node_of(0)
            return str(self.store.get(key).decode())

    def gather(self, prefix: str) -> list[str]:
        """Rank 0: every rank's ``prefix/<rank>``, once all have set it."""
        return [self.wait_for(f"{prefix}/{r}") for r in range(self.size)]

    def finished(self, report: dict[str, Any]) -> None:
        self._finished = True
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
            except STORE_ERRORS:  # the store is gone: rank 0 with it, under srun
                self.store_gone()
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


def _in_memory(store: Any) -> bool:
    """Whether ``store`` is one in this process's memory (``alone_with``'s)."""
    import torch.distributed as dist

    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return isinstance(store, dist.HashStore)
