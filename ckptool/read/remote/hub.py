"""The Hugging Face Hub's side of an ``hf://`` read.

- ``pinned``: a revision (``main``, a tag) resolved to its commit once, by
  one request to the repository's API, and every listing and range read at
  that commit: a branch that moves meanwhile is not followed.
- ``scan``: the Hub's own scan of the repository, from that same answer,
  and ``sha256s``: each LFS file's sha256, from the listing ckptool made
  anyway. Both are shown beside ckptool's verdict, never instead of it: the
  Hub's scanners flag names they know, ckptool models what the loader does.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

from ckptool.read.remote import counts, stores, tree, urls


def sha256s(urls_: list[str]) -> dict[str, str]:
    """The store's sha256 of each of these remote files that has one."""
    out = {}
    for url in urls_:
        scheme = urls.scheme_of(url)
        if scheme is None:
            continue
        entry = tree.tree(scheme).entry(url)
        if entry is not None and entry.sha256:
            out[url] = entry.sha256
    return out


def scan(url: str) -> dict[str, Any] | None:
    """The Hub's security scan of the repository ``url`` is in, as its API
    gives it (``scansDone``, ``filesWithIssues``...); None where it gives
    none (another store, an endpoint without scans). Asked with the commit
    its revision names (``pinned``): no request of its own."""
    if urls.scheme_of(url) != "hf":
        return None
    repo = _parse(stores.filesystem("hf")._strip_protocol(urls.real(url)))
    if repo is None or repo[0] != "model":
        return None
    found = _info(url, *repo[:3])
    status = getattr(found, "security_repo_status", None)
    return status if isinstance(status, dict) else None


_SHA = re.compile(r"^[0-9a-f]{40}$")
_infos: dict[tuple[str, str, str], Any] = {}  # (repo type, repo, revision) -> its information
_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}


def pinned(path: str) -> str:
    """``path`` (an ``hf://`` URL without its scheme, as HfFileSystem takes
    it) at the commit its revision names now, resolved once for a read: a
    branch that moves while the files are read is not followed, so no two
    commits are ever mixed."""
    repo = _parse(path)
    if repo is None:
        return path  # (a repository named by one word: HfFileSystem resolves it as it is)
    kind, repo_id, revision, inside = repo
    if _SHA.match(revision):
        return path
    sha = _info("hf://" + path, kind, repo_id, revision).sha
    return f"{_PREFIX[kind]}{repo_id}@{sha}{inside}"


def _parse(path: str) -> tuple[str, str, str, str] | None:
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


def _info(url: str, kind: str, repo_id: str, revision: str) -> Any:
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
