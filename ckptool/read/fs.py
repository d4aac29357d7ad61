"""Files and folders, local or remote, as the readers ask about them.

Every question ``ckptool.read`` asks of the file system about a
checkpoint goes through here: a local path is answered by ``os`` exactly
as before (nothing added to the local path's cost), a URL
(``ckptool.read.remote``) by one listing of its folder and range
requests. The functions mirror ``os`` and ``os.path``: the same names,
the same answers, the same ``OSError`` subclasses for a missing file or
a directory opened as a file, so a reader cannot tell the two apart.
Remote failures other than "not there" (access denied, a server down)
are ``InputError``s naming the URL.

A path in an archive open as a folder (``ckptool.read.archive``: a
``.nemo``, once ``recognise`` has indexed it) is answered by the archive,
before either: its members are files read in place, as a remote file is
read (by ``pread``, no descriptor): ``is_remote`` is true of them.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from typing import IO, Any, cast

from ckptool.errors import InputError
from ckptool.read.archive import mounts
from ckptool.read.remote import urls

_archive = mounts.find  # the mounted archive a path is or lies in, else None


def is_remote(path: object) -> bool:
    """Whether ``path`` is read through this module's own files, never by
    ``os``: a URL, or a path in a mounted archive."""
    return urls.is_url(path) or _archive(path) is not None


def _entry(path: str) -> tuple[str, Any]:
    from ckptool.read.remote import tree

    scheme = urls.scheme_of(path)
    assert scheme is not None
    return scheme, tree.tree(scheme).entry(path)


def listable(path: str) -> bool:
    """Whether the folders of ``path`` can be listed (locally, and on every
    store but plain HTTP(S): there, whether a file exists is only what a
    server answers, and some answer a page for any name)."""
    return not urls.is_url(path) or urls.SCHEMES[urls.scheme_of(path) or ""] != "http"


def open_binary(path: str) -> io.BufferedReader:
    """``open(path, "rb")``, for a URL a ``RemoteFile``, for a member of an
    archive an ``archive.window.Window``."""
    if (archive := _archive(path)) is not None:
        return cast(io.BufferedReader, archive.open(path))
    return open_unmounted(path)


def open_unmounted(path: str) -> io.BufferedReader:
    """``open_binary`` of the file itself, even where it is a mounted
    archive (what the archive reads its members from)."""
    if not urls.is_url(path):
        return open(path, "rb")
    from ckptool.read.remote.rfile import RemoteFile

    scheme, entry = _entry(path)
    if entry is None:
        raise FileNotFoundError(errno.ENOENT, "not found", urls.shown(path))
    if entry.directory:
        raise IsADirectoryError(errno.EISDIR, "is a directory", urls.shown(path))
    # a RemoteFile reads as a BufferedReader does (read, readinto, seek,
    # tell, readall): the readers take it for one
    return cast(io.BufferedReader, RemoteFile(scheme, entry))


def located(path: str) -> tuple[str, int]:
    """Where a file's bytes lie, for a reader of descriptors: (the file, the
    offset of its first byte). A member of a mounted local archive is a
    range of the archive; any other path is itself, from 0."""
    archive = _archive(path)
    if archive is None or urls.is_url(archive.path):
        return path, 0
    return archive.path, archive.member(path).offset


def size_of(f: IO[bytes]) -> int:
    """The size of an open file (``os.fstat(f.fileno()).st_size``)."""
    size = getattr(f, "size", None)
    if isinstance(size, int) and is_remote(getattr(f, "url", None)):
        return size
    return os.fstat(f.fileno()).st_size


def getsize(path: str) -> int:
    if (archive := _archive(path)) is not None:
        return int(archive.getsize(path))
    if not is_remote(path):
        return os.path.getsize(path)
    _, entry = _entry(path)
    if entry is None:
        raise FileNotFoundError(errno.ENOENT, "not found", urls.shown(path))
    return int(entry.size)


def isdir(path: str) -> bool:
    if (archive := _archive(path)) is not None:
        return bool(archive.isdir(path))
    if not is_remote(path):
        return os.path.isdir(path)
    return bool((entry := _entry(path)[1]) is not None and entry.directory)


def isfile(path: str) -> bool:
    if (archive := _archive(path)) is not None:
        return bool(archive.isfile(path))
    if not is_remote(path):
        return os.path.isfile(path)
    return bool((entry := _entry(path)[1]) is not None and not entry.directory)


def regular(path: str) -> bool:
    """Whether ``path`` is a regular file (following links; a FIFO or a
    device is not: reading one could block for ever)."""
    if is_remote(path):
        return isfile(path)
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def exists(path: str) -> bool:
    if (archive := _archive(path)) is not None:
        return bool(archive.exists(path))
    if not is_remote(path):
        return os.path.exists(path)
    return _entry(path)[1] is not None


def islink(path: str) -> bool:
    return False if is_remote(path) else os.path.islink(path)


def listdir(path: str) -> list[str]:
    """``os.listdir``: the names in a folder (OSError if it is none)."""
    if not is_remote(path):
        return os.listdir(path)
    return [name for name, _, _ in entries(path)]


def entries(path: str) -> list[tuple[str, bool, bool]]:
    """(name, is a directory, is a regular file) of each entry of a folder."""
    if (archive := _archive(path)) is not None:
        return list(archive.entries(path))
    if not is_remote(path):
        with os.scandir(path) as it:
            return [(e.name, e.is_dir(), e.is_file()) for e in it]
    from ckptool.read.remote import tree

    scheme, entry = _entry(path)
    if entry is None:
        raise FileNotFoundError(errno.ENOENT, "not found", urls.shown(path))
    if not entry.directory:
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", urls.shown(path))
    return [(urls.name(e.url), e.directory, not e.directory)
            for e in tree.tree(scheme).children(path)]


def join(base: str, *names: str) -> str:
    if not urls.is_url(base):
        return os.path.join(base, *names)
    for name in names:
        base = urls.join(base, name)
    return base


def abspath(path: str) -> str:
    """``os.path.abspath``; a URL is absolute as it is."""
    return path.rstrip("/") if urls.is_url(path) else os.path.abspath(path)


def basename(path: str) -> str:
    """The last component, a trailing separator ignored
    (``os.path.basename(os.path.normpath(os.path.abspath(path)))``)."""
    if urls.is_url(path):
        return urls.name(path)
    return os.path.basename(os.path.normpath(os.path.abspath(path)))


def dirname(path: str) -> str:
    return urls.parent(path) if urls.is_url(path) else os.path.dirname(path)


PREFETCH_WORKERS = 8  # requests in flight at once


def prefetch(paths: list[str]) -> None:
    """Fetch the first bytes of each remote file of ``paths`` at once, on a
    bounded pool (a sharded model's headers: N requests in the time of a
    few); local paths are left alone. Failures are left for the read that
    follows to meet and say."""
    remote = [p for p in paths if urls.is_url(p)]
    if len(remote) < 2:
        return
    from concurrent.futures import ThreadPoolExecutor

    def head(path: str) -> None:
        try:
            with open_binary(path) as f:
                f.read(1)
        except (OSError, InputError):
            return  # (said by the read that follows, in order)

    with ThreadPoolExecutor(min(PREFETCH_WORKERS, len(remote))) as pool:
        list(pool.map(head, remote))
