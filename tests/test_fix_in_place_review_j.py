"""``fix --in-place`` and its journal, as a second review broke them:
shards outside the directory, a single-file fix inside a directory with a
journal, a Ctrl-C after a fix settled its own earlier crash, and readers
while a fix commits."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CliResult
from test_fix_in_place_dir import ARGS, make_shards

hub = pytest.importorskip("huggingface_hub")


# --- D4: shards in a subfolder ------------------------------------------------

def test_in_place_refuses_shards_outside_the_directory(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    folder = tmp_path / "shards"
    folder.mkdir()
    make_shards(folder / "sub", "st")
    index_name = "model.safetensors.index.json"
    index = json.loads((folder / "sub" / index_name).read_text())
    index["weight_map"] = {k: f"sub/{v}" for k, v in index["weight_map"].items()}
    (folder / "sub" / index_name).unlink()
    (folder / index_name).write_text(json.dumps(index))
    code, _, err = run_cli("inspect", str(folder))
    assert code == 0, err  # it reads
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    code, _, err = run_cli("fix", str(folder), *ARGS)
    assert code == 3, err
    lines = err.splitlines()
    assert lines[0].startswith(f"ckptool: error: {folder}: its index names shard 'sub/"), err
    assert "not a file of the directory itself" in lines[0]
    assert lines[1] == f"hint: write a fixed copy instead: ckptool fix {folder} -o DIR"
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
    assert sorted(os.listdir(folder / "sub")) == sorted(
        p.name for p in before if p.parent.name == "sub")  # no .partial left there
