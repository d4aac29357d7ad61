"""A directory output that appears complete or not at all.

Its files are written into a temporary directory beside the target
(``.NAME.ckptool-<pid>-<random>.partial``), each through ``AtomicOutput``
and verified there; then the directory is renamed to the target in one
step. A failure removes the temporary directory; one the system refuses
(disk full, a name too long) is an ``OutputError`` naming the target
directory (``ckptool.write.failures``). ``kill -9`` cannot be
cleaned up after by the process it kills: the target never appears, and
the next ckptool run that writes beside it removes the leftovers of runs
whose process is gone (the pid in the name says whose it was).

``--force`` over an existing directory: the old one is renamed aside, the
new one into place, then the old one removed; a crash between the renames
leaves the old one under ``.NAME.ckptool-<pid>-<random>.<random>.old`` (never removed
by ckptool: it is the user's data). Durable
(``fsync``, or when it replaces something): every file is fsynced, then
the temporary directory and, after the rename, the parent.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
from collections.abc import Callable, Collection
from pathlib import Path
from types import TracebackType

from ckptool.errors import InputError, UsageError
from ckptool.read.layouts.journal import alive
from ckptool.write.commit import AtomicOutput
from ckptool.write.failures import is_output_error, naming, output_error
from ckptool.write.outlock import OutputLock

_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.ckptool-(?P<pid>\d+)-[0-9a-f]+\.partial$")


class AtomicDirectory:
    """Use as ``with AtomicDirectory(target) as out``: write files through
    ``out.file(name)`` (an ``AtomicOutput``), then ``out.commit()``."""

    def __init__(self, target: str, force: bool = False, fsync: bool = False,
                 source: str | None = None, writes: Collection[str] = ()) -> None:
        self.target = Path(target.rstrip("/") or target)
        self.source = source  # what is read: never replaced, never written into
        self.writes = frozenset(writes)  # top-level names it writes beside the weights
        self.force = force
        self.durable = fsync
        self.temp: Path | None = None
        self._committed = False
        self._lock = OutputLock(self.target)

    def __enter__(self) -> AtomicDirectory:
        self._lock.acquire()  # one writer of the target (``outlock``)
        try:
            with naming(self.target):  # a name too long for the filesystem...
                return self._stage()
        except BaseException:
            self._lock.release()
            raise

    def _stage(self) -> AtomicDirectory:
        parent = self.target.parent
        if self.source is not None:
            check_apart(Path(self.source), self.target)
        if self.target.exists() or self.target.is_symlink():
            if not self.force:
                raise UsageError(f"{self.target} already exists",
                                 "pass --force to replace it, or name another output")
            if not self.target.is_dir() or self.target.is_symlink():
                raise UsageError(f"{self.target} exists and is not a directory",
                                 "remove it, or name another output")
            check_replaceable(self.target, self._source_dir(), self.writes)
            self.durable = True
        if not parent.is_dir():
            raise InputError(f"cannot write {self.target}: {parent} is not a directory",
                             "create the directory first")
        remove_leftovers(parent, self.target.name)
        token = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.temp = parent / f".{self.target.name}.ckptool-{token}.partial"
        try:
            self.temp.mkdir()
        except OSError as exc:
            raise output_error(self.target, exc) from exc
        return self

    def _source_dir(self) -> str | None:
        """The input's folder, whose files a conversion copies (None for a file)."""
        return self.source if self.source is not None and os.path.isdir(self.source) else None

    def file(self, name: str) -> AtomicOutput:
        """A file of the directory, written atomically inside it."""
        assert self.temp is not None
        return AtomicOutput(self.temp / name, fsync=self.durable, shown=self.target / name)

    @property
    def path(self) -> str:
        """Where the files are, until ``commit``."""
        assert self.temp is not None
        return str(self.temp)

    def commit(self) -> None:
        assert self.temp is not None
        if self.durable:
            fsync_directory(self.temp)
        replace_directory(self.temp, self.target, self.force, on_renamed=self._renamed,
                          source=self._source_dir(), writes=self.writes)
        if self.durable:
            fsync_directory(self.target.parent)

    def _renamed(self) -> None:
        self._committed = True

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._lock.release()
        if not self._committed and self.temp is not None:
            shutil.rmtree(self.temp, ignore_errors=True)
        mine = (self.target, *([self.temp] if self.temp is not None else []))
        if isinstance(exc, OSError) and is_output_error(exc, mine):  # the disk filled...
            raise output_error(self.target, exc) from exc


def replace_directory(temp: Path, target: Path, force: bool,
                      on_renamed: Callable[[], None] | None = None,
                      source: str | None = None, writes: Collection[str] = ()) -> None:
    """Rename directory ``temp`` to ``target``. Without ``force`` a
    ``target`` that appeared meanwhile is an error, never replaced; with it,
    a ``target`` there is renamed aside first (``<temp>.<random>.old``,
    without ``.partial``) and removed once the new one is in place, if it is
    still a checkpoint directory (or an empty one): one that came to hold
    other files meanwhile is refused, its files kept."""
    old = None
    if target.exists() or target.is_symlink():
        if not force:
            raise appeared(target)
        if not target.is_dir() or target.is_symlink():
            raise UsageError(f"{target} exists and is not a directory",
                             "remove it, or name another output")
        check_replaceable(target, source, writes)
        old = temp.with_name(f"{temp.name.removesuffix('.partial')}.{secrets.token_hex(4)}.old")
        os.rename(target, old)
    try:
        os.rename(temp, target)
    except OSError as exc:
        if old is None and exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
            raise appeared(target) from exc  # in the instant since the check
        if old is not None:
            os.rename(old, target)  # the old one back: nothing lost
        raise
    if on_renamed is not None:
        on_renamed()
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def appeared(target: Path) -> UsageError:
    """The error of an output that another program made while ckptool wrote it."""
    return UsageError(f"{target} appeared while ckptool was writing it",
                      "nothing was overwritten; pass --force to replace it")


def check_apart(source: Path, target: Path) -> None:
    """The output is neither the input, nor inside it, nor around it: --force
    would replace the input, and a directory written into one is read as it."""
    src, dst = os.path.realpath(source), os.path.realpath(target)
    if src == dst or src.startswith(dst + os.sep) or dst.startswith(src + os.sep):
        where = "is" if src == dst else "holds" if src.startswith(dst + os.sep) else "is inside"
        raise UsageError(f"the output {target} {where} the input {source}",
                         "write the output beside the input, under another name")


# what a framework keeps beside a model that ckptool never writes: --force
# never removes a directory holding it (a run's training state)
_TRAINING = re.compile(r"^(optimizer|scheduler|rng_state|random_states|training_args|"
                       r"trainer_state|scaler|sampler|dl_state_dict|custom_checkpoint)")
_WEIGHTS = re.compile(r"^(.+\.(safetensors|bin|pt|pth|distcp)|\.metadata|.+\.index\.json)$")


def check_replaceable(target: Path, source: str | os.PathLike[str] | None = None,
                      writes: Collection[str] = ()) -> None:
    """``--force`` replaces a checkpoint directory (or an empty one), never
    one that holds something else: each of its entries must be a file of the
    checkpoint (weights, an index, DCP's ``.metadata``), a framework's file
    that a conversion writes beside it (configs, tokenizer, model card), or
    one of the same name in ``source`` (the input's folder, whose files a
    conversion copies) or in ``writes`` (what it writes beside the
    weights: a framework's files and module folders); a training run's
    state (``optimizer.pt``...), notes, logs or other folders are the
    user's."""
    from ckptool.errors import CkptoolError
    from ckptool.read.layouts import framework, recognise

    try:
        entries = os.listdir(target)
        found = not entries or recognise.recognise(str(target)) is not None
    except (CkptoolError, OSError):  # unreadable, or several checkpoints: not one to replace
        found, entries = False, []
    if not found:
        raise UsageError(f"{target} is a directory that holds no checkpoint: --force "
                         "replaces only a checkpoint directory",
                         "remove it yourself, or name another output")
    given = Path(source) if source is not None else None
    copied = set(os.listdir(given)) if given is not None and given.is_dir() else set()
    copied |= set(writes)
    for name in sorted(entries):
        path = target / name
        if name in copied:
            continue
        if path.is_dir() or path.is_symlink() or _TRAINING.match(name) or not (
                _WEIGHTS.match(name) or framework.role_of(name) is not None):
            raise UsageError(f"{target} holds {name}, which is no part of a checkpoint: "
                             "--force replaces only a checkpoint directory",
                             "move it away or remove the directory yourself, or name "
                             "another output")


def remove_stale_records(parent: Path, name: str) -> bool:
    """Remove the records a distributed convert's rank 0 set aside while it
    committed directory ``parent/name`` (``.NAME.ckptool-dist.manifest``),
    when it was killed once the output was in place: its staging directory
    is gone. Only what ckptool writes there is removed; returns whether."""
    staging, aside = dist_paths(parent, name)
    if not aside.is_dir() or aside.is_symlink() or staging.exists() or \
            not only_records(aside):
        return False
    shutil.rmtree(aside, ignore_errors=True)
    return True


def dist_paths(parent: Path, name: str) -> tuple[Path, Path]:
    """A distributed convert's staging directory for ``parent/name``, and
    where its commit sets the records aside."""
    return (parent / f".{name}.ckptool-dist.partial",
            parent / f".{name}.ckptool-dist.manifest")


def only_records(meta: Path) -> bool:
    """Whether a staging directory's ``.ckptool/`` (or its records set
    aside) holds only what a distributed convert writes there."""
    try:
        names = os.listdir(meta)
    except OSError:
        return False
    return all(n in ("plan", "token", "placed", ".plan.tmp", ".token.tmp", ".placed.tmp")
               or (n.startswith(("done-", "dcp-")) and n.endswith((".jsonl", ".json")))
               for n in names)


def remove_leftovers(parent: Path, name: str) -> list[str]:
    """Remove what runs killed while writing ``parent/name`` left behind
    (their process is gone); returns what was removed."""
    removed: list[str] = []
    if remove_stale_records(parent, name):
        removed.append(dist_paths(parent, name)[1].name)
    try:
        entries = os.listdir(parent)
    except OSError:
        return removed
    for entry in entries:
        m = _LEFTOVER.match(entry)
        if m is None or m.group("name") != name or alive(int(m.group("pid"))):
            continue
        shutil.rmtree(parent / entry, ignore_errors=True)
        removed.append(entry)
    return removed


def fsync_directory(directory: Path) -> None:
    """Make a directory's entries (a rename into it) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
