"""``ckptool browse``: the Textual browser, started from the command line.

A missing or foreign file fails before the screen opens (exit 3), and a
session without a terminal is a usage error (exit 2) that points to
``inspect``. An in-place fix of the directory that a crash cut short is
settled before the screen opens, and the note saying so stays on the
terminal. The command exits with the app's return code: 0 when quit with
``q``, 130 with Ctrl-C. The app itself lives in ``ckptool.tui``.
"""

from __future__ import annotations

import sys

import click

from ckptool.cli.common import model_loader, target_options
from ckptool.cli.inputs import InputPath


@click.command()
@click.argument("path", type=InputPath(streams=False, why="it reads keys from the terminal"))
@target_options
def browse(path: str, model_spec: str | None, model_args: tuple[str, ...],
           reference: str | None, device_count: int | None) -> int:
    """Browse a checkpoint in the terminal: module tree, tensors, devices,
    storage sharing, statistics, findings, and fixes with a preview."""
    from ckptool.check.gpus import machine as gpus
    from ckptool.errors import UsageError
    from ckptool.read import dispatch

    loader = model_loader(model_spec, model_args, reference)
    dispatch.check(path)  # a missing or foreign file fails here, before the screen opens
    if not _is_terminal():
        raise UsageError("browse needs a terminal (stdin and stdout are not both one)",
                         "for output you can pipe, use `ckptool inspect` or `inspect --json`")
    _settle(path)
    machine = gpus.assumed(device_count) if device_count is not None else None
    from ckptool.tui import make_app

    app = make_app(path, machine=machine, model=loader)
    app.run()
    if app.error is not None:
        raise app.error
    # the app's own: 0 when quit with q, 130 with Ctrl-C (as any interrupted command)
    return app.return_code or 0


command = browse


def _is_terminal() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


def _settle(path: str) -> None:
    """An in-place fix of a directory that a crash cut short is finished or
    rolled back before the screen opens, so that the note saying so is on
    the terminal, not lost behind the screen."""
    from ckptool.read.layouts import journal, recognise

    layout = recognise.recognise(path)
    if layout is not None and layout.kind == recognise.HF:
        journal.settle(layout.directory)
