"""The local stand-ins for remote stores (tests/remote_servers.py, fake_hub.py,
fake_s3.py) answer the client libraries ckptool reads through (fsspec's HTTP
filesystem, huggingface_hub's HfFileSystem, s3fs) the way the real services
do, log every request, and inject the faults tests ask for."""

from __future__ import annotations

import hashlib
import http.client
import time
from pathlib import Path

import aiohttp
import fsspec
import pytest
from fake_hub import FakeHub
from fake_s3 import S3Server
from huggingface_hub import HfApi, HfFileSystem
from huggingface_hub.errors import EntryNotFoundError
from remote_servers import RangeHTTPServer

DATA = bytes(range(256)) * 64  # 16 KiB


def raw(method: str, server_url: str, path: str) -> http.client.HTTPResponse:
    """One request, no redirect followed."""
    conn = http.client.HTTPConnection(server_url.removeprefix("http://"))
    conn.request(method, path)
    response = conn.getresponse()
    response.read()
    conn.close()
    return response


def http_fs() -> fsspec.AbstractFileSystem:
    return fsspec.filesystem("http", skip_instance_cache=True)


# -- plain HTTP ----------------------------------------------------------------


def test_http_info_and_ranges_are_served_and_logged(http_server: RangeHTTPServer) -> None:
    url = http_server.put("dir/model.bin", DATA)
    fs = http_fs()
    info = fs.info(url)
    assert info["size"] == len(DATA)
    assert info["ETag"] == http_server.etag("dir/model.bin")
    assert info["ETag"].startswith('"')
    assert fs.cat_file(url, 10, 20) == DATA[10:20]
    assert fs.cat_file(url, -8, None) == DATA[-8:]
    assert fs.cat_file(url, len(DATA) - 5, None) == DATA[-5:]
    assert fs.cat_file(url, 0, 4, headers={"If-Match": info["ETag"]}) == DATA[:4]
    assert http_server.log.summary() == [
        "HEAD /dir/model.bin 200 - 0",
        "GET /dir/model.bin 206 bytes=10-19 10",
        "GET /dir/model.bin 206 bytes=-8 8",
        f"GET /dir/model.bin 206 bytes={len(DATA) - 5}- 5",
        "GET /dir/model.bin 206 bytes=0-3 4",
    ]
    assert http_server.log.bytes_sent("GET") == 27
    assert http_server.log.entries[-1].headers["if-match"] == info["ETag"]


def test_http_unsatisfiable_range_and_missing_file(http_server: RangeHTTPServer) -> None:
    url = http_server.put("a.bin", b"0123456789")
    fs = http_fs()
    with pytest.raises(aiohttp.ClientResponseError) as err:
        fs.cat_file(url, 20, 30)
    assert err.value.status == 416
    with pytest.raises(FileNotFoundError):
        fs.cat_file(http_server.url_for("nope.bin"), 0, 4)
    assert [e.status for e in http_server.log] == [416, 404]


def test_http_replaced_file_changes_etag_and_fails_if_match(
    http_server: RangeHTTPServer,
) -> None:
    url = http_server.put("a.bin", DATA)
    fs = http_fs()
    etag = fs.info(url)["ETag"]
    http_server.replace("a.bin", DATA[::-1])  # same size
    assert http_server.etag("a.bin") != etag
    with pytest.raises(aiohttp.ClientResponseError) as err:
        fs.cat_file(url, 0, 4, headers={"If-Match": etag})
    assert err.value.status == 412
    assert fs.cat_file(url, 0, 4) == DATA[::-1][:4]


def test_http_file_replaced_after_the_nth_request(http_server: RangeHTTPServer) -> None:
    url = http_server.put("a.bin", DATA)
    http_server.replace_after("a.bin", b"new content", requests=2)
    fs = http_fs()
    etag = fs.info(url)["ETag"]  # request 1
    assert fs.cat_file(url, 0, 4) == DATA[:4]  # request 2, then replaced
    assert fs.cat_file(url, 0, 3) == b"new"
    assert fs.info(url)["ETag"] != etag


def test_http_status_faults_then_recovery(http_server: RangeHTTPServer) -> None:
    url = http_server.put("a.bin", DATA)
    http_server.faults.fail("/a.bin", 503, times=2)
    http_server.faults.fail("/b*", 403, times=None)
    fs = http_fs()
    statuses = []
    for _ in range(2):
        with pytest.raises(aiohttp.ClientResponseError) as err:
            fs.cat_file(url, 0, 4)
        statuses.append(err.value.status)
    assert statuses == [503, 503]
    assert fs.cat_file(url, 0, 4) == DATA[:4]
    http_server.put("b.bin", DATA)
    with pytest.raises(aiohttp.ClientResponseError, match="403"):
        fs.cat_file(http_server.url_for("b.bin"), 0, 4)
    assert [e.status for e in http_server.log] == [503, 503, 206, 403]


def test_http_truncated_body_and_delay(http_server: RangeHTTPServer) -> None:
    url = http_server.put("a.bin", DATA)
    http_server.faults.truncate("/a.bin", keep=100)
    fs = http_fs()
    with pytest.raises(aiohttp.ClientPayloadError):
        fs.cat_file(url, 0, 1000)
    assert http_server.log.entries[-1].sent == 100
    http_server.faults.delay("/a.bin", 0.2, times=1)
    start = time.perf_counter()
    assert fs.cat_file(url, 0, 1000) == DATA[:1000]
    assert time.perf_counter() - start >= 0.2
    http_server.reset()
    assert len(http_server.log) == 0
    assert fs.cat_file(url, 0, 1000) == DATA[:1000]


# -- Hugging Face Hub ------------------------------------------------------------


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    (folder / "sub" / "deep").mkdir(parents=True)
    (folder / "config.json").write_text('{"hidden": 4}')
    (folder / "model.safetensors").write_bytes(DATA)
    (folder / "sub" / "notes.txt").write_text("small git file")
    (folder / "sub" / "deep" / "w.bin").write_bytes(DATA[:1000])
    return folder


def test_hub_find_lists_everything_with_lfs_metadata(fake_hub: FakeHub, model_dir: Path) -> None:
    fake_hub.add_repo("org/name", model_dir)
    fs = HfFileSystem()
    found = fs.find("org/name", detail=True, withdirs=True)
    assert sorted(found) == [
        "org/name",
        "org/name/config.json",
        "org/name/model.safetensors",
        "org/name/sub",
        "org/name/sub/deep",
        "org/name/sub/deep/w.bin",
        "org/name/sub/notes.txt",
    ]
    st = found["org/name/model.safetensors"]
    assert st["type"] == "file"
    assert st["size"] == len(DATA)
    assert st["lfs"]["sha256"] == hashlib.sha256(DATA).hexdigest()
    assert st["lfs"]["size"] == len(DATA)
    assert st["xet_hash"] is None
    assert found["org/name/config.json"]["lfs"] is None
    assert found["org/name/sub"]["type"] == "directory"
    # find = repo info + one recursive tree page; info and exists then come from the cache
    assert fake_hub.log.summary() == [
        "GET /api/models/org/name 200 - " + str(fake_hub.log.entries[0].sent),
        "GET /api/models/org/name/tree/main 200 - " + str(fake_hub.log.entries[1].sent),
    ]
    assert fake_hub.log.entries[1].query == "recursive=true&expand=false"
    assert fs.info("org/name/sub/notes.txt")["size"] == len("small git file")
    assert not fs.exists("org/name/missing.bin")
    assert len(fake_hub.log) == 2


def test_hub_range_reads_of_lfs_and_git_files(fake_hub: FakeHub, model_dir: Path) -> None:
    sha = fake_hub.add_repo("org/name", model_dir)
    fs = HfFileSystem()
    assert fs.cat_file("org/name/model.safetensors", 100, 110, cache_type="none") == DATA[100:110]
    # LFS: the resolve URL redirects to the CDN, which serves the range
    assert fake_hub.log.summary()[-2:] == [
        "GET /org/name/resolve/main/model.safetensors 302 bytes=100-109 0",
        f"GET /cdn-lfs/{hashlib.sha256(DATA).hexdigest()} 206 bytes=100-109 10",
    ]
    fake_hub.log.clear()
    assert fs.cat_file("org/name/config.json") == b'{"hidden": 4}'
    with fs.open("org/name/sub/notes.txt") as f:
        assert f.read() == b"small git file"
    assert fake_hub.log.count("GET", "*/resolve/main/*") == 2
    # the headers huggingface_hub's downloads read, and no Xet
    head = raw("HEAD", fake_hub.url, "/org/name/resolve/main/model.safetensors")
    assert head.status == 302
    assert head.headers["X-Repo-Commit"] == sha
    assert head.headers["X-Linked-Etag"] == f'"{hashlib.sha256(DATA).hexdigest()}"'
    assert head.headers["X-Linked-Size"] == str(len(DATA))
    assert not [h for h in head.headers if "xet" in h.lower()]
    small = raw("GET", fake_hub.url, f"/org/name/resolve/{sha}/config.json")
    assert small.headers["X-Repo-Commit"] == sha
    assert small.headers["ETag"].startswith('"')


def test_hub_default_cat_file_reads_a_whole_block(fake_hub: FakeHub, model_dir: Path) -> None:
    """Without cache_type="none", HfFileSystem.cat_file(path, a, b) fetches
    from a to a + block_size (5 MiB) or the end of the file."""
    fake_hub.add_repo("org/name", model_dir)
    fake_hub.redirect_lfs = False
    fs = HfFileSystem()
    assert fs.cat_file("org/name/model.safetensors", 10, 20) == DATA[10:20]
    assert fake_hub.log.select("GET", "*/resolve/*")[-1].range == f"bytes=10-{len(DATA) - 1}"
    assert fake_hub.log.bytes_sent("GET", "*/resolve/*") == len(DATA) - 10
    assert fake_hub.log.count(path="/cdn-lfs/*") == 0


def test_hub_pins_revisions(fake_hub: FakeHub, model_dir: Path, tmp_path: Path) -> None:
    first = fake_hub.add_repo("org/name", model_dir)
    (model_dir / "config.json").write_text('{"hidden": 8}')
    (model_dir / "extra.txt").write_text("new")
    second = fake_hub.add_commit("org/name", model_dir)
    assert first != second
    assert len(first) == 40
    fs = HfFileSystem()
    assert fs.cat_file(f"org/name@{first}/config.json") == b'{"hidden": 4}'
    assert fs.cat_file("org/name/config.json") == b'{"hidden": 8}'
    assert not fs.exists(f"hf://org/name@{first}/extra.txt")
    assert fs.exists(f"hf://org/name@{second}/extra.txt")
    assert fake_hub.log.count(path=f"/org/name/resolve/{first}/config.json") == 1
    assert not fs.exists("org/name@0123456789012345678901234567890123456789/config.json")


def test_hub_tree_pagination_and_paths_info(fake_hub: FakeHub, model_dir: Path) -> None:
    fake_hub.add_repo("org/name", model_dir)
    fake_hub.page_size = 2
    fs = HfFileSystem(max_workers=1)
    assert len(fs.find("org/name", withdirs=True)) == 7
    assert fake_hub.log.count("GET", "*/tree/main") == 3  # 6 entries, 2 a page
    infos = HfApi().get_paths_info("org/name", ["config.json", "sub", "missing"], expand=True)
    assert [i.path for i in infos] == ["config.json", "sub"]
    assert infos[0].last_commit is not None
    assert fake_hub.log.count("POST", "/api/models/org/name/paths-info/main") == 1


def test_hub_private_and_gated_repos_need_the_token(
    fake_hub: FakeHub, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_hub.add_repo("org/private", model_dir, token="hf_secret")
    fake_hub.add_repo("org/gated", model_dir, token="hf_secret", gated=True)
    fs = HfFileSystem()
    assert not fs.exists("org/private/config.json")
    assert fake_hub.log.entries[-1].status == 401
    assert fs.exists("org/gated/config.json")  # listing is public
    with pytest.raises(OSError, match="gated"):
        fs.cat_file("org/gated/config.json")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    HfFileSystem.clear_instance_cache()
    fs = HfFileSystem()
    assert fs.cat_file("org/private/config.json") == b'{"hidden": 4}'
    assert fs.cat_file("org/gated/config.json") == b'{"hidden": 4}'
    assert fake_hub.log.entries[-1].headers["authorization"] == "Bearer hf_secret"


def test_hub_status_fault_is_retried_by_the_client(fake_hub: FakeHub, model_dir: Path) -> None:
    fake_hub.add_repo("org/name", model_dir)
    fake_hub.faults.fail("*/resolve/*/config.json", 503, times=1)
    entry_not_found = {"X-Error-Code": "EntryNotFound"}  # what makes it FileNotFoundError
    fake_hub.faults.fail("*/resolve/*/notes.txt", 404, times=None, headers=entry_not_found)
    fs = HfFileSystem()
    assert fs.cat_file("org/name/config.json") == b'{"hidden": 4}'  # after a 1 s back-off
    assert [e.status for e in fake_hub.log.select(path="*/config.json")] == [503, 200]
    # a read that meets 404 raises huggingface_hub's EntryNotFoundError (an OSError),
    # not FileNotFoundError
    with pytest.raises(EntryNotFoundError):
        fs.cat_file("org/name/sub/notes.txt", 0, 4, cache_type="none")


# -- S3 -----------------------------------------------------------------------------


def test_s3_find_info_and_ranges(s3_server: S3Server, model_dir: Path) -> None:
    import s3fs

    bucket = s3_server.make_bucket()
    keys = s3_server.upload(model_dir, bucket, "ckpt/run1")
    assert "ckpt/run1/sub/deep/w.bin" in keys
    s3_server.log.clear()
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server.url})
    found = fs.find(f"{bucket}/ckpt", detail=True, withdirs=True)
    assert f"{bucket}/ckpt/run1/sub/deep" in found
    assert found[f"{bucket}/ckpt/run1/model.safetensors"]["size"] == len(DATA)
    assert s3_server.log.count() == 1, s3_server.log.summary()  # one ListObjectsV2 page
    assert fs.info(f"{bucket}/ckpt/run1/model.safetensors")["size"] == len(DATA)
    assert s3_server.log.count() == 1  # from find's cache
    path = f"{bucket}/ckpt/run1/model.safetensors"
    assert fs.cat_file(path, start=100, end=110) == DATA[100:110]
    last = s3_server.log.entries[-1]
    assert (last.method, last.path, last.range, last.status, last.sent) == (
        "GET",
        f"/{bucket}/ckpt/run1/model.safetensors",
        "bytes=100-109",
        206,
        10,
    )
    # the environment alone points s3fs at the server
    assert s3fs.S3FileSystem(skip_instance_cache=True).cat_file(path) == DATA


def test_s3_versioned_bucket(s3_server: S3Server) -> None:
    import s3fs

    bucket = s3_server.make_bucket(versioned=True)
    old = s3_server.put(bucket, "m.bin", b"old")
    new = s3_server.put(bucket, "m.bin", b"new!")
    assert old and new and old != new
    fs = s3fs.S3FileSystem(version_aware=True)
    assert fs.info(f"{bucket}/m.bin")["VersionId"] == new
    assert fs.cat_file(f"{bucket}/m.bin", version_id=old) == b"old"
    assert fs.cat_file(f"{bucket}/m.bin?versionId={new}") == b"new!"
    assert s3_server.log.count("GET", f"/{bucket}/m.bin") == 2, s3_server.log.summary()


def test_s3_faults(s3_server: S3Server) -> None:
    import s3fs

    bucket = s3_server.make_bucket()
    s3_server.put(bucket, "m.bin", DATA)
    fs = s3fs.S3FileSystem()
    s3_server.faults.fail("/*/m.bin", 403, method="GET")
    with pytest.raises(PermissionError):
        fs.cat_file(f"{bucket}/m.bin", start=0, end=4)
    # s3fs reads again after a short body: right bytes, two requests
    s3_server.log.clear()
    s3_server.faults.truncate("/*/m.bin", keep=3)
    assert fs.cat_file(f"{bucket}/m.bin", start=0, end=10) == DATA[:10]
    assert [(e.status, e.sent) for e in s3_server.log] == [(206, 3), (206, 10)]
