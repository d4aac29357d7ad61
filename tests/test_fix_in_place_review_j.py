"""``fix --in-place`` and its journal, as a second review broke them:
shards outside the directory, a single-file fix inside a directory with a
journal, a Ctrl-C after a fix settled its own earlier crash, and readers
while a fix commits."""

from __future__ import annotations

import fcntl
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CliResult
from test_fix_in_place_dir import (
    ARGS,
    contents,
    interrupt_at,
    keys_of,
    make_shards,
    send_sigint,
    spawn,
    state_dict,
)

from ckptool.errors import InputError
from ckptool.read.layouts import journal

hub = pytest.importorskip("huggingface_hub")
ROLLED_BACK = "ckptool: note: rolled back an interrupted fix of {} (ckptool fix --add-prefix x. " \
              "--in-place): it is as it was"


# --- D4: shards in a subfolder ------------------------------------------------

def test_in_place_refuses_shards_outside_the_directory(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    folder = tmp_path / "shards"
    folder.mkdir()
    make_shards(folder / "sub", "st")
    index_name = "model.safetensors.index.json"
    index = json.loads((folder / "sub" / index_name).read_text())
    index["weight_map"] = {k: f"sub/{v}" for k, v in index["weight_map"].items()}
    (folder / "sub" / index_name).unlink()
    (folder / index_name).write_text(json.dumps(index))
    code, _, err = run_cli("inspect", str(folder))
    assert code == 0, err  # it reads
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    code, _, err = run_cli("fix", str(folder), *ARGS)
    assert code == 3, err
    lines = err.strip().splitlines()
    assert lines[0].startswith(f"ckptool: error: {folder}: its index names shard 'sub/"), err
    assert "not a file of the directory itself" in lines[0]
    assert lines[1] == f"hint: write a fixed copy instead: ckptool fix {folder} -o DIR"
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
    assert sorted(os.listdir(folder / "sub")) == sorted(
        p.name for p in before if p.parent.name == "sub")  # no .partial left there


# --- D1: a single-file fix inside a directory holding a journal ----------------

def crashed(folder: Path, kind: str, step: str) -> list[str]:
    names = make_shards(folder, kind)
    assert spawn(folder, step).wait(timeout=60) == 137
    assert journal.JOURNAL in os.listdir(folder)
    return names


def test_a_single_file_fix_settles_its_directorys_journal_first(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    """The reviewer's case: the rename of one shard was undone by the next
    command on the directory, which rolled back the crashed fix under it."""
    folder = tmp_path / "shards"
    names = crashed(folder, "bin", "prepared")
    shard = folder / names[0]
    key = next(iter(torch.load(shard, weights_only=True)))
    code, _, err = run_cli("fix", str(shard), "--rename", f"{key}=renamed.w", "--in-place",
                           "-q")
    assert code == 0, err
    assert err.splitlines() == [ROLLED_BACK.format(folder)]
    assert journal.JOURNAL not in os.listdir(folder)
    assert "renamed.w" in torch.load(shard, weights_only=True)
    code, _, err = run_cli("inspect", str(folder))  # nothing left to settle: the rename stays
    assert "interrupted fix" not in err
    assert "renamed.w" in torch.load(shard, weights_only=True)


@pytest.mark.parametrize("step", ["prepared", "journal-written"])
def test_a_shard_changed_after_the_crash_is_not_cut(
        tmp_path: Path, step: str, run_cli: Callable[..., CliResult]) -> None:
    """Something else appended to a shard after the crash (its end is no
    longer the copy of the old end the fix wrote): settling refuses, and
    says why, rather than cut what was appended."""
    folder = tmp_path / "shards"
    names = crashed(folder, "bin", step)
    shard = folder / names[0]
    with open(shard, "ab") as f:
        f.write(b"\0" * 100)
    before = contents(folder)
    code, _, err = run_cli("inspect", str(folder))
    assert code == 3, err
    assert f"{shard} is not what the in-place fix cut short left there" in err
    assert "something else appended to it" in err
    assert contents(folder) == before


# --- D2: a Ctrl-C while fix finishes its own earlier crash --------------------

@pytest.mark.parametrize("same", [True, False], ids=["same_fix", "another_fix"])
def test_a_ctrl_c_after_fix_finished_its_own_crash_never_says_run_it_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, same: bool,
        run_cli: Callable[..., CliResult]) -> None:
    folder = tmp_path / "shards"
    crashed(folder, "st", "journal-written")
    interrupt_at(monkeypatch, "renaming", send_sigint)
    args = ARGS if same else ["--add-prefix", "y.", "--in-place", "-q"]
    code, _, err = run_cli("fix", str(folder), *args)
    assert code == 130
    lines = err.strip().splitlines()
    head = f"ckptool: error: interrupted: finished an interrupted fix of {folder} (ckptool " \
           "fix --add-prefix x. --in-place): "
    if same:
        assert lines == [head + f"it was this same fix, so {folder} is fixed",
                         "hint: there is nothing more to do: do not run this fix again (it "
                         f"would apply it twice); ckptool inspect {folder} shows what it holds"]
    else:
        assert lines == [head + f"{folder} is fixed as that fix asked; this fix was not applied",
                         f"hint: see what it holds now: ckptool inspect {folder}; then run this "
                         "command again if it is still wanted"]
    monkeypatch.undo()
    assert keys_of(run_cli, folder) == ("after", [])  # x. once, never y.


# --- D3: readers wait for a writer that holds the directory -------------------

def test_a_reader_waits_for_a_writer_that_holds_the_directory_without_a_journal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer holds the lock from before it reads (no journal yet): a
    reader that starts then waits until it lets go, and after ``WAIT``
    seconds is refused, saying who holds it."""
    import ckptool
    from ckptool.read.layouts import dirlock

    folder = tmp_path / "shards"
    make_shards(folder, "st")
    fd = os.open(folder, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # (another open file: flock conflicts, as across processes)
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(len(ckptool.open(str(folder)).tensors)))
    reader.start()
    reader.join(0.5)
    assert reader.is_alive() and got == []  # waiting
    os.close(fd)
    reader.join(10)
    assert got == [len(state_dict())]
    monkeypatch.setattr(dirlock, "WAIT", 0.3)
    fd = os.open(folder, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(InputError, match="is being fixed in place by another ckptool"):
            ckptool.open(str(folder))
    finally:
        os.close(fd)


def test_readers_share_the_lock_and_a_fix_reads_under_its_own(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    """Two readers at once do not wait for each other, and the fix's own
    read of the directory (its lock held) does not wait for itself."""
    import ckptool
    from ckptool.read.layouts import dirlock

    folder = tmp_path / "shards"
    names = make_shards(folder, "st")
    with dirlock.shared(str(folder), lambda: "test"):
        other = threading.Thread(target=lambda: ckptool.open(str(folder)))
        other.start()
        other.join(3)
        assert not other.is_alive()  # (a shared lock does not keep out a reader)
    code, _, err = run_cli("fix", str(folder), *ARGS)
    assert code == 0, err
    assert sorted(os.listdir(folder)) == names
    assert keys_of(run_cli, folder) == ("after", [])


def test_a_cut_never_follows_a_link(tmp_path: Path) -> None:
    """A link swapped in for a shard after the journal was checked: the cut
    fails on the link; the file behind it keeps every byte."""
    target = tmp_path / "elsewhere.bin"
    target.write_bytes(b"x" * 100)
    (tmp_path / "shard.bin").symlink_to(target)
    with pytest.raises(OSError):
        journal._cut(str(tmp_path / "shard.bin"), 10)
    assert target.read_bytes() == b"x" * 100
