"""The fsspec filesystem behind each scheme, and its failures as ckptool's.

Each scheme's library is an optional dependency (``pip install
'ckptool[s3]'``, ``[gcs]``, ``[hf]``, ``[http]``); a missing one is a
usage error naming the extra. Credentials and endpoints come from each
library's usual places and are never printed: AWS's environment, profiles
and ``AWS_ENDPOINT_URL`` (MinIO and other S3-compatible stores), gcloud's
credentials and ``STORAGE_EMULATOR_HOST``, ``HF_TOKEN``/the saved token
and ``HF_ENDPOINT``.

``failures(url)`` turns what a library raises (a 404, a 403, a timeout, a
refused connection, throttling that outlasted the retries) into an
``InputError`` naming the URL as ``urls.shown`` shows it, with a hint;
``retrying`` repeats a read that failed for a reason that passes (a
timeout, a 5xx, 429), a bounded number of times with backoff.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ckptool.errors import InputError, UsageError
from ckptool.read.remote import urls

T = TypeVar("T")
_LIBRARY = {"hf": "huggingface_hub", "s3": "s3fs", "gcs": "gcsfs", "http": "aiohttp"}
TRIES = 4  # attempts of a read that failed for a passing reason
READ_TIMEOUT = 60.0  # seconds without a byte from the server: that attempt failed
CONNECT_TIMEOUT = 30.0
BACKOFF = 0.25  # seconds before the second attempt, doubled after each
_SECRET = re.compile(r"(https?://[^\s'\"?#]*)[?#][^\s'\"]*")  # a URL's query: maybe a signature
_USER = re.compile(r"(https?://)[^/\s'\"@]+@")


class MissingExtra(UsageError):
    """The library of a scheme is not installed."""


_made: dict[str, Any] = {}


def filesystem(scheme: str) -> Any:
    """The fsspec filesystem that reads ``scheme`` URLs (one per process)."""
    extra = urls.SCHEMES[scheme]
    if extra not in _made:
        try:
            _made[extra] = _make(extra)
        except ImportError as exc:
            raise MissingExtra(
                f"reading {scheme}:// needs {_LIBRARY[extra]}, which is not installed",
                f"pip install 'ckptool[{extra}]'") from exc
    return _made[extra]


def made() -> list[Any]:
    """The filesystems made so far."""
    return list(_made.values())


def drop() -> None:
    """Forget the filesystems made (a test points a library elsewhere)."""
    for fs in _made.values():
        fs.invalidate_cache()
    _made.clear()


def _make(extra: str) -> Any:
    if extra == "hf":
        from huggingface_hub import HfFileSystem

        # HF_ENDPOINT and HF_TOKEN are read by the library; an instance of
        # ckptool's own, so that no listing cached by another user of it is seen
        return HfFileSystem(skip_instance_cache=True)
    if extra == "s3":
        import s3fs

        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        kwargs: dict[str, Any] = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}
        read = timeout()
        return s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs={
            "connect_timeout": min(CONNECT_TIMEOUT, read), "read_timeout": read}, **kwargs)
    if extra == "gcs":
        import gcsfs.core

        # The JSON API's filesystem. gcsfs.GCSFileSystem is, since gcsfs 2025.x, a
        # subclass that first asks each bucket's layout of the Storage Control API
        # (gRPC): without credentials it warns on stderr at every call, and where
        # STORAGE_EMULATOR_HOST names an emulator it retries for a minute.
        # STORAGE_EMULATOR_HOST and gcloud's credentials are read by the library;
        # an instance of ckptool's own, so that no listing cached by another user
        # of it is seen. Its log says failures (with tracebacks) that ckptool says
        # in its own words: kept off stderr where no one set logging up.
        log = logging.getLogger("gcsfs")
        if not any(isinstance(h, logging.NullHandler) for h in log.handlers):
            log.addHandler(logging.NullHandler())
        import aiohttp

        read = timeout()
        waits = aiohttp.ClientTimeout(total=None, sock_connect=min(CONNECT_TIMEOUT, read),
                                      sock_read=read)
        return gcsfs.core.GCSFileSystem(skip_instance_cache=True, requests_timeout=waits)
    import aiohttp  # (fsspec's HTTP filesystem needs it: said up front)
    import fsspec

    read = timeout()
    return fsspec.filesystem("http", skip_instance_cache=True, client_kwargs={
        "timeout": aiohttp.ClientTimeout(total=None, sock_connect=min(CONNECT_TIMEOUT, read),
                                         sock_read=read)})


def timeout() -> float:
    """Seconds a request may wait for the server's next bytes before it is
    made again (``CKPTOOL_REMOTE_TIMEOUT``, default ``READ_TIMEOUT``)."""
    given = os.environ.get("CKPTOOL_REMOTE_TIMEOUT", "")
    try:
        value = float(given) if given else READ_TIMEOUT
    except ValueError:
        raise UsageError(f"CKPTOOL_REMOTE_TIMEOUT={given!r} is not a number of seconds",
                         "set it to seconds, e.g. CKPTOOL_REMOTE_TIMEOUT=120") from None
    if not value > 0:
        raise UsageError(f"CKPTOOL_REMOTE_TIMEOUT={given!r} must be more than 0 seconds",
                         "set it to seconds, e.g. CKPTOOL_REMOTE_TIMEOUT=120")
    return value


def strip_protocol(scheme: str, url: str) -> str:
    """The path the filesystem of ``scheme`` takes for ``url`` (as given,
    credentials included: ``urls.real``)."""
    url = urls.real(url)
    if urls.SCHEMES[scheme] == "http":
        return url
    return str(filesystem(scheme)._strip_protocol(url))


def scrub(text: str) -> str:
    """A library's error text without URL queries or users (credentials)."""
    return _USER.sub(r"\1", _SECRET.sub(r"\1", text))


def _status(exc: BaseException) -> int | None:
    for attr in ("status", "status_code", "code"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value
    response = getattr(exc, "response", None)
    value = getattr(response, "status_code", None)
    if isinstance(value, int):
        return value
    error = getattr(exc, "response", None)
    if isinstance(error, dict):  # botocore's ClientError
        code = error.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code if isinstance(code, int) else None
    # gcsfs says a 412 (ifGenerationMatch not met) as FileExistsError and a
    # 403 as an OSError("Forbidden: <request URL>")
    if isinstance(exc, FileExistsError):
        return 412
    if type(exc) is OSError and str(exc).startswith("Forbidden: "):
        return 403
    return None


def passing(exc: BaseException) -> bool:
    """Whether a failure may pass if the read is made again."""
    status = _status(exc)
    if status is not None:
        return status == 429 or status >= 500
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"TimeoutError", "ServerTimeoutError", "ServerDisconnectedError",
                         "ClientConnectionError", "ClientPayloadError", "ConnectionError",
                         "ConnectionResetError", "ReadTimeout", "ConnectTimeout",
                         "ConnectError", "NetworkError", "TimeoutException",
                         "RemoteProtocolError", "ReadError", "IncompleteRead"})


def retrying(read: Callable[[], T], url: str) -> T:
    """``read()``, made again after a passing failure (``TRIES`` in all)."""
    delay = BACKOFF
    for attempt in range(TRIES):
        try:
            return read()
        except InputError:
            raise
        except Exception as exc:
            if attempt + 1 == TRIES or not passing(exc):
                raise
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


def _caused_by(exc: BaseException, names: set[str]) -> bool:
    """Whether ``exc``, or what it was raised from, is of a class named so
    (fsspec says a redirect loop as FileNotFoundError from it)."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if {c.__name__ for c in type(seen).__mro__} & names:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def not_found(url: str) -> InputError:
    return InputError(f"{urls.shown(url)}: not found",
                      "check the URL (bucket, repository, revision and path); a private "
                      "repository or bucket also answers 'not found' without credentials")


def refused(url: str, exc: BaseException) -> InputError:
    """What a library raised on ``url``, said as ckptool says it."""
    shown = urls.shown(url)
    status = _status(exc)
    names = {c.__name__ for c in type(exc).__mro__}
    text = scrub(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)[:200]
    if _caused_by(exc, {"TooManyRedirects", "TooManyRedirectsError"}):
        return InputError(f"{shown}: the server redirects in a loop",
                          "check the URL: it should name the file itself")
    if isinstance(exc, FileNotFoundError) or status == 404 or names & {
            "RepositoryNotFoundError", "RevisionNotFoundError", "EntryNotFoundError",
            "RemoteEntryNotFoundError", "NoSuchKey", "NoSuchBucket"}:
        return not_found(url)
    if isinstance(exc, PermissionError) or status in (401, 403) or "GatedRepoError" in names:
        return InputError(f"{shown}: access denied ({status or 'forbidden'})",
                          "check the credentials: HF_TOKEN for hf://, AWS_PROFILE or "
                          "AWS_ACCESS_KEY_ID for s3://, gcloud auth for gs://")
    if status == 412 or "PreconditionFailed" in text or "pre-conditions" in text:
        return InputError(f"{shown}: the file changed while ckptool read it",
                          "run the command again once it is no longer being written; "
                          "nothing of the two versions was mixed")
    if status == 429:
        return InputError(f"{shown}: the server is throttling requests (429), "
                          f"{TRIES} attempts made", "wait a minute, then run the command again")
    if status is not None and status >= 500:
        return InputError(f"{shown}: the server failed ({status}), {TRIES} attempts made",
                          "run the command again later")
    if passing(exc):
        return InputError(f"{shown}: no answer ({text}), {TRIES} attempts made",
                          "check the network and the endpoint (HF_ENDPOINT, AWS_ENDPOINT_URL), "
                          "then run the command again")
    return InputError(f"{shown}: {text}", "check the URL and the credentials")


@contextlib.contextmanager
def failures(url: str) -> Iterator[None]:
    """Turn what the libraries raise into ``InputError`` naming ``url``."""
    try:
        yield
    except (InputError, UsageError):
        raise
    except (OSError, ValueError) as exc:
        raise refused(url, exc) from None
    except Exception as exc:
        if type(exc).__module__.split(".")[0] in {
                "aiohttp", "botocore", "aiobotocore", "requests", "httpx", "httpx2", "httpcore",
                "httpcore2", "h11", "huggingface_hub", "google", "gcsfs", "s3fs", "fsspec",
                "urllib3", "asyncio"}:
            raise refused(url, exc) from None
        raise
