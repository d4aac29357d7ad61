"""The one error hierarchy of ckptool.

Every failure a user can cause is a ``CkptoolError`` carrying a one-line
``message``, a ``hint`` saying what to do about it, and the process
``exit_code`` the CLI turns it into. The CLI converts these to output in
exactly one place (``ckptool.cli``); the core only raises them.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2
EXIT_BAD_INPUT = 3
EXIT_RANK_FAILED = 4
EXIT_INTERRUPTED = 130


class CkptoolError(Exception):
    """Base class: a message for the user, a hint, and an exit code."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(CkptoolError):
    """The command line asked for something that cannot be done."""

    exit_code = EXIT_USAGE


class InputError(CkptoolError):
    """The input path is missing, unreadable, corrupt, unsupported or unsafe."""

    exit_code = EXIT_BAD_INPUT


class NotACheckpointError(InputError):
    """The file is readable but is not any checkpoint format we know."""


class CorruptCheckpointError(InputError):
    """The file claims to be a checkpoint but is truncated or malformed."""


class RefusedPickleError(CorruptCheckpointError):
    """A pickle refused for what it does, not for being malformed: a tensor
    rebuilt by an unknown function, a frame made to be read two ways. The
    same in every pickle of a file: one after the first is never taken for
    junk bytes."""


class UnsupportedCheckpointError(InputError):
    """A recognised checkpoint variety that ckptool cannot read yet."""


class OutputError(CkptoolError):
    """The output cannot be written: the disk is full, its name is too long,
    its directory is read-only... The message names the output."""

    exit_code = EXIT_BAD_INPUT


class RankFailedError(CkptoolError):
    """A process of a distributed convert failed or was lost; nothing was
    committed."""

    exit_code = EXIT_RANK_FAILED


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a command that changes its input in place, with what it
    left on disk (``ckptool.write.interrupt``): the CLI says ``message`` and
    ``hint`` and exits 130, as for any Ctrl-C."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class CkptoolNote(UserWarning):
    """Something a command did that its user must hear of although it is no
    error (it finished a fix a crash cut short in the input it read). A
    Python warning, so that library callers see it too; the CLI says it on
    stderr as ``ckptool: note: ...``, whatever the command prints."""
