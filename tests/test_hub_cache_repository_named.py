"""A Hugging Face cache repository (``models--org--name/``) or its
``snapshots/`` holds the model one level down, in the snapshot refs/main
names: every command refuses it in one line whose hint names that snapshot
(as ``verify`` reads it), never "no checkpoint in it"."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CliResult

import ckptool
from ckptool.errors import EXIT_BAD_INPUT, InputError

MODEL = Path(__file__).resolve().parent / "fixtures" / "frameworks" / "llama_tied"
MAIN, OLD = "0" * 39 + "1", "f" * 40


def snapshot(repo: Path, commit: str) -> Path:
    """``snapshots/<commit>/`` of ``repo``: links to its blobs, as huggingface_hub lays them."""
    folder = repo / "snapshots" / commit
    folder.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for item in sorted(MODEL.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(item.read_bytes()).hexdigest()
        shutil.copyfile(item, blob)
        os.symlink(os.path.relpath(blob, folder), folder / item.name)
    return folder


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot(repo, OLD)
    snapshot(repo, MAIN)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    return repo


@pytest.mark.parametrize("given", ["", "snapshots"])
def test_the_repository_and_its_snapshots_name_refs_main(repo: Path, given: str) -> None:
    path = repo / given if given else repo
    with pytest.raises(InputError) as raised:
        ckptool.open(path)
    assert f"its files are in snapshots/{MAIN} (the revision refs/main names)" in \
        raised.value.message
    assert raised.value.hint == f"name it: ckptool inspect {repo}/snapshots/{MAIN}"
    assert ckptool.open(repo / "snapshots" / MAIN).framework is not None  # the hint reads


def test_the_cli_says_it_in_one_line(repo: Path, run_cli: Callable[..., CliResult]) -> None:
    for command in ("inspect", "diagnose"):
        code, out, err = run_cli(command, str(repo))
        assert (code, out) == (EXIT_BAD_INPUT, "")
        assert err.startswith(f"ckptool: error: {repo} is a Hugging Face cache repository")
        assert err.count("\n") == 2 and f"snapshots/{MAIN}" in err.splitlines()[1]


def test_without_refs_main(repo: Path) -> None:
    (repo / "refs" / "main").unlink()
    with pytest.raises(InputError) as raised:
        ckptool.open(repo)
    assert "2 snapshots and no refs/main naming one" in raised.value.message
    shutil.rmtree(repo / "snapshots" / OLD)
    with pytest.raises(InputError) as raised:
        ckptool.open(repo)
    assert f"snapshots/{MAIN} (its only snapshot)" in raised.value.message
