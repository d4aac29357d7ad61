"""``ckptool convert`` on many processes: ``--dry-run`` (the plan: which
rank writes which files, what each reads and writes) and a run under
torchrun, srun or ``--workers`` (``ckptool.write.distributed``), where rank
0 alone shows the bar and the report and the others stay quiet.
"""

from __future__ import annotations

import os
import signal
from types import FrameType
from typing import Any

import click

from ckptool.cli.common import (
    SCHEMA_VERSION,
    console,
    keep_until_exit,
    one_shot,
    progress,
    say_error,
    write_json,
)
from ckptool.describe import human_bytes, plural
from ckptool.errors import CkptoolError
from ckptool.write.distributed.coordinate import RESUME

SHOWN_RANKS = 16  # rows of the text plan before the middle is summed up


def show_plan(path: str, output: str, ranks: int, options: dict[str, Any], as_json: bool,
              quiet: bool) -> None:
    """``--dry-run``: the plan, as text or JSON. The collector stays off
    throughout (``one_shot``): at 100,000 tensors its passes over the
    checkpoint's millions of records cost seconds."""
    with one_shot():
        _show_plan(path, output, ranks, options, as_json, quiet)


def _show_plan(path: str, output: str, ranks: int, options: dict[str, Any], as_json: bool,
               quiet: bool) -> None:
    from ckptool.write.distributed.run import plan_only

    plan = plan_only(path, output, ranks, **options)
    keep_until_exit(plan)
    if quiet:
        return
    rows = plan.rows()
    summary = {"input": plan.job.source.path, "output": output,
               "output_format": plan.job.result.output_format, "ranks": ranks,
               "files": [f.name for f in plan.files] + ([plan.index[0]] if plan.index else []),
               "tensors": len(plan.units), "tensor_bytes": plan.total}
    if as_json:
        write_json({"schema_version": SCHEMA_VERSION, "dry_run": True, **summary,
                    "plan": rows})
        return
    out = console()
    where = f"in {plural(len(plan.files), 'file')}" if plan.files else \
        "in DCP files, one per rank"
    out.print(f"plan: {summary['input']} -> {output} ({summary['output_format']}): "
              f"{plural(len(plan.units), 'tensor')}, {human_bytes(plan.total)} {where}, on "
              f"{plural(ranks, 'rank')}")
    busy = [row for row in rows if row["tensors"]]
    shown: list[dict[str, Any] | None] = list(busy) if len(busy) <= SHOWN_RANKS else [
        *busy[:SHOWN_RANKS // 2], None, *busy[-SHOWN_RANKS // 2:]]
    out.print(f"{'rank':>6}  {'tensors':>8}  {'writes':>10}  {'reads':>10}  files")
    for row in shown:
        if row is None:
            out.print(f"{'…':>6}  ({len(busy) - SHOWN_RANKS} more ranks: --json lists all)")
            continue
        out.print(f"{row['rank']:>6}  {row['tensors']:>8}  "
                  f"{human_bytes(int(row['tensor_bytes'])):>10}  "
                  f"{human_bytes(int(row['bytes_read'])):>10}  {_files(row['files'])}")
    idle = len(rows) - len(busy)
    if idle:
        out.print(f"{plural(idle, 'rank')} {'has' if idle == 1 else 'have'} no tensor to write"
                  + (" (each writes its empty .distcp)" if not plan.files else ""))
    if plan.index is not None:
        out.print(f"rank 0 writes {plan.index[0]} last, once every rank has written its share")


def _files(names: list[str]) -> str:
    """A rank's files, short: a run of shards as its first and last."""
    if len(names) <= 2:
        return ", ".join(names) or "-"
    return f"{names[0]} … {names[-1]} ({len(names)} files)"


def run_distributed(launch: Any, path: str, output: str, force: bool, fsync: bool,
                    quiet: bool, options: dict[str, Any]) -> Any:
    """This rank's part of the conversion (``launch``: from ``world.detect``;
    None: this one process, resuming what a distributed run left): the
    report on rank 0, None on the others. A failure is said once, by rank 0
    (or its stand-in); every rank exits with its code. SIGTERM (the launcher
    stopping the job, ``scancel``) is said by rank 0 and ends every rank at
    once; one that comes once this rank is leaving changes nothing."""
    from ckptool.write.distributed import ending, world
    from ckptool.write.distributed.ending import EXIT_TERMINATED, Quiet, Terminated
    from ckptool.write.distributed.launch import WORKERS_SAY_SIGNALS
    from ckptool.write.distributed.run import convert

    if launch is None:
        import torch.distributed as dist

        joined = world.alone_with(dist.HashStore(), 0, 1)
    else:
        joined = world.join(launch)
    rank = joined.rank

    said: list[int] = []  # the exit code of the failure this process has said

    def say(err: CkptoolError) -> None:
        said.append(err.exit_code)
        say_error(err.message, err.hint)

    def terminated(signum: int, frame: FrameType | None) -> None:
        if ending.LEAVING.is_set():  # its ending is on its way, with its own code
            return
        if said:  # the launcher stops the job the failure said here ended: nothing to add
            raise Quiet(said[0])
        if os.environ.get(WORKERS_SAY_SIGNALS):  # --workers: its process says what ended
            raise Quiet(EXIT_TERMINATED)
        raise Terminated("stopped by SIGTERM: the launcher or the scheduler stopped the job "
                         "(another process failed, or it was cancelled or ran out of time)",
                         RESUME)

    ending.LEAVING.clear()
    ending.COMMITTED.clear()
    before = signal.signal(signal.SIGTERM, terminated)
    try:
        with progress(quiet or rank != 0) as update:
            return convert(joined, path, output, say=say,
                           force=force, progress=update, fsync=fsync, **options)
    except Quiet as exc:
        raise click.exceptions.Exit(exc.exit_code) from exc
    except Terminated as exc:  # before this rank's part began, or in its teardown
        if rank == 0 and not said:
            if ending.COMMITTED.is_set():  # (by this process: nothing else is "committed")
                exc.message = f"stopped by SIGTERM after {output} was committed"
                exc.hint = f"the output is complete; check it with: ckptool verify {output}"
            say(exc)
        raise click.exceptions.Exit(EXIT_TERMINATED) from exc
    finally:
        signal.signal(signal.SIGTERM, before)
        joined.close()


def staged(output: str) -> bool:
    """Whether a distributed run into ``output`` left its staging directory
    (then even one process resumes it, through the same path)."""
    from ckptool.write.distributed.staging import Staging

    try:
        return Staging(output, False).path.is_dir()
    except OSError:  # a name too long for the filesystem...: the writer says it
        return False
