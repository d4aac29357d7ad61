"""The ``ckptool`` command line: arguments in, core calls, output out.

Errors from the core (``CkptoolError``) become ``ckptool: error: ...`` plus
a ``hint:`` line on stderr and the error's exit code, here and nowhere
else. stdout carries only data. Rich is imported only for human output.
"""

from __future__ import annotations

import contextlib
import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any

import click

from ckptool import __version__
from ckptool.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_USAGE, CkptoolError

FSYNC_HELP = ("Return only once OUT is on disk, safe from a power cut (as cp + sync). "
              "Replacing a file (--force, --in-place) always waits.")


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
    from ckptool.read.reader import open_checkpoint

    ckpt = open_checkpoint(path)
    if as_json:
        from ckptool.cli.report import dumps, inspect_dict

        sys.stdout.write(dumps(inspect_dict(ckpt, pattern)))
        return
    from ckptool.cli.render import render_inspect

    render_inspect(_console(), ckpt, pattern, depth, limit)


def _target_options(command: Any) -> Any:
    """--model/--model-arg/--reference/--device-count: what diagnose and
    browse check the file against."""
    for option in reversed([
        click.option("--model", "-m", "model_spec", metavar="MODULE:CLASS",
                     help="The model to load into: package.module:Class or "
                          "path/to/file.py:Class (built on the meta device: no memory "
                          "for weights)."),
        click.option("--model-arg", "-a", "model_args", multiple=True, metavar="NAME=VALUE",
                     help="A constructor argument for --model (value parsed as JSON, "
                          "else a string)."),
        click.option("--reference", "-r", metavar="CKPT",
                     help="Compare keys and shapes with another checkpoint instead of "
                          "a model."),
        click.option("--device-count", type=click.IntRange(min=0), metavar="N",
                     help="Diagnose for a machine with N visible GPUs instead of this one."),
    ]):
        command = option(command)
    return command


def _model_loader(model_spec: str | None, model_args: tuple[str, ...],
                  reference: str | None) -> Any:
    """A function from the read checkpoint to the ModelKeys to compare with
    (None without --model or --reference); bad combinations fail now."""
    from ckptool.check import modelspec
    from ckptool.errors import UsageError

    if model_spec and reference:
        raise UsageError("--model and --reference both say what to compare with",
                         "use one of them")
    if model_args and not model_spec:
        raise UsageError("--model-arg needs --model", "name the class: --model mod:Class")
    arguments = modelspec.parse_arguments(model_args)
    if model_spec:
        def build(ckpt: Any) -> Any:
            from ckptool.check.modelspec import saved_settings

            return modelspec.build_model(model_spec, arguments, saved_settings(ckpt.root))
        return build
    if reference:
        return lambda ckpt: modelspec.reference_keys(reference)
    return None


@cli.command()
@click.argument("path", type=click.Path(dir_okay=True, path_type=str))
@_target_options
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")
def diagnose(path: str, model_spec: str | None, model_args: tuple[str, ...],
             reference: str | None, device_count: int | None, as_json: bool) -> int:
    """Say why a checkpoint will not load here (or into a model) and print the
    one `ckptool fix` command that repairs it. Exits 0 when nothing needs
    fixing, 1 when problems were found."""
    from ckptool.check import gpus
    from ckptool.check.diagnosis import diagnose as run_diagnose
    from ckptool.read.reader import open_checkpoint

    loader = _model_loader(model_spec, model_args, reference)
    ckpt = open_checkpoint(path)
    model = loader(ckpt) if loader else None
    machine = gpus.assumed(device_count) if device_count is not None else gpus.probe()
    result = run_diagnose(ckpt, machine, model)
    if as_json:
        from ckptool.cli.report import dumps
        from ckptool.cli.report_diagnose import diagnose_dict

        sys.stdout.write(dumps(diagnose_dict(result)))
    else:
        from ckptool.cli.render_diagnose import render_diagnose

        render_diagnose(_console(), result)
    return result.exit_code


@cli.command()
@click.argument("path", type=click.Path(dir_okay=True, path_type=str))
@_target_options
def browse(path: str, model_spec: str | None, model_args: tuple[str, ...],
           reference: str | None, device_count: int | None) -> int:
    """Browse a checkpoint in the terminal: module tree, tensors, devices,
    storage sharing, statistics, findings, and fixes with a preview."""
    from ckptool.check import gpus
    from ckptool.errors import UsageError
    from ckptool.read import formats

    loader = _model_loader(model_spec, model_args, reference)
    formats.check(path)  # a missing or foreign file fails here, before the screen opens
    if not _is_terminal():
        raise UsageError("browse needs a terminal (stdin and stdout are not both one)",
                         "for output you can pipe, use `ckptool inspect` or `inspect --json`")
    machine = gpus.assumed(device_count) if device_count is not None else None
    from ckptool.tui import make_app

    app = make_app(path, machine=machine, model=loader)
    app.run()
    if app.error is not None:
        raise app.error
    return 0


def _is_terminal() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


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
    from ckptool.check.diff import diff_checkpoints
    from ckptool.read.reader import open_checkpoint

    report = diff_checkpoints(open_checkpoint(path_a), open_checkpoint(path_b),
                              compare_values=not no_values, all_tensors=all_tensors)
    if as_json:
        from ckptool.cli.report import dumps
        from ckptool.cli.report_diff import diff_dict

        sys.stdout.write(dumps(diff_dict(report)))
    else:
        from ckptool.cli.render_diff import render_diff

        render_diff(_console(), report, limit)
    return report.exit_code


@cli.command()
@click.argument("path", type=click.Path(dir_okay=True, path_type=str))
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
@click.option("--dry-run", is_flag=True, help="Show the plan and write nothing.")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
@click.option("--in-place", is_flag=True, help="Replace IN itself (atomically).")
@click.option("--fsync", is_flag=True, help=FSYNC_HELP)
@click.option("--quiet", "-q", is_flag=True, help="Print nothing but errors.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan and result as JSON.")
def fix(path: str, output: str | None, strip_module: bool, strip_prefix: tuple[str, ...],
        add_prefix: str | None, rename: tuple[str, ...], extract: str | None,
        drop: tuple[str, ...], dtype: str | None, to: str | None, maps: tuple[str, ...],
        dry_run: bool, force: bool, in_place: bool, fsync: bool, quiet: bool,
        as_json: bool) -> None:
    """Rewrite a checkpoint so that it loads: keys, devices, dtypes, entries."""
    from ckptool.write import plan as planning
    from ckptool.write.rewrite import fix as run_fix

    opts = planning.FixOptions(
        strip_module=strip_module, strip_prefixes=strip_prefix, add_prefix=add_prefix,
        renames=tuple(planning.parse_pair(r, "--rename") for r in rename),
        extract=extract, drop=drop,
        dtype=planning.DTYPE_NAMES[dtype] if dtype else None,
        to=planning.parse_device(to) if to else None,
        maps=tuple((planning.parse_device(a), planning.parse_device(b))
                   for a, b in (planning.parse_pair(m, "--map") for m in maps)),
    )
    with _progress(quiet) as progress:
        result = run_fix(path, opts, output, force=force, in_place=in_place,
                         dry_run=dry_run, progress=progress, fsync=fsync)
    if as_json:
        from ckptool.cli.report import dumps, fix_dict

        sys.stdout.write(dumps(fix_dict(result)))
    elif not quiet:
        from ckptool.cli.render import render_fix

        render_fix(_console(), result)


@cli.command()
@click.argument("path", type=click.Path(dir_okay=True, path_type=str))
@click.argument("output", metavar="OUT", type=click.Path(path_type=str))
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
@click.option("--fsync", is_flag=True, help=FSYNC_HELP)
@click.option("--quiet", "-q", is_flag=True, help="Print nothing but errors.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def convert(path: str, output: str, force: bool, fsync: bool, quiet: bool,
            as_json: bool) -> None:
    """Convert between torch files and safetensors (direction from OUT's extension)."""
    from ckptool.write.conversion import convert as run_convert

    with _progress(quiet) as progress:
        result = run_convert(path, output, force=force, progress=progress, fsync=fsync)
    if as_json:
        from ckptool.cli.report import convert_dict, dumps

        sys.stdout.write(dumps(convert_dict(result)))
    elif not quiet:
        from ckptool.cli.render import render_convert

        render_convert(_console(), result)


@cli.command()
@click.argument("path", metavar="[CKPT]", required=False,
                type=click.Path(dir_okay=True, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")
def devices(path: str | None, as_json: bool) -> None:
    """Show the CUDA GPUs torch would see here (CUDA_VISIBLE_DEVICES applied)
    and, given CKPT, which device to load it onto and how."""
    from ckptool.check.gpus import probe

    ckpt = None
    if path is not None:
        from ckptool.read.reader import open_checkpoint

        ckpt = open_checkpoint(path)
    machine = probe()
    if as_json:
        from ckptool.cli.report import dumps
        from ckptool.cli.report_devices import devices_dict

        sys.stdout.write(dumps(devices_dict(machine, ckpt)))
        return
    from ckptool.cli.render_devices import render_devices

    render_devices(_console(), machine, ckpt)


@contextlib.contextmanager
def _progress(quiet: bool) -> Iterator[Any]:
    """A progress callback that shows a bar on stderr once a write takes over
    a second, and never when quiet or when stderr is not a terminal."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    start = time.monotonic()
    bar = Progress("writing", BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                   console=Console(stderr=True), transient=True)
    task = None

    def update(done: int, total: int) -> None:
        nonlocal task
        if task is None:
            if time.monotonic() - start < 1.0:
                return
            bar.start()
            task = bar.add_task("write", total=total)
        bar.update(task, completed=done)

    try:
        yield update
    finally:
        if task is not None:
            bar.stop()


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
    except OSError as exc:  # the system refused a read or write (disk full...)
        if show_tb:
            traceback.print_exc()
        where = f"{exc.filename}: " if exc.filename else ""
        return _fail(f"{where}{exc.strerror or exc}", "check free space and permissions; "
                     "nothing was left half-written", EXIT_BAD_INPUT)
    return result if isinstance(result, int) else 0


def entry() -> None:
    sys.exit(main())
