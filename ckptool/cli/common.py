"""What several commands share: the JSON writer, the console, progress bars,
and the options that say what to check a checkpoint against.

No rich at import time: ``console()`` and ``progress()`` import it when
text or a bar is actually shown.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from typing import Any

import click

# every --json report carries it; it changes only when a field changes
# meaning or goes away (new fields may be added)
SCHEMA_VERSION = 1


def fsync_help(replacing: str) -> str:
    """--fsync's help, naming the options of this command that replace a file."""
    return ("Return only once OUT is on disk, safe from a power cut (as cp + sync). "
            f"Replacing a file ({replacing}) always waits.")


def dumps(data: dict[str, Any]) -> str:
    """JSON text: one line per top-level field and per list item.

    ``json.dumps(indent=...)`` falls back to the pure-Python encoder, which
    cost more than reading a 2,000-tensor file; this keeps the C encoder and
    still gives one tensor per line for grep and diff.
    """
    encode = json.JSONEncoder(default=repr).encode  # one encoder, not one per item
    fields = []
    for key, value in data.items():
        name = encode(key)
        if isinstance(value, Encoded) and value:
            items = ",\n    ".join(value)
            fields.append(f"  {name}: [\n    {items}\n  ]")
        elif isinstance(value, list) and value:
            items = ",\n    ".join(map(encode, value))
            fields.append(f"  {name}: [\n    {items}\n  ]")
        else:
            fields.append(f"  {name}: {encode(value)}")
    return "{\n" + ",\n".join(fields) + "\n}\n"


_WHOLE_PROCESS = [False]  # set by ``cli.entry``: the command is all this process does


def whole_process() -> None:
    """Say that the command about to run is all this process does (the
    ``ckptool`` executable), not one call among others (a test, a program
    calling ``cli.main``): ``one_shot`` may then freeze what it made."""
    _WHOLE_PROCESS[0] = True


@contextlib.contextmanager
def one_shot() -> Iterator[None]:
    """Around a command that reads a checkpoint and reports on it: Python's
    cycle collector stays off while it runs (``no_cycle_collection``).

    When the command is the whole process, what it made is then frozen
    (``gc.freeze``) before the collector is back on: otherwise the collector
    makes one full pass over the checkpoint's millions of objects at its
    first allocation after (0.37 s of ``inspect --json`` at 100,000 tensors).
    Nothing is lost: those objects live until the process ends anyway, and
    reference counting still frees what is dropped. Called in a longer-lived
    process, nothing is frozen: its collector keeps seeing everything."""
    import gc

    from ckptool.read.reader import no_cycle_collection

    with no_cycle_collection():
        yield
        if _WHOLE_PROCESS[0]:
            gc.freeze()


_KEPT: list[Any] = []  # what ``keep_until_exit`` keeps


def keep_until_exit(obj: Any) -> None:
    """When the command is the whole process, keep ``obj`` (what it read) until
    the process ends: it ends without the interpreter's teardown (``main._end``),
    so the millions of objects of a large checkpoint need not be freed one by
    one first (0.5 s at 100,000 tensors in 800,000 chunks). Called in a
    longer-lived process, nothing is kept."""
    if _WHOLE_PROCESS[0]:
        _KEPT.append(obj)


class Encoded(list[str]):
    """List items already in ``dumps``'s JSON text, one string each (a report
    of 100,000 tensors writes its lines faster than the encoder would)."""


def write_json(data: dict[str, Any]) -> None:
    from ckptool.cli.inputs import unspool

    try:
        sys.stdout.write(unspool(dumps(data)))
        sys.stdout.flush()
    except BrokenPipeError:
        reader_gone()


def say_error(message: str, hint: str = "") -> None:
    """``ckptool: error: MESSAGE`` and ``hint: HINT`` on stderr."""
    from ckptool.cli.inputs import unspool
    from ckptool.describe import shown

    # a name that is not UTF-8, or holds control codes, is shown escaped:
    # never raw bytes to the terminal, never a surrogate that cannot print
    click.echo(f"ckptool: error: {shown(unspool(message))}", err=True)
    if hint:
        click.echo(f"hint: {shown(hint)}", err=True)


def reader_gone() -> None:
    """`ckptool ... | head`: the reader of the output went away, which is no
    error (click's own handling exits 1): stdout to devnull, so that nothing
    written after it fails again, and exit 0."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    raise click.exceptions.Exit(0)


def console() -> Any:
    """A rich console that shows the file's own text exactly: no markup
    (``[red]x[/red]`` and ``w[i]`` in a key are text), no emoji codes
    (``enc:x:w``), and control or invisible characters escaped
    (``describe.shown``) in every string and ``Text`` it prints."""
    from rich.console import Console
    from rich.segment import Segment

    from ckptool.cli.inputs import unspool
    from ckptool.describe import shown

    class Faithful(Console):
        def render_str(self, text: str, **kwargs: Any) -> Any:
            # before layout, so that an escape takes its columns in a table
            return super().render_str(shown(text), **kwargs)

        def _render_buffer(self, buffer: Any) -> str:
            # our own line breaks are newline segments; any other control
            # character here came from the data (control segments, cursor
            # moves of a progress bar, carry no text and pass as they are)
            text = str(super()._render_buffer(
                seg if seg.control or seg.text.isprintable() or seg.text == "\n"
                else Segment("\n".join(shown(part) for part in seg.text.split("\n")),
                             seg.style, seg.control)
                for seg in buffer))
            text = unspool(text)  # the input as given ("-"), not its temporary copy
            if self.is_terminal:
                return text
            # into a pipe or a file: no padding after the last cell of a line
            return "\n".join(line.rstrip(" ") for line in text.split("\n"))

        def on_broken_pipe(self) -> None:  # rich's own exits 1
            self.quiet = True
            reader_gone()

    return Faithful(highlight=False, markup=False, emoji=False)


def fold_key(key: str, width: int) -> str:
    """``key`` (already ``shown``) on lines of at most ``width`` columns,
    broken after a ``.`` or ``/`` and never inside a name, unless one name
    alone is wider than a line: ``bn.running_mea`` / ``n`` never happens."""
    lines, line = [], ""
    for part in re.findall(r"[^./]+[./]?|[./]", key):
        if len(line) + len(part) <= width:
            line += part
            continue
        if line:
            lines.append(line)
        while len(part) > width > 0:
            lines.append(part[:width])
            part = part[width:]
        line = part
    return "\n".join([*lines, line] if line else lines) or key


def key_width(console: Any, cells: list[list[str]], headers: list[str], minimum: int = 16
              ) -> int:
    """The width left for a table's first column (the keys) once the other
    columns take what their widest cell needs (tables without edges, with
    `` │ `` between columns)."""
    others = sum(max([len(h), *(len(row[i]) for row in cells)])
                 for i, h in enumerate(headers))
    return max(minimum, console.width - others - 3 * len(headers))


@contextlib.contextmanager
def progress(quiet: bool) -> Iterator[Any]:
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


def target_options(command: Any) -> Any:
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


def model_loader(model_spec: str | None, model_args: tuple[str, ...],
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
            return modelspec.build_model(model_spec, arguments,
                                         modelspec.saved_settings(ckpt.root))
        return build
    if reference:
        return lambda ckpt: modelspec.reference_keys(reference)
    return None
