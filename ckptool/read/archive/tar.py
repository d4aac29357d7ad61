"""An uncompressed tar archive's member index, and the questions
``ckptool.read.fs`` asks of a folder answered from it.

An uncompressed tar stores each member's bytes contiguously after its
header, so a member is a byte range of the archive: ``tarfile`` reads the
headers alone (``getmembers`` seeks past each member's bytes, reading only
the last byte before the next header, to tell a cut archive), once per
archive, and every member is then read in place (``window``). Nothing is
extracted.

Refused, with the member named: a name outside the archive (absolute, or
with a ``..``), a link (symbolic or hard), a device or a pipe, a sparse
member (its bytes are not one range), a name given twice (``tar x`` would
keep the last one, a reader of the first would see other bytes), a file
and a folder of one name, and a member whose bytes run past the archive's
end. Folders are implied by the files' names where the archive lists
none. A member named ``./x`` (NeMo's ``tar.add(folder, arcname=".")``) is
``x``.
"""

from __future__ import annotations

import errno
import os
import tarfile
from dataclasses import dataclass
from typing import IO, Any, cast

from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.read import fs
from ckptool.read.archive import mounts
from ckptool.read.archive.window import Window
from ckptool.read.remote import urls

TAR_MAGIC = b"ustar"  # at offset 257 of the first header (POSIX and GNU)
GZIP_MAGIC = b"\x1f\x8b"
HEAD = 512
HINT = "the archive is damaged or was not written by NeMo; extract it with tar to see"


def sniff(head: bytes) -> str | None:
    """"tar" for an uncompressed tar's first header, "gzip" for a gzip
    stream (a compressed tar, maybe), else None."""
    if head[257:262] == TAR_MAGIC:
        return "tar"
    if head[:2] == GZIP_MAGIC:
        return "gzip"
    return None


def head_of(path: str) -> bytes:
    """The first ``HEAD`` bytes of a file (b"" if it cannot be read)."""
    try:
        with fs.open_unmounted(path) as f:
            return f.read(HEAD)
    except OSError:
        return b""


@dataclass(frozen=True)
class Member:
    offset: int  # of its first byte in the archive
    size: int


class Archive:
    """A mounted archive: the folder ``path`` whose files are its members."""

    def __init__(self, path: str, size: int, files: dict[str, Member],
                 dirs: set[str]) -> None:
        self.path, self.size, self.files = path, size, files
        self._root = mounts.key(path)
        self._identity = _identity(path)
        self._children: dict[str, dict[str, bool]] = {d: {} for d in dirs}
        for name in [*dirs, *files]:
            if name:
                parent, _, base = name.rpartition("/")
                self._children[parent][base] = name in dirs

    def stale(self) -> bool:
        """Whether the archive file is no longer the one indexed (a local
        one's device, inode, size and time; a URL's version is pinned by
        its reader)."""
        return _identity(self.path) != self._identity

    def inner(self, path: str) -> str:
        """``path``'s name inside the archive ("" for the archive itself)."""
        return mounts.key(path)[len(self._root):].strip("/")

    def isdir(self, path: str) -> bool:
        return self.inner(path) in self._children

    def isfile(self, path: str) -> bool:
        return self.inner(path) in self.files

    def exists(self, path: str) -> bool:
        name = self.inner(path)
        return name in self.files or name in self._children

    def member(self, path: str) -> Member:
        name = self.inner(path)
        found = self.files.get(name)
        if found is not None:
            return found
        if name in self._children:
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        raise FileNotFoundError(errno.ENOENT, f"not in the archive {self.path}", path)

    def getsize(self, path: str) -> int:
        return self.member(path).size

    def entries(self, path: str) -> list[tuple[str, bool, bool]]:
        name = self.inner(path)
        if name in self.files:
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
        if name not in self._children:
            raise FileNotFoundError(errno.ENOENT, f"not in the archive {self.path}", path)
        return [(n, d, not d) for n, d in self._children[name].items()]

    def open(self, path: str) -> Window:
        found = self.member(path)
        raw = fs.open_unmounted(self.path)
        if fs.size_of(raw) != self.size:
            raw.close()
            raise CorruptCheckpointError(
                f"{self.path} changed since its member index was read "
                f"({self.size} -> {fs.size_of(raw)} bytes)",
                "run the command again once the archive is no longer being written")
        return Window(raw, found.offset, found.size, path)


def _identity(path: str) -> tuple[int, ...] | None:
    if urls.is_url(path):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def mount(path: str) -> Archive:
    """The archive at ``path`` indexed and mounted: from now on ``fs`` sees
    a folder there."""
    archive = index(path)
    mounts.mount(path, archive)
    return archive


def index(path: str) -> Archive:
    """The member index of the uncompressed tar at ``path`` (headers only)."""
    with fs.open_unmounted(path) as f:
        size = fs.size_of(f)
        try:
            with tarfile.open(fileobj=cast("IO[bytes]", _Capped(f, size)), mode="r:") as tf:
                members = tf.getmembers()
                end = tf.offset  # where it stopped: the end marker, or what it took for one
            # (tarfile stops quietly at a damaged header, or at a cut between
            # members: the members after it would be missing, unsaid)
            f.seek(end)
            marker = f.read(HEAD)
        except (tarfile.TarError, EOFError, ValueError, OverflowError) as exc:
            # (tarfile's own parsing of a crafted header: a size of 2**80, a
            # sparse map that is no number, raise ValueError and OverflowError)
            raise CorruptCheckpointError(f"{path} is a damaged tar archive: "
                                         f"{str(exc)[:120]}", HINT) from exc
        if marker != bytes(HEAD):
            raise CorruptCheckpointError(
                f"{path} is a damaged tar archive: byte {end} is neither a member's header "
                "nor the archive's end (cut short, or a header there damaged)", HINT)
    return _checked(path, size, members)


class _Capped:
    """A file for ``tarfile`` whose reads stop at its end: a header naming a
    64 GiB pax or long-name block reads what is there (and fails as cut
    short) rather than asking for 64 GiB of memory first."""

    def __init__(self, f: Any, size: int) -> None:
        self.f, self.size = f, size

    def read(self, n: int = -1) -> bytes:
        left = max(0, self.size - self.f.tell())
        return bytes(self.f.read(left if n is None or n < 0 or n > left else n))

    def seek(self, offset: int, whence: int = 0) -> int:
        return int(self.f.seek(offset, whence))

    def tell(self) -> int:
        return int(self.f.tell())


def _checked(path: str, size: int, members: list[tarfile.TarInfo]) -> Archive:
    files: dict[str, Member] = {}
    dirs = {""}
    for m in members:
        name = _name(path, m.name)
        what = f"{path}: its member {m.name!r:.120}"
        if m.issym() or m.islnk():
            raise UnsupportedCheckpointError(
                f"{what} is a link (to {m.linkname!r:.80}): ckptool reads archives of "
                "plain files only", "extract it with tar and read the folder")
        if m.isdir():
            if name in files:
                raise CorruptCheckpointError(f"{what} is a file and a folder", HINT)
            dirs.update(_parents(name), {name})
            continue
        if not m.isreg() or m.issparse():
            raise UnsupportedCheckpointError(
                f"{what} is {'sparse' if m.isreg() else 'a device or a pipe'}: ckptool "
                "reads archives of plain files only", "extract it with tar and read the folder")
        if not name or name in dirs:
            raise CorruptCheckpointError(f"{what} is a file and a folder", HINT)
        if name in files:
            raise CorruptCheckpointError(
                f"{what} is in the archive twice: tar would extract the last one, a reader "
                "of the first would see other bytes", "extract it with tar and read the folder")
        if m.offset_data + m.size > size:
            raise CorruptCheckpointError(
                f"{what} runs past the end of the archive ({m.offset_data + m.size} > "
                f"{size} bytes): cut short?", "copy the archive again")
        files[name] = Member(m.offset_data, m.size)
        dirs.update(_parents(name))
    clash = sorted(set(files) & dirs)
    if clash:
        raise CorruptCheckpointError(f"{path}: {clash[0]!r:.120} is a file and a folder", HINT)
    return Archive(path, size, files, dirs)


def _name(path: str, raw: str) -> str:
    """A member's name inside the archive (``./a//b`` -> ``a/b``); refused
    where it leads outside (absolute, or through ``..``)."""
    if raw.startswith("/") or any(part == ".." for part in raw.replace("\\", "/").split("/")):
        raise UnsupportedCheckpointError(
            f"{path}: its member {raw!r:.120} names a place outside the archive "
            "(extracted, it would be written there)",
            "do not extract this archive; ask whoever made it for a clean one")
    return "/".join(p for p in raw.split("/") if p not in ("", "."))


def _parents(name: str) -> list[str]:
    parts = name.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]

