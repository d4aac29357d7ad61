"""``convert`` on every rank of a ``torch.distributed`` job: the steps, and
who does what.

1. Every rank reads the input's metadata and plans the same conversion
   (``plan``); rank 0 checks that every rank computed the same plan.
2. Rank 0 prepares the staging directory (``staging``: kept from an earlier
   run of the same plan, else afresh), and a one-file output's file in it;
   every rank checks that it sees it, and notes the inode it will commit
   (``lost.committed``: what is said of OUT if rank 0 is lost).
3. Every rank writes its share (``files``; a DCP output through one
   ``dcp.save`` of all ranks) and verifies every byte it wrote.
4. Rank 0 waits for every rank, writes what needs all of them (a zip's
   directory, the HF index, a framework's config files), reads every file
   back, checks that the files (and the index, or DCP's metadata) hold each
   tensor exactly once, and renames the output into place.

A failure anywhere (``coordinate``) stops every rank and commits nothing;
the staging directory stays for the re-run, which resumes. Rank 0 says what
failed; the other ranks say nothing, unless rank 0 could not hear them.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

from ckptool.errors import EXIT_BAD_INPUT, InputError
from ckptool.read.reader import no_cycle_collection
from ckptool.write.convert.directory import check_whole
from ckptool.write.convert.folder import top_names
from ckptool.write.convert.job import Job, prepare
from ckptool.write.distributed import dcpshare, ending, lost
from ckptool.write.distributed import files as dist_files
from ckptool.write.distributed.coordinate import STORE_ERRORS, Coordinator, Failure
from ckptool.write.distributed.ending import Say
from ckptool.write.distributed.plan import Plan, make
from ckptool.write.distributed.staging import Staging, write_small
from ckptool.write.failures import NEEDED
from ckptool.write.results import ConvertResult
from ckptool.write.sources import TensorSource

Progress = Callable[[int, int], None]


def plan_only(src: str, dst: str, ranks: int, **options: Any) -> Plan:
    """``--dry-run``: the plan of ``src`` into ``dst`` on ``ranks`` ranks."""
    return make(prepare(src, dst, **options), ranks)


def convert(world: Any, src: str, dst: str, *, say: Say, force: bool = False,
            progress: Progress | None = None, fsync: bool = False,
            **options: Any) -> ConvertResult | None:
    """This rank's part of converting ``src`` into ``dst`` (``options`` as
    ``convert.run.convert`` takes them). Returns the report on rank 0, None
    on the others. A failure is said once, by rank 0 through ``say``, and
    raised on every rank as ``Quiet`` with its exit code (``ending``)."""
    coord = Coordinator(world.store, world.rank, world.size, world.node, target=dst)
    coord.say = say  # rank 0's, or its stand-in's once it is lost
    coord.start()
    start = time.monotonic()
    stack = contextlib.ExitStack()  # what rank 0 holds until the end (the lock)
    needs = NEEDED.set(None)  # the plan's bytes, once planned: a full disk says them
    try:
        return _convert(world, coord, stack, src, dst, force, progress, fsync, options, start)
    except BaseException as exc:
        err = ending.as_error(exc, coord, dst)
        if err is None:  # a bug: heard by every rank, its traceback here
            coord.handled.set()
            with contextlib.suppress(*STORE_ERRORS):
                coord.fail(Failure(coord.rank, coord.node, f"{type(exc).__name__}: {exc}",
                                   "this is a bug in ckptool; its traceback is above",
                                   EXIT_BAD_INPUT))
            raise
        raise ending.leave(coord, err, say) from exc
    finally:
        NEEDED.reset(needs)
        coord.close()
        stack.close()


def _convert(world: Any, coord: Coordinator, stack: contextlib.ExitStack[Any], src: str,
             dst: str, force: bool, progress: Progress | None, fsync: bool,
             options: dict[str, Any], start: float) -> ConvertResult | None:
    rank = coord.rank
    with no_cycle_collection():  # millions of small objects at scale: see reader
        job = prepare(src, dst, **options)
        plan = make(job, coord.size)
    NEEDED.set(plan.total)
    staging = Staging(dst, job.is_directory, force)
    placed = staging.placed(plan.files[0].name if plan.files else "")
    if rank == 0:
        staging.check_target(job.source.directory or job.source.path, top_names(job.extras))
        staging.lock()  # released when this process ends, or at the end
        stack.callback(staging.unlock)
    durable = fsync or (force and os.path.exists(dst))
    coord.publish(f"plan/{rank}", f"{plan.fingerprint()} {coord.node}")
    if rank == 0:
        gathered = [p.partition(" ") for p in coord.gather("plan")]
        coord.nodes = {r: node for r, (_, _, node) in enumerate(gathered)}
        prints = [p for p, _, _ in gathered]
        odd = [r for r, p in enumerate(prints) if p != prints[0]]
        if odd:
            raise InputError(f"rank {odd[0]} planned another conversion than rank 0 (it sees "
                             "another input, or runs another ckptool)",
                             "every rank must read the same IN: put it on a filesystem every "
                             "node shares, and run one ckptool version everywhere")
        token, resumed = staging.prepare(prints[0])
        if not job.is_directory:  # the one file there from now on (it is what is committed)
            os.close(os.open(placed, os.O_WRONLY | os.O_CREAT, 0o644))
        coord.placed = lost.identity(placed)
        lost.tell_launcher(coord.placed)
        coord.publish("ready", f"{int(resumed)} {token}")
    else:
        resumed_text, _, token = coord.wait_for("ready").partition(" ")
        resumed = resumed_text == "1"
        if not staging.sees(token):
            raise InputError(f"rank {rank} does not see {staging.path}, which rank 0 made",
                             "OUT must be on a filesystem every node shares")
        coord.placed = lost.identity(placed)  # (true of OUT once rank 0 has committed it)
    coord.staged = True
    coord.total = plan.total
    coord.progress = progress if rank == 0 else None

    def advance(done: int) -> None:
        coord.done_bytes = done
        coord.check()

    with TensorSource(job.source) as tensors:
        if job.kind == "dcp":
            report = dcpshare.write_share(plan, world, coord, staging, tensors, durable,
                                          advance)
        else:
            report = dist_files.write_share(plan, rank, staging, tensors, durable, advance,
                                            resumed)
        report.update(rank=rank, node=coord.node, seconds=round(time.monotonic() - start, 3),
                      peak_memory=_peak_memory())
        coord.finished(report)
        if rank != 0:
            coord.wait_for("outcome")
            coord.leave()
            return None
        reports = coord.wait_all_finished()
        result = _commit(plan, staging, tensors, durable, job)
    ending.COMMITTED.set()
    coord.publish("outcome", "committed")
    coord.wait_all_left()  # under srun, the store lives in this process
    result.distributed = {"ranks": coord.size, "plan": plan.rows(), "per_rank": reports,
                          "resumed": resumed}
    if progress is not None:
        progress(plan.total, plan.total)
    return result


def _peak_memory() -> int:
    """This process's peak resident memory so far, in bytes (Linux counts kB)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) * (1 if sys.platform == "darwin" else 1024)


def _commit(plan: Plan, staging: Staging, tensors: TensorSource, durable: bool,
            job: Job) -> ConvertResult:
    """Rank 0, once every rank has written its share."""
    result = job.result
    if job.kind == "dcp":
        names = sorted(n for n in os.listdir(staging.path) if not n.startswith(".ckptool"))
    else:
        names = dist_files.finish(plan, staging, tensors, durable)
    if plan.index is not None:
        write_small(staging.file(plan.index[0]), plan.index[1], durable)
        names.append(plan.index[0])
    for extra in job.extras:  # a framework's files (a module's folder made first)
        staging.file(extra.name).parent.mkdir(parents=True, exist_ok=True)
        with extra.open() as f:
            write_small(staging.file(extra.name), f.read(), durable)
        names.append(extra.name)
    if job.is_directory:
        back = check_whole(str(staging.path), job.written, job.kind)
        result.bytes_written = back.file_size
        result.files = names
    else:
        result.bytes_written = os.path.getsize(staging.file(names[0]))
    staging.commit(names[0] if not job.is_directory else None, durable)
    return result
