"""``ckptool diff`` by manifests (issue 28 item 3): with a manifest on both
sides (given, or ``<PATH>.manifest.json`` beside each), values are told by
the tensor digests and no tensor byte is read; a manifest that no longer
describes its checkpoint (a size, a file modified since, a tensor) is left
aside with a note and values are read."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ckptool
from ckptool.check.verify import manifest
from ckptool.read.tensor_source import TensorValues

CliRun = Callable[..., tuple[int, str, str]]


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"fc.weight": torch.randn(4, 3, generator=g), "fc.bias": torch.randn(3, generator=g),
            "steps": torch.arange(5), "half": torch.randn(6, generator=g).half()}


def with_manifest(path: Path, dest: Path | None = None) -> Path:
    dest = dest or Path(str(path) + ".manifest.json")
    manifest.write_manifest(ckptool.open(path), str(dest), 1)
    return dest


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    """The same weights as torch.save and safetensors, fc.bias changed in B;
    each with its manifest beside it."""
    a, b = tmp_path / "a.pth", tmp_path / "b.safetensors"
    torch.save({"w": weights(), "note": "x"}, a)
    changed = weights()
    changed["fc.bias"][1] += 1
    save_file(changed, str(b))
    with_manifest(a), with_manifest(b)
    return a, b


@pytest.fixture
def no_reads(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Call it to make any read of a tensor's values fail the test."""
    def refuse(*args: object, **kw: object) -> None:
        raise AssertionError("a tensor's bytes were read")

    def forbid() -> None:
        monkeypatch.setattr(TensorValues, "values", refuse)
        monkeypatch.setattr(TensorValues, "__enter__", refuse)

    return forbid


def test_digests_tell_values_without_reading(run_cli: CliRun, pair: tuple[Path, Path],
                                            no_reads: Callable[[], None], tmp_path: Path) -> None:
    a, b = pair
    same = tmp_path / "same.safetensors"
    save_file(weights(), str(same))
    with_manifest(same)
    no_reads()
    rc, out, err = run_cli("diff", "--json", str(a), str(b))
    assert rc == 1, err
    report = json.loads(out)
    assert report["values_by_digest"] is True
    assert [c["name"] for c in report["changed"]] == ["fc.bias"]
    values = report["changed"][0]["values"]
    assert (values["status"], values["by_digest"], values["num_different"]) == (
        "different", True, None)
    assert report["num_identical"] == 3
    assert "no tensor bytes read" in report["manifest_notes"][0]
    rc, out, _ = run_cli("diff", str(a), str(b))
    assert rc == 1 and "differ (digest)" in out and "manifest digests" in out
    # the same weights in both layouts: equal, exit 0
    rc, out, err = run_cli("diff", "--json", str(a), str(same))
    assert rc == 0, err
    assert json.loads(out)["num_identical"] == 4


def test_manifests_given_elsewhere(run_cli: CliRun, pair: tuple[Path, Path],
                                   no_reads: Callable[[], None], tmp_path: Path) -> None:
    a, b = pair
    ma, mb = with_manifest(a, tmp_path / "ma.json"), with_manifest(b, tmp_path / "mb.json")
    os.remove(str(a) + ".manifest.json")
    os.remove(str(b) + ".manifest.json")
    no_reads()
    rc, out, err = run_cli("diff", "--json", str(a), str(b), "--manifest-a", str(ma),
                           "--manifest-b", str(mb))
    assert rc == 1, err
    assert json.loads(out)["values_by_digest"] is True


def test_values_read_where_digests_cannot_tell(run_cli: CliRun, tmp_path: Path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(weights(), str(a))
    other = weights()
    other["half"] = other["half"].float()  # another dtype, the same values
    save_file(other, str(b))
    with_manifest(a), with_manifest(b)
    rc, out, err = run_cli("diff", "--json", str(a), str(b))
    report = json.loads(out)
    assert rc == 1, err  # the dtype changed
    [change] = report["changed"]
    assert change["changes"] == ["dtype"] and change["values"]["status"] == "equal"
    assert change["values"]["by_digest"] is False
    assert "values of 1 pair read" in report["manifest_notes"][0]


def test_a_manifest_that_no_longer_matches_is_not_trusted(run_cli: CliRun,
                                                          tmp_path: Path) -> None:
    a, b = tmp_path / "a.pth", tmp_path / "b.pth"
    torch.save({"w": weights(), "note": "x"}, a)
    torch.save({"w": weights(), "note": "x"}, b)
    with_manifest(a), with_manifest(b)
    written = os.stat(b).st_mtime
    changed = weights()
    changed["fc.weight"][0, 0] += 1
    torch.save({"w": changed, "note": "x" * 300}, b)  # another size
    os.utime(b, (written, written))  # not newer: the size alone tells
    assert os.path.getsize(b) != json.loads(Path(str(b) + ".manifest.json").read_text())[
        "files"]["b.pth"]["size"]
    rc, out, err = run_cli("diff", "--json", str(a), str(b))
    report = json.loads(out)
    assert rc == 1, err
    assert report["values_by_digest"] is False
    assert "B's" in report["manifest_notes"][0] and "not trusted" in report["manifest_notes"][0]
    assert "b.pth is" in report["manifest_notes"][0] and "bytes" in report["manifest_notes"][0]
    [change] = report["changed"]
    assert change["values"]["num_different"] == 1  # read: how many is known

    # the same size, written after the manifest: modified since
    torch.save({"w": changed, "note": "x"}, b)
    os.utime(b, (written + 10, written + 10))
    rc, out, _ = run_cli("diff", "--json", str(a), str(b))
    report = json.loads(out)
    assert "modified after the manifest" in report["manifest_notes"][0]
    assert report["changed"][0]["values"]["num_different"] == 1

    # changed in place, its times set back as they were (touch -r, rsync -a):
    # the change time still tells
    with_manifest(b)
    st = os.stat(b)
    time.sleep(0.02)
    changed["fc.weight"][0, 0] += 1
    torch.save({"w": changed, "note": "x"}, b)  # the same size
    assert os.stat(b).st_size == st.st_size
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns))
    rc, out, _ = run_cli("diff", "--json", str(a), str(b))
    assert "modified after the manifest" in json.loads(out)["manifest_notes"][0]


def test_one_side_only_and_bad_manifests(run_cli: CliRun, pair: tuple[Path, Path],
                                         tmp_path: Path) -> None:
    a, b = pair
    os.remove(str(b) + ".manifest.json")
    report = json.loads(run_cli("diff", "--json", str(a), str(b))[1])
    assert report["values_by_digest"] is False
    assert report["manifest_notes"] == [f"only A has one ({a}.manifest.json); B has none: "
                                        "values read"]
    Path(str(b) + ".manifest.json").write_text("{}")  # found beside: left aside
    report = json.loads(run_cli("diff", "--json", str(a), str(b))[1])
    assert "not used" in report["manifest_notes"][0]
    assert report["changed"][0]["values"]["num_different"] == 1
    rc, _, err = run_cli("diff", str(a), str(b), "--manifest-b", str(tmp_path / "none.json"))
    assert rc == 2 and "cannot read the manifest" in err
    report = json.loads(run_cli("diff", "--json", "--no-values", str(a), str(b))[1])
    assert report["manifest_notes"] == [] and report["values_compared"] is False


def test_directory_manifest_beside_it(run_cli: CliRun, tmp_path: Path,
                                      no_reads: Callable[[], None]) -> None:
    from huggingface_hub import save_torch_state_dict

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    save_torch_state_dict(weights(), a, max_shard_size=100)
    save_torch_state_dict(weights(), b, max_shard_size=200)
    with_manifest(a, tmp_path / "a.manifest.json")
    with_manifest(b, tmp_path / "b.manifest.json")
    no_reads()
    rc, out, err = run_cli("diff", "--json", f"{a}/", str(b))
    assert rc == 0, err
    assert json.loads(out)["values_by_digest"] is True
