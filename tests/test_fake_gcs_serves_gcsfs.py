"""The local GCS (tests/fake_gcs.py: gcp-storage-emulator behind the request
log) answers gcsfs as GCS does: listings by prefix with each object's size,
generation, md5Hash and crc32c; ranged reads (206); a read of a generation
that is no longer live is 404, an ``ifGenerationMatch`` not met 412 (the
emulator alone serves the live object to both); every request is logged and
faults apply."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import pytest

DATA = bytes(range(256)) * 64  # 16 KiB


def gcs_fs() -> Any:
    import gcsfs.core

    return gcsfs.core.GCSFileSystem(skip_instance_cache=True)


def test_listing_and_ranges_are_served_and_logged(gcs_server: Any) -> None:
    bucket = gcs_server.make_bucket()
    generation = gcs_server.put(bucket, "run/a b/model.bin", DATA)
    gcs_server.put(bucket, "run/other.bin", b"x")
    fs = gcs_fs()
    found = fs.find(f"{bucket}/run", detail=True, withdirs=True)
    assert sorted(found) == [f"{bucket}/run", f"{bucket}/run/a b", f"{bucket}/run/a b/model.bin",
                             f"{bucket}/run/other.bin"]
    info = found[f"{bucket}/run/a b/model.bin"]
    assert (info["size"], info["generation"]) == (len(DATA), generation)
    assert info["md5Hash"] == base64.b64encode(hashlib.md5(DATA).digest()).decode()
    assert info["crc32c"]
    assert fs.cat_file(f"{bucket}/run/a b/model.bin", start=10, end=20) == DATA[10:20]
    assert gcs_server.log.summary() == [
        f"GET /storage/v1/b/{bucket}/o 200 - {gcs_server.log.entries[0].sent}",
        f"GET /download/storage/v1/b/{bucket}/o/run/a b/model.bin 206 bytes=10-19 10",
    ]


def test_a_generation_replaced_is_gone_and_a_precondition_fails(gcs_server: Any) -> None:
    bucket = gcs_server.make_bucket()
    first = gcs_server.put(bucket, "m.bin", DATA)
    fs = gcs_fs()
    path = f"{bucket}/m.bin"
    assert fs.cat_file(path, start=0, end=4, generation=first) == DATA[:4]
    assert fs.call("GET", fs.url(path), headers={"Range": "bytes=0-3"},
                   ifGenerationMatch=first)[1] == DATA[:4]
    second = gcs_server.put(bucket, "m.bin", DATA[::-1])
    assert second != first and gcs_server.generation(bucket, "m.bin") == second
    with pytest.raises(FileNotFoundError):
        fs.cat_file(path, start=0, end=4, generation=first)
    with pytest.raises(FileExistsError):  # gcsfs's word for 412
        fs.call("GET", fs.url(path), headers={"Range": "bytes=0-3"}, ifGenerationMatch=first)
    assert [e.status for e in gcs_server.log.select("GET", "/download/*")] == [206, 206, 404, 412]


def test_faults_apply(gcs_server: Any) -> None:
    bucket = gcs_server.make_bucket()
    gcs_server.put(bucket, "m.bin", DATA)
    gcs_server.faults.fail("/download/*", 403)
    fs = gcs_fs()
    with pytest.raises(OSError, match="Forbidden"):
        fs.cat_file(f"{bucket}/m.bin", start=0, end=4)
    assert fs.cat_file(f"{bucket}/m.bin", start=0, end=4) == DATA[:4]
