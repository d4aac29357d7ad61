"""``verify --manifest`` of a checkpoint converted to another layout (issue
35 item 13): the manifest of a DCP directory checks its conversion by
``ckptool convert`` (safetensors, torch), a ``torch.save({"model": sd})``
file and Hugging Face shards of the same model, its names paired as
``diff`` pairs them (``model.fc.weight`` as ``fc.weight`` or
``model/fc.weight``); a changed tensor is named under both names, and
tensors a conversion left out are still missing. Within one layout, names
are compared as they are."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from ckptool.cli import main
from ckptool.errors import EXIT_FINDINGS, EXIT_OK

KEYS = ("embed.weight", "layer.weight", "layer.bias", "head.weight")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model as ``dcp.save({"model": sd})`` with its manifest, and what
    the other writers make of it: ``ckptool convert``'s safetensors and
    torch files, ``torch.save({"model": sd})`` and ``torch.save(sd)``,
    huggingface_hub's shards; and a DCP save with its optimizer too."""
    import huggingface_hub
    import torch.distributed.checkpoint as dcp

    folder = tmp_path_factory.mktemp("across")
    torch.manual_seed(0)
    sd = {"embed.weight": torch.randn(64, 16), "layer.weight": torch.randn(16, 16),
          "layer.bias": torch.randn(16), "head.weight": torch.randn(4, 16)}
    optim = {"state": {0: {"exp_avg": torch.randn(16, 16)}}, "param_groups": [{"lr": 0.1}]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": sd}, checkpoint_id=str(folder / "dcp"))
        dcp.save({"model": sd, "optim": optim}, checkpoint_id=str(folder / "dcp_optim"))
    for name in ("dcp", "dcp_optim"):
        assert main(["verify", str(folder / name), "-q", "--write-manifest",
                     str(folder / f"{name}.manifest.json")]) == EXIT_OK
    for out in ("model.safetensors", "model.pt"):
        assert main(["convert", str(folder / "dcp"), str(folder / out)]) == EXIT_OK
    torch.save({"model": sd}, folder / "wrapped.pt")
    torch.save(sd, folder / "plain.pt")
    (folder / "hf").mkdir()
    huggingface_hub.save_torch_state_dict(sd, str(folder / "hf"), max_shard_size="2KB")
    return folder


def verify(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["verify", *args])
    out, err = capsys.readouterr()
    assert not err, err
    return code, out


@pytest.mark.parametrize(("converted", "shown"), [
    ("model.safetensors", "embed.weight"),  # convert of the DCP: the 'model' entry's names
    ("model.pt", "model/embed.weight"),
    ("wrapped.pt", "model/embed.weight"),  # torch.save({"model": sd})
    ("plain.pt", "embed.weight"),
    ("hf", "embed.weight"),
])
def test_a_conversion_checks_against_the_dcp_manifest(
        saved: Path, capsys: pytest.CaptureFixture[str], converted: str, shown: str) -> None:
    code, out = verify(capsys, str(saved / converted), "--manifest",
                       str(saved / "dcp.manifest.json"))
    assert code == EXIT_OK, out
    assert "problem" not in out and "missing: the manifest lists it\n" not in out
    assert f"as diff pairs them: model.embed.weight as {shown} (and 3 more)" in \
        " ".join(out.split())


def test_the_dcp_checks_against_a_torch_files_manifest(
        saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "wrapped.manifest.json"
    assert main(["verify", str(saved / "wrapped.pt"), "-q", "--write-manifest",
                 str(manifest)]) == EXIT_OK
    code, out = verify(capsys, str(saved / "dcp"), "--manifest", str(manifest))
    assert code == EXIT_OK, out


def test_a_changed_tensor_is_named_both_ways(
        saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    damaged = tmp_path / "model.safetensors"
    data = bytearray((saved / "model.safetensors").read_bytes())
    data[-3] ^= 0x40  # inside the last tensor's bytes (the header names its offsets)
    damaged.write_bytes(bytes(data))
    code, out = verify(capsys, str(damaged), "--manifest", str(saved / "dcp.manifest.json"))
    assert code == EXIT_FINDINGS
    [line] = [line for line in out.splitlines() if line.startswith("problem")]
    assert "values differ from the manifest" in line
    tensor = line.split(": ")[1]
    assert tensor in KEYS and line.endswith(f"; the manifest names it model.{tensor}")


def test_what_a_conversion_left_out_is_still_missing(
        saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = verify(capsys, str(saved / "model.safetensors"), "--manifest",
                       str(saved / "dcp_optim.manifest.json"))
    assert code == EXIT_FINDINGS
    problems = [line for line in out.splitlines() if line.startswith("problem")]
    assert problems and all(line.startswith("problem  optim.") and
                            line.endswith("missing: the manifest lists it") for line in problems)


def test_names_are_not_paired_within_one_layout(
        saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "plain.manifest.json"
    assert main(["verify", str(saved / "plain.pt"), "-q", "--write-manifest",
                 str(manifest)]) == EXIT_OK
    code, out = verify(capsys, str(saved / "wrapped.pt"), "--manifest", str(manifest))
    assert code == EXIT_FINDINGS  # torch-zip both: model/embed.weight is another key
    assert "problem  embed.weight: missing: the manifest lists it" in out
