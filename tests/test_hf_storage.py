"""torch's HuggingFaceStorageWriter output (2 ranks under torchrun, by
tests/fixtures/multifile/make_distributed.py): shard files joined by their
DCP_SHARDING_INFO into whole tensors, converted exactly; one shard alone
says what it is; a broken set is refused."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptool
from ckptool.cli import main

HERE = Path(__file__).parent / "fixtures" / "multifile" / "hf_storage"
REFERENCE = torch.load(HERE / "reference.pt", weights_only=True)


@pytest.mark.parametrize("case", ["distributed", "fqn_map", "consolidated", "single"])
def test_every_layout_reads_whole(case: str) -> None:
    ckpt = ckptool.open(HERE / case)
    assert {t.key: t.shape for t in ckpt.tensors} == {k: tuple(v.shape)
                                                       for k, v in REFERENCE.items()}
    got = ckptool.load_state_dict(HERE / case)
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in REFERENCE.items())


@pytest.mark.parametrize("case", ["distributed", "fqn_map"])
@pytest.mark.parametrize("fmt", ["safetensors", "hf"])
def test_convert_joins_the_shards(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  case: str, fmt: str) -> None:
    out = tmp_path / ("out.safetensors" if fmt == "safetensors" else "out")
    args = ["convert", str(HERE / case), str(out)] + (["--format", "hf"] if fmt == "hf" else [])
    assert main(args) == 0, capsys.readouterr().err
    written = load_file(out if fmt == "safetensors" else out / "model.safetensors")
    assert written.keys() == REFERENCE.keys()
    assert all(torch.equal(written[k], v) for k, v in REFERENCE.items())


def test_a_shard_alone_says_it_is_a_piece(capsys: pytest.CaptureFixture[str]) -> None:
    one = HERE / "distributed" / "shard-00002-model-00001-of-00001.safetensors"
    ckpt = ckptool.open(one)
    note = " ".join(ckpt.metadata["notes"])
    assert "HuggingFaceStorageWriter" in note and "pieces of larger ones" in note


def test_fix_points_to_convert(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fix", str(HERE / "distributed"), "--strip-prefix", "model."]) == 3
    assert "ckptool convert" in capsys.readouterr().err


def _drop_sharding_info(path: Path) -> None:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    text += b" " * (n - len(text)) if len(text) <= n else b""
    assert len(text) == n
    path.write_bytes(raw[:8] + text + raw[8 + n:])


def test_a_missing_piece_or_sharding_info_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "d"
    shutil.copytree(HERE / "distributed", folder)
    (folder / "shard-00001-model-00001-of-00001.safetensors").unlink()
    with pytest.raises(ckptool.CkptoolError, match="lacks the shards of rank 0"):
        ckptool.open(folder)
    shutil.rmtree(folder)
    shutil.copytree(HERE / "distributed", folder)
    _drop_sharding_info(folder / "shard-00001-model-00001-of-00001.safetensors")
    with pytest.raises(ckptool.CkptoolError, match="records no DCP_SHARDING_INFO"):
        ckptool.open(folder)


def test_a_shard_numbered_zero_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "d"
    folder.mkdir()
    shutil.copy(HERE / "distributed" / "shard-00001-model-00001-of-00001.safetensors",
                folder / "shard-00000-model-00001-of-00001.safetensors")
    with pytest.raises(ckptool.CkptoolError, match="from shard-00001"):
        ckptool.open(folder)
