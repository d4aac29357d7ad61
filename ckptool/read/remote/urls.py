"""Which paths are URLs, and how a URL is shown.

A URL is ``scheme://...`` with a scheme ckptool reads (``SCHEMES``); any
other string is a local path, so a local file named ``s3:`` still opens as
one when written ``./s3:``. A URL is shown without its user, password or
query string (a presigned URL's signature is a credential).
"""

from __future__ import annotations

import re

# the schemes read, and the extra that installs each one's library
SCHEMES = {"hf": "hf", "s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs",
           "http": "http", "https": "http"}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def scheme_of(path: str) -> str | None:
    """The (lower-case) scheme of ``path`` when it is a URL ckptool reads."""
    found = _URL.match(path)
    if found is None:
        return None
    scheme = found.group(1).lower()
    return scheme if scheme in SCHEMES else None


def is_url(path: object) -> bool:
    return isinstance(path, str) and scheme_of(path) is not None


def looks_like_url(path: str) -> str | None:
    """The scheme of a ``scheme://`` path ckptool does not read, for the error."""
    found = _URL.match(path)
    if found is None or found.group(1).lower() in SCHEMES:
        return None
    return found.group(1)


def shown(url: str) -> str:
    """``url`` as it may be printed: no user, password, query or fragment."""
    if not is_url(url):
        return url
    from urllib.parse import urlsplit, urlunsplit  # (URLs only: not on a local path's start)

    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host += f":{parts.port}"
    netloc = host if "@" in parts.netloc else parts.netloc
    if parts.scheme.lower() == "hf":  # hf://org/model@rev: the @ is a revision, not a user
        netloc = parts.netloc
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


_secret: dict[str, str] = {}  # a URL as shown -> as given (with its credentials)


def hide(url: str) -> str:
    """``url`` as it is shown, remembering the URL as given: every request
    is made to the URL as given (``real``), every message, report and file
    name says it as shown. A user and password carry over to the other
    files of its host (an index's shards); a query string (a presigned
    URL's signature) belongs to that one file."""
    if not is_url(url):
        return url
    seen = shown(url)
    if seen != url:
        _secret[seen] = url
    return seen


def forget_hidden() -> None:
    """Forget the URLs given with credentials (a test, a new session)."""
    _secret.clear()


def real(url: str) -> str:
    """The URL to request for ``url`` as shown (itself if nothing is hidden)."""
    if url in _secret:
        return _secret[url]
    from urllib.parse import urlsplit, urlunsplit

    for seen, given in _secret.items():  # a file beside one given with a user and password
        parts, seen_parts = urlsplit(given), urlsplit(seen)
        if parts.username and (url.startswith(seen_parts.scheme + "://" + seen_parts.netloc + "/")):
            return urlunsplit((parts.scheme, parts.netloc, urlsplit(url).path, "", ""))
    return url


def join(base: str, name: str) -> str:
    """``name`` inside the folder ``base`` (a URL): ``base/name``."""
    return base.rstrip("/") + "/" + name.lstrip("/")


def parent(url: str) -> str:
    """The folder ``url`` is in (never above the scheme and first component)."""
    head, _, rest = url.partition("://")
    if "/" not in rest.rstrip("/"):
        return url.rstrip("/")
    return head + "://" + rest.rstrip("/").rsplit("/", 1)[0]


def name(url: str) -> str:
    """The last component of ``url``."""
    return url.rstrip("/").rsplit("/", 1)[-1]
