"""``ckptool explain``: an error message from a log, what it means, what to
do, and with ``--checkpoint``, the one command that fixes the file; the
command and its JSON report (the text view: ``explain_text.py``).

The error comes from the argument, standard input (``-``) or a log file
(``--file``); ``--checkpoint``, ``--model``, ``--model-arg``,
``--reference`` and ``--device-count`` are diagnose's options
(``common.target_options``), taken the same way. ``explain_dict`` is the
``--json`` schema: ``findings[].code`` values and ``exit_code`` are contracts.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from ckptool.check.explain.run import Explanation
from ckptool.check.findings import Finding
from ckptool.check.gpus.machine import describe_machine
from ckptool.cli.common import SCHEMA_VERSION, console, model_loader, target_options, write_json
from ckptool.cli.inputs import InputPath
from ckptool.errors import InputError, UsageError

_WHERE = "give the error as TEXT (quoted), pipe it in with -, or name a log with --file LOG"


@click.command()
@click.argument("text", required=False, metavar="[TEXT | -]")
@click.option("--file", "-f", "log", metavar="LOG",
              help="Read the error from a log file; the last error in it is explained.")
@click.option("--checkpoint", "-c",
              type=InputPath(streams=False, why="its fix command reads the file again"),
              metavar="CKPT", help="The checkpoint the error is about: diagnose it for the "
                                   "machine the error implies and print the command that "
                                   "fixes it.")
@target_options
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")
def explain(text: str | None, log: str | None, checkpoint: str | None, model_spec: str | None,
            model_args: tuple[str, ...], reference: str | None, device_count: int | None,
            as_json: bool) -> int:
    """Say what an error message from loading a checkpoint or placing a model
    on GPUs means and what to do; with --checkpoint, print the one `ckptool
    fix` command that repairs the file. Exits 1 when an error was
    recognised, 0 when none was."""
    from ckptool.check.explain.run import explain as run_explain
    from ckptool.check.explain.run import with_checkpoint

    message, source = read_error(text, log)
    loader = model_loader(model_spec, model_args, reference)
    if loader is not None and checkpoint is None:
        raise UsageError(f"--{'model' if model_spec else 'reference'} needs --checkpoint",
                         "name the checkpoint the error is about: --checkpoint CKPT")
    result = run_explain(message, device_count)
    if checkpoint is not None and result.error is not None:
        from ckptool.read.reader import open_checkpoint

        ckpt = open_checkpoint(checkpoint)
        with_checkpoint(result, ckpt, loader(ckpt) if loader else None)
    if as_json:
        write_json(explain_dict(result, source))
    else:
        from ckptool.cli.explain_text import render_explain

        render_explain(console(), result, checkpoint)
    return result.exit_code


command = explain


def read_error(text: str | None, log: str | None) -> tuple[str, str]:
    """(the text to explain, where it came from: ``argument``, ``stdin`` or the log's path)."""
    if text is not None and log is not None:
        raise UsageError("the error is given twice, as TEXT and as --file", _WHERE)
    if log is not None:
        try:
            with open(log, encoding="utf-8", errors="replace") as f:
                message, source = f.read(), log
        except OSError as exc:
            raise InputError(f"cannot read the log {log}: {exc.strerror or exc}",
                             "check the path of the log file") from None
    elif text == "-":
        if sys.stdin.isatty():
            raise UsageError("standard input is a terminal, not a log", _WHERE)
        # a log is bytes in any encoding: what is not UTF-8 is replaced, never fatal
        raw = getattr(sys.stdin, "buffer", None)  # none where stdin was replaced by text
        message = raw.read().decode("utf-8", "replace") if raw is not None else sys.stdin.read()
        source = "stdin"
    elif text is None:
        raise UsageError("no error message to explain", _WHERE)
    else:
        message, source = text, "argument"
    if not message.strip():
        raise UsageError(f"the error message ({source}) is empty", _WHERE)
    return message, source


def explain_dict(exp: Explanation, source: str) -> dict[str, Any]:
    d = exp.diagnosis
    return {
        "schema_version": SCHEMA_VERSION,
        "input": {"source": source, **exp.input},
        "checkpoint": None if d is None else {
            "path": d.checkpoint.path,
            "format": d.checkpoint.format,
            "target": {"description": describe_machine(d.machine), "source": d.machine.source,
                       "device_count": d.machine.device_count},
            "against": exp.against,
            "notes": exp.notes,
        },
        "findings": [_finding(f, "error") for f in exp.findings]
                    + [_finding(f, "checkpoint") for f in exp.also],
        "fix_command": exp.fix_command,
        "fix_output": d.fix_output if d else None,
        "fix_refused": d.fix_refused if d else None,
        "remaining": exp.remaining,
        "exit_code": exp.exit_code,
    }


def _finding(f: Finding, source: str) -> dict[str, Any]:
    return {"code": f.code, "severity": f.severity, "message": f.message, "fix": f.fix,
            "snippet": f.snippet, "keys": list(f.keys), "source": source}
