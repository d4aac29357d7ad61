"""``verify`` names damage to a known file as that file's (issue 35 items
11 and 14): a shard of a Hugging Face folder whose safetensors header is
damaged (its 8-byte length, its first byte) is that shard's damaged
header, and a shard renamed to ``.bak`` is the shard the index names as
missing, exit 1, never exit 3 "not a checkpoint" or "holds two
checkpoints"; a DeepSpeed ZeRO problem names its file once, one way; and
``verify --help`` lists every exit code verify returns."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from ckptool.check.verify.structure import check
from ckptool.cli import main
from ckptool.cli.verify_text import problem_line
from ckptool.errors import EXIT_BAD_INPUT, EXIT_FINDINGS, EXIT_OK, EXIT_USAGE
from ckptool.read.ziparchive import ZipArchive

ROOT = Path(__file__).resolve().parent.parent
ZERO3 = ROOT / "samples" / "deepspeed_zero3"
ZERO1 = ROOT / "tests" / "fixtures" / "deepspeed" / "z1_fp32"
FIRST, SECOND = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two safetensors shards and their index, by huggingface_hub."""
    import huggingface_hub

    folder = tmp_path_factory.mktemp("hf") / "model"
    folder.mkdir()
    torch.manual_seed(0)
    sd = {"embed.weight": torch.randn(64, 16), "layer.weight": torch.randn(16, 16),
          "layer.bias": torch.randn(16), "head.weight": torch.randn(4, 16)}
    huggingface_hub.save_torch_state_dict(sd, str(folder), max_shard_size="2KB")
    assert sorted(p.name for p in folder.glob("*.safetensors")) == [FIRST, SECOND]
    return folder


def copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def verify(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["verify", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("at", "xor", "said"), [
    (3, 0xFF, "its 8-byte length says"),  # the header's length, far past the file's end
    (8, 0x7B, "it starts with b'\\x00'"),  # the header's first byte, '{' made NUL
])
def test_a_shard_with_a_damaged_header_is_that_shard_damaged(
        shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], at: int, xor: int,
        said: str) -> None:
    folder = copy(shards, tmp_path)
    with open(folder / FIRST, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ xor]))
    code, out, err = verify(capsys, str(folder))
    assert code == EXIT_FINDINGS, err
    assert f"problem  {FIRST}: damaged safetensors header: {said}" in out
    assert "not a checkpoint" not in out + err


def test_a_shard_renamed_to_bak_is_the_missing_shard(
        shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy(shards, tmp_path)
    (folder / SECOND).rename(folder / f"{SECOND}.bak")
    code, out, err = verify(capsys, str(folder))
    assert code == EXIT_FINDINGS, err
    assert f"problem  {SECOND}: the file is missing; model.safetensors.index.json puts " \
           "3 tensors in it" in out
    assert f"warning  {SECOND}.bak: a checkpoint file that model.safetensors.index.json " \
           "does not name" in out
    report = check(str(folder), 1)
    assert [(p.kind, p.file, p.severity) for p in report.problems] == [
        ("extra-file", f"{SECOND}.bak", "warning"), ("missing-file", SECOND, "error")]
    assert report.layout == "hf-safetensors"


def test_a_folder_holding_two_whole_checkpoints_is_still_refused(
        shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy(shards, tmp_path)
    torch.save({"w": torch.zeros(2)}, folder / "other.pt")
    code, out, err = verify(capsys, str(folder))
    assert code == EXIT_BAD_INPUT and not out
    assert "holds two checkpoints" in err


def _data_of(path: Path, suffix: str) -> int:
    """Where the data of the zip record whose name ends with ``suffix`` starts."""
    with open(path, "rb") as f:
        archive = ZipArchive(f, os.path.getsize(path))
        member = next(m for m in archive.members.values() if m.name.endswith(suffix))
        return archive.data_offset(member)


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("sample", "name", "record"), [
    (ZERO3, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "data/2"),  # one tensor
    (ZERO1, "mp_rank_00_model_states.pt", "data/2"),  # a record several tensors view
])
def test_a_zero_crc_problem_names_its_file_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], sample: Path, name: str,
        record: str) -> None:
    folder = copy(sample, tmp_path)
    damaged = folder / "global_step2" / name
    _flip(damaged, _data_of(damaged, record) + 3)
    code, out, _ = verify(capsys, str(folder))
    assert code == EXIT_FINDINGS
    line = next(line for line in out.splitlines() if line.startswith("problem"))
    assert "does not match its CRC-32" in line
    assert line.count(name) == 1, line  # the file, not again as <file>/...
    assert line.startswith(f"problem  {name}: ")
    [problem] = check(str(folder), 1).problems
    assert problem_line(problem) == line.removeprefix("problem  ")


@pytest.mark.parametrize("name", ["zero_pp_rank_1_mp_rank_00_model_states.pt",
                                  "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"])
def test_a_missing_zero_rank_is_named_once(tmp_path: Path, name: str) -> None:
    folder = copy(ZERO3, tmp_path)
    (folder / "global_step2" / name).unlink()
    [problem] = check(str(folder), 1).problems
    assert (problem.kind, problem.file) == ("missing-file", name)
    assert name not in problem.message and "global_step2" not in problem.message
    assert problem.message.startswith("rank 1's ")


def test_zero_model_states_all_gone_name_no_made_up_file(tmp_path: Path) -> None:
    folder = copy(ZERO1, tmp_path)
    (folder / "global_step2" / "mp_rank_00_model_states.pt").unlink()
    [problem] = check(str(folder), 1).problems
    assert (problem.kind, problem.file) == ("missing-file", None)  # not "_model_states.pt"
    assert "holds no *_model_states.pt file" in problem.message


def test_verify_help_lists_every_exit_code(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = verify(capsys, "--help")
    assert code == EXIT_OK
    text = " ".join(out.split())
    for said in ("0 when whole", "1 when a problem was found", "2 on a usage error",
                 "3 when it cannot be read", "(0 whole, 1 problems, 2 usage, 3 unreadable)"):
        assert said in text, said
    not_a_manifest = tmp_path / "m.json"
    not_a_manifest.write_text("{}")
    code, out, err = verify(capsys, str(ZERO3), "--manifest", str(not_a_manifest))
    assert code == EXIT_USAGE and "not a ckptool manifest" in err
