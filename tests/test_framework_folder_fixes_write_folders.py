"""A fix diagnose prints for a framework folder's model writes a folder: the
framework's loader reads ``model.safetensors`` by its name, so a fixed file
beside it (``model.fixed.safetensors``) would never be read, and
``diagnose`` would ask for the same fix again. Run as printed, the command
gives a folder whose model loads with nothing left to fix.
"""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import framework_nets
import pytest
from safetensors.torch import load_file, save_file

import ckptool
from ckptool.check.diagnosis import diagnose
from ckptool.check.gpus.machine import Machine
from ckptool.cli import main

CPU = Machine((), False, None, "none", "")


@pytest.mark.parametrize("name", ["mixtral", "base_llama"])
def test_the_printed_fix_writes_a_folder_that_needs_no_fix(
        tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "model"
    shutil.copytree(framework_nets.ECOSYSTEM / name, folder)
    sd = load_file(str(folder / "model.safetensors"))
    save_file({f"module.{k}": v for k, v in sd.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    monkeypatch.chdir(tmp_path)
    d = diagnose(ckptool.open("model"), CPU)
    assert d.fix_command is not None
    assert d.fix_command.startswith("ckptool fix model --strip")
    assert d.fix_command.endswith(" -o model.fixed/")
    assert all(f.fix is None or " model/" not in f.fix for f in d.findings)
    assert main(shlex.split(d.fix_command)[1:]) == 0
    capsys.readouterr()
    fixed = tmp_path / "model.fixed"
    assert sorted(p.name for p in fixed.iterdir()) == sorted(p.name for p in folder.iterdir())
    assert load_file(str(fixed / "model.safetensors")).keys() == sd.keys()
    again = diagnose(ckptool.open("model.fixed"), CPU)
    assert again.findings == [] and again.fix_command is None
