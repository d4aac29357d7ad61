"""``fix --in-place`` never writes through a link (issue 26, item 3).

A huggingface_hub cache keeps each file once, in ``blobs/`` (named by its
hash), and every revision's ``snapshots/<rev>/`` names it by a symbolic
link. Fixing ``snapshots/rev1`` in place replaces rev1's links with files
of its own: the blobs, and ``rev2`` which links to the same ones, stay
byte for byte as they were. The same for one file that is a symbolic link,
or that has other hard links: the name given gets a new file, its other
names keep the old one, and the report says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import CliResult

hub = pytest.importorskip("huggingface_hub")


def state_dict() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {f"layers.{i}.weight": torch.randn(32, 16, generator=gen) for i in range(6)}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def hf_cache(root: Path, kind: str) -> Path:
    """``models--x/`` as huggingface_hub lays it out: blobs named by their
    sha256, two revisions whose snapshot files link to the same blobs."""
    staging = root / "staging"
    staging.mkdir()
    hub.save_torch_state_dict(state_dict(), staging, max_shard_size="5KB",
                              safe_serialization=kind == "st")
    repo = root / "models--org--model"
    (repo / "blobs").mkdir(parents=True)
    for rev in ("rev1", "rev2"):
        (repo / "snapshots" / rev).mkdir(parents=True)
    for name in sorted(os.listdir(staging)):
        blob = repo / "blobs" / digest(staging / name)
        shutil.move(staging / name, blob)
        for rev in ("rev1", "rev2"):
            os.symlink(f"../../blobs/{blob.name}", repo / "snapshots" / rev / name)
    return repo


def keys(run_cli: Callable[..., CliResult], path: Path) -> set[str]:
    code, out, err = run_cli("inspect", "--json", str(path))
    assert code == 0, err
    return {t["key"] for t in json.loads(out)["tensors"]}


def tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (links as links) and its bytes' digest."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            out[str(path.relative_to(folder))] = "-> " + os.readlink(path)
        elif path.is_file():
            out[str(path.relative_to(folder))] = digest(path)
    return out


@pytest.mark.parametrize("kind", ["st", "bin"])
def test_in_place_in_a_hub_cache_snapshot_leaves_the_blobs_and_other_revisions(
        tmp_path: Path, kind: str, run_cli: Callable[..., CliResult]) -> None:
    repo = hf_cache(tmp_path, kind)
    rev1, rev2 = repo / "snapshots" / "rev1", repo / "snapshots" / "rev2"
    blobs, other = tree(repo / "blobs"), tree(rev2)
    assert all(name == sha for name, sha in blobs.items())  # as the cache names them
    old = set(state_dict())
    code, out, err = run_cli("fix", str(rev1), "--add-prefix", "x.", "--in-place", "--json")
    assert code == 0, err
    assert tree(repo / "blobs") == blobs  # no blob changed: each still matches its name
    assert tree(rev2) == other
    notes = json.loads(out)["notes"]
    assert any("was a symbolic link to ../../blobs/" in n and "untouched" in n
               for n in notes), notes
    assert keys(run_cli, rev2) == old
    assert keys(run_cli, rev1) == {f"x.{k}" for k in old}
    # rev1's files are its own now (every shard changed, and the index)
    assert not any((rev1 / n).is_symlink() for n in os.listdir(rev1))
    net = torch.nn.Module()
    net.x = torch.nn.Module()
    net.x.layers = torch.nn.ModuleList(torch.nn.Module() for _ in state_dict())
    for i, value in enumerate(state_dict().values()):
        net.x.layers[i].register_buffer("weight", torch.zeros_like(value))
    hub.load_torch_model(net, rev1, strict=True, safe=kind == "st")
    assert torch.equal(net.x.layers[1].weight, state_dict()["layers.1.weight"])


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_one_file_that_is_a_link_is_replaced_not_written_through(
        tmp_path: Path, suffix: str, run_cli: Callable[..., CliResult]) -> None:
    """``.pth`` would be rewritten metadata-only (appended to): never through a link."""
    blob = tmp_path / "blob"
    sd = {f"module.{k}": v for k, v in state_dict().items()}
    if suffix == ".pth":
        torch.save(sd, blob)
    else:
        from safetensors.torch import save_file

        save_file(sd, blob)
    before = digest(blob)
    link = tmp_path / f"model{suffix}"
    link.symlink_to(blob.name)
    code, out, err = run_cli("fix", str(link), "--strip-module", "--in-place", "--json")
    assert code == 0, err
    assert digest(blob) == before
    notes = json.loads(out)["notes"]
    assert f"{link} was a symbolic link to blob: it is now a file of its own, and the file " \
        "it shared is untouched" in notes, notes
    assert not link.is_symlink()
    assert keys(run_cli, link) == set(state_dict())
    assert keys(run_cli, blob) == set(sd)


def test_one_file_with_another_hard_link_keeps_it(tmp_path: Path,
                                                  run_cli: Callable[..., CliResult]) -> None:
    path = tmp_path / "model.pth"
    torch.save({f"module.{k}": v for k, v in state_dict().items()}, path)
    other = tmp_path / "backup.pth"
    os.link(path, other)
    before = digest(other)
    code, out, err = run_cli("fix", str(path), "--strip-module", "--in-place", "--json")
    assert code == 0, err
    assert digest(other) == before and os.stat(other).st_nlink == 1
    report = json.loads(out)
    assert not report["metadata_only"]  # appending would change backup.pth too
    assert any("had 1 other hard link" in n for n in report["notes"]), report["notes"]
    assert keys(run_cli, path) == set(state_dict())
