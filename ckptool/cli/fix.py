"""``ckptool fix``: rewrite a checkpoint so that it loads; the command and
its JSON report (the text view: ``fix_text.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import click

from ckptool.cli.common import SCHEMA_VERSION, console, fsync_help, progress, write_json
from ckptool.cli.inputs import InputPath

if TYPE_CHECKING:
    from ckptool.write.fix.run import FixResult


@click.command()
@click.argument("path", type=InputPath(), required=False)
@click.option("-o", "--output", metavar="OUT",
              help="Where to write (default: IN.fixed.EXT beside IN).")
@click.option("--strip-module", is_flag=True,
              help="Remove the DataParallel/DDP/compile/Lightning prefix the keys share.")
@click.option("--strip-prefix", multiple=True, metavar="P", help="Remove prefix P from keys.")
@click.option("--add-prefix", metavar="P", help="Put P in front of every key.")
@click.option("--rename", multiple=True, metavar="REGEX=REPL",
              help="Rename keys with a regular expression (Python re.sub).")
@click.option("--extract", is_flag=False, flag_value="auto", metavar="[PATH]",
              help="Keep only the main state dict, or the entry at PATH.")
@click.option("--drop", multiple=True, metavar="PATH", help="Leave out an entry (e.g. optimizer).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]),
              help="Cast floating-point tensors.")
@click.option("--to", "to", metavar="DEVICE",
              help="Save every storage as on DEVICE (cpu, cuda:0...).")
@click.option("--map", "maps", multiple=True, metavar="SRC=DST",
              help="Move storages saved on SRC to DST (e.g. cuda:2=cuda:0).")
@click.option("--salvage", is_flag=True,
              help="Write from a file flagged unsafe: its tensors and plain values only, "
                   "the output re-read and refused unless clean.")
@click.option("--dry-run", is_flag=True, help="Show the plan and write nothing.")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
@click.option("--in-place", is_flag=True, help="Replace IN itself (atomically).")
@click.option("--manifest", "manifest", metavar="FILE", default=None,
              help="Also write the output's manifest to FILE (as ckptool verify OUT "
              "--write-manifest FILE would).")
@click.option("--fsync", is_flag=True, help=fsync_help("--force, --in-place"))
@click.option("--quiet", "-q", is_flag=True, help="Print nothing but errors.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan and result as JSON.")
def fix(path: str | None, output: str | None, strip_module: bool, strip_prefix: tuple[str, ...],
        add_prefix: str | None, rename: tuple[str, ...], extract: str | None,
        drop: tuple[str, ...], dtype: str | None, to: str | None, maps: tuple[str, ...],
        salvage: bool, dry_run: bool, force: bool, in_place: bool, manifest: str | None,
        fsync: bool, quiet: bool, as_json: bool) -> None:
    """Rewrite a checkpoint so that it loads: keys, devices, dtypes, entries."""
    from ckptool.cli.inputs import is_spooled, local_output, shown_path
    from ckptool.errors import UsageError
    from ckptool.write import interrupt
    from ckptool.write.fix import plan as planning
    from ckptool.write.fix.run import fix as run_fix

    local_output(output, "-o")
    local_output(manifest, "--manifest")
    if path is None:
        _missing_path(extract)
    if is_spooled(path) and (in_place or not output):
        raise UsageError(f"fix reads {shown_path(path)} as a stream: there is no file "
                         f"{'to replace' if in_place else 'to write beside'}",
                         "name the output: -o OUT")

    opts = planning.FixOptions(
        strip_module=strip_module, strip_prefixes=strip_prefix, add_prefix=add_prefix,
        renames=tuple(planning.parse_pair(r, "--rename") for r in rename),
        extract=extract, drop=drop,
        dtype=planning.DTYPE_NAMES[dtype] if dtype else None,
        to=planning.parse_device(to) if to else None,
        maps=tuple((planning.parse_tag(a), planning.parse_device(b))
                   for a, b in (planning.parse_pair(m, "--map") for m in maps)),
        salvage=salvage,
    )
    if manifest is not None and not dry_run:
        from ckptool.check.verify.outmanifest import check_destination

        check_destination(manifest, path if in_place else output, path)
    # a Ctrl-C says whether PATH was changed in place (exit 130 either way)
    with interrupt.reported(path if in_place and not dry_run else None):
        streams: dict[str, Any] | None = {} if manifest is not None else None
        with progress(quiet) as update:
            result = run_fix(path, opts, output, force=force, in_place=in_place,
                             dry_run=dry_run, progress=update, fsync=fsync, streams=streams)
        written = None
        if manifest is not None and result.output is not None:
            from ckptool.check.verify.outmanifest import default_jobs, write_for_output

            result.plan.notes.append(write_for_output(result.output, manifest,
                                                      default_jobs(), streams)[1])
            written = manifest
        if as_json:
            write_json(fix_dict(result, written))
        elif not quiet:
            from ckptool.cli.fix_text import render_fix

            render_fix(console(), result)


command = fix


def _missing_path(extract: str | None) -> NoReturn:
    """No checkpoint named: most often ``--extract FILE``, where click took
    the file for the entry to extract (--extract's PATH is optional)."""
    import os

    from ckptool.describe import shell_word
    from ckptool.errors import UsageError

    if extract not in (None, "auto") and os.path.exists(extract):
        raise UsageError(f"--extract took {extract} for the entry to extract, and no "
                         "checkpoint was named",
                         f"put the checkpoint first: `ckptool fix {shell_word(extract)} "
                         "--extract ...`, or write --extract=PATH")
    raise UsageError("missing the checkpoint to fix", "ckptool fix CKPT [OPTIONS]")


def fix_dict(result: FixResult, manifest: str | None = None) -> dict[str, Any]:
    """The ``fix --json`` schema (a FixResult from ckptool.write.fix.run);
    ``manifest``: where the output's manifest was written."""
    plan = result.plan
    devices, casts = result.moves()
    return {
        "schema_version": SCHEMA_VERSION,
        "input": result.source.path,
        "format": result.source.format,
        "output": result.target,
        "dry_run": result.output is None,
        "renamed": [{"from": a, "to": b} for a, b in plan.renames],
        "dropped": plan.dropped,
        "extracted": plan.extracted,
        "devices": devices,
        "casts": casts,
        "metadata_only": result.metadata_only,
        "bytes_written": result.bytes_written,
        "verified_storages": result.verified_storages,
        "notes": plan.notes,
        "manifest": manifest,
    }
