"""A Hugging Face Hub repository as ckptool reads it, at one commit.

- ``pinned``: a revision (``main``, a tag) resolved to its commit once for a
  read, by the one request to the repository's API that also brings the
  Hub's scan (``info``); every listing and range is then asked for that
  commit, so a branch that moves meanwhile is not followed and no two
  commits are mixed.
- ``listing``: the repository tree at that commit, guarded: an entry given
  twice (pages that repeat) or a listing that never ends is an error.
- ``range_get``: bytes of a file from its ``resolve`` URL at that commit,
  checked to be the bytes asked.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

from ckptool.errors import InputError
from ckptool.read.remote import counts, httprange, stores

_SHA = re.compile(r"^[0-9a-f]{40}$")
_infos: dict[tuple[str, str, str], Any] = {}  # (repo type, repo, revision) -> its information
_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}


def pinned(path: str) -> str:
    """``path`` (an ``hf://`` URL without its scheme, as HfFileSystem takes
    it) at the commit its revision names now, resolved once for a read: a
    branch that moves while the files are read is not followed, so no two
    commits are ever mixed."""
    repo = parse(path)
    if repo is None:
        return path  # (a repository named by one word: HfFileSystem resolves it as it is)
    kind, repo_id, revision, inside = repo
    if _SHA.match(revision):
        return path
    sha = info("hf://" + path, kind, repo_id, revision).sha
    return f"{_PREFIX[kind]}{repo_id}@{sha}{inside}"


def parse(path: str) -> tuple[str, str, str, str] | None:
    """(repository type, id, revision, the rest as ``/sub/file`` or "") of a
    Hub path ``[datasets/|spaces/]org/name[@revision][/sub/file]``; None
    for one it cannot split so (a repository of one word)."""
    kind = "model"
    for k, prefix in _PREFIX.items():
        if prefix and path.startswith(prefix):
            kind, path = k, path[len(prefix):]
    org, _, rest = path.partition("/")
    if not org or "@" in org or not rest:
        return None
    name, _, after = rest.partition("/")
    name, _, revision = name.partition("@")
    revision = unquote(revision) if revision else "main"
    return kind, f"{org}/{name}", revision, f"/{after}" if after else ""


def info(url: str, kind: str, repo_id: str, revision: str) -> Any:
    """The repository's information at ``revision`` (its commit; for a
    model, the Hub's scan too): one request, once for a read."""
    key = (kind, repo_id, revision)
    if key not in _infos:
        from huggingface_hub import HfApi

        fs = stores.filesystem("hf")
        api = HfApi(endpoint=fs.endpoint, token=fs.token)
        counts.request()
        with stores.failures(url):
            _infos[key] = (api.model_info(repo_id, revision=revision, securityStatus=True)
                           if kind == "model" else
                           api.repo_info(repo_id, revision=revision, repo_type=kind))
    return _infos[key]


def forget() -> None:
    """Resolve revisions again (a new read)."""
    _infos.clear()


MAX_LISTED = 2_000_000  # entries of one repository listing, at most


def listing(path: str) -> dict[str, dict[str, Any]]:
    """Every file and folder under ``path`` (a pinned Hub path), as fsspec's
    ``find(detail=True, withdirs=True)`` gives them, from the repository
    tree the Hub pages through. A listing that gives an entry twice (a
    next page that is one already read) or never ends is an error, not a
    loop; a path that names a file gives nothing (its details come alone)."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    repo = parse(path)
    if repo is None:  # (a repository named by one word: HfFileSystem's own listing)
        return dict(stores.filesystem("hf").find(path, detail=True, withdirs=True))
    kind, repo_id, revision, inside = repo
    fs = stores.filesystem("hf")
    base = f"{_PREFIX[kind]}{repo_id}@{revision}"
    found: dict[str, dict[str, Any]] = {}
    entries = HfApi(endpoint=fs.endpoint, token=fs.token).list_repo_tree(
        repo_id, inside.lstrip("/") or None, recursive=True, revision=revision, repo_type=kind)
    try:
        for item in entries:
            name = f"{base}/{item.path}"
            if name in found or len(found) >= MAX_LISTED:
                raise InputError(
                    f"hf://{path}: the Hub's listing "
                    + ("gives an entry twice (its pages repeat)" if name in found else
                       f"goes on past {MAX_LISTED:,} entries"),
                    "check HF_ENDPOINT: the server does not list repositories as the Hub does")
            lfs = getattr(item, "lfs", None)
            found[name] = {"name": name, "size": getattr(item, "size", 0) or 0,
                           "type": "file" if isinstance(item, RepoFile) else "directory",
                           "lfs": {"sha256": lfs.sha256} if lfs is not None else None}
    except Exception as exc:  # a path that names a file, not a folder: its folder's entry
        if type(exc).__name__ not in ("EntryNotFoundError", "RemoteEntryNotFoundError") and \
                getattr(getattr(exc, "response", None), "status_code", None) != 404:
            raise
        if not inside:
            return {}
        parent = inside.strip("/").rpartition("/")[0]
        name = f"{base}{inside}"
        for item in HfApi(endpoint=fs.endpoint, token=fs.token).list_repo_tree(
                repo_id, parent or None, revision=revision, repo_type=kind):
            if f"{base}/{item.path}" == name and isinstance(item, RepoFile):
                lfs = getattr(item, "lfs", None)
                return {name: {"name": name, "size": item.size or 0, "type": "file",
                               "lfs": {"sha256": lfs.sha256} if lfs is not None else None}}
        return {}
    return found


def range_get(path: str, start: int, end: int, size: int) -> bytes:
    """Bytes [start, end) of the file (of ``size`` bytes) at the pinned Hub
    path ``path``: one GET of its ``resolve`` URL at that commit (redirected
    to the CDN for an LFS file), checked to be exactly those bytes
    (``httprange.check``; the commit pins the version, not an ETag)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import hf_hub_url
    from huggingface_hub.utils import hf_raise_for_status, http_backoff

    repo = parse(path)
    fs = stores.filesystem("hf")
    if repo is None:
        return bytes(fs.cat_file(path, start=start, end=end, cache_type="none"))
    kind, repo_id, revision, inside = repo
    url = hf_hub_url(repo_id, inside.lstrip("/"), repo_type=kind, revision=revision,
                     endpoint=fs.endpoint)
    headers = {"range": f"bytes={start}-{end - 1}", **fs._api._build_hf_headers()}
    r = http_backoff("GET", url, headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT)
    hf_raise_for_status(r)
    httprange.check(f"hf://{path}", r.status_code, r.headers, start, end, size, None)
    return bytes(r.content)
