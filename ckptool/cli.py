"""The ``ckptool`` command line: arguments in, core calls, output out.

Errors from the core (``CkptoolError``) become ``ckptool: error: ...`` plus
a ``hint:`` line on stderr and the error's exit code, here and nowhere
else. stdout carries only data. Rich is imported only for human output.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

import click

from ckptool import __version__
from ckptool.errors import EXIT_INTERRUPTED, EXIT_USAGE, CkptoolError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckptool")
@click.option("--traceback", "show_traceback", is_flag=True, hidden=False,
              help="Show the Python traceback of an error (for bug reports).")
@click.pass_context
def cli(ctx: click.Context, show_traceback: bool) -> None:
    """Inspect, diagnose and fix PyTorch checkpoints, without a GPU and
    without running code from the file."""
    ctx.obj = {"traceback": show_traceback}


@cli.command()
@click.argument("path", type=click.Path(dir_okay=True, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")
@click.option("--filter", "-f", "pattern", metavar="GLOB",
              help="Only tensors whose key matches (glob, or substring without wildcards).")
@click.option("--depth", "-d", type=click.IntRange(min=1), metavar="N",
              help="Group tensors by the first N key components (split on / and .).")
@click.option("--limit", "-n", type=click.IntRange(min=0), default=200, show_default=True,
              help="Most tensor rows to print; 0 prints all.")
def inspect(path: str, as_json: bool, pattern: str | None, depth: int | None,
            limit: int) -> None:
    """Show what is in a checkpoint: tensors, devices, entries, unsafe globals."""
    from ckptool.reader import open_checkpoint

    ckpt = open_checkpoint(path)
    if as_json:
        from ckptool.report import dumps, inspect_dict

        sys.stdout.write(dumps(inspect_dict(ckpt, pattern)))
        return
    from ckptool.render import render_inspect

    render_inspect(_console(), ckpt, pattern, depth, limit)


@cli.command()
@click.argument("path_a", metavar="A", type=click.Path(dir_okay=True, path_type=str))
@click.argument("path_b", metavar="B", type=click.Path(dir_okay=True, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")
@click.option("--no-values", is_flag=True,
              help="Compare metadata only (shape, dtype, location); read no tensor bytes.")
@click.option("--all", "all_tensors", is_flag=True,
              help="Compare every tensor by its full key, not only the main state dicts.")
@click.option("--limit", "-n", type=click.IntRange(min=0), default=200, show_default=True,
              help="Most difference rows to print; 0 prints all.")
def diff(path_a: str, path_b: str, as_json: bool, no_values: bool, all_tensors: bool,
         limit: int) -> int:
    """Compare two checkpoints: names only in A or B, shape, dtype, location
    and value changes. Exits 0 when they match, 1 when they differ."""
    from ckptool.diff import diff_checkpoints
    from ckptool.reader import open_checkpoint

    report = diff_checkpoints(open_checkpoint(path_a), open_checkpoint(path_b),
                              compare_values=not no_values, all_tensors=all_tensors)
    if as_json:
        from ckptool.report import dumps
        from ckptool.report_diff import diff_dict

        sys.stdout.write(dumps(diff_dict(report)))
    else:
        from ckptool.render_diff import render_diff

        render_diff(_console(), report, limit)
    return report.exit_code


def _console() -> Any:
    from rich.console import Console

    return Console(highlight=False)


def _fail(message: str, hint: str, code: int) -> int:
    click.echo(f"ckptool: error: {message}", err=True)
    if hint:
        click.echo(f"hint: {hint}", err=True)
    return code


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; every error becomes a message and an exit code here."""
    show_tb = "--traceback" in (argv if argv is not None else sys.argv[1:])
    try:
        # a command's int return value is its exit code (diff: 1 = differences)
        result = cli.main(args=argv, prog_name="ckptool", standalone_mode=False)
    except CkptoolError as exc:
        if show_tb:
            traceback.print_exc()
        return _fail(exc.message, exc.hint, exc.exit_code)
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.ClickException as exc:
        hint = "run 'ckptool --help' or 'ckptool COMMAND --help' for usage"
        return _fail(exc.format_message(), hint, EXIT_USAGE)
    except click.exceptions.Abort:
        return _fail("interrupted", "", EXIT_INTERRUPTED)
    except KeyboardInterrupt:
        return _fail("interrupted", "", EXIT_INTERRUPTED)
    except BrokenPipeError:
        # output piped into `head` and the reader went away: not an error
        sys.stderr.close()
        return 0
    return result if isinstance(result, int) else 0


def entry() -> None:
    sys.exit(main())
