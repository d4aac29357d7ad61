"""``ckptool convert``: between torch files and safetensors, and TorchScript
archives and plain pickles into torch files; the command and its JSON
report (the text view: ``fix_text.py``, beside fix's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ckptool.cli.common import SCHEMA_VERSION, console, fsync_help, progress, write_json
from ckptool.cli.inputs import InputPath

if TYPE_CHECKING:
    from ckptool.write.convert import ConvertResult


@click.command()
@click.argument("path", type=InputPath())
@click.argument("output", metavar="OUT", type=click.Path(path_type=str))
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
@click.option("--fsync", is_flag=True, help=fsync_help("--force"))
@click.option("--quiet", "-q", is_flag=True, help="Print nothing but errors.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def convert(path: str, output: str, force: bool, fsync: bool, quiet: bool,
            as_json: bool) -> None:
    """Convert between torch files and safetensors, or TorchScript and pickles to
    torch (direction from OUT's extension)."""
    from ckptool.write.convert import convert as run_convert

    with progress(quiet) as update:
        result = run_convert(path, output, force=force, progress=update, fsync=fsync)
    if as_json:
        write_json(convert_dict(result))
    elif not quiet:
        from ckptool.cli.fix_text import render_convert

        render_convert(console(), result)


command = convert


def convert_dict(result: ConvertResult) -> dict[str, Any]:
    """The ``convert --json`` schema (a ConvertResult from ckptool.write.convert)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "input": result.source.path,
        "input_format": result.source.format,
        "output": result.output,
        "output_format": "safetensors" if result.direction == "safetensors" else "torch-zip",
        "tensors": result.tensors,
        "aliases": result.aliases,
        "copied_views": result.copied_views,
        "kept_entries": result.kept_entries,
        "left_out": result.left_out,
        "bytes_written": result.bytes_written,
        "notes": result.notes,
    }
