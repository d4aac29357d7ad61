"""The writing side of an in-place fix's journal (``ckptool.read.layouts.journal``).

A ``Job`` is one ``fix DIR --in-place``, run with the directory's lock held:
``prepare`` records, durably, what the fix may touch (the shards it may
append to, with their sizes; the temporary files it will write) before any
of it is touched; each shard's fix then writes beside it (``pending``);
``commit`` replaces the record with the changes to make, makes them and
removes it. Until the commit, ``roll_back`` puts every file back as it was,
byte for byte; a process killed first leaves the prepare record, and the
next command on the directory does the same.
"""

from __future__ import annotations

import os
import socket
from dataclasses import replace

from ckptool.describe import shell_word
from ckptool.errors import InputError
from ckptool.read.layouts import dirlock, journal
from ckptool.write.commit import AtomicOutput


class Job:
    """An in-place fix of ``directory``: the shards ``touched`` (files named
    by the old index or the new one: ``files``), the index last."""

    def __init__(self, directory: str, index: str, options: str, command: str,
                 touched: list[str], files: set[str]) -> None:
        self.directory = directory
        self.touched = touched
        self.temps = {name: journal.new_temp() for name in [*touched, index]}
        self.record = journal.Record(
            journal.PREPARE, os.stat(directory).st_ino, os.getpid(), socket.gethostname(),
            index, options, command, sorted(files | {index}), temps=list(self.temps.values()))
        self.stage = "new"  # then "prepared", "committed"

    def prepare(self, locks: bool) -> None:
        """Record, durably, what the fix may touch (nothing is touched yet)."""
        journal.remove_leftovers(self.directory, locks)
        self.record.grown = [g for name in self.touched
                             if (g := journal.grown(self.directory, name)) is not None]
        self.stage = "prepared"  # (from before it is written: a Ctrl-C just after it)
        self._write(self.record)
        journal.crash_point("prepare-written")

    def pending(self, name: str) -> journal.Pending:
        """Where the fix of shard ``name`` writes, and the steps it adds to."""
        return journal.Pending(self.temps[name], self.record.steps)

    def commit(self) -> None:
        """The changes, durably named (each temporary file by its inode, each
        file it replaces as found now), then made."""
        steps = [replace(s, ino=os.lstat(self._path(s.temp)).st_ino, old=_identity(
            self._path(s.name))) if s.temp else s for s in self.record.steps]
        record = replace(self.record, phase=journal.COMMIT, steps=steps)
        self._write(record)
        self.stage = "committed"
        journal.crash_point("journal-written")
        try:
            journal.roll_forward(self.directory, record)
        except OSError as exc:
            raise InputError(
                f"{self.directory} is fixed as far as its journal goes, but ckptool could not "
                f"make every change it names: {exc.strerror or exc} "
                f"({exc.filename or self.directory})",
                f"the next ckptool command on it makes them: ckptool inspect "
                f"{shell_word(self.directory)}") from exc

    def roll_back(self) -> None:
        """Before the commit record (or once it is written, before any change
        it names is made): every file as it was, the temporaries and the
        record gone (a Ctrl-C meanwhile waits: the way out says what it left)."""
        if self.stage != "prepared":
            return
        with dirlock.held_interrupts():
            journal.roll_back(self.directory, self.record)
        self.stage = "new"

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _write(self, record: journal.Record) -> None:
        with AtomicOutput(self._path(journal.JOURNAL), force=True, fsync=True,
                          shown=self.directory) as out:
            out.file.write(record.dumps())
            out.commit()


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size
