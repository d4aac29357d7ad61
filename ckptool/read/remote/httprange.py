"""One range of a file over HTTP(S), checked as fsspec's ``cat_file`` does
not: the answer must be ``206 Partial Content`` for exactly the bytes asked
(its ``Content-Range``), of a file of the size listed, with the ETag listed
where the server gives one (compared weakly: a weak ETag still says a file
changed); its body exactly that long. A server that ignores ``Range`` and
starts sending the whole file (a ``200``) is refused after its headers, not
read to the end: a 100 GB body is never pulled into memory.
"""

from __future__ import annotations

import re
from typing import Any

from ckptool.errors import CorruptCheckpointError, InputError
from ckptool.read.remote import urls

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
CHUNK = 1 << 20


class Changed(InputError):
    """The file is not the version first listed any more."""


def get(fs: Any, url: str, start: int, end: int, size: int, etag: str | None) -> bytes:
    """Bytes [start, end) of ``url`` (a file of ``size`` bytes listed with
    ``etag``), through the session of fsspec's HTTP filesystem ``fs``."""
    from fsspec.asyn import sync

    headers = {"Range": f"bytes={start}-{end - 1}"}
    if etag and not etag.startswith("W/"):
        headers["If-Match"] = etag

    async def fetch() -> bytes:
        session = await fs.set_session()
        async with session.get(fs.encode_url(url), headers=headers, **fs.kwargs) as r:
            if r.status == 404:
                raise FileNotFoundError(url)
            if r.status == 412:
                raise _changed(url)
            r.raise_for_status()
            check(url, r.status, r.headers, start, end, size, etag)
            return await _body(url, r, end - start)

    return bytes(sync(fs.loop, fetch))


def check(url: str, status: int, headers: Any, start: int, end: int, size: int,
          etag: str | None) -> None:
    """Refuse an answer to a request for bytes [start, end) of ``url`` (a
    file of ``size`` bytes listed with ``etag``) that is not those bytes of
    that file: its status, ``Content-Range`` and ETag (the Hub's answers
    too: ``hubrepo.range_get``)."""
    shown = urls.shown(url)
    if status != 206:
        if status == 200 and start == 0 and end == size:
            return  # the whole file, asked for whole
        raise InputError(f"{shown}: the server answered {status} to a range request, not 206",
                         "it does not serve byte ranges: download the file, then name the "
                         "local copy")
    found = _CONTENT_RANGE.match(headers.get("Content-Range", "").strip())
    if found is None or (int(found.group(1)), int(found.group(2)) + 1) != (start, end):
        raise CorruptCheckpointError(
            f"{shown}: asked for bytes {start}-{end - 1}, the server sent "
            f"{headers.get('Content-Range') or 'no Content-Range'}",
            "the server answers ranges wrongly: download the file, then name the local copy")
    total = found.group(3)
    now = headers.get("ETag")
    if (total != "*" and int(total) != size) or (etag and now and _weak(now) != _weak(etag)):
        raise _changed(url)


async def _body(url: str, r: Any, n: int) -> bytes:
    """The body, which must be ``n`` bytes: read no further than one byte past."""
    data = bytearray()
    while len(data) <= n:
        chunk = await r.content.read(min(CHUNK, n + 1 - len(data)))
        if not chunk:
            break
        data += chunk
    if len(data) != n:
        raise CorruptCheckpointError(
            f"{urls.shown(url)}: the server sent {'more' if len(data) > n else len(data)} "
            f"{'than the ' if len(data) > n else 'of '}{n} bytes asked",
            "the remote file changed or the response was cut short; run the command again")
    return bytes(data)


def _weak(etag: str) -> str:
    return etag.strip().removeprefix("W/")


def _changed(url: str) -> Changed:
    return Changed(f"{urls.shown(url)}: the file changed while ckptool read it",
                   "run the command again once it is no longer being written; "
                   "nothing of the two versions was mixed")
