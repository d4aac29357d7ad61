"""``ckptool verify URL``: a checkpoint behind a URL is verified as its
local copy is, from its structure alone by default (no tensor byte read:
the bytes read are a small part of the file), every byte once with
``--full`` (zip records against their CRC-32, Hub LFS files against the
sha256 the Hub lists, in large ranges), and against a local manifest with
``--manifest``; a damaged remote byte is exit 1 naming the file, a missing
one exit 3."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptool.read import remote
from ckptool.read.remote import stream

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
CASES = ["lightning.ckpt", "tinynet.safetensors", "legacy_compiled_ddp.pth", "dcp_tinynet",
         "deepspeed_zero3"]
NOT_READ = "structure checked; tensor bytes not read (--full reads them)"


pytestmark = pytest.mark.usefixtures("fresh_remote")


def verify_json(run_cli: Any, *args: str) -> tuple[int, dict[str, Any]]:
    code, out, err = run_cli("verify", "--json", *args)
    assert code in (0, 1), err
    return code, json.loads(out)


def flipped(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1:]


def big_zip(path: Path) -> Path:
    torch.save({f"layer{i}.weight": torch.randn(256, 256) for i in range(40)}, path)  # ~10 MB
    return path


@pytest.mark.parametrize("name", CASES)
def test_verify_of_a_url_finds_what_the_local_copy_shows(name: str, s3_server: Any,
                                                         run_cli: Any) -> None:
    bucket = s3_server.make_bucket()
    local = SAMPLES / name
    s3_server.upload(local, bucket, f"runs/{name}" if local.is_dir() else "runs")
    url = f"s3://{bucket}/runs/{name}"
    code, got = verify_json(run_cli, url)
    local_code, want = verify_json(run_cli, str(local))
    assert code == local_code == 0
    for key in ("layout", "ok", "files", "tensors", "problems"):
        assert got[key] == want[key], key
    assert got["bytes_checked"] == 0 and "crc" not in got["checks"]
    assert any("tensor bytes not read" in n for n in got["notes"])
    assert got["remote"]["bytes_read"] is False and got["remote"]["requests"] >= 1
    code, full = verify_json(run_cli, url, "--full")
    assert code == 0
    assert (full["bytes_checked"], full["checks"]) == (want["bytes_checked"], want["checks"])


def test_default_verify_reads_no_tensor_bytes(tmp_path: Path, http_server: Any,
                                              run_cli: Any) -> None:
    path = big_zip(tmp_path / "m.pt")
    url = http_server.put("m.pt", path.read_bytes())
    code, out, err = run_cli("verify", url)
    assert code == 0, err
    assert out.splitlines()[0] == f"ok  {url} · torch-zip · 1 file · 40 tensors · {NOT_READ}"
    assert out.splitlines()[-1].startswith("read remotely: ")
    sent = http_server.log.bytes_sent()
    assert sent < path.stat().st_size / 20, http_server.log.summary()


def test_full_reads_each_byte_once_in_large_ranges_and_finds_a_flipped_byte(
        tmp_path: Path, http_server: Any, run_cli: Any) -> None:
    path = big_zip(tmp_path / "m.pt")
    data = path.read_bytes()
    url = http_server.put("m.pt", data)
    code, report = verify_json(run_cli, url, "--full")
    assert code == 0 and "crc" in report["checks"] and report["bytes_checked"] > 10 << 20
    gets = http_server.log.select("GET")
    big = [g for g in gets if g.sent > 1 << 20]
    assert big and all(g.sent <= stream.BLOCK for g in big), http_server.log.summary()
    # every byte once, and the structure's few pieces: not twice the file
    assert http_server.log.bytes_sent() < len(data) * 1.1, http_server.log.summary()

    at = len(data) // 2  # inside a tensor's record
    http_server.replace("m.pt", flipped(data, at))
    remote.forget()
    code, out, _ = run_cli("verify", url)
    assert code == 0  # its structure is whole: the bytes were not read
    code, out, _ = run_cli("verify", url, "--full")
    assert code == 1
    assert "problem  m.pt: " in out and "does not match its CRC-32" in out, out
    assert out.splitlines()[-2].startswith("damaged  "), out


def hub_repo(tmp_path: Path, fake_hub: Any) -> tuple[Path, str]:
    folder = tmp_path / "tiny"
    folder.mkdir()
    from safetensors.torch import save_file

    save_file({"w": torch.randn(64, 64), "b": torch.randn(64)},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"model_type": "tiny"}')
    fake_hub.add_repo("acme/tiny", folder)
    return folder, "hf://acme/tiny"


def test_full_compares_each_hub_file_with_the_hubs_sha256(tmp_path: Path, fake_hub: Any,
                                                         run_cli: Any) -> None:
    folder, url = hub_repo(tmp_path, fake_hub)
    code, report = verify_json(run_cli, url, "--full")
    assert code == 0 and "store-sha256" in report["checks"], report
    assert not any("safetensors files record no checksum" in n for n in report["notes"])

    data = (folder / "model.safetensors").read_bytes()
    blob = fake_hub._blobs[hashlib.sha256(data).hexdigest()]
    blob.data = flipped(data, len(data) - 100)  # a tensor's byte; the Hub's sha256 unchanged
    remote.forget()
    code, report = verify_json(run_cli, url)
    assert code == 0  # a safetensors file has no checksum of its own
    remote.forget()
    code, out, _ = run_cli("verify", url, "--full")
    assert code == 1, out
    assert "problem  model.safetensors: its bytes hash to " in out
    assert "not to the sha256 the store lists for it" in out


def test_manifest_is_checked_against_a_remote_copy_hashed_once(tmp_path: Path, s3_server: Any,
                                                              run_cli: Any) -> None:
    folder = tmp_path / "dcp"
    shutil.copytree(SAMPLES / "dcp_tinynet", folder)
    manifest = tmp_path / "m.json"
    code, _, err = run_cli("verify", str(folder), "--write-manifest", str(manifest))
    assert code == 0, err
    bucket = s3_server.make_bucket()
    s3_server.upload(folder, bucket, "run/step")
    url = f"s3://{bucket}/run/step"
    code, report = verify_json(run_cli, url, "--full", "--manifest", str(manifest))
    assert code == 0 and "manifest" in report["checks"], report
    remote.forget()
    code, alone = verify_json(run_cli, url, "--full")
    # the rank file hashed once, by --full; .metadata (no CRC of its own) by the manifest
    extra = report["remote"]["bytes"] - alone["remote"]["bytes"]
    assert extra == (folder / ".metadata").stat().st_size

    rank = folder / "__0_0.distcp"
    s3_server.put(bucket, "run/step/__0_0.distcp", flipped(rank.read_bytes(), 2000))
    remote.forget()
    code, report = verify_json(run_cli, url, "--manifest", str(manifest))
    assert code == 1
    assert any(p["kind"] == "manifest-file" and p["file"] == "__0_0.distcp"
               for p in report["problems"]), report["problems"]


def test_a_missing_rank_file_is_damage_and_a_missing_url_unreadable(s3_server: Any,
                                                                   run_cli: Any) -> None:
    bucket = s3_server.make_bucket()
    s3_server.upload(SAMPLES / "dcp_tinynet", bucket, "run/step")
    s3_server.client.delete_object(Bucket=bucket, Key="run/step/__0_0.distcp")
    code, out, _ = run_cli("verify", f"s3://{bucket}/run/step")
    assert code == 1
    assert "problem  __0_0.distcp: the file is missing" in out, out
    code, _, err = run_cli("verify", f"s3://{bucket}/run/no-such-step")
    assert code == 3
    assert err.startswith(f"ckptool: error: s3://{bucket}/run/no-such-step: not found"), err


def test_a_url_is_verified_by_one_process(http_server: Any, run_cli: Any) -> None:
    url = http_server.put("t.safetensors", (SAMPLES / "tinynet.safetensors").read_bytes())
    code, _, err = run_cli("verify", url, "--workers", "2")
    assert code == 2
    assert "a URL is verified by one process" in err


def test_the_records_of_a_remote_zip_are_checked_many_at_once(tmp_path: Path) -> None:
    """The local header and data descriptor of each of a zip's records are
    asked for several at a time, not one round trip after another."""
    import threading
    import time

    from remote_servers import RangeHTTPServer

    from ckptool.cli import main

    class Counting(RangeHTTPServer):
        in_flight = most = 0
        lock = threading.Lock()

        def handle(self, req: Any) -> Any:
            with self.lock:
                Counting.in_flight += 1
                Counting.most = max(Counting.most, Counting.in_flight)
            try:
                time.sleep(0.02)  # (a round trip: requests overlap only if made at once)
                return super().handle(req)
            finally:
                with self.lock:
                    Counting.in_flight -= 1

    torch.save({f"l{i}": torch.randn(64, 64) for i in range(40)}, tmp_path / "m.pt")
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(tmp_path / "m.pt", root / "m.pt")
    server = Counting(root)
    try:
        assert main(["verify", server.url_for("m.pt")]) == 0
    finally:
        server.close()
    assert Counting.most >= 4
