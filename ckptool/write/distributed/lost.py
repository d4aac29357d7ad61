"""A failure as every rank of a distributed convert hears it (``Failure``),
and what a rank can find out, without rank 0, about a rank that is gone
(``LostRanks``, which the ``Coordinator`` is): whether its process still
exists (a rank on this machine: its pid, which every rank publishes), which
rank's beat stood still, who says the failure once rank 0 is lost (its
stand-in), and whether rank 0 committed the output before it went (OUT
is the very directory or file this run staged, ``Staging.placed``: its
inode; an OUT there before, or made by another program, is not): "nothing
was committed" is said only when nothing was. Under ``--workers`` rank 0
tells its launching process that inode too (``PLACED``), for it says how a
worker killed by a signal ended.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptool.errors import EXIT_RANK_FAILED, CkptoolError, RankFailedError

GRACE = 5.0  # a rank told to stop that has not stopped by then leaves at once
RESUME = ("nothing was committed; run the same command again to resume: what was written "
          "and verified is kept")
STORE_ERRORS = (RuntimeError, OSError)  # what a store call raises when its host is gone
# set for the workers of ``convert --workers``: that process says how a
# worker killed by a signal ended, so their rank 0 need not
WORKERS = "CKPTOOL_WORKERS_PARENT"
# set for them too: the file in which rank 0 records ``Identity`` of what it
# will commit, before it writes anything (``tell_launcher``, ``told``)
PLACED = "CKPTOOL_WORKERS_PLACED"
COMMITTED_HINT = "no re-run is needed; check it with: ckptool verify {target}"
Identity = tuple[int, int]  # (st_dev, st_ino)


@dataclass
class Failure:
    """A failure as every rank hears it. ``rank`` -1: no rank's (the
    launcher's store); ``node`` "?": not known. ``gone``: that rank is lost
    (it cannot say it). ``elsewhere``: the launcher says it (``--workers``:
    a rank killed by a signal), not rank 0."""

    rank: int
    node: str
    message: str
    hint: str
    code: int
    gone: bool = False
    elsewhere: bool = False

    def error(self, size: int, prefix: bool = True) -> RankFailedError:
        said = f"rank {self.rank} of {size} ({self.node}): {self.message}" \
            if prefix and self.rank >= 0 else self.message
        err = RankFailedError(said, self.hint)
        err.exit_code = self.code
        return err


class LostRanks:
    """The ``Coordinator``'s part that finds the ranks that are gone."""

    store: Any
    rank: int
    size: int
    node: str
    target: str | None
    failure: Failure | None
    lost: set[int]
    nodes: dict[int, str]
    pids: dict[int, int]
    store_in_rank0: bool
    placed: Identity | None  # what rank 0 will commit as OUT (``identity``), once known
    stopping: threading.Event
    _finished: bool
    fail: Callable[[Failure], Failure]  # (the Coordinator's: record a failure for all)
    stopped: Callable[[], CkptoolError]
    _heard: Callable[[], None]

    def store_gone(self, how: str = "went away") -> Failure:
        """The store stopped answering (``how``): under srun it lived in rank
        0's process, which is lost; under torchrun, its agent is (no rank's)."""
        if self.failure is None:
            self.failure = Failure(
                0, self.nodes.get(0, "?"), f"the rendezvous store it held {how} (killed, "
                "stopped, or its machine was lost)", RESUME, EXIT_RANK_FAILED, gone=True) \
                if self.store_in_rank0 else Failure(
                -1, "?", f"the launcher's rendezvous store {how} (the launcher, or its "
                "machine, is gone)", RESUME, EXIT_RANK_FAILED)
        if self.store_in_rank0:
            self.lost.add(0)
        self.stopping.set()
        return self.failure

    def node_of(self, rank: int) -> str:
        """Rank ``rank``'s host, from what it published as it started."""
        if rank not in self.nodes:
            self.known_pids([rank])
        return self.nodes.get(rank, "?")

    def known_pids(self, ranks: list[int] | None = None) -> dict[int, int]:
        """Each rank's pid (of ``ranks``; None: all), as far as published,
        and its host into ``nodes``. Asked of the store once for each."""
        wanted = [r for r in (range(self.size) if ranks is None else ranks)
                  if r not in self.pids]
        there = [r for r in wanted if self.store.check([f"pid/{r}"])]
        for r, raw in zip(there, self.store.multi_get([f"pid/{r}" for r in there]) if there
                          else [], strict=True):
            pid, _, node = bytes(raw).decode().partition(" ")
            self.pids[r], self.nodes[r] = int(pid), self.nodes.get(r, node)
        return self.pids

    def dead(self) -> list[int]:
        """The other ranks of this machine whose process has ended."""
        pids = self.known_pids()
        return [r for r, pid in sorted(pids.items()) if r != self.rank and
                self.nodes.get(r) == self.node and pid != os.getpid() and process_gone(pid)]

    def speaks(self) -> bool:
        """Whether this rank says the failure: rank 0, unless it is lost; then
        the rank that claims it first. A store gone with rank 0 raises."""
        if 0 not in self.lost:
            return self.rank == 0
        if self.rank == 0:
            return False
        mine = str(self.rank).encode()
        return bytes(self.store.compare_set("stand-in", "", mine)) == mine

    def last_word(self, failure: Failure) -> CkptoolError:
        """The failure as said: once rank 0 is lost, true of the output (it
        may have committed it before it went)."""
        if 0 in self.lost and self._finished and self.target is not None and \
                committed(self.target, self.placed):
            return complete(f"rank 0 of {self.size} was lost after it committed "
                            f"{self.target}", self.target, failure.code)
        return failure.error(self.size, prefix=failure.rank != 0 or 0 in self.lost)

    def heard_from(self, rank: int | None, exc: CkptoolError) -> CkptoolError:
        """The error to leave with when a collective call said that a rank
        failed (``rank``, if it said which): that rank's own record of why,
        once it arrives. Where it did not say which (gloo: "connection closed
        by peer"), the rank that died: its process gone from this machine,
        or its beat standing still all the while. Else ``exc``, recorded."""
        deadline = time.monotonic() + GRACE
        before = self._counts() if rank is None else {}
        while self.failure is None and time.monotonic() < deadline:
            if self.store.check(["failed"]):
                self._heard()
            elif rank is not None or self.died() is None:
                time.sleep(0.05)
        still = [r for r, count in self._counts().items()
                 if r != self.rank and before.get(r) == count]
        if self.failure is None and still:
            self.lost.add(still[0])
            self.fail(Failure(still[0], self.node_of(still[0]), "stopped answering (killed, "
                              "or its machine was lost)", RESUME, EXIT_RANK_FAILED, gone=True))
        if self.failure is None:
            self.fail(Failure(rank if rank is not None else -1, self.nodes.get(rank, "?")
                              if rank is not None else "?", exc.message, RESUME,
                              EXIT_RANK_FAILED))
        return self.stopped()

    def died(self) -> Failure | None:
        """The failure of another rank of this machine whose process has
        ended without a word (kill -9, the OOM killer), recorded; None if
        none has. Under ``--workers`` its launcher says it."""
        dead = self.dead()
        if not dead:
            return None
        self.lost.update(dead)
        return self.fail(Failure(dead[0], self.node_of(dead[0]), "was killed (its process "
                                 "is gone: kill -9, or the OOM killer)", RESUME,
                                 EXIT_RANK_FAILED, gone=True,
                                 elsewhere=bool(os.environ.get(WORKERS))))

    def _counts(self) -> dict[int, bytes]:
        """Every rank's beat count, now."""
        beats = self.store.multi_get([f"beat/{r}" for r in range(self.size)])
        return {r: bytes(raw).partition(b" ")[0] for r, raw in enumerate(beats)}


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` (of this machine) has ended: gone, or a
    zombie its parent has not reaped yet. Another user's process counts as
    there."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False  # no /proc: os.kill said it is there
    return state in (b"Z", b"X")


def identity(path: str | Path) -> Identity | None:
    """``path``'s inode, links followed (OUT written through a link to a
    file is its target); None where there is none."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def committed(target: str, placed: Identity | None) -> bool:
    """Whether the output ``target`` of a distributed convert is committed:
    it is the directory or file the run staged (``placed``), renamed or
    linked into place (``Staging.commit``). An output there before
    (``--force``), or that another program made meanwhile, is not; nor is
    anything where ``placed`` is not known."""
    return placed is not None and identity(target) == placed


def complete(said: str, target: str, code: int = EXIT_RANK_FAILED) -> RankFailedError:
    """The error of a rank lost once ``target`` was committed (``said``):
    true of the output, which is complete."""
    err = RankFailedError(f"{said}: the output is complete",
                          COMMITTED_HINT.format(target=target))
    err.exit_code = code
    return err


def tell_launcher(placed: Identity | None) -> None:
    """Rank 0 under ``--workers``: what it will commit, for the launching
    process (``PLACED``), written whole before it is renamed into place."""
    path = os.environ.get(PLACED)
    if not path or placed is None:
        return
    temp = f"{path}.tmp"
    with open(temp, "w", encoding="ascii") as f:
        f.write(f"{placed[0]} {placed[1]}\n")
    os.replace(temp, path)


def told(path: str) -> Identity | None:
    """What rank 0 said it would commit (``tell_launcher``); None if it said nothing."""
    try:
        with open(path, encoding="ascii") as f:
            dev, ino = f.read().split()
        return int(dev), int(ino)
    except (OSError, ValueError):
        return None
