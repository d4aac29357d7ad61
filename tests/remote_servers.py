"""Local stand-ins for remote checkpoint stores, for tests that must run with
no internet: a plain HTTP file server with ranges (``RangeHTTPServer``); the
fake Hugging Face Hub and the S3 server live in ``fake_hub.py`` and
``fake_s3.py`` and share the request log and the faults defined here.

Every server binds 127.0.0.1 on a free port, serves from a daemon thread and
keeps a ``log`` (``RequestLog``: one ``Logged`` per request: method, path,
query, Range header, status, body bytes sent) and ``faults`` (``Faults``:
answer a status N times, delay, truncate bodies, run a hook after N requests),
both emptied by ``reset()``. Paths in the log and in fault patterns are
percent-decoded URL paths (``/dir/file.bin``); patterns are ``fnmatch`` globs
(``*`` also matches ``/``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from urllib.parse import parse_qs, unquote, urlsplit


@dataclass(frozen=True)
class Logged:
    """One request as a server saw and answered it."""

    method: str
    path: str  # percent-decoded URL path
    query: str  # raw query string, '' when none
    range: str | None  # the Range header as sent
    status: int
    sent: int  # body bytes actually written (0 for HEAD)
    headers: Mapping[str, str] = field(repr=False)  # request headers, lower-case names


class RequestLog:
    """Thread-safe list of ``Logged`` requests; ``select``/``count``/``bytes_sent``
    filter by method and by a glob on the path."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[Logged] = []

    def add(self, entry: Logged) -> None:
        with self._lock:
            self._entries.append(entry)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def replace(self, old: Logged, new: Logged) -> None:
        with self._lock:
            for i, entry in enumerate(self._entries):
                if entry is old:
                    self._entries[i] = new

    @property
    def entries(self) -> list[Logged]:
        with self._lock:
            return list(self._entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[Logged]:
        return iter(self.entries)

    def select(self, method: str | None = None, path: str | None = None) -> list[Logged]:
        return [
            e
            for e in self.entries
            if (method is None or e.method == method)
            and (path is None or fnmatch.fnmatchcase(e.path, path))
        ]

    def count(self, method: str | None = None, path: str | None = None) -> int:
        return len(self.select(method, path))

    def bytes_sent(self, method: str | None = None, path: str | None = None) -> int:
        return sum(e.sent for e in self.select(method, path))

    def summary(self) -> list[str]:
        """``['GET /a/b 206 bytes=0-9 10', ...]``: handy in assertion messages."""
        return [f"{e.method} {e.path} {e.status} {e.range or '-'} {e.sent}" for e in self.entries]


@dataclass
class _Fault:
    pattern: str
    method: str | None
    remaining: int | None  # None: forever
    status: int = 0
    headers: Mapping[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    keep: int = -1
    hook: Callable[[], None] | None = None

    def matches(self, method: str, path: str) -> bool:
        return (
            (self.remaining is None or self.remaining > 0)
            and (self.method is None or self.method == method)
            and fnmatch.fnmatchcase(path, self.pattern)
        )

    def use(self) -> None:
        if self.remaining is not None:
            self.remaining -= 1


@dataclass
class Planned:
    """What the faults say about one request."""

    status: _Fault | None = None
    delay: float = 0.0
    truncate: int | None = None  # body bytes to send before closing


class Faults:
    """Faults tests set on a server. ``times=None`` means every matching request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: list[_Fault] = []
        self._delays: list[_Fault] = []
        self._truncs: list[_Fault] = []
        self._hooks: list[_Fault] = []

    def fail(
        self,
        path: str,
        status: int,
        times: int | None = 1,
        *,
        method: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Answer requests whose path matches ``path`` with ``status`` (no
        content) ``times`` times, then serve them normally again."""
        with self._lock:
            self._status.append(_Fault(path, method, times, status=status, headers=headers or {}))

    def delay(
        self, path: str, seconds: float, times: int | None = None, *, method: str | None = None
    ) -> None:
        """Sleep ``seconds`` before answering matching requests."""
        with self._lock:
            self._delays.append(_Fault(path, method, times, seconds=seconds))

    def truncate(
        self, path: str, keep: int = 0, times: int | None = 1, *, method: str | None = None
    ) -> None:
        """Announce the full Content-Length but send only ``keep`` body bytes,
        then close the connection."""
        with self._lock:
            self._truncs.append(_Fault(path, method, times, keep=keep))

    def after(
        self, path: str, hook: Callable[[], None], requests: int = 1, *, method: str | None = None
    ) -> None:
        """Run ``hook()`` once, right after the ``requests``-th matching request
        was answered (e.g. to replace a file between two range reads)."""
        with self._lock:
            self._hooks.append(_Fault(path, method, requests, hook=hook))

    def clear(self) -> None:
        with self._lock:
            for faults in (self._status, self._delays, self._truncs, self._hooks):
                faults.clear()

    def plan(self, method: str, path: str) -> Planned:
        planned = Planned()
        with self._lock:
            for fault in self._status:
                if fault.matches(method, path):
                    fault.use()
                    planned.status = fault
                    break
            for fault in self._delays:
                if fault.matches(method, path):
                    fault.use()
                    planned.delay += fault.seconds
            for fault in self._truncs:
                if planned.status is None and fault.matches(method, path):
                    fault.use()
                    planned.truncate = fault.keep
                    break
        return planned

    def answered(self, method: str, path: str) -> None:
        """Count a served request for the ``after`` hooks, running those due."""
        due = []
        with self._lock:
            for fault in self._hooks:
                if fault.matches(method, path):
                    fault.use()
                    if fault.remaining == 0 and fault.hook is not None:
                        due.append(fault.hook)
        for hook in due:
            hook()


@dataclass
class Incoming:
    method: str
    path: str  # percent-decoded
    raw_path: str  # as sent, without the query
    query: str
    headers: Mapping[str, str]  # lower-case names
    body: bytes

    @property
    def params(self) -> dict[str, list[str]]:
        return parse_qs(self.query, keep_blank_values=True)


@dataclass
class Reply:
    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes | memoryview = b""  # a view of a range is served without a copy
    quiet: bool = False  # not logged (client housekeeping, not data)


_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class FileBytes:
    """A file's bytes, read only as sliced: a range answer reads its range,
    not the whole file (tests measure the client's memory in-process)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = path.stat().st_size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, part: slice) -> bytes:
        start, stop, _ = part.indices(self.size)
        with self.path.open("rb") as f:
            f.seek(start)
            return f.read(max(0, stop - start))


def serve_bytes(data: bytes | FileBytes, etag: str, req: Incoming,
                headers: list[tuple[str, str]]) -> Reply:
    """Full (200) or one-range (206/416) answer for ``data`` with strong ``etag``
    honouring If-Match (412). Ranges the server can't parse (several ranges,
    other units) are ignored, as RFC 9110 allows: 200 with everything."""
    size = len(data)
    head = [*headers, ("ETag", etag), ("Accept-Ranges", "bytes")]
    if_match = req.headers.get("if-match")
    if_match = None if if_match is None or if_match.strip() == "*" else if_match
    if if_match is not None and etag not in [tag.strip() for tag in if_match.split(",")]:
        return Reply(412, head)
    match = _RANGE.match(req.headers.get("range", "").replace(" ", ""))
    if match is None or match.group(1) == match.group(2) == "":
        if req.method == "HEAD":  # its length, not its bytes
            return Reply(200, [*head, ("Content-Type", "application/octet-stream"),
                               ("Content-Length", str(size))])
        return Reply(200, [*head, ("Content-Type", "application/octet-stream")], data[:])
    first, last = match.groups()
    if first == "":  # suffix: the last n bytes
        start, end = max(0, size - int(last)), size - 1
        empty = int(last) == 0
    else:
        start = int(first)
        end = min(int(last), size - 1) if last else size - 1
        empty = last != "" and int(last) < start
    if empty or start >= size:
        return Reply(416, [*head, ("Content-Range", f"bytes */{size}")])
    # a range of bytes held is a view, not a copy: tests measure the
    # client's memory in-process, with the server's threads beside it
    held = memoryview(data) if isinstance(data, bytes) else data
    return Reply(
        206,
        [
            *head,
            ("Content-Type", "application/octet-stream"),
            ("Content-Range", f"bytes {start}-{end}/{size}"),
        ],
        held[start : end + 1],
    )


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like the real services
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms stalls
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        """Silent: the RequestLog is the record."""

    def _dispatch(self) -> None:
        owner = self.server.owner
        split = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        req = Incoming(
            method=self.command,
            path=unquote(split.path),
            raw_path=split.path,
            query=split.query,
            headers={k.lower(): v for k, v in self.headers.items()},
            body=self.rfile.read(length) if length else b"",
        )
        planned = owner.faults.plan(req.method, req.path)
        if planned.delay:
            time.sleep(planned.delay)
        if planned.status is not None:
            reply = Reply(planned.status.status, list(planned.status.headers.items()))
        else:
            reply = owner.handle(req)
        body = b"" if req.method == "HEAD" else reply.body
        if planned.truncate is not None:
            body = body[: planned.truncate]
        # logged (and hooks run) before the client can see the answer
        entry = Logged(
            req.method,
            req.path,
            req.query,
            req.headers.get("range"),
            reply.status,
            len(body),
            req.headers,
        )
        if not reply.quiet:
            owner.log.add(entry)
        owner.faults.answered(req.method, req.path)
        if not self._send(reply, body, len(reply.body), planned.truncate is not None):
            owner.log.replace(entry, dataclasses.replace(entry, sent=0))

    def _send(self, reply: Reply, body: bytes | memoryview, length: int, truncated: bool) -> bool:
        """Write the answer; False when the client had gone."""
        self.send_response(reply.status)
        for name, value in reply.headers:
            self.send_header(name, value)
        if not any(name.lower() == "content-length" for name, _ in reply.headers):
            self.send_header("Content-Length", str(length))
        if truncated:
            self.send_header("Connection", "close")
        self.end_headers()
        try:
            self.wfile.write(body)
            self.wfile.flush()
        except ConnectionError:
            self.close_connection = True
            return False
        if truncated:  # the client waits for the announced length: cut the connection
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
        return True

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = _dispatch


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: LoggedServer


class LoggedServer:
    """A threaded HTTP server on 127.0.0.1 whose subclasses answer ``handle``."""

    def __init__(self) -> None:
        self.log = RequestLog()
        self.faults = Faults()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self.port: int = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def handle(self, req: Incoming) -> Reply:
        raise NotImplementedError

    def reset(self) -> None:
        """Empty the log and drop every fault."""
        self.log.clear()
        self.faults.clear()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> LoggedServer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class RangeHTTPServer(LoggedServer):
    """Serves the files under ``root`` (HEAD, GET; ranges; If-Match) at
    ``url_for(name)``. ETag: ``"<size hex>-<mtime_ns hex>"``."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = Path(root)

    def url_for(self, name: str) -> str:
        return f"{self.url}/{name.lstrip('/')}"

    def put(self, name: str, data: bytes) -> str:
        """Write ``root/name`` (folders made) and return its URL."""
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return self.url_for(name)

    def replace(self, name: str, data: bytes) -> None:
        """Change the content of ``root/name``; its ETag changes for sure
        (mtime moves forward even on coarse clocks)."""
        path = self.root / name
        old = path.stat().st_mtime_ns
        path.write_bytes(data)
        new = max(old + 1_000_000, time.time_ns())
        os.utime(path, ns=(new, new))

    def replace_after(self, name: str, data: bytes, requests: int = 1) -> None:
        """Replace ``name`` right after its ``requests``-th request was answered."""
        self.faults.after(f"/{name.lstrip('/')}", lambda: self.replace(name, data), requests)

    def etag(self, name: str) -> str:
        st = (self.root / name).stat()
        return f'"{st.st_size:x}-{st.st_mtime_ns:x}"'

    def handle(self, req: Incoming) -> Reply:
        if req.method not in ("GET", "HEAD"):
            return Reply(405, [("Allow", "GET, HEAD")])
        parts = [p for p in req.path.split("/") if p]
        if any(p in (".", "..") for p in parts):
            return Reply(404)
        path = self.root.joinpath(*parts)
        if not parts or not path.is_file():
            return Reply(404, [("Content-Type", "text/plain")], b"not found")
        name = path.relative_to(self.root).as_posix()
        while True:  # an ETag that belongs to the bytes sent, even mid-replace
            etag = self.etag(name)
            reply = serve_bytes(FileBytes(path), etag, req, [])
            if self.etag(name) == etag:
                return reply


def files_to_upload(local: Path, prefix: str = "") -> list[tuple[str, Path]]:
    """(key, file) of a file, or of every file under a folder, below
    ``prefix`` (folder layout kept), for a test store's ``upload``."""
    local = Path(local)
    prefix = prefix.strip("/")
    files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
    out = []
    for path in files:
        rel = path.name if local.is_file() else path.relative_to(local).as_posix()
        out.append((f"{prefix}/{rel}" if prefix else rel, path))
    return out
