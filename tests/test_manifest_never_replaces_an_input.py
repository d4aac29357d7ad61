"""``convert --manifest M`` and ``fix --manifest M`` never write M over the
input: M naming the input file, one of an input folder's files, or another
name of one (a symlink, a hard link) is refused before anything is written
(exit 2), as ``verify --write-manifest`` refuses it, and the input is
unchanged.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from ckptool.cli import main
from ckptool.errors import EXIT_USAGE

HERE = Path(__file__).parent / "fixtures" / "frameworks"


def _bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("how", ["same", "symlink", "hardlink", "inside"])
@pytest.mark.parametrize("command", ["convert", "fix"])
def test_a_manifest_naming_an_input_file_is_refused(tmp_path: Path, how: str, command: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "model"
    shutil.copytree(HERE / "llama_tied", folder)
    weights = folder / "model.safetensors"
    before = _bytes(folder)
    source = str(weights)
    manifest = str(weights)
    if how == "symlink":
        os.symlink(weights, tmp_path / "m.json")
        manifest = str(tmp_path / "m.json")
    elif how == "hardlink":
        os.link(weights, tmp_path / "m.json")
        manifest = str(tmp_path / "m.json")
    elif how == "inside":
        source, manifest = str(folder), str(folder / "config.json")
    args = ([command, source, str(tmp_path / "out.pt")] if command == "convert"
            else [command, source, "--dtype", "bf16", "-o", str(tmp_path / "out.safetensors")])
    assert main([*args, "--manifest", manifest]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--manifest" in err and "replace" in err
    assert _bytes(folder) == before
    assert not (tmp_path / "out.pt").exists() and not (tmp_path / "out.safetensors").exists()
