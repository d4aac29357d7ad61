"""A full disk says what the output needs and what its filesystem has
left, on one process and on many: ``cannot write OUT: no space left on
device (needs 2.1 MB, 310.4 MB free on /x)``."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from test_distributed_convert import on_ranks

from ckptool.describe import human_bytes
from ckptool.errors import OutputError
from ckptool.write import copy
from ckptool.write.convert.run import convert

NEEDS = 8 * 256 * 256 * 4


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    _fill(monkeypatch)


def _fill(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every write of a tensor's bytes from now on finds the disk full."""
    def full(*args: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(copy, "copy_pieces", full)
    monkeypatch.setattr(copy.Copier, "_pwrite", full)


@pytest.fixture
def src(tmp_path: Path) -> Path:
    path = tmp_path / "big.pt"
    torch.save({f"w{i}": torch.ones(256, 256) * i for i in range(8)}, path)
    return path


def _figures(message: str, tmp_path: Path) -> None:
    mount = str(tmp_path)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    m = re.search(r"\(needs (.+), (.+) free on (\S+)\)$", message)
    assert m is not None, message
    assert m.group(1) == human_bytes(NEEDS) and m.group(3) == mount
    free = shutil.disk_usage(tmp_path).free
    assert m.group(2).split()[1] == human_bytes(free).split()[1]  # same unit, nearly the same


@pytest.mark.usefixtures("full_disk")
def test_one_process_says_what_the_output_needs_and_what_is_free(src: Path,
                                                                 tmp_path: Path) -> None:
    with pytest.raises(OutputError) as caught:
        convert(str(src), str(tmp_path / "out.safetensors"))
    assert caught.value.message.startswith(f"cannot write {tmp_path / 'out.safetensors'}: "
                                           "no space left on device (")
    _figures(caught.value.message, tmp_path)


@pytest.mark.usefixtures("full_disk")
def test_many_processes_say_the_figures_and_how_to_resume(src: Path, tmp_path: Path) -> None:
    results = on_ranks(2, src, tmp_path / "out.safetensors")
    assert isinstance(results[0], OutputError), results[0]
    _figures(results[0].message, tmp_path)
    assert "()" not in results[0].hint and "run the same command again" in results[0].hint


def _needs(message: str) -> str:
    m = re.search(r"\(needs (.+?), ", message)
    assert m is not None, message
    return m.group(1)


@pytest.mark.usefixtures("full_disk")
def test_fix_into_a_folder_names_the_folders_file_and_what_a_cast_needs(
        src: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from ckptool.write.fix.plan import FixOptions
    from ckptool.write.fix.run import fix

    folder = tmp_path / "one"
    folder.mkdir()
    save_file({f"w{i}": torch.ones(256, 256) * i for i in range(8)},
              str(folder / "model.safetensors"))
    with pytest.raises(OutputError) as caught:
        fix(str(folder), FixOptions(dtype="bfloat16"), str(tmp_path / "f1") + "/")
    message = caught.value.message
    assert message.startswith(f"cannot write {tmp_path / 'f1' / 'model.safetensors'}: "), message
    assert ".partial" not in message
    assert _needs(message) == human_bytes(NEEDS // 2 + 64 * 8)  # bf16, about (headers aside)
    with pytest.raises(OutputError) as caught:
        fix(str(src), FixOptions(dtype="bfloat16"), str(tmp_path / "f.pt"))
    assert _needs(caught.value.message) == human_bytes(src.stat().st_size - NEEDS // 2)


def test_a_folder_of_shards_says_what_it_needs(src: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptool.write.fix.plan import FixOptions
    from ckptool.write.fix.run import fix

    convert(str(src), str(tmp_path / "hf"), fmt="hf", max_shard_size=300_000)
    _fill(monkeypatch)
    with pytest.raises(OutputError) as caught:
        fix(str(tmp_path / "hf"), FixOptions(add_prefix="m."), str(tmp_path / "fixed"))
    assert _needs(caught.value.message) == human_bytes(NEEDS)


def test_no_inode_left_is_said_as_such(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptool.write.failures import output_error

    real = os.statvfs

    def statvfs(path: Any) -> Any:
        fs = real(path)
        return os.statvfs_result((fs.f_bsize, fs.f_frsize, fs.f_blocks, fs.f_bfree,
                                  fs.f_bavail, fs.f_files, 0, 0, fs.f_flag, fs.f_namemax))

    monkeypatch.setattr(os, "statvfs", statvfs)
    message = output_error(tmp_path / "out", OSError(errno.ENOSPC, "No space left")).message
    assert "no inode left on" in message and "free on" not in message


def test_a_manifest_that_finds_the_disk_full_says_out_was_written(
        src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from ckptool.check.verify import outmanifest
    from ckptool.cli.main import main
    from ckptool.write.failures import output_error

    def full(checkpoint: Any, dest: str, *args: Any) -> Any:
        raise output_error(dest, OSError(errno.ENOSPC, "No space left on device"))

    monkeypatch.setattr(outmanifest, "write_manifest", full)
    out, manifest = tmp_path / "out.safetensors", tmp_path / "m.json"
    assert main(["convert", str(src), str(out), "--manifest", str(manifest), "-q"]) == 3
    said = capsys.readouterr().err
    assert said.startswith(f"ckptool: error: wrote {out}, but not its manifest: cannot write "
                           f"{manifest}: no space left on device"), said
    assert f"ckptool verify {out} --write-manifest {manifest}" in said
    assert "nothing was left half-written" not in said
    assert out.exists()  # whole, as said
