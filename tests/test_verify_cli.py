"""``ckptool verify`` on the command line: its exit codes (0 whole, 1 a
problem, 3 no checkpoint, 2 usage), its text (``ok  PATH · ...`` first, or
one ``problem  FILE: TENSOR: message`` line each and a summary), its JSON,
``--quiet``, and the options that hand over to the values and manifest
checks."""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import CliResult
from safetensors.torch import save_file

from ckptool.read.ziparchive import ZipArchive

Run = Callable[..., CliResult]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model.pt"
    torch.save({"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(4)}, path)
    return path


def damage(path: Path) -> None:
    """A flipped byte in the data of tensor ``w`` (record data/0)."""
    with open(path, "r+b") as f:
        archive = ZipArchive(f, os.path.getsize(path))
        member = next(m for m in archive.members.values() if m.name.endswith("data/0"))
        at = archive.data_offset(member) + 5
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


def records(path: Path) -> int:
    """The bytes of every record of a zip: what its CRC check reads."""
    with open(path, "rb") as f:
        return sum(m.size for m in ZipArchive(f, os.path.getsize(path)).members.values())


def test_ok_is_one_line(model: Path, run_cli: Run) -> None:
    code, out, err = run_cli("verify", str(model))
    assert (code, err) == (0, "")
    assert out == f"ok  {model} · torch-zip · 1 file · 2 tensors · {records(model)} B checked\n"


def test_a_problem_per_line_then_the_summary(model: Path, run_cli: Run) -> None:
    damage(model)
    code, out, err = run_cli("verify", str(model))
    assert (code, err) == (1, "")
    lines = out.splitlines()
    assert lines[0].startswith("problem  model.pt: w: record model/data/0 (256 B at byte ")
    assert lines[0].endswith("does not match its CRC-32: its bytes changed after they were "
                             "written")
    assert lines[-1] == (f"damaged  {model} · torch-zip · 1 file · 2 tensors · "
                         f"{records(model)} B checked · 1 problem")


def test_json(model: Path, run_cli: Run) -> None:
    code, out, _ = run_cli("verify", "--json", str(model))
    report = json.loads(out)
    assert code == 0 and report["ok"] is True and report["schema_version"] == 1
    assert list(report) == ["schema_version", "input", "layout", "ok", "files", "tensors",
                            "bytes_checked", "checks", "problems", "notes", "values",
                            "manifest"]
    assert report["files"] == [{"name": "model.pt", "size": model.stat().st_size}]
    damage(model)
    code, out, _ = run_cli("verify", "--json", "--jobs", "1", str(model))
    report = json.loads(out)
    assert code == 1 and report["ok"] is False
    assert report["problems"] == [{"kind": "crc", "severity": "error", "file": "model.pt",
                                   "tensor": "w", "message": report["problems"][0]["message"]}]


def test_quiet_says_it_by_the_exit_code(model: Path, run_cli: Run) -> None:
    assert run_cli("verify", "--quiet", str(model)) == (0, "", "")
    damage(model)
    assert run_cli("verify", "-q", str(model)) == (1, "", "")


def test_standard_input_is_named_as_given(model: Path, run_cli: Run,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    damage(model)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(model.read_bytes())))
    code, out, _ = run_cli("verify", "-")
    assert code == 1
    assert out.startswith("problem  <stdin>: w: record ")
    assert out.splitlines()[-1].startswith("damaged  <stdin> · torch-zip · 1 file")


def test_no_checkpoint_is_exit_3_and_bad_options_exit_2(tmp_path: Path, run_cli: Run) -> None:
    code, out, err = run_cli("verify", str(tmp_path / "absent.pt"))
    assert (code, out) == (3, "") and err.startswith("ckptool: error: ")
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    code, out, err = run_cli("verify", str(tmp_path / "notes.txt"))
    assert (code, out) == (3, "") and "not a checkpoint" in err
    code, _, err = run_cli("verify", "--jobs", "0", str(tmp_path / "notes.txt"))
    assert code == 2 and "--jobs" in err


def test_a_damaged_directory_never_crashes(tmp_path: Path, run_cli: Run) -> None:
    """A DCP directory with its .metadata cut short and an extra file: a
    problem per line, exit 1, no traceback."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "c", no_dist=True)
    meta = tmp_path / "c" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:50])
    code, out, err = run_cli("verify", str(tmp_path / "c"))
    assert (code, err) == (1, "")
    assert out.splitlines()[0].startswith("problem  .metadata: ")


def test_values_are_read_when_asked(tmp_path: Path, run_cli: Run) -> None:
    path = tmp_path / "nan.safetensors"
    save_file({"w": torch.tensor([1.0, float("nan"), 3.0])}, str(path))
    code, out, _ = run_cli("verify", str(path))
    assert code == 0  # the structure is whole
    code, out, _ = run_cli("verify", "--values", "--json", str(path))
    report = json.loads(out)
    assert code == 1 and "values" in report["checks"] and report["values"]["nan"] == {"w": 1}
    assert [p["kind"] for p in report["problems"]] == ["nan"]


def test_a_manifest_written_then_checked(model: Path, tmp_path: Path, run_cli: Run) -> None:
    manifest = tmp_path / "model.manifest.json"
    code, out, _ = run_cli("verify", str(model), "--write-manifest", str(manifest))
    assert code == 0 and manifest.is_file()
    assert "manifest  written to" in out
    code, out, _ = run_cli("verify", str(model), "--manifest", str(manifest))
    assert code == 0 and out.startswith("ok  ") and f"against {manifest}" in out
    torch.save({"w": torch.zeros(64), "b": torch.ones(4)}, model)  # whole, but not the same
    code, out, _ = run_cli("verify", "--json", str(model), "--manifest", str(manifest))
    report = json.loads(out)
    assert code == 1 and report["manifest"] == {"checked": str(manifest)}
    assert any(p["tensor"] == "w" for p in report["problems"])


def test_no_manifest_of_a_damaged_checkpoint(model: Path, tmp_path: Path, run_cli: Run) -> None:
    damage(model)
    manifest = tmp_path / "m.json"
    code, out, _ = run_cli("verify", str(model), "--write-manifest", str(manifest))
    assert code == 1 and not manifest.exists()
    assert "note  no manifest written" in out


def test_what_was_checked_is_what_the_report_says(tmp_path: Path,
                                                  run_cli: Callable[..., CliResult]) -> None:
    """A safetensors file has no CRC to check ("crc" not among the checks);
    once it is checked against a manifest, the note that only a manifest can
    prove its bytes is not said."""
    samples = Path(__file__).resolve().parent.parent / "samples"
    _, out, _ = run_cli("verify", str(samples / "tinynet.safetensors"), "--json")
    report = json.loads(out)
    assert report["checks"] == ["structure"] and report["notes"]
    dest = tmp_path / "m.json"
    run_cli("verify", str(samples / "tinynet.safetensors"), "--write-manifest", str(dest), "-q")
    code, out, _ = run_cli("verify", str(samples / "tinynet.safetensors"), "--manifest",
                           str(dest), "--json")
    report = json.loads(out)
    assert code == 0 and report["checks"] == ["structure", "manifest"] and not report["notes"]
