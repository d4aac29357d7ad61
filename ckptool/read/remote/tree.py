"""What a remote folder holds, from one listing.

A command asks many questions of a checkpoint's folder (is this a
directory, which files are in it, how large is each): locally each is a
system call, remotely each would be a request. A ``Tree`` answers them
from listings made once: the folder a command names is listed whole
(recursively) on first use, any other folder (a parent holding a
``latest`` file) when it is first asked about. HTTPS has no listing: a
file's details come from a HEAD request, once per file.

Entries keep what pins a file's version (an S3 version id or ETag, a GCS
generation, an HTTP ETag): ``rfile`` reads every range of that version
and refuses a file that changed meanwhile.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from ckptool.read.remote import counts, hubrepo, paths, stores, urls


@dataclass(frozen=True)
class Entry:
    url: str
    directory: bool
    size: int = 0
    version: dict[str, str] = field(default_factory=dict, compare=False)
    sha256: str | None = None  # the store's own hash of the file (the Hub's LFS)


class Tree:
    """The entries of remote folders of one scheme, listed on demand."""

    def __init__(self, scheme: str) -> None:
        self.scheme = scheme
        self.listable = urls.SCHEMES[scheme] != "http"
        self._entries: dict[str, Entry | None] = {}
        self._deep: set[str] = set()  # folders listed recursively: every entry below is known
        self._lock = threading.RLock()

    def entry(self, url: str) -> Entry | None:
        """What is at ``url`` (None: nothing). A folder not known yet is
        listed whole, as it will be read; a file is looked up alone."""
        url = url.rstrip("/") or url
        with self._lock:
            if url in self._entries:
                return self._entries[url]
            if self._known_absent(url):
                return None
            if self.listable:
                self._list(url)
                if url in self._entries:
                    return self._entries[url]
            found = self._info(url)
            self._entries[url] = found
            return found

    def children(self, url: str) -> list[Entry]:
        """The entries directly inside the folder ``url`` (listed if need be)."""
        url = url.rstrip("/")
        with self._lock:
            if self.listable:
                self._list(url)
            prefix = url + "/"
            return [e for u, e in self._entries.items() if e is not None
                    and u.startswith(prefix) and "/" not in u[len(prefix):]]

    def _known_absent(self, url: str) -> bool:
        folder = url
        while True:
            up = urls.parent(folder)
            if up == folder:
                return False
            if up in self._deep:
                return True
            folder = up

    def _info(self, url: str) -> Entry | None:
        fs = stores.filesystem(self.scheme)
        path = paths.of(self.scheme, url)
        counts.request()
        try:
            with stores.failures(url):
                info = stores.retrying(lambda: fs.info(path), url)
        except stores.InputError as exc:
            if exc.message == stores.not_found(url).message:
                return None
            raise
        return _entry(url, info)

    def _list(self, url: str) -> None:
        """List the folder ``url`` recursively; a file there is recorded as one."""
        if url in self._deep:
            return
        fs = stores.filesystem(self.scheme)
        path = paths.of(self.scheme, url).rstrip("/")
        counts.request(listing=True)
        with stores.failures(url):
            try:
                found = stores.retrying(lambda: _found(fs, self.scheme, path), url)
            except FileNotFoundError:
                found = {}
        inside = False
        for name, info in found.items():
            rel = str(name).rstrip("/")
            if rel == path:  # the URL names a file
                if info.get("type") != "directory":
                    self._entries[url] = _entry(url, info)
                continue
            if not rel.startswith(path + "/"):
                continue
            inside = True
            child = urls.join(url, rel[len(path) + 1:])
            self._entries[child] = _entry(child, info)
            up = urls.parent(child)
            # folders a store lists only by the files in them
            while up != url and up.startswith(url + "/"):
                self._entries.setdefault(up, Entry(up, True))
                self._deep.add(up)
                up = urls.parent(up)
            if self._entries[child].directory:  # type: ignore[union-attr]
                self._deep.add(child)
        if inside:
            self._entries[url] = Entry(url, True)
            self._deep.add(url)


def _found(fs: Any, scheme: str, path: str) -> dict[str, Any]:
    """Everything under ``path``, files and folders, with their details."""
    if urls.SCHEMES[scheme] == "hf":  # (guarded against listings that never end)
        return hubrepo.listing(path)
    return dict(fs.find(path, detail=True, withdirs=True))


def _entry(url: str, info: dict[str, Any]) -> Entry:
    directory = info.get("type") == "directory"
    version = {k: str(info[k]) for k in ("VersionId", "ETag", "etag", "generation")
               if info.get(k) not in (None, "", "null")}
    lfs = info.get("lfs")
    sha = lfs.get("sha256") if isinstance(lfs, dict) else None
    return Entry(url, directory, int(info.get("size") or 0), version, sha)


_trees: dict[str, Tree] = {}
_trees_lock = threading.Lock()


def tree(scheme: str) -> Tree:
    with _trees_lock:
        if scheme not in _trees:
            _trees[scheme] = Tree(scheme)
        return _trees[scheme]


def forget() -> None:
    """Drop every listing (a new command, or a test, starts afresh)."""
    with _trees_lock:
        _trees.clear()
