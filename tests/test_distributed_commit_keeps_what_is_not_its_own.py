"""The end of a distributed convert never loses data and never wedges the
next run: a rank 0 killed between its commit's renames leaves records the
next run takes back (or removes, once OUT is in place); an OUT that another
program made meanwhile is never replaced without ``--force``, and a
directory of other files never removed with it; one lock serves plain and
distributed conversions into one OUT, and is gone after any ending; the
staging directory, its records and the lock are never the input."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from helpers import flip_record_byte
from test_distributed_convert import on_ranks, same_bytes

from ckptool.errors import RankFailedError, UsageError
from ckptool.write.convert.run import convert as convert_one
from ckptool.write.distributed.ending import Quiet
from ckptool.write.distributed.staging import Staging
from ckptool.write.outlock import OutputLock

REPO = Path(__file__).resolve().parent.parent

KILLED = """
import os, sys
sys.path[:0] = [{tests!r}, {repo!r}]
import shutil
from helpers import on_thread_ranks
from ckptool.write.distributed import staging
from ckptool.write.distributed.run import convert

if {where!r} == "between-renames":  # .ckptool/ set aside, OUT not yet renamed
    staging.replace_directory = lambda *a, **k: os._exit(9)
elif {where!r} == "file-placed":  # one file: OUT in place, the staging not yet removed
    staging.Staging._remove = lambda self: os._exit(9)
else:  # OUT in place, the records set aside not yet removed
    real = shutil.rmtree
    def rmtree(path, *a, **k):
        if str(path).endswith(".manifest"):
            os._exit(9)
        return real(path, *a, **k)
    shutil.rmtree = rmtree
options = dict(fmt="hf", max_shard_size=300_000) if {where!r} != "file-placed" else {{}}
on_thread_ranks(2, lambda w: convert(w, {src!r}, {dst!r}, say=print, **options), ())
"""


def _killed_while_committing(src: Path, dst: Path, where: str) -> None:
    code = KILLED.format(tests=str(REPO / "tests"), repo=str(REPO), where=where,
                         src=str(src), dst=str(dst))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 9, done.stderr


def test_records_set_aside_by_a_killed_commit_are_taken_back_and_resumed(
        big_pt: Path, tmp_path: Path) -> None:
    out = tmp_path / "shards"
    _killed_while_committing(big_pt, out, "between-renames")
    staging = Staging(str(out), True)
    assert staging.aside.is_dir() and not out.exists()
    results = on_ranks(2, big_pt, out, fmt="hf", max_shard_size=300_000)
    report = results[0].distributed
    assert report["resumed"]  # the whole files were kept, not written again
    assert sum(r["bytes_kept"] for r in report["per_rank"]) == 8 * 256 * 256 * 4
    convert_one(str(big_pt), str(tmp_path / "one"), fmt="hf", max_shard_size=300_000)
    same_bytes(out, tmp_path / "one")
    assert not staging.aside.exists() and not staging.path.exists()


def test_records_left_beside_a_committed_output_are_removed(big_pt: Path,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "shards"
    _killed_while_committing(big_pt, out, "after-rename")
    staging = Staging(str(out), True)
    assert staging.aside.is_dir() and out.is_dir()
    results = on_ranks(2, big_pt, out, fmt="hf", max_shard_size=300_000, force=True)
    assert not isinstance(results[0], BaseException), results[0]
    assert not staging.aside.exists() and not staging.path.exists()
    convert_one(str(big_pt), str(tmp_path / "one"), fmt="hf", max_shard_size=300_000)
    same_bytes(out, tmp_path / "one")


def test_records_beside_the_staging_that_are_not_ckptools_are_kept(big_pt: Path,
                                                                  tmp_path: Path) -> None:
    out = tmp_path / "shards"
    aside = Staging(str(out), True).aside
    aside.mkdir()
    (aside / "notes.txt").write_text("mine")
    results = on_ranks(2, big_pt, out, fmt="hf")
    assert isinstance(results[0], UsageError)
    assert "did not write" in results[0].message
    assert (aside / "notes.txt").read_text() == "mine"


def _appearing(monkeypatch: pytest.MonkeyPatch, make: Any) -> None:
    """Another program makes OUT just before rank 0 commits."""
    real = Staging.commit

    def commit(self: Staging, name: str | None, durable: bool) -> None:
        make(self.target)
        real(self, name, durable)

    monkeypatch.setattr(Staging, "commit", commit)


def test_a_file_that_appeared_meanwhile_is_not_replaced(
        big_pt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out.safetensors"
    _appearing(monkeypatch, lambda t: t.write_bytes(b"theirs"))
    results = on_ranks(2, big_pt, out)
    assert isinstance(results[0], UsageError)
    assert "appeared while ckptool was writing it" in results[0].message
    assert "--force" in results[0].hint
    assert isinstance(results[1], Quiet)
    assert out.read_bytes() == b"theirs"


def _their_directory(target: Path) -> None:
    target.mkdir()
    (target / "theirs.txt").write_text("theirs")


def test_a_directory_that_appeared_meanwhile_is_not_replaced(
        big_pt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "shards"

    _appearing(monkeypatch, _their_directory)
    results = on_ranks(2, big_pt, out, fmt="hf")
    assert isinstance(results[0], UsageError)
    assert "appeared while ckptool was writing it" in results[0].message
    assert os.listdir(out) == ["theirs.txt"]
    monkeypatch.undo()  # the records were taken back: the re-run resumes
    (out / "theirs.txt").unlink()
    out.rmdir()
    results = on_ranks(2, big_pt, out, fmt="hf")
    assert results[0].distributed["resumed"]


def test_force_never_removes_a_directory_that_came_to_hold_other_files(
        big_pt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "shards"

    _appearing(monkeypatch, _their_directory)
    results = on_ranks(2, big_pt, out, fmt="hf", force=True)
    assert isinstance(results[0], UsageError)
    assert "holds no checkpoint" in results[0].message
    assert (out / "theirs.txt").read_text() == "theirs"


def test_a_plain_convert_waits_for_no_one_and_takes_the_distributed_lock(
        big_pt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    staging = Staging(str(out), False)
    staging.lock()  # a distributed convert's rank 0, mid-run
    try:
        refused = _elsewhere(lambda: convert_one(str(big_pt), str(out)))
    finally:
        staging.unlock()
    assert refused is not None and "another ckptool is writing" in refused.message
    assert not out.exists()
    with OutputLock(out):  # a plain convert, mid-run
        results = on_ranks(2, big_pt, out)
    assert isinstance(results[0], UsageError)
    assert "another ckptool is writing" in results[0].message
    assert not out.exists()
    convert_one(str(big_pt), str(out))  # once it is free
    assert out.exists()


def test_the_lock_is_gone_after_a_failure_and_after_a_success(big_pt: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    flip_record_byte(big_pt, "big/data/7")
    results = on_ranks(2, big_pt, out)
    assert isinstance(results[0], RankFailedError)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".lock")]
    flip_record_byte(big_pt, "big/data/7")
    on_ranks(2, big_pt, out)
    assert out.exists()
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".lock")]
    with pytest.raises(UsageError):
        convert_one(str(big_pt), str(out))  # already exists
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".lock")]


@pytest.mark.parametrize("role", ["staging", "aside", "lock"])
def test_what_a_run_removes_is_never_the_input(big_pt: Path, tmp_path: Path,
                                               role: str) -> None:
    out = tmp_path / "out.safetensors"
    staging = Staging(str(out), False)
    path = {"staging": staging.path, "aside": staging.aside,
            "lock": tmp_path / ".out.safetensors.ckptool.lock"}[role]
    if role == "lock":
        big_pt.rename(path)
    else:
        path.mkdir()
        big_pt.rename(path / "big.pt")
        path = path / "big.pt"
    before = path.read_bytes()
    results = on_ranks(2, path, out)
    assert isinstance(results[0], UsageError), results[0]
    assert path.read_bytes() == before
    assert not out.exists()


def _elsewhere(work: Any) -> UsageError | None:
    """``work()`` on another thread (as another process would: a lock is
    taken again by the thread that holds it): the UsageError it raised."""
    caught: list[UsageError] = []

    def run() -> None:
        try:
            work()
        except UsageError as exc:
            caught.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    return caught[0] if caught else None


@pytest.mark.parametrize("args", [{"fmt": "hf"}, {}], ids=["convert-folder", "fix-file"])
def test_a_second_writer_of_an_output_is_refused(big_pt: Path, tmp_path: Path,
                                                 args: dict[str, Any]) -> None:
    from ckptool.write.fix.plan import FixOptions
    from ckptool.write.fix.run import fix

    out = tmp_path / ("shards" if args else "out.pt")
    with OutputLock(out):  # a convert into it, mid-run
        refused = _elsewhere(lambda: convert_one(str(big_pt), str(out), **args) if args
                             else fix(str(big_pt), FixOptions(to="cpu"), str(out)))
    assert refused is not None and "another ckptool is writing" in refused.message
    assert not out.exists()


@pytest.mark.parametrize("next_run", ["refused", "plain-force", "after-rm"])
def test_records_left_beside_a_committed_output_go_with_any_next_run(
        big_pt: Path, tmp_path: Path, next_run: str) -> None:
    import shutil

    out = tmp_path / "shards"
    _killed_while_committing(big_pt, out, "after-rename")
    aside = Staging(str(out), True).aside
    assert aside.is_dir()
    if next_run == "refused":
        results = on_ranks(2, big_pt, out, fmt="hf")
        assert isinstance(results[0], UsageError) and "already exists" in results[0].message
    elif next_run == "plain-force":
        convert_one(str(big_pt), str(out), fmt="hf", force=True)
    else:
        shutil.rmtree(out)
        convert_one(str(big_pt), str(out), fmt="hf")
    assert not aside.exists()


def test_the_staging_left_beside_a_committed_file_goes_with_the_next_run(
        big_pt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    _killed_while_committing(big_pt, out, "file-placed")
    staging = Staging(str(out), False)
    assert staging.path.is_dir() and out.is_file()
    results = on_ranks(2, big_pt, out)
    assert isinstance(results[0], UsageError) and "already exists" in results[0].message
    assert not staging.path.exists()
    convert_one(str(big_pt), str(tmp_path / "one.safetensors"))
    assert out.read_bytes() == (tmp_path / "one.safetensors").read_bytes()
