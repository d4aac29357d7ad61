"""A Hugging Face cache snapshot's files against their blobs' names, and the
downloads left unfinished beside them.

huggingface_hub keeps each file of a repository once, in
``<cache>/models--org--name/blobs/<etag>``, and a revision as a folder of
links to them (``snapshots/<commit>/config.json -> ../../blobs/<etag>``).
The etag is the content's own hash: the sha256 of an LFS file (64 hex
digits: the weights), git's SHA-1 of ``blob <size>\\0<content>`` for a small
one (40 hex digits). A blob whose content no longer hashes to its name was
damaged after it was downloaded (or replaced); a link whose blob is gone
leaves the file missing; ``blobs/<etag>[.<id>].incomplete`` is a download
that was killed before its end.

Blobs are hashed on ``jobs`` threads (``hashlib`` releases the GIL), each
read once, in 8 MiB pieces; within ``remembered()`` a file's digest is
kept, for ``hubsnapshot`` (``verify --against-hub``) to ask again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ckptool.check.verify.problems import (
    BLOB_HASH,
    INCOMPLETE,
    MISSING_FILE,
    UNREADABLE,
    Problem,
)
from ckptool.describe import human_bytes, shell_word
from ckptool.errors import InputError
from ckptool.read import fs

REPO_DIR = re.compile(r"^(models|datasets|spaces)--.+")
SHA256, GIT_SHA1 = re.compile(r"^[0-9a-f]{64}$"), re.compile(r"^[0-9a-f]{40}$")
PIECE = 8 << 20


@dataclass(frozen=True)
class Snapshot:
    """Where a path sits in a Hugging Face cache."""

    repo: str  # the repository's folder (models--org--name)
    directory: str  # the snapshot's folder (snapshots/<commit>)
    target: str  # what is verified: the snapshot, or a file or folder in it


@dataclass
class CacheCheck:
    problems: list[Problem] = field(default_factory=list)
    checked: int = 0  # bytes hashed
    missing: set[str] = field(default_factory=set)  # files whose blob is gone
    hashed: set[str] = field(default_factory=set)  # files checked against their blob's name


def locate(path: str) -> Snapshot | None:
    """The snapshot ``path`` is (or is in); a repository's folder stands for
    the snapshot its ``refs/main`` names. None outside a cache."""
    if fs.is_remote(path):  # a cache is a local folder
        return None
    full = os.path.abspath(path)  # (links are not followed: a snapshot's files are links)
    if REPO_DIR.match(os.path.basename(full)) and os.path.isdir(os.path.join(full, "snapshots")):
        snapshot = _current(full)
        return Snapshot(full, snapshot, snapshot)
    at = full
    while True:
        parent = os.path.dirname(at)
        if parent == at:
            return None
        repo = os.path.dirname(parent)
        if os.path.basename(parent) == "snapshots" and REPO_DIR.match(os.path.basename(repo)) \
                and os.path.isdir(at):
            return Snapshot(repo, at, path)
        at = parent


def _current(repo: str) -> str:
    """The snapshot ``refs/main`` names, or the repository's only one."""
    snapshots = os.path.join(repo, "snapshots")
    try:
        with open(os.path.join(repo, "refs", "main"), encoding="utf-8") as f:
            commit = f.read().strip()
        if commit and "/" not in commit and os.path.isdir(os.path.join(snapshots, commit)):
            return os.path.join(snapshots, commit)
    except (OSError, UnicodeDecodeError):
        pass
    found = sorted(n for n in os.listdir(snapshots) if os.path.isdir(os.path.join(snapshots, n)))
    if len(found) == 1:
        return os.path.join(snapshots, found[0])
    if not found:
        raise InputError(f"{repo} is a Hugging Face cache folder with no snapshot in it",
                         "download the model again (huggingface_hub.snapshot_download)")
    raise InputError(f"{repo} holds {len(found)} snapshots and no refs/main naming one",
                     f"name the one to verify: ckptool verify "
                     f"{shell_word(os.path.join(snapshots, found[-1]))}")


def check(snapshot: Snapshot, jobs: int) -> CacheCheck:
    """Every file of ``snapshot.target`` against its blob's name, and the
    repository's unfinished downloads. File names are relative to the
    target's folder (the target's own folder for a file), as the rest of
    verify names them."""
    out = CacheCheck()
    target = snapshot.target
    base = target if os.path.isdir(target) else os.path.dirname(target)
    blobs = os.path.join(snapshot.repo, "blobs")
    to_hash: dict[str, list[str]] = {}  # blob -> the files linking to it
    for entry in entries(target):
        name = os.path.relpath(entry, base)
        if not os.path.islink(entry):
            continue  # a copy, not a link (no symlinks on this system): nothing names it
        try:
            blob = os.path.normpath(os.path.join(os.path.abspath(os.path.dirname(entry)),
                                                 os.readlink(entry)))
        except OSError:
            continue
        if os.path.dirname(blob) != os.path.normpath(os.path.abspath(blobs)):
            continue
        if not os.path.exists(blob):
            out.missing.add(name)
            out.problems.append(Problem(MISSING_FILE, f"it links to blobs/{os.path.basename(blob)}"
                                        ", which is gone (deleted, or the cache was cleaned)",
                                        name))
        elif SHA256.match(os.path.basename(blob)) or GIT_SHA1.match(os.path.basename(blob)):
            to_hash.setdefault(blob, []).append(name)
    with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="ckptool-hash") as pool:
        results = list(pool.map(_digest, to_hash))
    for (blob, names), (got, size) in zip(to_hash.items(), results, strict=True):
        want = os.path.basename(blob)
        if size < 0:  # (got: why it could not be read)
            out.problems += [Problem(UNREADABLE, f"its blob {want[:12]}… cannot be read ({got})",
                                     name) for name in names]
            continue
        out.checked += size
        out.hashed.update(names)
        if got != want:
            for name in names:
                out.problems.append(Problem(
                    BLOB_HASH, f"its blob {want[:12]}… ({human_bytes(size)}) hashes to "
                    f"{got[:12]}…, not to its name: the file changed after it was downloaded",
                    name))
    if os.path.isdir(target):  # (one file of it was downloaded whole: it is there)
        out.problems += _incomplete(snapshot.repo)
    return out


def entries(target: str) -> list[str]:
    """``target`` itself, or every file and link under it."""
    if not os.path.isdir(target):
        return [target]
    out = []
    for folder, dirs, files in os.walk(target):
        dirs.sort()
        out += [os.path.join(folder, n) for n in sorted(files)]
    return out


def _digest(blob: str) -> tuple[str, int]:
    """The hash a blob is named by (sha256, or git's SHA-1 for a 40-digit
    name) of its content, and its size; or why it cannot be read, and -1."""
    return digest(blob, git=bool(GIT_SHA1.match(os.path.basename(blob))))


Stamp = tuple[int, int, int, int, int]
_remembered: list[dict[tuple[str, bool], tuple[Stamp, str, int]]] = []


@contextlib.contextmanager
def remembered() -> Iterator[None]:
    """Within it, each file is hashed once: ``verify --against-hub`` asks
    again for the digests of the blobs the cache check hashed. A file
    changed meanwhile (device, inode, size, mtime or ctime) is hashed again."""
    _remembered.append({})
    try:
        yield
    finally:
        _remembered.pop()


def remembers(path: str, git: bool) -> bool:
    """Whether ``digest(path, git)`` is known already, unchanged (within
    ``remembered()``)."""
    memo = _remembered[-1] if _remembered else None
    try:
        st = os.stat(path)
    except OSError:
        return False
    known = memo.get((os.path.realpath(path), git)) if memo is not None else None
    return known is not None and known[0] == (st.st_dev, st.st_ino, st.st_size,
                                              st.st_mtime_ns, st.st_ctime_ns)


def digest(path: str, git: bool) -> tuple[str, int]:
    """The sha256 (``git``: git's SHA-1 of ``blob <size>\\0<content>``, a
    small file's id on the Hub) of the content of ``path`` (a link is
    followed), and its size; or why it cannot be read, and -1."""
    buf = bytearray(PIECE)
    view = memoryview(buf)
    done = 0
    memo = _remembered[-1] if _remembered else None
    try:
        with open(path, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            key = (os.path.realpath(path), git)
            stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            known = memo.get(key) if memo is not None else None
            if known is not None and known[0] == stamp:
                return known[1], known[2]
            if git:
                h = hashlib.sha1(usedforsecurity=False)
                h.update(b"blob %d\0" % st.st_size)
            else:
                h = hashlib.sha256()
            while n := f.readinto(buf):
                h.update(view[:n])
                done += n
    except OSError as exc:
        return exc.strerror or str(exc), -1
    if memo is not None:
        memo[key] = (stamp, h.hexdigest(), done)
    return h.hexdigest(), done


def _incomplete(repo: str) -> list[Problem]:
    """``blobs/*.incomplete``: downloads killed before their end."""
    blobs = os.path.join(repo, "blobs")
    try:
        names = sorted(n for n in os.listdir(blobs) if n.endswith(".incomplete"))
    except OSError:
        return []
    out = []
    for n in names:
        try:
            size = os.path.getsize(os.path.join(blobs, n))
        except OSError:
            continue
        out.append(Problem(INCOMPLETE, f"a download killed before its end ({human_bytes(size)} "
                           f"of blob {n.split('.')[0][:12]}… written): download the model "
                           "again", f"{os.path.basename(repo)}/blobs/{n}"))
    return out
