"""A checkpoint's files, named as a manifest names them, and their sha256
computed on several threads.

``files_of(ckpt)`` is every file of the checkpoint: the layout's own (the one
file; an index and its shards; ``.metadata`` and the ``.distcp`` files; each
rank's file; DeepSpeed's model and optimizer states; Lightning's ``meta.pt``),
every other regular file in the folders that hold a layout of many files (a
shard or a rank's file added is a change too), and the framework's files
beside the model (configs, tokenizer, a Trainer's optimizer, scheduler and
RNG states...), relative to ``root_of(ckpt)``: the
directory given, or the one file's folder. ``holders`` says which of them
each tensor's bytes are read from.

``Hashing(paths, jobs)`` hashes files on ``jobs`` threads, the largest
first, ``FILE_BLOCK`` at a time into one buffer per file; ``hashlib``
releases the GIL, so the calling thread can digest tensors meanwhile. A
failure or Ctrl-C in the calling thread stops the hashes within a block.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Protocol

from ckptool.model import Checkpoint, TensorInfo
from ckptool.read import fs
from ckptool.read.layouts import journal, names

FILE_BLOCK = 4 << 20  # bytes read and hashed at a time


class Known(Protocol):
    """Hashes already taken of a checkpoint's bytes (as a writer wrote them)."""

    def file(self, path: str) -> tuple[int, str] | None:
        """A file's (size, sha256), or None."""

    def tensor(self, path: str, offset: int, size: int) -> str | None:
        """The digest of ``size`` bytes of ``path`` at ``offset``, or None."""


class Stopped(Exception):
    """A file hash given up because the caller failed or was interrupted."""


def layout_paths(ckpt: Checkpoint) -> list[str]:
    """The paths of the files of ``ckpt``'s layout (not a framework's others)."""
    if ckpt.directory is not None:
        return [fs.join(ckpt.directory, f.path) for f in ckpt.files]
    return [ckpt.path]


def own_paths(ckpt: Checkpoint) -> list[str]:
    """The layout's files and a framework's files beside the model: what a
    manifest written there would destroy."""
    paths = layout_paths(ckpt)
    fw = ckpt.framework
    if fw is not None:
        paths += [fs.join(fw.directory, c.path) for c in fw.companions]
    return paths


def _all_paths(ckpt: Checkpoint) -> list[str]:
    """``own_paths`` and every other regular file in the folders that hold
    the layout's files, when they are many (a shard or a rank file added is
    one of its files too)."""
    paths = own_paths(ckpt)
    if ckpt.directory is not None:
        for folder in sorted({fs.dirname(p) for p in layout_paths(ckpt)}):
            paths += [fs.join(folder, n) for n in sorted(names.listing(folder))
                      if not journal.is_temporary(n)
                      and names.regular_file(fs.join(folder, n))]
    return [p for p in paths if _hashable(p)]


def _hashable(path: str) -> bool:
    """A regular file, or one that is missing (said when it is read); never a
    FIFO or a device, whose reading could block for ever."""
    if fs.is_remote(path):
        return not fs.isdir(path)
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return True  # missing or unreadable: said when it is read


def root_of(ckpt: Checkpoint) -> str:
    """The directory the manifest's file names are relative to: the path
    given when it is a directory, else the one file's folder (or, should a
    file lie outside it, the deepest folder holding them all). A URL's
    files all lie under it."""
    if fs.is_remote(ckpt.path):
        return ckpt.path if fs.isdir(ckpt.path) else fs.dirname(ckpt.path)
    root = ckpt.path if os.path.isdir(ckpt.path) else os.path.dirname(ckpt.path) or "."
    paths = [os.path.abspath(p) for p in _all_paths(ckpt)]
    base = os.path.abspath(root)
    if any(os.path.relpath(p, base).startswith(os.pardir) for p in paths):
        return os.path.commonpath([base, *map(os.path.dirname, paths)])
    return root


def name_in(path: str, root: str) -> str:
    """``path`` relative to ``root``, with ``/`` separators."""
    if fs.is_remote(path):
        return path.removeprefix(root.rstrip("/") + "/")
    return os.path.relpath(os.path.abspath(path), os.path.abspath(root)).replace(os.sep, "/")


def files_of(ckpt: Checkpoint) -> list[str]:
    """Every file of ``ckpt``, relative to ``root_of(ckpt)``, sorted."""
    root = root_of(ckpt)
    return sorted({name_in(p, root) for p in _all_paths(ckpt)})


def holders(ckpt: Checkpoint, root: str) -> dict[str, set[str]]:
    """Per tensor key, the files (relative to ``root``) its bytes are read
    from; an empty set where that is not known."""
    base = ckpt.directory

    def of(t: TensorInfo) -> set[str]:
        if base is None:
            return {name_in(ckpt.path, root)}
        names = {c.file for c in t.chunks}
        if t.file is not None:
            names.add(t.file)
        storage = ckpt.storages.get(t.storage) if t.storage is not None else None
        if storage is not None and storage.file is not None:
            names.add(storage.file)
        for part in t.parts:
            names |= of(part)
        return {name_in(os.path.join(base, n), root) for n in names}

    return {t.key: of(t) for t in ckpt.tensors}


def same_file(a: str, b: str) -> bool:
    """True when ``a`` and ``b`` are one file (or, absent, one path)."""
    if fs.is_remote(a) or fs.is_remote(b):
        return a.rstrip("/") == b.rstrip("/")
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def hash_file(path: str, stop: threading.Event | None = None) -> tuple[int, str]:
    """(size, sha256 hex) of the file at ``path``, read ``FILE_BLOCK`` at a
    time; a URL's as ``verify --full`` read it, else streamed
    (``remotebytes``)."""
    if fs.is_remote(path):
        return _remote_hash(path, stop)
    h = hashlib.sha256()
    size = 0
    buf = bytearray(FILE_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            if stop is not None and stop.is_set():
                raise Stopped(path)
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


_remote: dict[str, tuple[int, str]] = {}  # a URL's (size, sha256), read once a run
_remote_lock = threading.Lock()


def remember(url: str, size: int, sha: str) -> None:
    """The (size, sha256) of a remote file read whole (``verify --full``)."""
    with _remote_lock:
        _remote[url] = (size, sha)


def forget_remote() -> None:
    """Drop the remote hashes kept (a new verify run)."""
    with _remote_lock:
        _remote.clear()


def _remote_hash(url: str, stop: threading.Event | None) -> tuple[int, str]:
    """``hash_file`` of a URL: as read before in this run, else read now,
    ``stream.BLOCK`` bytes a request."""
    from ckptool.read.remote import stream

    with _remote_lock:
        done = _remote.get(url)
    if done is not None:
        return done
    h = hashlib.sha256()
    size = 0
    for _, data in stream.blocks(url):
        if stop is not None and stop.is_set():
            raise Stopped(url)
        h.update(data)
        size += len(data)
    remember(url, size, h.hexdigest())
    return size, h.hexdigest()


class Hashing:
    """``with Hashing({name: path}, jobs) as h``: the files are hashed in the
    background from the start; ``h.result(name)`` waits for one (its
    ``OSError`` raised). Leaving the block stops what is left."""

    def __init__(self, paths: dict[str, str], jobs: int) -> None:
        self.paths = paths
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max(1, jobs),
                                        thread_name_prefix="ckptool-hash")
        self._futures: dict[str, Future[tuple[int, str]]] = {}

    def __enter__(self) -> Hashing:
        def size(name: str) -> int:
            try:
                return fs.getsize(self.paths[name])
            except OSError:
                return 0

        for name in sorted(self.paths, key=size, reverse=True):
            self._futures[name] = self._pool.submit(hash_file, self.paths[name], self._stop)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()  # nothing is left to hash on a normal exit
        self._pool.shutdown(wait=True, cancel_futures=True)

    def result(self, name: str) -> tuple[int, str]:
        """(size, sha256 hex) of file ``name``."""
        return self._futures[name].result()
