"""The staging directory of a distributed convert, and its manifest.

Every rank writes into one directory beside the output, on the filesystem
they share: ``.NAME.ckptool-dist.partial`` (a hidden name that never looks
like a checkpoint; its name does not depend on the run, so that a re-run
finds it). It holds the output's files as they are being written, and
``.ckptool/``: ``plan`` (the plan's fingerprint), ``token`` (proof to the
other ranks that they see the directory rank 0 made: the filesystem is
shared), and one manifest per rank and run (``done-<rank>-<hex>.jsonl``):
a line per unit written and verified, with the output ranges it covers and
their CRCs (a DCP output: ``dcp-<rank>.json``, ``ckptool.write.distributed.dcpshare``).

A re-run of the same conversion (the same fingerprint) keeps the directory;
each rank re-reads the ranges the manifests list for its units and keeps
those that still have their CRCs. Another conversion into the same output
starts afresh. On success rank 0 removes ``.ckptool/`` and renames the
directory (or, for a one-file output, the file in it) into place, replacing
what ``--force`` allows as ``AtomicDirectory`` does.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from ckptool.errors import InputError, UsageError
from ckptool.write.failures import naming, output_error
from ckptool.write.outdir import (
    appeared,
    check_apart,
    check_replaceable,
    dist_paths,
    fsync_directory,
    only_records,
    remove_stale_records,
    replace_directory,
)
from ckptool.write.outlock import OutputLock

Check = tuple[int, int, int]  # (offset, size, CRC)


class Staging:
    """``Staging(target, is_directory)``; rank 0 calls ``lock``, ``prepare``,
    then ``commit`` and ``unlock``; the other ranks check that they ``sees``
    the directory it prepared."""

    def __init__(self, target: str, is_directory: bool, force: bool = False) -> None:
        self.target = Path(target.rstrip("/") or target)
        if not is_directory and self.target.is_symlink():  # written through, as cp does
            self.target = Path(os.path.realpath(self.target))  # (and one-process convert)
        self.is_directory = is_directory
        self.force = force
        self.path, self.aside = dist_paths(self.target.parent, self.target.name)
        self.meta = self.path / ".ckptool"
        self._lock = OutputLock(self.target)
        self._source_dir: str | None = None  # the input's folder (its files are copied)
        self._writes: frozenset[str] = frozenset()

    def file(self, name: str) -> Path:
        return self.path / name

    def placed(self, name: str) -> Path:
        """What ``commit`` makes OUT, itself (renamed or linked: OUT is then
        this very inode): the directory, or its one file ``name``."""
        return self.path if self.is_directory else self.file(name)

    # -- before writing ------------------------------------------------------

    def check_target(self, source: str, writes: Collection[str] = ()) -> None:
        """The output may be written: not the input, not there unless --force."""
        self._source_dir = source if os.path.isdir(source) else None
        self._writes = frozenset(writes)  # a framework's files beside the weights
        check_apart(Path(source), self.target)
        remove_stale_records(self.target.parent, self.target.name)  # OUT was committed
        self._remove_if_committed()
        for own in (self.path, self.aside, self._lock.path):  # what a run removes
            check_apart(Path(source), own)
        for own in (self.path, self.aside):
            if own.is_symlink() or (own.exists() and not own.is_dir()):
                raise UsageError(f"{own} is in the way of the staging directory",
                                 "move it away, then run again")
        if (self.target.exists() or self.target.is_symlink()) and not self.force:
            raise UsageError(f"{self.target} already exists",
                             "pass --force to replace it, or name another output")
        if self.is_directory and self.target.exists():
            if not self.target.is_dir() or self.target.is_symlink():
                raise UsageError(f"{self.target} exists and is not a directory",
                                 "remove it, or name another output")
            check_replaceable(self.target, self._source_dir, self._writes)  # nothing else
        elif not self.is_directory and self.target.is_dir():
            raise UsageError(f"{self.target} is a directory, and the output is one file",
                             "name the output file, or give --format for a directory")
        if not self.target.parent.is_dir():
            raise InputError(f"cannot write {self.target}: {self.target.parent} is not a "
                             "directory", "create the directory first")

    def lock(self) -> None:
        """Rank 0, for the whole run: one conversion at a time into this
        output, distributed or not (another one's rank 0 would remove this
        one's staging; a plain one would commit over it)."""
        self._lock.acquire()

    def unlock(self) -> None:
        self._lock.release()

    def prepare(self, fingerprint: str) -> tuple[str, bool]:
        """Rank 0: the directory ready for this plan; returns (the token the
        other ranks must find, whether an earlier run's work is kept)."""
        with naming(self.target):
            self._take_back_aside()
            kept = self._plan() == fingerprint
            if not kept and self.path.exists():
                self._check_ours()
                self._remove()
            try:
                self.meta.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise output_error(self.target, exc) from exc
            token = secrets.token_hex(8)
            write_small(self.meta / "plan", fingerprint.encode())
            write_small(self.meta / "token", token.encode())
        return token, kept

    def _take_back_aside(self) -> None:
        """An earlier run's rank 0 stopped while committing a directory,
        with ``.ckptool/`` set aside: back into the staging directory if it
        is still there (killed before the output was renamed into place: the
        files are whole, and a re-run keeps them), else removed (the output
        was committed)."""
        if not self.aside.is_dir() or self.aside.is_symlink():
            return
        if not only_records(self.aside):
            raise UsageError(f"{self.aside} holds files ckptool did not write",
                             "move it away, then run again")
        if self.path.is_dir() and not self.meta.exists():
            os.rename(self.aside, self.meta)
        else:
            shutil.rmtree(self.aside)

    def _remove_if_committed(self) -> None:
        """A one-file output's staging directory left by a rank 0 killed
        after OUT was in place (``placed`` names the file OUT now is):
        removed, as its commit would have."""
        try:
            placed = (self.meta / "placed").read_text().split()
            st = os.stat(self.target)
        except OSError:
            return
        if placed == [str(st.st_dev), str(st.st_ino)] and only_records(self.meta):
            with contextlib.suppress(OSError):
                self._remove()

    def _remove(self) -> None:
        """The staging directory removed, ``.ckptool/`` last: stopped
        half-way, what is left is still recognisably ckptool's."""
        for entry in os.scandir(self.path):
            if entry.name == ".ckptool":
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        shutil.rmtree(self.path)

    def _check_ours(self) -> None:
        """The staging directory is removed only if a run of ckptool made
        it (it holds ``.ckptool/``, or nothing)."""
        if self.path.is_symlink() or not self.path.is_dir():
            raise UsageError(f"{self.path} is in the way of the staging directory",
                             "move it away, then run again")
        if self.meta.is_dir() or not os.listdir(self.path):
            return
        raise UsageError(f"{self.path} holds files ckptool did not write",
                         "move it away, then run again")

    def _plan(self) -> str | None:
        try:
            return (self.meta / "plan").read_text()
        except OSError:
            return None

    def sees(self, token: str) -> bool:
        """Whether this rank sees the directory rank 0 prepared (shared filesystem)."""
        try:
            return (self.meta / "token").read_text() == token
        except OSError:
            return False

    # -- the manifest --------------------------------------------------------

    def manifest(self, rank: int) -> Manifest:
        return Manifest(self.meta / f"done-{rank}-{secrets.token_hex(4)}.jsonl")

    def recorded(self) -> dict[tuple[str, str], dict[str, Any]]:
        """Every unit some run recorded as written and verified: (file, unit) -> entry."""
        found: dict[tuple[str, str], dict[str, Any]] = {}
        try:
            names = sorted(os.listdir(self.meta))
        except OSError:
            return found
        for name in names:
            if name.startswith("done-") and name.endswith(".jsonl"):
                for entry in _lines(self.meta / name):
                    found[(entry["file"], entry["unit"])] = entry
        return found

    # -- the end -------------------------------------------------------------

    def commit(self, name: str | None, durable: bool) -> None:
        """Rank 0, once every file is written and checked: the output into
        place. Without --force an OUT that appeared meanwhile is an error,
        never replaced (``replace_directory``, ``_place``)."""
        if durable:
            fsync_directory(self.path)
        if not self.is_directory:
            assert name is not None
            st = os.stat(self.path / name)  # what OUT will be: a leftover beside it is told
            write_small(self.meta / "placed", f"{st.st_dev} {st.st_ino}".encode())
            self._place(self.path / name)
            with contextlib.suppress(OSError):
                self._remove()
        else:  # the manifests stay beside it until the output is in place
            os.rename(self.meta, self.aside)
            try:
                replace_directory(self.path, self.target, self.force,
                                  source=self._source_dir, writes=self._writes)
            except BaseException:
                os.rename(self.aside, self.meta)  # still resumable
                raise
            shutil.rmtree(self.aside, ignore_errors=True)
        if durable:
            fsync_directory(self.target.parent)

    def _place(self, file: Path) -> None:
        """The one output file to OUT: over it with --force; else linked
        there, which fails on a file that appeared meanwhile (where the
        filesystem has no hard links: checked, then renamed)."""
        if self.force:
            if self.target.is_dir() and not self.target.is_symlink():
                raise UsageError(f"{self.target} appeared as a directory while ckptool was "
                                 "writing it", "nothing was overwritten; remove it, or name "
                                 "another output")
            os.replace(file, self.target)
            return
        try:
            os.link(file, self.target, follow_symlinks=False)
        except FileExistsError as exc:
            raise appeared(self.target) from exc
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            if self.target.exists() or self.target.is_symlink():
                raise appeared(self.target) from exc
            os.rename(file, self.target)
            return
        os.unlink(file)


class Manifest:
    """One rank's record of the units it wrote and verified (appended, flushed per batch)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the share)

    def add(self, entries: list[dict[str, Any]]) -> None:
        self._f.write("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in entries))
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    """A manifest's entries; a line cut short by a crash is no entry."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and {"file", "unit", "checks"} <= entry.keys():
            yield entry


def write_small(path: Path, data: bytes, durable: bool = False) -> None:
    """A small file written whole under a temporary name, then renamed."""
    temp = path.with_name(f".{path.name}.tmp")
    with open(temp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(temp, path)
