"""``verify --against-hub``: a Hugging Face cache snapshot against the Hub's
own listing of the same commit.

A snapshot's folder is named by its commit and sits in the repository's
folder (``models--org--name/snapshots/<commit>``): the Hub is asked once
for that repository at that commit (its information: the repository and
the commit exist) and once for its files (the tree, recursively, paged as
the Hub pages it), with the endpoint and token ckptool reads ``hf://``
with. No file's bytes are downloaded. Then every file the Hub lists must
be in the snapshot, every file in the snapshot must be listed, with the
size listed, and its content must hash to what the Hub gives: an LFS
file's sha256, a small file's git blob id. The content is hashed here
(the digests the cache check computed are reused: ``hfcache.digest``),
never taken from the blob's name. A file whose blob is gone, or whose
blob does not hash to its name, is said once, by the cache check.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ckptool.check.verify import hfcache
from ckptool.check.verify.problems import (
    BLOB_HASH,
    EXTRA_FILE,
    MISSING_FILE,
    SIZE,
    UNREADABLE,
    Problem,
)
from ckptool.describe import plural
from ckptool.errors import InputError, UsageError
from ckptool.read.remote import hubrepo, stores

_KINDS = {"models": "model", "datasets": "dataset", "spaces": "space"}
_URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}


@dataclass(frozen=True)
class Listed:
    """One commit of a repository, as the Hub lists it."""

    kind: str  # model, dataset, space
    repo_id: str  # org/name
    commit: str
    # path in the repository -> (size, the LFS file's sha256 or None, git blob id)
    files: dict[str, tuple[int, str | None, str]]

    @property
    def url(self) -> str:
        return f"hf://{_URL_PREFIX[self.kind]}{self.repo_id}@{self.commit}"


def repository(snapshot: hfcache.Snapshot) -> tuple[str, str, str]:
    """(repository type, id, commit) of a snapshot, from its folders' names."""
    folder = os.path.basename(snapshot.repo)
    prefix, _, rest = folder.partition("--")
    parts = rest.split("--")
    commit = os.path.basename(snapshot.directory)
    if prefix not in _KINDS or not 1 <= len(parts) <= 2 or not all(parts):
        raise UsageError(f"--against-hub: {folder} is not named as huggingface_hub names a "
                         "repository's folder (models--org--name)",
                         "give a snapshot of a cache huggingface_hub wrote")
    if not hfcache.GIT_SHA1.match(commit):
        raise UsageError(f"--against-hub: the snapshot folder {commit} is not named by a "
                         "commit (40 hex digits), as huggingface_hub names them",
                         f"give one of {os.path.join(snapshot.repo, 'snapshots')}/<commit>")
    return _KINDS[prefix], "/".join(parts), commit


def listing(snapshot: hfcache.Snapshot) -> Listed:
    """The Hub's files at the snapshot's commit: one request for the
    repository's information, one listing (paged). The Hub unreachable, the
    repository or the commit unknown to it: ``InputError`` (exit 3)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RevisionNotFoundError

    kind, repo_id, commit = repository(snapshot)
    url = Listed(kind, repo_id, commit, {}).url
    fs = stores.filesystem("hf")  # (huggingface_hub missing: a usage error naming the extra)
    api = HfApi(endpoint=fs.endpoint, token=fs.token)
    with stores.failures(url):  # (a refused connection, a timeout: said there)
        try:
            info = stores.retrying(
                lambda: api.repo_info(repo_id, revision=commit, repo_type=kind), url)
        except RevisionNotFoundError:
            raise InputError(f"{url}: the Hub's {repo_id} has no commit {commit}",
                             "the snapshot is of a commit the Hub no longer has (a history "
                             "rewritten) or of another endpoint (HF_ENDPOINT); download "
                             f"the model again: hf download {repo_id}") from None
        if getattr(info, "sha", None) != commit:
            raise InputError(f"{url}: the Hub answered for commit "
                             f"{getattr(info, 'sha', None)}, not {commit}",
                             "check HF_ENDPOINT: the server does not answer as the Hub does")
        files = stores.retrying(lambda: _files(api, kind, repo_id, commit, url), url)
    return Listed(kind, repo_id, commit, files)


def _files(api: Any, kind: str, repo_id: str, commit: str,
           url: str) -> dict[str, tuple[int, str | None, str]]:
    """Every file of the repository's tree at ``commit``; a listing that
    repeats an entry or never ends is an error, not a loop (as ``hub.listing``)."""
    from huggingface_hub.hf_api import RepoFile

    out: dict[str, tuple[int, str | None, str]] = {}
    seen: set[str] = set()
    for item in api.list_repo_tree(repo_id, recursive=True, revision=commit, repo_type=kind):
        if item.path in seen or len(seen) >= hubrepo.MAX_LISTED:
            raise InputError(
                f"{url}: the Hub's listing " + (
                    "gives an entry twice (its pages repeat)" if item.path in seen else
                    f"goes on past {hubrepo.MAX_LISTED:,} entries"),
                "check HF_ENDPOINT: the server does not list repositories as the Hub does")
        seen.add(item.path)
        if isinstance(item, RepoFile):
            lfs = item.lfs.sha256 if item.lfs is not None else None
            out[item.path] = (item.size or 0, lfs, item.blob_id)
    return out


def compare(snapshot: hfcache.Snapshot, listed: Listed,
            jobs: int) -> tuple[list[Problem], dict[str, Any], int]:
    """The snapshot's files (those under its target: the snapshot, or a
    file or folder of it) against ``listed``: its problems, the JSON's
    ``hub`` object, and the bytes hashed here that were not hashed before.
    Files are named relative to the target's folder, as verify names them."""
    target = snapshot.target
    base = target if os.path.isdir(target) else os.path.dirname(target)
    inside = os.path.relpath(target, snapshot.directory).replace(os.sep, "/")

    def named(path: str) -> str:  # a path in the repository, as verify names it
        return os.path.relpath(os.path.join(snapshot.directory, path), base)

    wanted = {p: f for p, f in listed.files.items()
              if inside == "." or p == inside or p.startswith(inside + "/")}
    local = {os.path.relpath(e, snapshot.directory).replace(os.sep, "/"): e
             for e in hfcache.entries(target)}
    at = f"at commit {listed.commit[:12]}…"
    problems = [Problem(MISSING_FILE, f"the Hub lists it {at} ({plural(size, 'byte')}); it is "
                        "not in the snapshot (not downloaded, or deleted)", named(path))
                for path, (size, _, _) in sorted(wanted.items()) if path not in local]
    problems += [Problem(EXTRA_FILE, f"in the snapshot, but the Hub does not list it {at}",
                         named(path)) for path in sorted(local) if path not in wanted]
    to_hash: list[tuple[str, str, bool, str]] = []  # (path, local file, git, what the Hub says)
    for path, entry in sorted(local.items()):
        if path not in wanted or not os.path.exists(entry):
            continue  # (a link whose blob is gone: the cache check said it)
        size, sha256, blob_id = wanted[path]
        here = os.path.getsize(entry)
        if here != size:
            problems.append(Problem(SIZE, f"{plural(here, 'byte')} here; the Hub lists "
                                    f"{plural(size, 'byte')} {at}", named(path)))
        else:
            to_hash.append((path, entry, sha256 is None, sha256 or blob_id))
    with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="ckptool-hash") as pool:
        fresh = {e: not hfcache.remembers(e, git) for _, e, git, _ in to_hash}
        digests = list(pool.map(lambda t: hfcache.digest(t[1], t[2]), to_hash))
    hashed = 0
    for (path, entry, git, want), (got, size) in zip(to_hash, digests, strict=True):
        if size < 0:
            problems.append(Problem(UNREADABLE, f"it cannot be read ({got})", named(path)))
            continue
        hashed += size if fresh[entry] else 0
        # (a blob that does not hash to its name: said once, by the cache check)
        said = _named_by(snapshot, entry, git) and os.path.basename(
            os.path.realpath(entry)) != got
        if got != want and not said:
            what = "git blob id" if git else "sha256"
            problems.append(Problem(BLOB_HASH, f"its {what} is {got[:12]}…, the Hub lists "
                                    f"{want[:12]}… {at}: not the file of that commit",
                                    named(path)))
    summary = {"url": listed.url, "repo": listed.repo_id, "repo_type": listed.kind,
               "commit": listed.commit, "files_listed": len(wanted),
               "files_compared": len(to_hash),
               "sha256_compared": sum(1 for t in to_hash if not t[2])}
    return problems, summary, hashed


def _named_by(snapshot: hfcache.Snapshot, entry: str, git: bool) -> bool:
    """Whether the cache check hashed this file's blob as the Hub does and
    compared it with its name: a link to ``blobs/<name>``, the name a hash
    of that kind."""
    blob = os.path.realpath(entry)
    return os.path.islink(entry) and os.path.dirname(blob) == os.path.realpath(
        os.path.join(snapshot.repo, "blobs")) and bool(
        (hfcache.GIT_SHA1 if git else hfcache.SHA256).match(os.path.basename(blob)))
