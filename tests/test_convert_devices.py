"""``convert`` says what it loses (issue 26, item 6): every output is written
as on cpu, so storages saved elsewhere (``cuda:2``) get a note, in text and
JSON, into every format and from every input layout that records a device
(torch zip and legacy files, Hugging Face ``.bin`` shards, plain pickles)."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import saved_on

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"
CliRun = Callable[..., Any]

RETARGET = "(`ckptool fix --to DEVICE` retargets them)"
SAFETENSORS = "(safetensors records no device: load_file(path, device=...) picks one)"
DCP = ("(DCP records no device: dcp.load puts each tensor where the state dict it is given "
       "has it)")
# output (as named on the command line) -> what follows "written as on cpu"
OUTPUTS = {"out.safetensors": SAFETENSORS, "hf": SAFETENSORS, "hf-bin": RETARGET, "dcp": DCP}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Each input layout that records devices, and the device it records."""
    hub = pytest.importorskip("huggingface_hub")
    root = tmp_path_factory.mktemp("devices")
    sd = {"a.weight": torch.randn(40, 16), "b.weight": torch.randn(40, 16)}
    (root / "shards").mkdir()
    with saved_on("cuda:1"):  # what a GPU box's save_pretrained writes
        hub.save_torch_state_dict(sd, root / "shards", max_shard_size="3KB",
                                  safe_serialization=False)
        with (root / "plain.pkl").open("wb") as f:
            pickle.dump(sd, f)
    return {"torch zip": (SAMPLES / "dataparallel_cuda2.pth", "cuda:2"),
            "torch legacy": (SAMPLES / "legacy_compiled_ddp.pth", "cuda:0"),
            "hf bin shards": (root / "shards", "cuda:1"),
            "pickle": (root / "plain.pkl", "cuda:1")}


def command(src: Path, out: str, tmp_path: Path) -> list[str]:
    tmp_path.mkdir(exist_ok=True)
    if out.endswith(".safetensors") or out.endswith(".pth"):
        return [str(src), str(tmp_path / out)]
    return [str(src), str(tmp_path / out), "--format", out]


@pytest.mark.parametrize("out", list(OUTPUTS))
@pytest.mark.parametrize("layout", ["torch zip", "torch legacy", "hf bin shards", "pickle"])
def test_a_saved_device_lost_is_said(inputs: dict[str, tuple[Path, str]], layout: str, out: str,
                                     tmp_path: Path, run_cli: CliRun) -> None:
    src, device = inputs[layout]
    note = f"storages saved on {device} are written as on cpu {OUTPUTS[out]}"
    code, stdout, _ = run_cli("convert", *command(src, out, tmp_path / "j"), "--json")
    assert code == 0
    assert note in json.loads(stdout)["notes"]
    code, stdout, _ = run_cli("convert", *command(src, out, tmp_path / "t"))
    assert code == 0
    assert "note" in stdout and " ".join(note.split()) in " ".join(stdout.split())


@pytest.mark.parametrize("layout", ["hf bin shards", "pickle"])
def test_into_one_torch_file_too(inputs: dict[str, tuple[Path, str]], layout: str,
                                 tmp_path: Path, run_cli: CliRun) -> None:
    src, device = inputs[layout]
    code, stdout, _ = run_cli("convert", *command(src, "out.pth", tmp_path), "--json")
    assert code == 0
    assert json.loads(stdout)["notes"] == [
        f"storages saved on {device} are written as on cpu {RETARGET}"]


@pytest.mark.parametrize("out", list(OUTPUTS))
def test_nothing_said_of_a_cpu_file(tmp_path: Path, out: str, run_cli: CliRun) -> None:
    torch.save({"w": torch.ones(3)}, tmp_path / "cpu.pt")
    code, stdout, _ = run_cli("convert", *command(tmp_path / "cpu.pt", out, tmp_path), "--json")
    assert code == 0 and not [n for n in json.loads(stdout)["notes"] if "saved on" in n]
