"""moto's S3 served on 127.0.0.1 from a thread (werkzeug), behind a WSGI
middleware that logs every request (``RequestLog``) and applies ``Faults``
(S3-style XML error bodies for injected statuses), plus helpers to make
buckets and upload files with boto3."""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from remote_servers import Faults, Logged, RequestLog, files_to_upload

ACCESS_KEY = "testing-key"
SECRET_KEY = "testing-secret"
REGION = "us-east-1"

_S3_ERRORS = {403: "AccessDenied", 404: "NoSuchKey", 429: "SlowDown", 500: "InternalError",
              503: "SlowDown"}  # fmt: skip
_names = itertools.count()


class _Logging:
    """WSGI middleware: faults first, then moto; logs what was sent."""

    def __init__(self, app: Callable[..., Iterable[bytes]], log: RequestLog, faults: Faults):
        self.app, self.log, self.faults = app, log, faults

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterator[bytes]:
        method = environ["REQUEST_METHOD"]
        path = unquote(environ.get("PATH_INFO", ""))
        planned = self.faults.plan(method, path)
        if planned.delay:
            time.sleep(planned.delay)
        status: list[int] = [0]

        def start(line: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            status[0] = int(line.split()[0])
            return start_response(line, headers, exc_info)

        if planned.status is not None:
            code = planned.status.status
            name = _S3_ERRORS.get(code, "InternalError")
            body = f"<Error><Code>{name}</Code><Message>injected</Message></Error>".encode()
            headers = [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))]
            start(f"{code} {name}", [*headers, *planned.status.headers.items()])
            chunks: Iterable[bytes] = [body]
        else:
            chunks = self.app(environ, start)
        try:  # moto answers from memory: whole body first, then log, then send
            body = b"" if method == "HEAD" else b"".join(chunks)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
        if planned.truncate is not None:
            body = body[: planned.truncate]
        # logged (and hooks run) before the client can see the answer
        self.log.add(
            Logged(
                method,
                path,
                environ.get("QUERY_STRING", ""),
                environ.get("HTTP_RANGE"),
                status[0],
                len(body),
                _headers(environ),
            )
        )
        self.faults.answered(method, path)
        yield body
        if planned.truncate is not None:
            # the client waits for the announced length: cut the connection
            sock: socket.socket | None = environ.get("werkzeug.socket")
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)
            raise ConnectionAbortedError("truncated on purpose")


def _headers(environ: dict[str, Any]) -> dict[str, str]:
    out = {k[5:].replace("_", "-").lower(): v for k, v in environ.items() if k.startswith("HTTP_")}
    for key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
        if environ.get(key):
            out[key.replace("_", "-").lower()] = environ[key]
    return out


class S3Server:
    """moto S3 at ``url`` (``endpoint_url`` for boto3/s3fs). ``reset()`` empties
    the log, drops faults and deletes every bucket."""

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        class Quiet(MotoRequestHandler):
            disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms stalls

            def log(self, type: str, message: str, *args: Any) -> None:
                """Silent: the RequestLog is the record."""

        self.log = RequestLog()
        self.faults = Faults()
        app = _Logging(DomainDispatcherApplication(create_backend_app), self.log, self.faults)
        self._server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=Quiet)
        self.port = self._server.port
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        self._client: Any = None

    @property
    def client(self) -> Any:
        """A boto3 S3 client on this server (fake credentials)."""
        if self._client is None:
            import boto3

            self._client = boto3.client(
                "s3",
                endpoint_url=self.url,
                aws_access_key_id=ACCESS_KEY,
                aws_secret_access_key=SECRET_KEY,
                region_name=REGION,
            )
        return self._client

    def env(self) -> dict[str, str]:
        """Environment that points AWS SDKs (and s3fs) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ENDPOINT_URL_S3": self.url,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
        }

    def make_bucket(self, name: str | None = None, *, versioned: bool = False) -> str:
        """Create a bucket (a fresh name unless given); returns its name."""
        name = name or f"bucket-{next(_names)}"
        self.client.create_bucket(Bucket=name)
        if versioned:
            self.client.put_bucket_versioning(
                Bucket=name, VersioningConfiguration={"Status": "Enabled"}
            )
        return name

    def put(self, bucket: str, key: str, data: bytes) -> str | None:
        """Upload ``data`` to ``s3://bucket/key``; returns the VersionId (None
        in an unversioned bucket)."""
        out = self.client.put_object(Bucket=bucket, Key=key, Body=data)
        return out.get("VersionId")

    def upload(self, local: Path, bucket: str, prefix: str = "") -> list[str]:
        """Upload a file, or every file under a folder, below ``prefix``;
        returns the keys written (folder layout kept)."""
        keys = []
        for key, path in files_to_upload(local, prefix):
            self.put(bucket, key, path.read_bytes())
            keys.append(key)
        return keys

    def reset(self) -> None:
        self.log.clear()
        self.faults.clear()
        from moto.s3.models import s3_backends

        for account in list(s3_backends):
            for region in list(s3_backends[account]):
                s3_backends[account][region].reset()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
