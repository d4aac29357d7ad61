"""``ckptool verify SNAPSHOT --against-hub``: a Hugging Face cache snapshot
against the Hub's own listing of its commit, with one repository-info
request and one listing, and no file downloaded.

The cache is written by huggingface_hub itself (``snapshot_download``)
from the fake Hub (``fake_hub``), LFS files served straight from
``resolve``: the fake Hub's CDN redirect stays on its own host, where
huggingface_hub 2.x follows it for the metadata and misses the commit
header. Then the fake Hub's log is emptied, and what verify asks of it is
all it shows."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import CliResult
from helpers import small_sharded_model

pytestmark = pytest.mark.usefixtures("fresh_remote")

REPO_ID = "org/tiny"


@pytest.fixture
def snapshot(fake_hub: Any, tmp_path: Path) -> Path:
    """A cache snapshot of org/tiny's only commit, as snapshot_download writes it."""
    import huggingface_hub

    source = small_sharded_model(tmp_path / "source")
    sha = fake_hub.add_repo(REPO_ID, source)
    fake_hub.redirect_lfs = False
    folder = Path(huggingface_hub.snapshot_download(REPO_ID, revision=sha,
                                                    cache_dir=tmp_path / "hub"))
    assert folder.name == sha and folder.parent.parent.name == "models--org--tiny"
    assert all((folder / p.name).is_symlink() for p in source.iterdir())
    fake_hub.log.clear()
    return folder


def downloaded(fake_hub: Any) -> list[str]:
    """What the fake Hub served of files' bytes."""
    return [e for e in fake_hub.log.summary() if "/resolve/" in e or "/cdn-lfs/" in e]


def verify_json(run_cli: Callable[..., CliResult], path: Path,
                *extra: str) -> tuple[int, dict[str, Any]]:
    code, out, err = run_cli("verify", str(path), "--against-hub", "--json", *extra)
    assert code in (0, 1), err
    return code, json.loads(out)


def problems(report: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["kind"], p["file"]) for p in report["problems"]]


def new_blob(folder: Path, name: str, data: bytes) -> None:
    """Point ``name`` at a blob of ``data`` named by its sha256, as a cache
    holding another commit's file would: the cache alone finds nothing."""
    blob = folder.parent.parent / "blobs" / hashlib.sha256(data).hexdigest()
    blob.write_bytes(data)
    (folder / name).unlink()
    os.symlink(os.path.relpath(blob, folder), folder / name)


def test_an_identical_snapshot_is_whole_from_two_requests_and_no_download(
        snapshot: Path, fake_hub: Any, run_cli: Callable[..., CliResult],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptool.check.verify import hfcache

    made: list[str] = []  # the hashes computed: each blob's once, for both checks

    class Counting:
        @staticmethod
        def sha256() -> Any:
            made.append("sha256")
            return hashlib.sha256()

        @staticmethod
        def sha1(**kwargs: Any) -> Any:
            made.append("sha1")
            return hashlib.sha1(**kwargs)

    monkeypatch.setattr(hfcache, "hashlib", Counting)
    code, report = verify_json(run_cli, snapshot)
    assert sorted(made) == ["sha1"] * 2 + ["sha256"] * 3
    assert code == 0 and report["ok"] and report["problems"] == []
    assert "hub" in report["checks"] and "hf-cache" in report["checks"]
    sha = snapshot.name
    assert report["hub"] == {"url": f"hf://{REPO_ID}@{sha}", "repo": REPO_ID,
                             "repo_type": "model", "commit": sha, "files_listed": 5,
                             "files_compared": 5, "sha256_compared": 3}
    # every blob hashed once: the cache check's digests were reused
    assert report["bytes_checked"] == sum(f.stat().st_size for f in snapshot.iterdir())
    assert downloaded(fake_hub) == []
    assert [(e.method, e.path) for e in fake_hub.log.entries] == [
        ("GET", f"/api/models/{REPO_ID}/revision/{sha}"),
        ("GET", f"/api/models/{REPO_ID}/tree/{sha}")], fake_hub.log.summary()


def test_the_text_report_says_what_the_hub_listed(
        snapshot: Path, run_cli: Callable[..., CliResult]) -> None:
    code, out, _ = run_cli("verify", str(snapshot), "--against-hub")
    sha = snapshot.name
    assert code == 0
    assert out.splitlines()[0].endswith("· against the Hub")
    assert f"hub  hf://{REPO_ID}@{sha}: 5 files listed, 5 compared by content (3 by LFS " \
           "sha256, 2 by git blob id); no file downloaded" in out


def test_a_file_missing_from_the_snapshot_is_named(
        snapshot: Path, run_cli: Callable[..., CliResult]) -> None:
    (snapshot / "config.json").unlink()
    code, report = verify_json(run_cli, snapshot)
    assert code == 1 and problems(report) == [("missing-file", "config.json")]
    assert "the Hub lists it" in report["problems"][0]["message"]


def test_a_shard_missing_is_said_once(snapshot: Path,
                                      run_cli: Callable[..., CliResult]) -> None:
    (snapshot / "model-00002-of-00003.safetensors").unlink()
    code, report = verify_json(run_cli, snapshot)
    assert code == 1
    assert problems(report) == [("missing-file", "model-00002-of-00003.safetensors")]


def test_a_file_the_hub_does_not_list_is_named(
        snapshot: Path, run_cli: Callable[..., CliResult]) -> None:
    (snapshot / "notes.txt").write_text("mine\n")
    code, report = verify_json(run_cli, snapshot)
    assert code == 1 and problems(report) == [("extra-file", "notes.txt")]


def test_a_blob_changed_in_place_is_said_once(
        snapshot: Path, run_cli: Callable[..., CliResult]) -> None:
    blob = (snapshot / "model-00001-of-00003.safetensors").resolve()
    data = bytearray(blob.read_bytes())
    data[-5] ^= 1
    blob.write_bytes(bytes(data))
    code, report = verify_json(run_cli, snapshot)
    assert code == 1
    assert problems(report) == [("blob-hash", "model-00001-of-00003.safetensors")]


def test_a_file_of_another_commit_differs_from_the_hubs_sha256(
        snapshot: Path, run_cli: Callable[..., CliResult]) -> None:
    name = "model-00002-of-00003.safetensors"
    want = os.readlink(snapshot / name).rsplit("/", 1)[-1]  # the Hub's sha256
    data = bytearray((snapshot / name).read_bytes())
    data[-5] ^= 1  # (same size, a blob named by its own sha256: the cache alone sees nothing)
    new_blob(snapshot, name, bytes(data))
    code, out, _ = run_cli("verify", str(snapshot))
    assert code == 0, out
    code, report = verify_json(run_cli, snapshot)
    assert code == 1 and problems(report) == [("blob-hash", name)]
    assert f"the Hub lists {want[:12]}…" in report["problems"][0]["message"]


def test_a_small_file_of_another_commit_differs_from_the_hubs_blob_id(
        snapshot: Path, run_cli: Callable[..., CliResult]) -> None:
    text = b'{"model_type": "gpt-j"}\n'  # (the same size as the listed config.json)
    assert len(text) == (snapshot / "config.json").stat().st_size
    blob = snapshot.parent.parent / "blobs" / hashlib.sha1(
        b"blob %d\0" % len(text) + text, usedforsecurity=False).hexdigest()
    blob.write_bytes(text)
    (snapshot / "config.json").unlink()
    os.symlink(os.path.relpath(blob, snapshot), snapshot / "config.json")
    code, report = verify_json(run_cli, snapshot)
    assert code == 1 and problems(report) == [("blob-hash", "config.json")]
    assert "git blob id" in report["problems"][0]["message"]


def test_a_file_of_another_size_is_named(snapshot: Path,
                                         run_cli: Callable[..., CliResult]) -> None:
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").write_text('{"model_type": "llama", "layers": 2}\n')
    code, report = verify_json(run_cli, snapshot)
    assert code == 1 and problems(report) == [("size", "config.json")]


def test_a_commit_the_hub_does_not_have_is_exit_3(
        snapshot: Path, fake_hub: Any, run_cli: Callable[..., CliResult]) -> None:
    other = snapshot.parent / ("f" * 40)
    snapshot.rename(other)
    code, out, err = run_cli("verify", str(other), "--against-hub")
    assert code == 3 and out == ""
    assert f"hf://{REPO_ID}@{'f' * 40}: the Hub's {REPO_ID} has no commit {'f' * 40}" in err
    assert downloaded(fake_hub) == []


def test_a_repository_the_hub_does_not_have_is_exit_3(
        snapshot: Path, run_cli: Callable[..., CliResult]) -> None:
    repo = snapshot.parent.parent
    repo.rename(repo.parent / "models--org--gone")
    code, _, err = run_cli("verify", str(repo.parent / "models--org--gone"), "--against-hub")
    assert code == 3 and f"hf://org/gone@{snapshot.name}: not found" in err


def test_the_hub_unreachable_is_exit_3(snapshot: Path, monkeypatch: pytest.MonkeyPatch,
                                        run_cli: Callable[..., CliResult]) -> None:
    from huggingface_hub import constants

    from ckptool.read.remote import stores

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # (nothing listens)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    stores.drop()
    code, _, err = run_cli("verify", str(snapshot), "--against-hub")
    assert code == 3 and f"hf://{REPO_ID}@{snapshot.name}: no answer" in err, err


def test_a_folder_that_is_no_cache_snapshot_is_a_usage_error(
        snapshot: Path, run_cli: Callable[..., CliResult]) -> None:
    source = snapshot.parent.parent.parent.parent / "source"
    code, out, err = run_cli("verify", str(source), "--against-hub")
    assert code == 2 and out == ""
    assert "is not in a Hugging Face cache snapshot" in err and "hint:" in err
    assert "Traceback" not in err


def test_a_file_of_the_snapshot_is_compared_alone(
        snapshot: Path, fake_hub: Any, run_cli: Callable[..., CliResult]) -> None:
    (snapshot / "config.json").unlink()  # (not the file asked about)
    code, report = verify_json(run_cli, snapshot / "model-00001-of-00003.safetensors")
    assert code == 0 and report["problems"] == []
    assert (report["hub"]["files_listed"], report["hub"]["files_compared"]) == (1, 1)
    assert downloaded(fake_hub) == []


def test_against_hub_on_many_processes_is_a_usage_error(
        snapshot: Path, run_cli: Callable[..., CliResult]) -> None:
    code, out, err = run_cli("verify", str(snapshot), "--against-hub", "--workers", "2")
    assert code == 2 and out == "" and "Traceback" not in err
    assert "--against-hub are not run on many processes" in err
