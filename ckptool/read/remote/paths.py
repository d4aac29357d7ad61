"""The path a store's filesystem takes for a URL as ckptool shows it: the
URL as given (credentials included: ``urls.real``), without its scheme
where the library wants none, and for the Hub at the commit its revision
names now (``hubrepo.pinned``)."""

from __future__ import annotations

from ckptool.read.remote import hubrepo, stores, urls


def of(scheme: str, url: str) -> str:
    path = stores.strip_protocol(scheme, url)
    return hubrepo.pinned(path) if urls.SCHEMES[scheme] == "hf" else path
