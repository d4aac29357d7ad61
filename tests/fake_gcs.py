"""Google Cloud Storage on 127.0.0.1 for gcsfs (reached through
``STORAGE_EMULATOR_HOST``): gcp-storage-emulator's JSON API handlers (its
in-memory ``Storage``) behind ``remote_servers.LoggedServer``, so requests are
logged (``RequestLog``) and faults injected (``Faults``) as on the other
servers, with keep-alive HTTP/1.1 and a thread per connection.

What gcsfs reads through it: ``GET /storage/v1/b/{bucket}/o?prefix=&delimiter=``
(listings: size, generation, etag, md5Hash, crc32c of each object),
``GET /storage/v1/b/{bucket}/o/{object}`` (one object's resource) and
``GET /download/storage/v1/b/{bucket}/o/{object}?alt=media`` with a ``Range``
(``bytes=a-b``: 206 and ``Content-Range``).

The emulator (2026.7.19) ignores the ``generation`` and ``ifGenerationMatch``
query parameters of object reads: it always serves the live object. Real GCS
answers a generation that is no longer live with 404 (a bucket without
versioning keeps no other) and a failed ``ifGenerationMatch`` with 412
(``conditionNotMet``); this module answers both that way before the emulator
sees the request. Log paths are the percent-decoded URL paths
(``/download/storage/v1/b/<bucket>/o/<key>``, ``/storage/v1/b/<bucket>/o``).
Buckets and objects made by the helpers below are not logged.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import re
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import quote

from remote_servers import Incoming, LoggedServer, Reply, files_to_upload

_names = itertools.count()
_OBJECT = re.compile(r"^(?:/download)?/storage/v1/b/(?P<bucket>[^/]+)/o/(?P<key>.+)$")
_NOT_MET = "At least one of the pre-conditions you specified did not hold."


class _Headers:
    """Request headers as the emulator asks for them (``get``, any case)."""

    def __init__(self, headers: dict[str, str]) -> None:
        self._headers = {k.lower(): v for k, v in headers.items()}

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._headers.get(name.lower(), default)


class _Exchange:
    """What the emulator's ``Router`` uses of a ``BaseHTTPRequestHandler``:
    the request's path, headers and body; the status and headers it sends and
    the body it writes are kept."""

    def __init__(self, storage: Any, address: tuple[str, int], method: str, path: str,
                 headers: dict[str, str], body: bytes) -> None:
        self.storage = storage
        self.server = SimpleNamespace(server_address=address)
        self.command = method
        self.path = path
        self.headers = _Headers(headers)
        self.rfile = io.BytesIO(body)
        self.wfile = io.BytesIO()
        self.status = 500
        self.sent: list[tuple[str, str]] = []

    def send_response(self, code: int, message: str | None = None) -> None:
        self.status = code

    def send_header(self, name: str, value: str) -> None:
        if name.lower() != "content-length":  # LoggedServer counts what it sends
            self.sent.append((name, value))

    def end_headers(self) -> None:
        """Nothing to flush."""


class GCSServer(LoggedServer):
    """gcp-storage-emulator at ``url``. ``reset()`` empties the log, drops the
    faults and deletes every bucket."""

    def __init__(self) -> None:
        from gcp_storage_emulator.storage import Storage

        quiet = logging.getLogger("gcp_storage_emulator")  # its errors are its answers
        quiet.addHandler(logging.NullHandler())
        quiet.propagate = False
        self.storage = Storage(use_memory_fs=True)
        self._lock = threading.Lock()  # the emulator's storage is not thread-safe
        super().__init__()

    def env(self) -> dict[str, str]:
        """Environment that points gcsfs (and Google's SDKs) at this server."""
        return {"STORAGE_EMULATOR_HOST": self.url}

    # -- serving ---------------------------------------------------------------

    def handle(self, req: Incoming) -> Reply:
        refused = self._precondition(req)
        if refused is not None:
            return refused
        target = req.raw_path + (f"?{req.query}" if req.query else "")
        return self._emulated(req.method, target, req.headers, req.body)

    def _emulated(self, method: str, target: str, headers: dict[str, str],
                  body: bytes) -> Reply:
        from gcp_storage_emulator.server import Router

        exchange = _Exchange(self.storage, ("127.0.0.1", self.port), method, target,
                             {"host": f"127.0.0.1:{self.port}",
                              "content-length": str(len(body)), **headers}, body)
        with self._lock:
            Router(exchange).handle(method)
        return Reply(exchange.status, exchange.sent, exchange.wfile.getvalue())

    def _precondition(self, req: Incoming) -> Reply | None:
        """GCS's answer to a read of a generation that is not the live one."""
        from gcp_storage_emulator.exceptions import NotFound

        match = _OBJECT.match(req.path)
        params = req.params
        if req.method != "GET" or match is None or not (
                "generation" in params or "ifGenerationMatch" in params):
            return None
        try:
            with self._lock:
                live = str(self.storage.get_file_obj(match["bucket"], match["key"])["generation"])
        except NotFound:
            return None  # the emulator says so
        if params.get("generation", [live])[0] != live:
            return _error(404, f"No such object: {match['bucket']}/{match['key']}", "notFound")
        if params.get("ifGenerationMatch", [live])[0] != live:
            return _error(412, _NOT_MET, "conditionNotMet")
        return None

    # -- content -------------------------------------------------------------

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh name unless given); returns its name."""
        name = name or f"bucket-{next(_names)}"
        reply = self._emulated("POST", "/storage/v1/b", {"content-type": "application/json"},
                               json.dumps({"name": name}).encode())
        assert reply.status == 200, reply
        return name

    def put(self, bucket: str, key: str, data: bytes) -> str:
        """Upload ``data`` to ``gs://bucket/key`` (a new generation if it
        exists); returns the object's generation."""
        reply = self._emulated(
            "POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={quote(key, safe='')}",
            {"content-type": "application/octet-stream"}, data)
        assert reply.status == 200, reply
        return str(json.loads(reply.body)["generation"])

    def upload(self, local: Path, bucket: str, prefix: str = "") -> list[str]:
        """Upload a file, or every file under a folder, below ``prefix``;
        returns the keys written (folder layout kept)."""
        keys = []
        for key, path in files_to_upload(local, prefix):
            self.put(bucket, key, path.read_bytes())
            keys.append(key)
        return keys

    def generation(self, bucket: str, key: str) -> str:
        with self._lock:
            return str(self.storage.get_file_obj(bucket, key)["generation"])

    def reset(self) -> None:
        super().reset()
        with self._lock:
            self.storage.wipe()


def _error(status: int, message: str, reason: str) -> Reply:
    body = json.dumps({"error": {"code": status, "message": message,
                                 "errors": [{"message": message, "domain": "global",
                                             "reason": reason}]}}).encode()
    return Reply(status, [("Content-Type", "application/json; charset=UTF-8")], body)
