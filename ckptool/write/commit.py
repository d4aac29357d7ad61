"""Stage 6 of a rewrite, the commit: the output is written to a temporary
file beside the target, verified there, then renamed into place.

Where the filesystem allows, the temporary file is anonymous (``O_TMPFILE``)
and is linked straight to the target name when it is complete, so even
``kill -9`` leaves no stray file behind (with ``--force`` it gets a dot-file
name for the instant before the rename over the old file); elsewhere it is
a dot-file that any failure removes, but that ``kill -9`` can leave.
Either way the target path is, at every instant, absent, the old file, or
the complete new one: a ``kill -9`` cannot leave it partial, because the
name appears only once the file is written and verified.

A write the system refuses (disk full, a name too long...) is an
``OutputError`` naming the output (``ckptool.write.failures``), with the
temporary file removed.

Durability against power loss is a separate cost. Before it replaces an
existing file the output is fsynced, so a crash cannot trade a good file
for a torn one. A brand-new file is left to the kernel's normal writeback,
as ``cp`` and ``torch.save`` leave theirs (the input is untouched, so
nothing existing is at risk), unless ``fsync=True`` (``--fsync``) asks to
wait until it is on disk.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import threading
from pathlib import Path
from types import TracebackType
from typing import IO

from ckptool.errors import UsageError
from ckptool.write.failures import is_output_error, naming, output_error


class AtomicOutput:
    """Use as ``with AtomicOutput(target) as out``: write ``out.file``, verify
    ``out.read_path``, then ``out.commit()``; leaving the block uncommitted
    removes the temporary file. ``shown``: the name errors give the output
    (a file of a directory being staged: its path in the final directory)."""

    def __init__(self, target: str | os.PathLike[str], force: bool = False,
                 fsync: bool = False, shown: str | os.PathLike[str] | None = None,
                 follow_links: bool = True, like: str | None = None) -> None:
        # a link to a file is written through, as cp does: the link stays and
        # its target gets the new bytes; not an input fixed in place, whose
        # link is replaced (``shared_file``)
        self.target = Path(os.path.realpath(target)) if follow_links and os.path.islink(
            target) else Path(target)
        self._replaced: os.stat_result | None = None  # the file this one replaces
        self._like = like  # a file it will replace later (a journal renames it): its mode
        self.shown = shown if shown is not None else target
        self.force = force
        self.durable = fsync  # also once it turns out to replace a file
        self.file: IO[bytes]
        self._named: Path | None = None  # temp file's name, when it has one
        self._committed = False
        self._sync: threading.Thread | None = None

    def __enter__(self) -> AtomicOutput:
        with naming(self.shown, self.target):
            return self._open()

    def _open(self) -> AtomicOutput:
        if self._like is not None:
            self._replaced = os.stat(self._like)
        if self.target.exists():
            if not self.force:
                raise UsageError(f"{self.target} already exists",
                                 "pass --force to overwrite it, or -o to choose another path")
            self.durable = True
            self._replaced = os.stat(self.target)
        directory = self.target.parent
        if not directory.is_dir():
            raise UsageError(f"{directory} is not a directory",
                             "create it first, or choose another output path")
        fd = self._open_anonymous(directory)
        if fd is None:
            self._named = directory / f".{self.target.name}.{secrets.token_hex(4)}.ckptool-tmp"
            try:
                fd = os.open(self._named, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except OSError as exc:
                raise output_error(self.shown, exc) from exc
        self.file = os.fdopen(fd, "w+b")
        return self

    @staticmethod
    def _open_anonymous(directory: Path) -> int | None:
        flag = getattr(os, "O_TMPFILE", 0)
        if not flag or os.environ.get("CKPTOOL_NO_TMPFILE"):
            return None
        try:
            return os.open(directory, flag | os.O_RDWR, 0o644)
        except OSError:
            return None  # filesystem without O_TMPFILE support

    @property
    def read_path(self) -> str:
        """A path that reads the temporary file's contents (for verification)."""
        self.file.flush()
        if self._named is not None:
            return str(self._named)
        return f"/proc/self/fd/{self.file.fileno()}"

    def sync_in_background(self) -> None:
        """Start making the file durable, if it is to be, while the caller
        verifies it (fsync and reading back both release the GIL)."""
        self.file.flush()
        if not self.durable:
            return
        self._sync = threading.Thread(target=os.fsync, args=(self.file.fileno(),))
        self._sync.start()

    def _link(self, name: Path) -> None:
        # os.link calls linkat(AT_SYMLINK_FOLLOW), which O_TMPFILE needs,
        # only when given a directory fd
        proc_fd = os.open("/proc/self/fd", os.O_RDONLY)
        try:
            os.link(str(self.file.fileno()), name, src_dir_fd=proc_fd)
        finally:
            os.close(proc_fd)

    def commit(self) -> None:
        """Put the file at the target path (durable first, when it is to be).

        Without ``force`` the file appears under the target name in one step
        (``linkat``), which never replaces a file: one that appeared while we
        wrote is an error, not overwritten. With ``force`` it gets a temporary
        name, then ``rename`` replaces the target atomically.
        """
        self.file.flush()
        self._keep_mode()
        if self._sync is not None:
            self._sync.join()
        elif self.durable:
            os.fsync(self.file.fileno())
        try:
            if self._named is None and not self.force:
                self._link(self.target)
            else:
                if self._named is None:
                    self._named = self.target.parent / (
                        f".{self.target.name}.{secrets.token_hex(4)}.ckptool-tmp")
                    self._link(self._named)
                if self.force:
                    os.replace(self._named, self.target)
                else:
                    os.link(self._named, self.target)
                    self._named.unlink()
        except FileExistsError as exc:
            raise UsageError(f"{self.target} appeared while ckptool was writing it",
                             "nothing was overwritten; pass --force to replace it") from exc
        self._committed = True
        self.file.close()
        if not self.durable:
            return
        with contextlib.suppress(OSError):  # not every filesystem can fsync a directory
            dir_fd = os.open(self.target.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def _keep_mode(self) -> None:
        """A file that replaces another keeps its permissions (a 0640 file
        stays group-only), and its owner where the system lets us."""
        old = self._replaced
        if old is None:
            return
        fd = self.file.fileno()
        os.fchmod(fd, stat.S_IMODE(old.st_mode))
        if (old.st_uid, old.st_gid) != (os.fstat(fd).st_uid, os.fstat(fd).st_gid):
            with contextlib.suppress(PermissionError):  # only root may give files away
                os.fchown(fd, old.st_uid, old.st_gid)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._sync is not None:
            self._sync.join()
        if self._committed:
            return
        if not self.file.closed:
            # closing flushes what is still buffered, which fails again on a
            # full disk: the file is dropped, and the first error is the one
            # to report (close still releases the descriptor)
            with contextlib.suppress(OSError):
                self.file.close()
        if self._named is not None:
            with contextlib.suppress(FileNotFoundError):
                self._named.unlink()
        mine = (self.target, *([self._named] if self._named else []))
        if isinstance(exc, OSError) and is_output_error(exc, mine):  # the disk filled...
            raise output_error(self.shown, exc) from exc


def shared_file(path: str) -> str | None:
    """Why writing into the file at ``path`` would change what other paths
    read: it is a symbolic link (a Hugging Face cache's snapshot file, whose
    blob other revisions share), or it has other hard links. None for a file
    of its own. An in-place fix replaces such a name with a new file."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"{path} was a symbolic link to {os.readlink(path)}"
    if st.st_nlink > 1:
        others = st.st_nlink - 1
        return f"{path} had {others} other hard link{'s' if others > 1 else ''}"
    return None
