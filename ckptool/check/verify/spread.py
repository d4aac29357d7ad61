"""``ckptool verify`` on every process of a distributed job (torchrun, srun,
``--workers``): each rank checks its share of the bytes, rank 0 reports.

Every rank runs the same structure checks (``structure.check``: directories,
headers, pickles, coverage, the index: cheap, and the same on every rank, as
they read the same files). The expensive part, the CRC-32 of every zip
record, goes through a ``SharedPool``: the units of records the checks hand
it (about ``zipcheck.UNIT`` bytes each, in the order the files are checked)
are cut into one contiguous run per rank, balanced by bytes
(``ckptool.write.distributed.plan.assign``, as convert cuts its tensors),
and each rank computes the CRC of its own run only. The records whose CRC
fails come back to rank 0 through the job's store, which names them as the
one-process run does: rank 0's report is the one-process report.

Store keys (``World.store``, JSON values): ``verify/<rank>`` for each rank
but 0: ``{"units": <digest of the units it saw>, "failures": [...]}``, or
``{"error", "hint", "code"}`` when the rank failed. Rank 0 waits for every
rank's (``CKPTOOL_JOIN_TIMEOUT`` seconds at most), says the first error of
another rank as its own, and refuses a run whose ranks saw different units
(the checkpoint changed under them).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ckptool.check.verify.problems import Report
from ckptool.check.verify.zipcheck import CrcPool, Failure, Record
from ckptool.errors import EXIT_RANK_FAILED, CkptoolError, InputError, RankFailedError
from ckptool.write.distributed.plan import assign
from ckptool.write.distributed.world import World, join_timeout

Unit = tuple[str, str, list[Record], object, int]  # path, file, records, label, bytes


class SharedPool(CrcPool):
    """A ``CrcPool`` whose units are held until ``failures``, then cut among
    the ranks: this rank checks its own; rank 0 gathers the others'."""

    def __init__(self, world: World, jobs: int) -> None:
        super().__init__(jobs)
        self.world = world
        self.units: list[Unit] = []  # every unit, as every rank sees them
        self.own = 0  # bytes of records this rank checked

    def _send(self, path: str, file: str, unit: list[Record], label: object) -> None:
        size = sum(r.size for r in unit)
        self.checked += size
        self.units.append((path, file, unit, label, size))

    def failures(self, done: Callable[[int], None] | None = None) -> list[Failure]:
        world = self.world
        bounds = assign([u[4] for u in self.units], world.size)
        total = self.checked
        for path, file, unit, label, _ in self.units[bounds[world.rank]:bounds[world.rank + 1]]:
            super()._send(path, file, unit, label)
        self.own, self.checked = self.checked - total, total
        mine = super().failures(done)
        if world.rank != 0:
            _post(world, {"units": _digest(self.units), "failures": [_encode(f) for f in mine]})
            return mine
        merged = list(mine)
        for rank, said in enumerate(_gather(world), start=1):
            if "error" in said:
                err = CkptoolError(f"rank {rank}: {said['error']}", said.get("hint", ""))
                err.exit_code = int(said.get("code", EXIT_RANK_FAILED))
                raise err
            if said.get("units") != _digest(self.units):
                raise InputError(f"rank {rank} found other files to check than rank 0: the "
                                 "checkpoint changed while it was verified, or the ranks do "
                                 "not see the same files",
                                 "verify it again once nothing writes to it, on a filesystem "
                                 "every rank sees alike")
            merged += [_decode(f) for f in said.get("failures", [])]
        return merged


def verify_share(world: World, path: str, jobs: int,
                 pool: SharedPool | None = None) -> Report | None:
    """This rank's part of ``verify PATH`` (no ``--values`` nor manifests):
    the whole report on rank 0, None on the others. A failure on a rank
    other than 0 is posted for rank 0 to say, then raised here."""
    from ckptool.check.verify.structure import check

    pool = pool if pool is not None else SharedPool(world, jobs)
    try:
        report = check(path, jobs, pool)
    except CkptoolError as exc:
        if world.rank != 0:
            _post(world, {"error": exc.message, "hint": exc.hint, "code": exc.exit_code})
        raise
    return report if world.rank == 0 else None


def _post(world: World, value: dict[str, Any]) -> None:
    world.store.set(f"verify/{world.rank}", json.dumps(value))


def _gather(world: World) -> list[dict[str, Any]]:
    """What ranks 1 to N-1 posted, in rank order."""
    keys = [f"verify/{r}" for r in range(1, world.size)]
    if not keys:
        return []
    wait = join_timeout()
    try:
        world.store.wait(keys, timedelta(seconds=wait))
    except RuntimeError:  # (torch's DistStoreError is one) the wait timed out
        late = [r for r, key in enumerate(keys, start=1) if not world.store.check([key])]
        raise RankFailedError(
            f"rank(s) {', '.join(map(str, late))} of {world.size} did not report their share "
            f"within {wait:g} s", "a rank stopped or is stuck: see its own output; "
            "CKPTOOL_JOIN_TIMEOUT is how long rank 0 waits") from None
    return [json.loads(v) for v in world.store.multi_get(keys)]


def _digest(units: list[Unit]) -> str:
    h = hashlib.sha256()
    for _, file, records, _, _ in units:
        h.update(json.dumps([file, [[r.offset, r.size] for r in records]]).encode())
    return h.hexdigest()[:32]


def _encode(f: Failure) -> dict[str, Any]:
    r = f.record
    return {"file": f.file, "record": [r.name, r.offset, r.size, r.crc],
            "label": f.label, "error": f.error}


def _decode(d: dict[str, Any]) -> Failure:
    label = d["label"]  # a DCP item's (tensor, where): a list in JSON
    return Failure(d["file"], Record(*d["record"]), tuple(label) if isinstance(label, list)
                   else label, d["error"])
