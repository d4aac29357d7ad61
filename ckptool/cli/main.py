"""The ``ckptool`` group and its one exit path: every error becomes a line
on stderr and an exit code here.

Errors from the core (``CkptoolError``) become ``ckptool: error: ...`` plus
a ``hint:`` line and the error's exit code; usage errors exit 2; Ctrl-C
130; a read or write the system refuses 3. No traceback unless
``--traceback``. stdout carries only data; what the core says as a
``CkptoolNote`` warning (it finished a fix a crash cut short) is a
``ckptool: note: ...`` line on stderr. A Ctrl-C says what the command
left, even once it is done (``entry``). Commands are imported when they
run (``LazyGroup``), so ``ckptool inspect`` never imports ``diff``'s code,
and ``--version`` and ``--help`` import none.
"""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import sys
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any, NoReturn, TextIO

import click

from ckptool import __version__
from ckptool.cli.common import say_error, whole_process
from ckptool.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    CkptoolError,
    CkptoolNote,
    Interrupted,
)

# command name -> the first sentence of its help, which ``ckptool --help``
# lists without importing the command (``ckptool.cli.NAME``'s ``command``);
# tests/test_cli_imports_lazily.py holds each to the command's own help
COMMANDS = {
    "browse": "Browse a checkpoint in the terminal: module tree, tensors, devices, storage "
              "sharing, statistics, findings, and fixes with a preview.",
    "convert": "Convert PATH (a file, a Hugging Face directory, a DCP or DeepSpeed directory) "
               "into OUT: one file (safetensors or torch, from OUT's extension) or a "
               "directory (--format).",
    "devices": "Show the CUDA GPUs torch would see here (CUDA_VISIBLE_DEVICES and a SLURM "
               "job's GPUs mapped to cuda:N) and, given CKPT, which device to load it onto "
               "and how.",
    "diagnose": "Say why a checkpoint will not load here (or into a model) and print the one "
                "`ckptool fix` command that repairs it.",
    "diff": "Compare two checkpoints: names only in A or B, shape, dtype, location and value "
            "changes.",
    "explain": "Say what an error message from loading a checkpoint or placing a model on "
               "GPUs means and what to do; with --checkpoint, print the one `ckptool fix` "
               "command that repairs the file.",
    "fix": "Rewrite a checkpoint so that it loads: keys, devices, dtypes, entries.",
    "inspect": "Show what is in a checkpoint: tensors, devices, entries, unsafe globals.",
    "verify": "Check that a checkpoint is whole: every file its layout names, with the size "
              "it implies; chunks and shards that cover every tensor once; zip records "
              "against their CRC-32; pickles and headers that parse; a Hugging Face cache's "
              "blobs against their names (with --against-hub, the snapshot against the Hub's "
              "files at its commit).",
}


class LazyGroup(click.Group):
    """A group whose commands are imported on first use (click's documented
    pattern for lazily loaded subcommands); its ``--help`` lists them from
    ``COMMANDS``, as click would from each command, importing none."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        command: click.Command = importlib.import_module(f"ckptool.cli.{cmd_name}").command
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # click.Group.format_commands, each short help made by click from the
        # sentence above (a bare command holding it) instead of the real command
        from gettext import gettext

        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(map(len, names))
        with formatter.section(gettext("Commands")):
            formatter.write_dl([
                (name, click.Command(name, help=COMMANDS[name]).get_short_help_str(limit))
                for name in names])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckptool")
@click.option("--traceback", "show_traceback", is_flag=True, hidden=False,
              help="Show the Python traceback of an error (for bug reports).")
@click.pass_context
def cli(ctx: click.Context, show_traceback: bool) -> None:
    """Inspect, diagnose and fix PyTorch checkpoints, without a GPU and
    without running code from the file."""
    ctx.obj = {"traceback": show_traceback}


def _fail(message: str, hint: str, code: int) -> int:
    say_error(message, hint)
    return code


def main(argv: list[str] | None = None, *,
         late: Callable[[int, FrameType | None], None] | None = None) -> int:
    """Run the CLI; every error becomes a message and an exit code here.
    ``late``: the SIGINT handler from the command's end on (``entry``'s)."""
    from ckptool.write import interrupt

    interrupt.begin()
    try:
        with warnings.catch_warnings():
            _say_notes()
            return _run(argv)
    finally:
        if late is not None:  # (before anything else can take a Ctrl-C for a traceback)
            signal.signal(signal.SIGINT, late)


def _say_notes() -> None:
    """What the core says as a ``CkptoolNote`` (it finished a fix a crash cut
    short) is one line on stderr, every time, whatever the command prints."""
    warnings.simplefilter("always", CkptoolNote)
    others = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
        if issubclass(category, CkptoolNote):
            from ckptool.cli.inputs import unspool  # (not before a note: --version needs
            from ckptool.describe import shown  # neither, and describe needs the model)

            click.echo(f"ckptool: note: {shown(unspool(str(message)))}", err=True)
        else:
            others(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def _run(argv: list[str] | None) -> int:
    show_tb = "--traceback" in (argv if argv is not None else sys.argv[1:])
    try:
        # a command's int return value is its exit code (diff: 1 = differences)
        result: Any = cli.main(args=argv, prog_name="ckptool", standalone_mode=False)
    except CkptoolError as exc:
        if show_tb:
            _print_traceback()
        return _fail(exc.message, exc.hint, exc.exit_code)
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.ClickException as exc:
        hint = "run 'ckptool --help' or 'ckptool COMMAND --help' for usage"
        return _fail(exc.format_message(), hint, EXIT_USAGE)
    except (click.exceptions.Abort, KeyboardInterrupt) as exc:
        # click raises Abort from the Ctrl-C; an in-place fix's says what it left
        cause = exc.__cause__ if isinstance(exc, click.exceptions.Abort) else exc
        return _interrupted(cause if isinstance(cause, Interrupted) else None)
    except OSError as exc:  # the system refused a read or write (disk full...)
        if show_tb:
            _print_traceback()
        where = f"{exc.filename}: " if exc.filename else ""
        return _fail(f"{where}{exc.strerror or exc}", "check that the path is readable (and, "
                     "for a write, free space): nothing was left half-written", EXIT_BAD_INPUT)
    return result if isinstance(result, int) else 0


def _print_traceback() -> None:
    import traceback  # only for --traceback: no command start pays for it

    traceback.print_exc()


def _interrupted(said: Interrupted | None) -> int:
    """A Ctrl-C: what it says, or, when nothing did, whether this command
    fixed its input (its change committed before the Ctrl-C)."""
    from ckptool.write import interrupt

    said = said or interrupt.late()
    if said is not None:
        return _fail(said.message, said.hint, EXIT_INTERRUPTED)
    return _fail("interrupted", "", EXIT_INTERRUPTED)


def entry() -> None:
    """The ``ckptool`` executable. Once the command is done, a Ctrl-C still
    says what it did (``interrupted after DIR was fixed``, exit 130) rather
    than kill the process unheard: the process ends here (``_end``), without
    the interpreter's teardown, during which SIGINT kills it."""
    whole_process()
    try:
        code = main(late=_late)
    except KeyboardInterrupt:  # between the command's end and its handler
        signal.signal(signal.SIGINT, _late)
        code = _interrupted(None)
    _end(code)


def _late(signum: int, frame: FrameType | None) -> None:
    _flush(sys.stdout)  # the report first, then what the Ctrl-C found
    try:
        code = _interrupted(None)
    except (OSError, ValueError):  # stderr is gone too: the exit code says it
        code = EXIT_INTERRUPTED
    _end(code)


def _end(code: int) -> NoReturn:
    """Exit as the interpreter would, but for its teardown: the output
    flushed, the ``atexit`` functions run (under the handler above)."""
    _flush(sys.stdout)
    atexit._run_exitfuncs()
    _flush(sys.stdout)
    _flush(sys.stderr)
    os._exit(code)


def _flush(stream: TextIO) -> bool:
    """Whether ``stream`` took what was written to it (a reader that went
    away, as `head` does, took nothing more: no error to tell it)."""
    try:
        stream.flush()
    except (OSError, ValueError):
        return False
    return True
