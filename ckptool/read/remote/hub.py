"""What the Hugging Face Hub says of the files of a repository it serves:
each LFS file's sha256 (from the listing ckptool made anyway) and the
Hub's own scan of the repository (one request to its API), shown beside
ckptool's verdict, never instead of it: the Hub's scanner lists names it
knows to be dangerous, ckptool models what the loader does."""

from __future__ import annotations

from typing import Any

from ckptool.errors import InputError
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
    none (another store, an endpoint without scans)."""
    if urls.scheme_of(url) != "hf":
        return None
    fs = stores.filesystem("hf")
    with stores.failures(url):
        resolved = fs.resolve_path(stores.strip_protocol("hf", url))
        if getattr(resolved, "repo_type", "model") != "model":
            return None
        from huggingface_hub import HfApi

        counts.request()
        try:
            info = HfApi(endpoint=fs.endpoint, token=fs.token).model_info(
                resolved.repo_id, revision=resolved.revision, securityStatus=True)
        except InputError:
            raise
        except Exception as exc:  # the scan is an extra: its failure is said, not fatal
            return {"error": stores.refused(url, exc).message}
    status = getattr(info, "security_repo_status", None)
    return status if isinstance(status, dict) else None
