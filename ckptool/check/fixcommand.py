"""The one ``ckptool fix`` command a diagnosis prints, checked before it is shown.

The options the findings asked for become one command line, run from the
folder the checkpoint is in, writing a file that does not exist yet. It is
planned first with the same core as ``ckptool fix --dry-run``
(``ckptool.write.preview``, from the checkpoint already read), so a command
that ``fix`` would refuse is never printed.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass

from ckptool.errors import CkptoolError
from ckptool.model import Checkpoint
from ckptool.write.plan import FixOptions


@dataclass
class Command:
    """What ``plan_command`` made of the options: a command, or why not."""

    line: str | None = None  # the command, as the user runs it
    output: str | None = None  # the file it writes (a name in the checkpoint's folder)
    refused: str | None = None  # why fix would refuse these options


def plan_command(ckpt: Checkpoint, opts: FixOptions) -> Command:
    """Turn the options the findings asked for into one checked command."""
    if opts == FixOptions():
        return Command()
    from ckptool.write.fix import default_output
    from ckptool.write.preview import preview

    output = default_output(ckpt.path)
    base, ext = os.path.splitext(output)
    n = 2
    while os.path.lexists(output):  # one new file: never one fix would refuse to replace
        output, n = f"{base}{n}{ext}", n + 1
    try:
        # fix's own dry run, planned from the checkpoint already read rather
        # than from a second read of the file (tests/test_preview.py holds
        # the two to the same plan)
        preview(ckpt, opts)
    except CkptoolError as exc:
        return Command(refused=f"{exc.message} ({exc.hint})" if exc.hint else exc.message)
    return Command(fix_command_line(ckpt.path, opts, output), os.path.basename(output))


def fix_command_line(path: str, opts: FixOptions, output: str) -> str:
    """The ``ckptool fix`` command that writes ``opts``' fix of ``path`` to
    ``output``, run from ``path``'s folder."""
    return " ".join(["ckptool", "fix", shell_name(path), *command_flags(opts),
                     "-o", shell_name(output)])


def command_flags(opts: FixOptions) -> list[str]:
    """``ckptool fix`` flags for ``opts`` (the ones diagnose sets)."""
    flags = []
    if opts.extract is not None:
        flags.append("--extract")
    if opts.strip_module:
        flags.append("--strip-module")
    flags += [f"--strip-prefix {shlex.quote(p)}" for p in opts.strip_prefixes]
    if opts.add_prefix:
        flags.append(f"--add-prefix {shlex.quote(opts.add_prefix)}")
    if opts.to:
        flags.append(f"--to {opts.to}")
    flags += [f"--map {a}={b}" for a, b in opts.maps]
    return flags


def shell_name(path: str) -> str:
    """``path``'s file name as a shell word that no command takes for an option."""
    name = os.path.basename(path)
    return shlex.quote(f"./{name}" if name.startswith("-") else name)


def stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]

