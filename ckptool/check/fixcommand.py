"""The one ``ckptool fix`` command a diagnosis prints, checked before it is shown.

The options the findings asked for become one command line, with the
paths as the user gave them (it runs from where diagnose ran), writing a
file beside the checkpoint that does not exist yet. It is
planned first with the same core as ``ckptool fix --dry-run``
(``ckptool.write.fix.preview``, from the checkpoint already read), so a command
that ``fix`` would refuse is never printed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ckptool.describe import shell_word
from ckptool.errors import CkptoolError
from ckptool.model import Checkpoint
from ckptool.write.fix.flags import flags
from ckptool.write.fix.plan import FixOptions


@dataclass
class Command:
    """What ``plan_command`` made of the options: a command, or why not."""

    line: str | None = None  # the command, as the user runs it
    output: str | None = None  # the file it writes, beside the checkpoint
    refused: str | None = None  # why fix would refuse these options


def plan_command(ckpt: Checkpoint, opts: FixOptions) -> Command:
    """Turn the options the findings asked for into one checked command."""
    if opts == FixOptions():
        return Command()
    from ckptool.write.fix.outputs import fresh_output
    from ckptool.write.fix.preview import preview

    if ckpt.is_multifile:  # HF shards: a new directory beside it; DCP: refused
        return _directory_command(ckpt, opts)
    folder = framework_folder(ckpt)
    if folder is not None:  # its loader reads the model by name: a fixed folder
        return _folder_command(folder, opts)

    output = fresh_output(ckpt.path)  # one new file: never one fix would refuse to replace
    try:
        # fix's own dry run, planned from the checkpoint already read rather
        # than from a second read of the file (tests/test_preview.py holds
        # the two to the same plan)
        preview(ckpt, opts)
    except CkptoolError as exc:
        return Command(refused=f"{exc.message} ({exc.hint})" if exc.hint else exc.message)
    return Command(fix_command_line(ckpt.path, opts, output), output)


def _directory_command(ckpt: Checkpoint, opts: FixOptions) -> Command:
    """``fix``'s dry run on a checkpoint of many files, into a fresh directory."""
    from ckptool.write.fix.outputs import fresh_output
    from ckptool.write.fix.run import fix

    output = fresh_output(ckpt.path.rstrip("/"))
    try:
        fix(ckpt.path, opts, output, dry_run=True)
    except CkptoolError as exc:
        return Command(refused=f"{exc.message} ({exc.hint})" if exc.hint else exc.message)
    return Command(fix_command_line(ckpt.path, opts, output), output)


def framework_folder(ckpt: Checkpoint) -> str | None:
    """The framework folder whose loader reads ``ckpt`` by its name
    (``model.safetensors`` of a transformers folder): a fixed file beside it
    is never read, so the fix writes a folder."""
    from ckptool.read.layouts import framework

    fw = ckpt.framework
    if fw is None or fw.kind not in framework.LOADS_BY_NAME:
        return None
    if os.path.dirname(os.path.abspath(ckpt.path)) != os.path.abspath(fw.directory):
        return None
    if os.path.basename(ckpt.path) not in framework.MODEL_FILES:
        return None
    return fw.directory.rstrip("/") or "."


def _folder_command(folder: str, opts: FixOptions) -> Command:
    """``fix``'s dry run of a framework folder into a fresh folder beside it."""
    from ckptool.write.fix.outputs import fresh_output
    from ckptool.write.fix.run import fix

    output = fresh_output(folder) + "/"
    try:
        fix(folder, opts, output, dry_run=True)
    except CkptoolError as exc:
        return Command(refused=f"{exc.message} ({exc.hint})" if exc.hint else exc.message)
    return Command(fix_command_line(folder, opts, output), output)


def fix_command_line(path: str, opts: FixOptions, output: str) -> str:
    """The ``ckptool fix`` command that writes ``opts``' fix of ``path`` to
    ``output``, both as the user gave them: it runs from where they ran."""
    return " ".join(["ckptool", "fix", shell_word(path), *flags(opts),
                     "-o", shell_word(output)])


def stem(path: str) -> str:
    """``path`` without its extension, folder kept."""
    return os.path.splitext(path)[0]

