"""What the Hugging Face Hub says of a repository it serves, shown beside
ckptool's verdict, never instead of it (the Hub's scanners flag names they
know, ckptool models what the loader does): each LFS file's sha256, from
the listing ckptool made anyway (``sha256s``), and the Hub's own scan of
the repository, from the answer that pinned its commit (``scan``).
"""

from __future__ import annotations

from typing import Any

from ckptool.read.remote import hubrepo, stores, tree, urls


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
    repo = hubrepo.parse(stores.filesystem("hf")._strip_protocol(urls.real(url)))
    if repo is None or repo[0] != "model":
        return None
    found = hubrepo.info(url, *repo[:3])
    status = getattr(found, "security_repo_status", None)
    return status if isinstance(status, dict) else None
