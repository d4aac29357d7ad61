"""``ckptool convert`` on many processes: ``--dry-run`` (the plan: which
rank writes which files, what each reads and writes) and a run under
torchrun, srun or ``--workers`` (``ckptool.write.distributed``), where rank
0 alone shows the bar and the report and the others stay quiet.
"""

from __future__ import annotations

from typing import Any

import click

from ckptool.cli.common import SCHEMA_VERSION, console, progress, write_json
from ckptool.describe import human_bytes

SHOWN_RANKS = 16  # rows of the text plan before the middle is summed up


def show_plan(path: str, output: str, ranks: int, options: dict[str, Any], as_json: bool,
              quiet: bool) -> None:
    from ckptool.write.distributed.run import plan_only

    plan = plan_only(path, output, ranks, **options)
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
    nfiles = len(plan.files) or "DCP"
    out.print(f"plan: {summary['input']} -> {output} ({summary['output_format']}): "
              f"{len(plan.units)} tensors, {human_bytes(plan.total)} in {nfiles} file(s), "
              f"on {ranks} rank(s)")
    shown: list[dict[str, Any] | None] = list(rows) if len(rows) <= SHOWN_RANKS else [
        *rows[:SHOWN_RANKS // 2], None, *rows[-SHOWN_RANKS // 2:]]
    out.print(f"{'rank':>6}  {'tensors':>8}  {'writes':>10}  {'reads':>10}  files")
    for row in shown:
        if row is None:
            out.print(f"{'…':>6}  ({len(rows) - SHOWN_RANKS} more ranks: --json lists all)")
            continue
        names = list(row["files"])
        files = ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
        out.print(f"{row['rank']:>6}  {row['tensors']:>8}  "
                  f"{human_bytes(int(row['bytes_written'])):>10}  "
                  f"{human_bytes(int(row['bytes_read'])):>10}  "
                  f"{files or '-'}")
    if plan.index is not None:
        out.print(f"rank 0 writes {plan.index[0]} last, once every rank has written its share")


def run_distributed(launch: Any, path: str, output: str, force: bool, fsync: bool,
                    quiet: bool, options: dict[str, Any]) -> Any:
    """This rank's part of the conversion: the report on rank 0, None on
    the others. A rank that must leave without a word exits with its code."""
    from ckptool.write.distributed import world
    from ckptool.write.distributed.run import Quiet, convert

    joined = world.join(launch)
    try:
        with progress(quiet or launch.rank != 0) as update:
            return convert(joined, path, output, force=force, progress=update, fsync=fsync,
                           **options)
    except Quiet as exc:
        raise click.exceptions.Exit(exc.exit_code) from exc
    finally:
        joined.close()
