"""A checkpoint in Google Cloud Storage (gs://, against gcp-storage-emulator:
tests/fake_gcs.py) reads as its local copy: ``inspect --json`` gives the same
report (but for the path and the ``remote`` counts) for a torch zip, a
safetensors file, a legacy torch file, a DCP folder and a DeepSpeed folder,
with nothing said on stderr; convert writes what convert of the local copy
writes; a folder is one listing, a small file one range; a missing object
or bucket is exit 3 "not found", a 401 or 403 "access denied" (and nothing
of gcsfs's log on stderr); an object replaced between two ranges is refused,
never read as two generations mixed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_remote_reads_as_local import local_and_remote_outputs, same_but_path, same_files

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
ONE_FILE = ["dataparallel_cuda2.pth", "tinynet.safetensors", "legacy_compiled_ddp.pth"]
FOLDERS = ["dcp_tinynet", "deepspeed_zero3"]


pytestmark = pytest.mark.usefixtures("fresh_remote")


def uploaded(gcs_server: Any, name: str) -> str:
    """``samples/name`` in a fresh bucket, under ``runs/``; its gs:// URL."""
    bucket = gcs_server.make_bucket()
    local = SAMPLES / name
    gcs_server.upload(local, bucket, f"runs/{name}" if local.is_dir() else "runs")
    return f"gs://{bucket}/runs/{name}"


def inspected(run_cli: Any, path: str) -> tuple[dict[str, Any], str]:
    code, out, err = run_cli("inspect", "--json", path)
    assert code in (0, 1), err
    return {"code": code, **json.loads(out)}, err


@pytest.mark.parametrize("name", ONE_FILE + FOLDERS)
def test_gs_reads_as_the_local_copy(name: str, gcs_server: Any, run_cli: Any) -> None:
    url = uploaded(gcs_server, name)
    got, err = inspected(run_cli, url)
    assert err == ""  # (no word from gcsfs about bucket types or credentials)
    counted = got["remote"]
    local = str(SAMPLES / name)
    same_but_path(got, inspected(run_cli, local)[0], url, local)
    listings = gcs_server.log.select("GET", "/storage/v1/b/*/o")
    reads = gcs_server.log.select("GET", "/download/*")
    folder = (SAMPLES / name).is_dir()
    files = [p for p in (SAMPLES / name).rglob("*") if p.is_file()] if folder else [SAMPLES / name]
    # the folder listed once; a file is two listings for gcsfs (as a folder, then as a name)
    assert len(listings) == (1 if folder else 2), gcs_server.log.summary()
    # each file of a few KiB: one range at most, never a byte twice
    assert len(reads) <= len(files) and all(r.status == 206 for r in reads)
    assert len(gcs_server.log) == len(listings) + len(reads), gcs_server.log.summary()
    if folder:  # (gcsfs lists a file's URL twice, as a folder then as a name: counted once)
        assert counted["requests"] == len(gcs_server.log)
    assert counted["bytes"] == sum(r.sent for r in reads)


@pytest.mark.parametrize(("name", "out"), [
    ("dataparallel_cuda2.pth", "o.safetensors"), ("tinynet.safetensors", "o.pt"),
    ("dcp_tinynet", "o.safetensors"), ("deepspeed_zero3", "o.pt")])
def test_convert_from_gs_writes_what_the_local_copy_gives(name: str, out: str, gcs_server: Any,
                                                         run_cli: Any, tmp_path: Path) -> None:
    url = uploaded(gcs_server, name)
    local, from_gs = local_and_remote_outputs(run_cli, tmp_path, ["convert", "IN", "OUT"], url,
                                              str(SAMPLES / name), out)
    same_files(local, from_gs)


def test_a_missing_object_or_bucket_is_not_found(gcs_server: Any, run_cli: Any) -> None:
    bucket = gcs_server.make_bucket()
    gcs_server.put(bucket, "runs/m.pt", (SAMPLES / "dataparallel_cuda2.pth").read_bytes())
    for url in (f"gs://{bucket}/runs/nothing.pt", f"gs://{bucket}/no/such/run",
                "gs://no-such-bucket/m.pt"):
        code, out, err = run_cli("inspect", url)
        assert code == 3, (out, err)
        assert err.splitlines()[0] == f"ckptool: error: {url}: not found", err
        assert err.splitlines()[1].startswith("hint: ") and "Traceback" not in err


@pytest.mark.parametrize("status", [401, 403])
def test_access_denied_is_said_without_gcsfs_tracebacks(status: int, gcs_server: Any,
                                                        run_cli: Any) -> None:
    url = uploaded(gcs_server, "dataparallel_cuda2.pth")
    gcs_server.faults.fail("/download/*", status, times=None)
    code, out, err = run_cli("inspect", url)
    assert code == 3, (out, err)
    assert err.splitlines()[0] == f"ckptool: error: {url}: access denied ({status})", err
    assert "gcloud auth for gs://" in err.splitlines()[1] and len(err.splitlines()) == 2, err


def test_an_object_replaced_between_two_ranges_is_refused(tmp_path: Path, gcs_server: Any,
                                                          run_cli: Any) -> None:
    torch.save({f"l{i}": torch.randn(256, 256) for i in range(8)}, tmp_path / "m.pt")
    data = (tmp_path / "m.pt").read_bytes()  # 2 MiB: its start and its end are two ranges
    bucket = gcs_server.make_bucket()
    first = gcs_server.put(bucket, "m.pt", data)
    gcs_server.faults.after(f"/download/storage/v1/b/{bucket}/o/m.pt",
                            lambda: gcs_server.put(bucket, "m.pt", data[::-1]), requests=1)
    code, out, err = run_cli("inspect", f"gs://{bucket}/m.pt")
    assert gcs_server.generation(bucket, "m.pt") != first
    reads = gcs_server.log.select("GET", "/download/*")
    assert len(reads) >= 2, gcs_server.log.summary()
    assert code == 3, (out, err)
    assert err.splitlines()[0] == (f"ckptool: error: gs://{bucket}/m.pt: "
                                   "the file changed while ckptool read it"), err
    # the second range asked for the generation listed, and was refused
    assert reads[1].query.count(f"ifGenerationMatch={first}") == 1 and reads[1].status == 412
