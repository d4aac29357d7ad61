"""``explain --checkpoint`` says what the file saved (issue 26, item 7): an
error naming ``CUDA device 3`` about a file that saved everything on
``cuda:2`` is told as such, and the mismatch is said: the error probably
came from another file. The errors are torch's own, raised by loading real
files with torch told how many GPUs the failing process had."""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import saved_on

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "samples" / "dataparallel_cuda2.pth"
Run = Callable[..., tuple[int, str, str]]


def torch_error(monkeypatch: pytest.MonkeyPatch, path: Path, gpus: int) -> str:
    """The traceback torch.load of ``path`` gives on a machine with ``gpus`` GPUs."""
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        m.setattr(torch.cuda, "device_count", lambda: gpus)
        try:
            torch.load(path, weights_only=False)
        except RuntimeError:
            return traceback.format_exc()
    raise AssertionError("expected torch.load to fail")


def explain(run_cli: Run, text: str, path: Path) -> tuple[dict[str, Any], str]:
    code, out, err = run_cli("explain", text, "--checkpoint", str(path), "--json")
    assert code == 1, err
    code, shown, err = run_cli("explain", text, "--checkpoint", str(path))
    assert code == 1, err
    return json.loads(out), " ".join(shown.split())


def test_an_error_about_another_device(run_cli: Run, monkeypatch: pytest.MonkeyPatch,
                                       tmp_path: Path) -> None:
    with saved_on("cuda:3"):
        torch.save({"w": torch.ones(2)}, tmp_path / "other.pth")
    text = torch_error(monkeypatch, tmp_path / "other.pth", 1)  # what the log holds
    assert "on CUDA device 3 but torch.cuda.device_count() is 1" in text
    data, shown = explain(run_cli, text, SAMPLE)
    finding = data["findings"][0]
    assert finding["code"] == "device-unavailable"
    assert "saved some on cuda:3" not in finding["message"]
    assert "the file saved 15 tensors on cuda:2, none on cuda:3" in finding["message"]
    assert "it probably came from another file" in finding["message"]
    assert data["checkpoint"]["notes"] == [
        f"the error names cuda:3, and {SAMPLE} saved nothing there (the file saved 15 tensors "
        "on cuda:2): the error probably came from another file"]
    assert finding["fix"] == f"ckptool fix {SAMPLE} --to cuda:0"  # what this file needs
    assert "the file saved 15 tensors on cuda:2, none on cuda:3" in shown
    assert f"the error names cuda:3, and {SAMPLE} saved nothing there" in shown


@pytest.mark.parametrize("gpus", [0, 2])
def test_the_error_about_this_file(run_cli: Run, monkeypatch: pytest.MonkeyPatch,
                                   gpus: int) -> None:
    """Its own error (no GPU: 'a CUDA device'; two GPUs: 'CUDA device 2'): what it
    saved, and no note."""
    text = torch_error(monkeypatch, SAMPLE, gpus)
    data, shown = explain(run_cli, text, SAMPLE)
    message = data["findings"][0]["message"]
    assert "the file saved 15 tensors on cuda:2;" in message and "none on" not in message
    assert data["checkpoint"]["notes"] == []
    assert "the file saved 15 tensors on cuda:2;" in shown


def test_a_file_on_the_cpu(run_cli: Run, monkeypatch: pytest.MonkeyPatch,
                           tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2), "b": torch.zeros(3)}, tmp_path / "cpu.pth")
    data, _ = explain(run_cli, torch_error(monkeypatch, SAMPLE, 2), tmp_path / "cpu.pth")
    finding = data["findings"][0]
    assert "the file saved 2 tensors on cpu, none on cuda:2" in finding["message"]
    assert finding["fix"] is None
    assert len(data["checkpoint"]["notes"]) == 1  # the one saying the file does not show it


@pytest.mark.parametrize("other", ["samples/tinynet.safetensors", "samples/dcp_tinynet"])
def test_a_file_that_records_no_device(run_cli: Run, monkeypatch: pytest.MonkeyPatch,
                                       other: str) -> None:
    """safetensors and DCP record no device: such a file cannot raise torch's
    deserialize error, and the explanation says so plainly."""
    data, shown = explain(run_cli, torch_error(monkeypatch, SAMPLE, 1), ROOT / other)
    message = data["findings"][0]["message"]
    assert "records no device for its tensors (it loads where it is asked): it cannot " \
           "have raised this, another file saved on cuda:2 did" in message
    assert ", none on" not in message and "rewritten since" not in message
    assert "it cannot have raised this" in shown
    assert data["checkpoint"]["notes"] == [
        f"the error names cuda:2, and {ROOT / other} records no device (its tensors load "
        "where they are asked): the error came from another file"]
