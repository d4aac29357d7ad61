"""``ckptool verify`` of a Hugging Face cache snapshot: each file against its
blob's name (sha256 of an LFS file, git's SHA-1 of a small one), links
whose blob is gone, and downloads killed before their end.

huggingface_hub has no way to fill its cache without the network, so the
cache is laid out here as ``hf_hub_download`` lays it out (``blobs/<etag>``,
``snapshots/<commit>/<file>`` relative links, ``refs/main``), with shards
``save_torch_state_dict`` wrote; huggingface_hub's own ``scan_cache_dir``
and ``try_to_load_from_cache`` read it back as a valid cache first.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CliResult
from helpers import small_sharded_model

from ckptool.check.verify.hfcache import locate
from ckptool.check.verify.structure import check

REPO_ID, COMMIT = "org/tiny", "0123456789abcdef0123456789abcdef01234567"


def etag(name: str, data: bytes) -> str:
    """The name huggingface_hub gives a blob: the LFS sha256 of the weights,
    git's blob SHA-1 of a small text file."""
    if name.endswith((".safetensors", ".bin")):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """A cache holding one snapshot of a sharded model; returns the repo's folder."""
    import huggingface_hub

    source = small_sharded_model(tmp_path / "source")
    repo = tmp_path / "hub" / f"models--{REPO_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    snapshot.mkdir(parents=True)
    for item in sorted(source.iterdir()):
        data = item.read_bytes()
        blob = repo / "blobs" / etag(item.name, data)
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / item.name)
    (repo / "refs" / "main").write_text(COMMIT)
    info = huggingface_hub.scan_cache_dir(tmp_path / "hub")
    assert not info.warnings and [r.repo_id for r in info.repos] == [REPO_ID]
    assert huggingface_hub.try_to_load_from_cache(REPO_ID, "config.json",
                                                  cache_dir=tmp_path / "hub") == str(
        snapshot / "config.json")
    return repo


def snapshot_of(repo: Path) -> Path:
    return repo / "snapshots" / COMMIT


def blob_of(repo: Path, name: str) -> Path:
    return repo / "blobs" / os.readlink(snapshot_of(repo) / name).rsplit("/", 1)[-1]


def test_a_whole_snapshot_is_checked_against_its_blobs(cache: Path) -> None:
    report = check(str(snapshot_of(cache)), 2)
    assert report.ok and not report.problems
    assert report.layout == "hf-safetensors" and "hf-cache" in report.checks
    blobs = sum(p.stat().st_size for p in (cache / "blobs").iterdir())
    assert report.bytes_checked == blobs  # every blob hashed (the shards hold no CRC)
    assert not report.notes  # their sha256 is a checksum: nothing left unchecked


def test_the_repository_folder_stands_for_its_main_snapshot(cache: Path) -> None:
    found = locate(str(cache))
    assert found is not None and found.target == str(snapshot_of(cache))
    assert check(str(cache), 1).ok


def test_a_blob_that_no_longer_hashes_to_its_name(cache: Path) -> None:
    shard = sorted(n for n in os.listdir(snapshot_of(cache)) if n.endswith(".safetensors"))[0]
    with open(blob_of(cache, shard), "r+b") as f:  # a flipped tensor byte: the header holds
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte ^ 0x01]))
    config = blob_of(cache, "config.json")
    config.write_text(config.read_text().replace("llama", "llamb"))  # git SHA-1 named
    report = check(str(snapshot_of(cache)), 2)
    assert {(p.kind, p.file) for p in report.problems} == {("blob-hash", shard),
                                                          ("blob-hash", "config.json")}
    assert "not to its name" in report.problems[0].message


def test_an_interrupted_download_and_a_blob_gone(cache: Path) -> None:
    shards = sorted(n for n in os.listdir(snapshot_of(cache)) if n.endswith(".safetensors"))
    blob = blob_of(cache, shards[1])
    # what hf_hub_download leaves when it is killed mid-file: <etag>.<id>.incomplete
    partial = cache / "blobs" / f"{blob.name}.5f3a9c1e.incomplete"
    partial.write_bytes(blob.read_bytes()[:1000])
    blob.unlink()
    report = check(str(snapshot_of(cache)), 1)
    assert {(p.kind, p.file) for p in report.problems} == {
        ("missing-file", shards[1]),  # said once, by the cache
        ("incomplete-download", f"{cache.name}/blobs/{partial.name}")}


def test_a_download_killed_before_any_weights_is_a_problem_not_exit_3(cache: Path) -> None:
    """The snapshot holds only config.json: the checkpoint is nowhere, and
    the unfinished download says why."""
    snapshot = snapshot_of(cache)
    for name in os.listdir(snapshot):
        if name != "config.json":
            blob = blob_of(cache, name)
            os.rename(blob, f"{blob}.0badf00d.incomplete")
            os.unlink(snapshot / name)
    report = check(str(snapshot), 1)
    assert not report.ok
    assert {p.kind for p in report.problems} == {"incomplete-download", "unreadable"}


def test_one_file_of_a_snapshot(cache: Path) -> None:
    shard = sorted(n for n in os.listdir(snapshot_of(cache)) if n.endswith(".safetensors"))[0]
    # another file's download, killed: no concern of this file, downloaded whole
    shutil.copy(blob_of(cache, "config.json"), cache / "blobs" / f"{'f' * 64}.1.incomplete")
    report = check(str(snapshot_of(cache) / shard), 1)
    assert report.ok and report.layout == "safetensors"
    assert report.bytes_checked == blob_of(cache, shard).stat().st_size


def test_cli_on_a_cache(cache: Path, run_cli: Callable[..., CliResult]) -> None:
    code, out, err = run_cli("verify", str(snapshot_of(cache)))
    assert (code, err) == (0, "") and out.startswith("ok  ")
    blob = blob_of(cache, "config.json")
    blob.write_text("{}")
    code, out, _ = run_cli("verify", str(cache))
    assert code == 1
    assert "problem  config.json: its blob" in out


def test_a_snapshot_named_by_a_relative_path_has_its_blobs_hashed(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = snapshot_of(cache)
    monkeypatch.chdir(snapshot.parent)
    report = check(snapshot.name, 2)
    assert report.bytes_checked == sum(p.stat().st_size for p in (cache / "blobs").iterdir())
    monkeypatch.chdir(snapshot)
    assert check(".", 2).bytes_checked == report.bytes_checked
