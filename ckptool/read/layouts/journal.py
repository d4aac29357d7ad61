"""An in-place fix of a directory of shards, made all-or-nothing: its journal.

``fix DIR --in-place`` (``ckptool.write.fix.shards``) holds the directory's
lock (``dirlock``) and writes one small file, the journal (``JOURNAL``), in
two phases:

1. prepare: before any byte of a file the index names changes, it records
   each shard the fix may append to (a torch zip whose pickle alone
   changes gets its new records appended, while it still reads as the old
   shard: ``ckptool.write.fix.inplace``) with its size and the CRC of its
   last bytes, and the temporary files the fix will write beside
   (``new_temp``: short names readers skip, ``is_temporary``). Then every
   new file is written and verified;
2. commit: the journal is replaced by one naming every change (rename a
   temporary file over a shard, cut an appended shard back to its new
   end), the index last; then the changes are made, and it is removed.

A journal found by any command is settled first (``settle``), under the
lock: in phase prepare the fix is rolled back (each shard cut back to its
old size, the temporaries removed: the directory is byte for byte as it
was); in phase commit it is finished. Either way the command says so: a
note in the checkpoint read and a ``InterruptedFixNote`` warning, which the
CLI prints on stderr. Every change is checked before the first is made.

A journal is trusted that far and no further (``journal_format`` reads it
back): it applies only in the directory it was written for (the
directory's inode), and may only rename a ckptool temporary file whose
inode it records over a file an index names (the one in place, or the new
one while it waits beside), or cut such a file (a regular file, never a
link) to a size whose bytes match a recorded CRC.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import warnings
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from ckptool.describe import shell_word
from ckptool.errors import CkptoolNote, CorruptCheckpointError, InputError, Interrupted
from ckptool.read.layouts import dirlock
from ckptool.read.layouts.journal_format import (
    COMMIT,
    CRASH_ENV,
    JOURNAL,
    JOURNAL_TEMP,
    PREPARE,
    TEMP,
    Grown,
    Pending,
    Record,
    Step,
    alive,
    bad_hint,
    crash_point,
    crc_of,
    fix_of,
    grown,
    holder,
    is_temporary,
    load,
    new_temp,
)

__all__ = ["COMMIT", "CRASH_ENV", "JOURNAL", "PREPARE", "Grown", "InterruptedFixNote", "Pending",
           "Record", "SettleInterrupted", "Settled", "Step", "alive", "crash_point", "grown",
           "holder", "is_temporary", "left_as_is", "load", "new_temp", "remove_leftovers",
           "roll_back", "roll_forward", "settle"]
_AS_IS: ContextVar[bool] = ContextVar("ckptool_journal_as_is", default=False)


class InterruptedFixNote(CkptoolNote):
    """A command found an in-place fix of its input that was cut short, and
    finished it or rolled it back (the message says which)."""


@dataclass(frozen=True)
class Settled:
    """What ``settle`` did: finished the fix ``options`` / ``command``, or
    rolled it back."""

    directory: str
    options: str
    command: str
    rolled_back: bool

    @property
    def done(self) -> str:
        verb = "rolled back" if self.rolled_back else "finished"
        return f"{verb} an interrupted fix of {self.directory} (ckptool fix {self.command})"

    @property
    def note(self) -> str:
        if self.rolled_back:
            return f"{self.done}: it is as it was"
        return (f"{self.done}: {self.directory} is fixed; running that fix again would "
                "apply it twice")


class SettleInterrupted(Interrupted):
    """A Ctrl-C while a command settled ``settled``: it was settled, and the
    command did nothing else (a fix of the directory says whether running it
    again would apply it twice)."""

    def __init__(self, settled: Settled) -> None:
        super().__init__(f"interrupted: {settled.note}",
                         "nothing else was done; run the command again")
        self.settled = settled


def remove_leftovers(directory: str, locks: bool) -> None:
    """With the lock held and no journal: remove what crashed fixes left
    (where the filesystem cannot lock, only the files of dead processes)."""
    for entry in os.listdir(directory):
        m = TEMP.fullmatch(entry)
        if (m is None and not (locks and JOURNAL_TEMP.fullmatch(entry))) or (
                m is not None and not locks and alive(int(m.group("pid")))):
            continue
        _unlink_file(os.path.join(directory, entry))


@contextlib.contextmanager
def left_as_is() -> Iterator[None]:
    """Reads inside (a dry run's) never settle a journal: they refuse it."""
    token = _AS_IS.set(True)
    try:
        yield
    finally:
        _AS_IS.reset(token)


def settle(directory: str, say: bool = True) -> Settled | None:
    """Finish or roll back the in-place fix of ``directory`` that its journal
    names, and say so (``say``: as a warning; else the caller does); None
    when there is no journal."""
    path = os.path.join(directory, JOURNAL)
    if not os.path.lexists(path):
        return None
    if _AS_IS.get():
        raise InputError(
            f"{directory} holds an in-place fix that was cut short{fix_of(directory)}, "
            "and a dry run changes nothing: it was left as it is",
            f"finish it or roll it back first: ckptool inspect {shell_word(directory)} "
            "does either, and says which; then run the dry run again")
    held: list[int] = []
    try:
        with dirlock.locked(directory, lambda: holder(directory)) as locks:
            if not os.path.lexists(path):
                return None  # the fix that held the directory is done
            record = load(directory)
            if not locks and record.phase == PREPARE and (
                    record.host != _host() or alive(record.pid)):
                raise InputError(f"{directory} is being fixed in place by {holder(directory)}",
                                 "wait for it to finish, then run this command again")
            _check_writable(directory, record)
            with dirlock.held_interrupts() as held:
                if record.phase == COMMIT:
                    roll_forward(directory, record)
                else:
                    roll_back(directory, record)
    except OSError as exc:
        raise InputError(
            f"{directory} holds an in-place fix that was cut short, and ckptool cannot settle "
            f"it: {exc.strerror or exc} ({exc.filename or path})",
            f"run ckptool on it again where it may write there (ckptool inspect "
            f"{shell_word(directory)}); its journal is {JOURNAL}") from exc
    done = Settled(directory, record.options, record.command, record.phase == PREPARE)
    if held:
        raise SettleInterrupted(done)
    if say:
        warnings.warn(InterruptedFixNote(done.note), stacklevel=2)
    return done


def _check_writable(directory: str, record: Record) -> None:
    """A directory ckptool may not write (a read-only mount, another user's)
    is refused before anything is tried, saying what holds it."""
    names = [s.name for s in record.steps if not s.temp] if record.phase == COMMIT else [
        g.name for g in record.grown]
    if all(os.access(p, os.W_OK) for p in [directory, *(os.path.join(directory, n)
                                                        for n in names)]):
        return
    readonly = os.statvfs(directory).f_flag & os.ST_RDONLY
    verb = "finish" if record.phase == COMMIT else "roll back"
    raise InputError(
        f"{directory} has an interrupted fix ckptool cannot {verb} here "
        f"({'read-only file system' if readonly else 'permission denied'}): "
        f"ckptool fix {record.command} was cut short, and {directory} is not read until "
        f"that fix is {'finished' if record.phase == COMMIT else 'rolled back'}",
        f"run ckptool inspect {shell_word(directory)} where it may write there "
        f"({'mounted read-write' if readonly else 'as its owner'}): it does that and says so")


def roll_forward(directory: str, record: Record) -> int:
    """Phase commit: make the changes not made yet (every one checked first),
    then remove the journal. Returns how many were made."""
    todo = [s for s in record.steps if _to_make(directory, s, record)]
    if todo:  # (each in an index: the index is replaced last, so until every step is made)
        _named(directory, record, [s.name for s in todo], record.steps[-1].temp)
    for step in todo:
        target = os.path.join(directory, step.name)
        if step.temp:
            try:
                os.replace(os.path.join(directory, step.temp), target)
            except FileNotFoundError:
                if _to_make(directory, step, record):  # (not made since by another process)
                    raise
        else:
            _cut(target, step.size)
        crash_point("renaming")
    _fsync_dir(directory)
    crash_point("renamed")
    _close(directory, record)
    return len(todo)


def roll_back(directory: str, record: Record) -> None:
    """Phase prepare: cut each shard back to its old size (every one checked
    first), remove the temporary files, then the journal."""
    cut = [g for g in record.grown if _to_cut(directory, g)]
    _named(directory, record, [g.name for g in cut], "")
    for g in cut:
        _cut(os.path.join(directory, g.name), g.size)
    _close(directory, record)


def _cut(path: str, size: int) -> None:
    """Cut ``path`` to ``size`` bytes, durably; never through a link swapped
    in since it was checked (O_NOFOLLOW: that open fails instead)."""
    fd = os.open(path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def _named(directory: str, record: Record, names: list[str], new_index: str) -> None:
    """Each of ``names`` is the index, or a shard its current version names,
    or its new one (in the temporary file ``new_index``, while it is there):
    a journal changes no other file."""
    allowed = {record.index}
    for index in (record.index, new_index):
        path = os.path.join(directory, index)
        if not index or (index == new_index and not os.path.lexists(path)):
            continue
        try:
            with open(path, "rb") as f:
                weight_map = json.loads(f.read()).get("weight_map")
            allowed |= {v for v in weight_map.values() if isinstance(v, str)}
        except (OSError, ValueError, AttributeError) as exc:
            raise CorruptCheckpointError(f"{path}: an index the journal of {directory} names "
                                         f"cannot be read ({exc})", bad_hint(directory)) from exc
    for name in names:
        if name not in allowed:
            raise CorruptCheckpointError(
                f"{os.path.join(directory, JOURNAL)} names a change ckptool never makes "
                f"({name!r:.80}: a file no index names): it was not applied", bad_hint(directory))


def _close(directory: str, record: Record) -> None:
    temps = set(record.temps)
    for entry in os.listdir(directory):
        if entry in temps or JOURNAL_TEMP.fullmatch(entry) or (
                entry.endswith(".ckptool-tmp") and entry[1:].rsplit(".", 2)[0] in temps):
            _unlink_file(os.path.join(directory, entry))
    _fsync_dir(directory)
    with contextlib.suppress(FileNotFoundError):  # another process closed it
        os.unlink(os.path.join(directory, JOURNAL))
    _fsync_dir(directory)


def _to_make(directory: str, step: Step, record: Record) -> bool:
    """Whether ``step`` is still to make (False: made); a file found as
    neither the journal's before nor its after is an error."""
    target = os.path.join(directory, step.name)
    st = _lstat(target)
    if step.temp:
        temp = _lstat(os.path.join(directory, step.temp))
        if temp is not None:
            if stat.S_ISREG(temp.st_mode) and (temp.st_ino, temp.st_size) == (
                    step.ino, step.size) and (None if st is None else (
                    st.st_ino, st.st_size)) == step.old:
                return True
        elif st is not None and (st.st_ino, st.st_size) == (step.ino, step.size):
            return False
    elif st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and \
            st.st_size >= step.size and crc_of(target, step.start, step.size) == step.crc:
        if st.st_size == step.size:
            return False
        if _ends_as_left(target, st.st_size, [g for g in record.grown if g.name == step.name]):
            return True
        raise _changed(directory, target, "finish the fix", _APPENDED)
    raise _changed(directory, target, "finish the fix")


def _to_cut(directory: str, g: Grown) -> bool:
    path = os.path.join(directory, g.name)
    st = _lstat(path)
    if st is not None and st.st_size == g.size:
        return False  # never appended to, or cut already
    if st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and \
            st.st_size > g.size and crc_of(path, g.start, g.size) == g.crc:
        if _ends_as_left(path, st.st_size, [g]):
            return True
        raise _changed(directory, path, "roll the fix back", _APPENDED)
    raise _changed(directory, path, "roll the fix back")


_END = 22  # a zip's end record: the copy of the old one ends whatever the fix appended
_APPENDED = (" (it no longer ends with the copy of its old end that the fix wrote: "
             "something else appended to it)")


def _ends_as_left(path: str, size: int, before: list[Grown]) -> bool:
    """Whether the shard at ``path`` (``size`` bytes now), appended to since
    it was ``before``, still ends as the fix left it: with a copy of its old
    last bytes (its end record), which a later change of the file replaces."""
    if not before:
        return False
    n = min(_END, before[0].size)
    with open(path, "rb") as f:
        return os.pread(f.fileno(), n, size - n) == os.pread(f.fileno(), n, before[0].size - n)


def _changed(directory: str, path: str, what: str, why: str = "") -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path} is not what the in-place fix cut short left there (journal "
        f"{os.path.join(directory, JOURNAL)}): it was changed since{why}, and ckptool cannot "
        f"{what}; it changed nothing", bad_hint(directory))


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _unlink_file(path: str) -> None:
    st = _lstat(path)
    if st is not None and stat.S_ISREG(st.st_mode):  # (never a directory or a link's target)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):  # not every filesystem can fsync a directory
            os.fsync(fd)
    finally:
        os.close(fd)


def _host() -> str:
    import socket  # (here: every read imports this module; few meet a journal)

    return socket.gethostname()
