"""Fixtures for tests of remote reading (imported by conftest.py). Each server
starts once per session; the function fixtures below reset it for each test
(empty log, no faults, no content) and point the client libraries at it.

``http_server`` -> ``RangeHTTPServer`` serving a fresh, empty ``root``
    url = http_server.put("dir/model.safetensors", data)    # writes root/..., gives URL
    http_server.url_for(name); http_server.etag(name)
    http_server.replace(name, data)                         # new content, new ETag
    http_server.replace_after(name, data, requests=1)       # ... after the n-th request

``fake_hub`` -> ``FakeHub`` with no repos; HF_ENDPOINT (and huggingface_hub's
    constants read at import) point at it, HF_TOKEN is unset, the token file is
    out of reach, HfFileSystem's instance cache is cleared before and after.
    sha = fake_hub.add_repo("org/name", folder)              # branch main
    sha2 = fake_hub.add_commit("org/name", other_folder)     # main moves, sha stays
    fake_hub.add_repo("org/private", folder, token="hf_x")  # 401 without the token
    fake_hub.add_repo("org/gated", folder, token="hf_x", gated=True)  # files only
    fake_hub.redirect_lfs = False  # LFS files straight from resolve (no 302 + /cdn-lfs)
    fake_hub.page_size = 2         # tree pagination (expand_page_size with expand)
    -> HfFileSystem().find("org/name", detail=True, withdirs=True); "hf://org/name@<sha>/..."

``s3_server`` -> ``S3Server`` (moto) with no buckets; AWS_ENDPOINT_URL(_S3), fake
    AWS_ACCESS_KEY_ID/SECRET, AWS_DEFAULT_REGION set; no AWS config files or
    profile; s3fs's instance cache cleared before and after.
    bucket = s3_server.make_bucket(versioned=True)
    keys = s3_server.upload(folder_or_file, bucket, "prefix")
    version = s3_server.put(bucket, "key", data); s3_server.client (boto3)
    -> s3fs.S3FileSystem().find(f"{bucket}/prefix", detail=True, withdirs=True)

``gcs_server`` -> ``GCSServer`` (gcp-storage-emulator, fake_gcs.py) with no
    buckets; STORAGE_EMULATOR_HOST points at it, no Google credentials are found
    (no GOOGLE_APPLICATION_CREDENTIALS, an empty gcloud config, no GCE metadata
    probe: gcsfs reads anonymously); gcsfs's instance cache cleared before and after.
    bucket = gcs_server.make_bucket()
    keys = gcs_server.upload(folder_or_file, bucket, "prefix")
    generation = gcs_server.put(bucket, "key", data)   # replaces: a new generation
    -> gcsfs.core.GCSFileSystem().find(f"{bucket}/prefix", detail=True, withdirs=True)

All four: ``.url``, ``.log`` (``RequestLog``: ``entries``, ``select(method,
path_glob)``, ``count(...)``, ``bytes_sent(...)``, ``summary()``, ``clear()``)
and ``.faults`` (``fail(path_glob, status, times=1)``, ``delay(path_glob,
seconds)``, ``truncate(path_glob, keep)``, ``after(path_glob, hook, requests)``).
Log paths are percent-decoded URL paths: ``/dir/f.bin``, ``/org/name/resolve/
main/f.bin``, ``/cdn-lfs/<sha256>``, ``/api/models/org/name/tree/main``,
``/<bucket>/<key>``, ``/download/storage/v1/b/<bucket>/o/<key>``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_gcs import GCSServer
from fake_hub import FakeHub
from fake_s3 import S3Server
from remote_servers import RangeHTTPServer


@pytest.fixture(scope="session")
def range_http_server_session(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RangeHTTPServer]:
    server = RangeHTTPServer(tmp_path_factory.mktemp("http_root"))
    yield server
    server.close()


@pytest.fixture
def http_server(range_http_server_session: RangeHTTPServer, tmp_path: Path) -> RangeHTTPServer:
    from fsspec.implementations.http import HTTPFileSystem

    server = range_http_server_session
    server.reset()
    server.root = tmp_path / "http_root"
    server.root.mkdir()
    HTTPFileSystem.clear_instance_cache()
    return server


@pytest.fixture(scope="session")
def fake_hub_session() -> Iterator[FakeHub]:
    hub = FakeHub()
    yield hub
    hub.close()


@pytest.fixture
def fake_hub(
    fake_hub_session: FakeHub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[FakeHub]:
    from huggingface_hub import HfFileSystem, constants
    from huggingface_hub.utils import _detect_agent

    hub = fake_hub_session
    hub.clear()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    # read once, at import: the environment alone comes too late
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(
        constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        hub.url + "/{repo_id}/resolve/{revision}/{filename}",
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-hf-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-hf-tokens"))
    # no user-agent probe of the Hub for "agent harnesses"
    monkeypatch.setattr(_detect_agent, "_registry", {"standardEnvVars": [], "harnesses": {}})
    HfFileSystem.clear_instance_cache()
    yield hub
    HfFileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def s3_server_session() -> Iterator[S3Server]:
    server = S3Server()
    yield server
    server.close()


@pytest.fixture
def s3_server(
    s3_server_session: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[S3Server]:
    import s3fs

    server = s3_server_session
    server.reset()
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()
    yield server
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def gcs_server_session() -> Iterator[GCSServer]:
    server = GCSServer()
    yield server
    server.close()


@pytest.fixture
def gcs_server(
    gcs_server_session: GCSServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[GCSServer]:
    import gcsfs.core
    from google.auth.compute_engine import _metadata

    server = gcs_server_session
    server.reset()
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "GCLOUD_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud-config"))
    monkeypatch.setenv("NO_GCE_CHECK", "true")
    monkeypatch.setattr(_metadata, "_NO_GCE_CHECK", True)  # (read at import)
    gcsfs.core.GCSFileSystem.clear_instance_cache()
    yield server
    gcsfs.core.GCSFileSystem.clear_instance_cache()


@pytest.fixture
def fresh_remote(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No listing, piece, count or filesystem of ckptool's remote layer kept
    from another test (each server here is reset, and libraries cache), and
    retries after a failure that passes 0.01 s apart, not 0.25 s."""
    from ckptool.read import remote
    from ckptool.read.remote import stores, urls

    remote.forget()
    stores.drop()
    urls.forget_hidden()
    monkeypatch.setattr(stores, "BACKOFF", 0.01)
    yield
    stores.drop()
    urls.forget_hidden()
