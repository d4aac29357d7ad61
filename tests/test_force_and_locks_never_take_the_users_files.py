"""What a conversion removes or replaces is only ever its own: ``--force``
never removes a directory that holds more than a checkpoint (notes, a
training run's state, other folders), OUT is never the input by any name,
and nothing at the lock's or the records' path that is not ckptool's (the
input, a link, a FIFO, a user's file) is taken or removed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_distributed_convert import on_ranks

from ckptool.errors import UsageError
from ckptool.write.convert.run import convert
from ckptool.write.distributed.staging import Staging
from ckptool.write.fix.plan import FixOptions
from ckptool.write.fix.run import fix


@pytest.fixture
def src(tmp_path: Path) -> Path:
    path = tmp_path / "model.pt"
    torch.save({f"w{i}": torch.ones(32, 32) * i for i in range(4)}, path)
    return path


@pytest.mark.parametrize("theirs", ["NOTES.txt", "optimizer.pt", "runs/events.out",
                                    "checkpoint-500/model.safetensors"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_force_keeps_a_checkpoint_directory_that_holds_more(src: Path, tmp_path: Path,
                                                            theirs: str, ranks: int) -> None:
    out = tmp_path / "out"
    convert(str(src), str(out), fmt="hf")
    (out / theirs).parent.mkdir(exist_ok=True)
    (out / theirs).write_bytes(b"theirs")
    if ranks == 1:
        with pytest.raises(UsageError, match="no part of a checkpoint"):
            convert(str(src), str(out), fmt="hf", force=True)
    else:
        results = on_ranks(ranks, src, out, fmt="hf", force=True)
        assert isinstance(results[0], UsageError)
        assert "no part of a checkpoint" in results[0].message
    assert (out / theirs).read_bytes() == b"theirs"
    assert (out / "model.safetensors").exists()


def test_force_replaces_a_checkpoint_with_its_framework_files(src: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(str(src), str(out), fmt="hf")
    (out / "config.json").write_text("{}")
    (out / "tokenizer.json").write_text("{}")
    convert(str(src), str(out), fmt="hf", force=True, dtype="float16")
    assert sorted(os.listdir(out)) == ["model.safetensors"]


def test_out_is_never_the_input_through_a_link(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    out.symlink_to(src)
    before = src.read_bytes()
    with pytest.raises(UsageError, match="is the input"):
        convert(str(src), str(out), force=True)
    assert src.read_bytes() == before


@pytest.mark.parametrize("what", ["input", "fifo", "hardlink", "symlink"])
@pytest.mark.parametrize("command", ["convert", "fix"])
def test_nothing_at_the_locks_path_is_taken(src: Path, tmp_path: Path, what: str,
                                            command: str) -> None:
    out = tmp_path / ("out.safetensors" if command == "convert" else "out.pt")
    lock = tmp_path / f".{out.name}.ckptool.lock"
    given = src
    if what == "input":
        given = src.rename(lock)
    elif what == "fifo":
        os.mkfifo(lock)
    elif what == "hardlink":
        (tmp_path / "mine").write_bytes(b"")
        os.link(tmp_path / "mine", lock)
    else:
        lock.symlink_to(src)
    before = given.read_bytes()
    with pytest.raises(UsageError, match="in the way of the output's lock"):
        if command == "convert":
            convert(str(given), str(out))
        else:
            fix(str(given), FixOptions(to="cpu"), str(out))
    assert os.path.lexists(lock) and given.read_bytes() == before
    assert not out.exists()


def test_a_file_at_the_records_path_is_said_before_any_work(src: Path,
                                                            tmp_path: Path) -> None:
    out = tmp_path / "out"
    Staging(str(out), True).aside.write_text("mine")
    results = on_ranks(2, src, out, fmt="hf")
    assert isinstance(results[0], UsageError) and "in the way" in results[0].message
    assert "resume" not in results[0].hint
    assert Staging(str(out), True).aside.read_text() == "mine"


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_link_as_out_is_written_through_on_one_process_and_many(
        src: Path, tmp_path: Path, ranks: int) -> None:
    real = tmp_path / "real.safetensors"
    link = tmp_path / "link.safetensors"
    link.symlink_to(real)  # dangling: the file it names is made
    if ranks == 1:
        convert(str(src), str(link))
    else:
        results = on_ranks(ranks, src, link)
        assert not isinstance(results[0], BaseException), results[0]
    assert link.is_symlink() and real.is_file()
    from ckptool.write.outlock import OutputLock

    with OutputLock(real):  # a writer of the real name excludes one of the link
        results = on_ranks(2, src, link, force=True)
    assert isinstance(results[0], UsageError)
    assert "another ckptool is writing" in results[0].message


def test_force_replaces_a_framework_folders_output_with_its_module_folders(
        tmp_path: Path) -> None:
    folder = Path(__file__).parent / "fixtures" / "frameworks" / "ecosystem" / \
        "st_dense_normalize"
    out = tmp_path / "st"
    convert(str(folder), str(out))
    before = sorted(os.listdir(out))
    assert any((out / n).is_dir() for n in before)  # its modules' folders
    convert(str(folder), str(out), force=True, dtype="bfloat16")
    assert sorted(os.listdir(out)) == before
