"""Every bundled sample reads, matches torch, and inspects cleanly: a new
file in samples/ is a new test."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import check_against_torch, make_samples

import ckptool
from ckptool.cli import main

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
FILES = sorted(p for p in SAMPLES.iterdir() if p.suffix != ".py")


def test_samples_exist() -> None:
    assert len(FILES) >= 6


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_sample_inspects(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--json", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_tensors"] > 0
    assert data["main_state_dict"] is not None
    hostile = path.name.startswith("hostile_")
    assert bool(data["unsafe_globals"]) == hostile


@pytest.fixture
def sample_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the classes the samples pickle importable, as in the user's own
    environment, so that torch.load can load them for comparison."""
    mod = make_samples
    monkeypatch.setattr(sys.modules["__main__"], "TinyNet", mod.TinyNet, raising=False)
    mod.attribute_dict_class()


@pytest.mark.parametrize("path", [p for p in FILES if p.suffix != ".safetensors"
                                  and not p.name.startswith("hostile_")
                                  and p.is_file()],  # a DCP directory: test_multifile_dcp
                         ids=lambda p: p.name)
@pytest.mark.usefixtures("sample_classes")
def test_sample_matches_torch(path: Path) -> None:
    ckpt = ckptool.open(path)
    check_against_torch(path, script=ckpt.format == "torchscript")


def test_samples_cover_the_cases_users_meet() -> None:
    found = {p.name: ckptool.open(p) for p in FILES}
    dp = found["dataparallel_cuda2.pth"]
    assert dp.locations == ["cuda:2"] and dp.main_state_dict.prefix == "module."  # type: ignore[union-attr]
    assert found["lightning.ckpt"].main_state_dict.prefix == "model."  # type: ignore[union-attr]
    assert found["legacy_compiled_ddp.pth"].format == "torch-legacy"
    assert found["tinynet.safetensors"].format == "safetensors"
    assert found["tinynet_script.pt"].format == "torchscript"
    assert found["whole_model_cuda1.pth"].locations == ["cuda:1"]
    assert found["hostile_runs_code.pth"].unsafe_globals == ["posix.system"]
