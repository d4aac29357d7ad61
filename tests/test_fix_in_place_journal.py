"""The journal of ``fix DIR --in-place``, as a reviewer tried to break it.

Every command that finds an interrupted fix settles it (finishes it, or
rolls it back byte for byte) and says so on stderr, JSON modes included; a
dry run changes nothing; every change is checked before the first is made;
a drop that empties a shard can be finished; readers and a second fix wait
for the fix that holds the directory's lock; a full disk names the
directory and leaves it as it was; a Ctrl-C says what it left, even after
the command is done or while it settles an earlier fix; hints quote paths;
long shard names work; a journal copied with its directory, or one in a
directory ckptool may not write, is never applied.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CliResult
from helpers import disk_full_lines
from test_fix_in_place_dir import (
    ARGS,
    ROOT,
    contents,
    interrupt_at,
    keys_of,
    make_shards,
    send_sigint,
    spawn,
    state_dict,
)

from ckptool.describe import shell_word
from ckptool.read.layouts import journal

hub = pytest.importorskip("huggingface_hub")
FINISHED = "ckptool: note: finished an interrupted fix of {} (ckptool fix --add-prefix x. " \
           "--in-place): {} is fixed; running that fix again would apply it twice"
ROLLED_BACK = "ckptool: note: rolled back an interrupted fix of {} (ckptool fix " \
              "--add-prefix x. --in-place): it is as it was"


def crashed(folder: Path, kind: str, step: str) -> list[str]:
    names = make_shards(folder, kind)
    assert spawn(folder, step).wait(timeout=60) == 137
    assert journal.JOURNAL in os.listdir(folder)
    return names


# --- every command says what it settled ---------------------------------------

@pytest.mark.parametrize("command", ["inspect", "diagnose", "convert", "diff"])
@pytest.mark.parametrize("step", ["renaming", "prepared"])
def test_every_command_settles_a_journal_and_says_so(
        tmp_path: Path, command: str, step: str, run_cli: Callable[..., CliResult]) -> None:
    folder = tmp_path / "shards"
    names = crashed(folder, "bin" if step == "prepared" else "st", step)
    args = {"inspect": ["inspect", "--json", str(folder)],
            "diagnose": ["diagnose", "--json", str(folder)],
            "convert": ["convert", str(folder), str(tmp_path / "one.safetensors"), "-q"],
            "diff": ["diff", "--json", str(folder), str(folder)]}[command]
    code, out, err = run_cli(*args)
    assert code in (0, 1), err
    said = (FINISHED if step == "renaming" else ROLLED_BACK).format(folder, folder)
    assert err.splitlines() == [said]  # on stderr, once; stdout is the command's own
    if "--json" in args:
        json.loads(out)
    assert sorted(os.listdir(folder)) == names
    assert keys_of(run_cli, folder) == ("after" if step == "renaming" else "before", [])


def test_ckptool_load_warns_that_it_finished_a_fix(tmp_path: Path) -> None:
    import ckptool

    folder = tmp_path / "shards"
    crashed(folder, "st", "journal-written")
    with pytest.warns(UserWarning, match="finished an interrupted fix of .* is fixed"):
        loaded = ckptool.load(folder)
    assert sorted(loaded) == sorted(f"x.{k}" for k in state_dict())


def test_a_dry_run_changes_nothing_not_even_an_interrupted_fix(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    folder = tmp_path / "shards"
    crashed(folder, "st", "renaming")
    before = contents(folder)
    code, out, err = run_cli("fix", str(folder), "--add-prefix", "y.", "--dry-run")
    assert (code, out) == (3, "")
    assert "a dry run changes nothing: it was left as it is" in err, err
    assert f"ckptool inspect {folder} does either" in err
    assert contents(folder) == before


# --- what a journal changes ------------------------------------------------------

def test_every_step_is_checked_before_the_first_is_made(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    """A shard changed since the crash: nothing is touched (the first shard's
    cut included), and the error says so."""
    folder, pristine = tmp_path / "shards", tmp_path / "pristine"
    names = crashed(folder, "bin", "journal-written")
    make_shards(pristine, "bin")
    shutil.copyfile(pristine / names[1], folder / names[1])  # as it was before the fix
    before = contents(folder)
    code, _, err = run_cli("inspect", str(folder))
    assert code == 3 and "it was changed since" in err and "it changed nothing" in err, err
    assert contents(folder) == before


def test_a_drop_that_empties_a_shard_is_finished(tmp_path: Path,
                                                 run_cli: Callable[..., CliResult]) -> None:
    folder = tmp_path / "shards"
    names = make_shards(folder, "st")
    index = json.loads((folder / names[-1]).read_text())["weight_map"]
    last = [k for k, f in index.items() if f == names[-2]]  # every name of the last shard
    env = {**os.environ, journal.CRASH_ENV: "renamed"}
    drops = [w for k in last for w in ("--drop", k)]
    assert subprocess.run([sys.executable, "-m", "ckptool", "fix", str(folder), *drops,
                           "--in-place"], cwd=ROOT, env=env, check=False).returncode == 137
    code, out, err = run_cli("inspect", "--json", str(folder))
    assert code == 0 and "ckptool: note: finished an interrupted fix" in err, err
    assert {t["key"] for t in json.loads(out)["tensors"]} == set(state_dict()) - set(last)
    assert journal.JOURNAL not in os.listdir(folder)


# --- the lock -----------------------------------------------------------------

@pytest.fixture
def held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory of shards whose lock another process holds."""
    from ckptool.read.layouts import dirlock

    monkeypatch.setattr(dirlock, "WAIT", 0.3)
    folder = tmp_path / "shards"
    make_shards(folder, "st")
    fd = os.open(folder, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield folder
    os.close(fd)


def test_a_second_fix_waits_then_is_refused(held: Path,
                                            run_cli: Callable[..., CliResult]) -> None:
    before = contents(held)
    code, _, err = run_cli("fix", str(held), *ARGS)
    assert code == 3 and f"{held} is being fixed in place by another ckptool process" in err
    assert contents(held) == before


def test_a_reader_waits_for_the_fix_that_holds_the_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        run_cli: Callable[..., CliResult]) -> None:
    """The reviewer's race: a reader that finds the journal while the fix
    commits waits for it (it once made the same renames, and one of them
    failed); once the fix is done there is nothing left to settle."""
    folder = tmp_path / "shards"
    names = make_shards(folder, "st")
    reader: list[Any] = []
    thread = threading.Thread(target=lambda: reader.append(journal.settle(str(folder))))

    def race() -> None:
        thread.start()
        thread.join(0.5)
        assert thread.is_alive()  # waiting for the lock

    interrupt_at(monkeypatch, "journal-written", race)
    code, _, err = run_cli("fix", str(folder), *ARGS)
    thread.join(10)
    assert code == 0 and err == ""
    assert reader == [None]
    assert sorted(os.listdir(folder)) == names


# --- a full disk, a Ctrl-C --------------------------------------------------------

FSIZE = """
import json, resource, sys
sys.path.insert(0, {root!r})
from ckptool.cli.main import main
resource.setrlimit(resource.RLIMIT_FSIZE, (36_000, 36_000))
print(json.dumps(main({args!r})))
"""


@pytest.mark.parametrize("tmpfile", [True, False], ids=["o_tmpfile", "named_temp"])
def test_a_full_disk_under_the_new_index(tmp_path: Path, tmpfile: bool) -> None:
    """The kernel refuses the new index (past ``ulimit -f``), after every
    .bin shard got its new pickle appended: the error names the directory,
    and every file is as it was, byte for byte."""
    folder = tmp_path / "shards"
    folder.mkdir()
    sd = {f"model.layers.{i}.mlp.weight": torch.full((2,), float(i)) for i in range(600)}
    hub.save_torch_state_dict(sd, folder, max_shard_size=480, safe_serialization=False)
    before = contents(folder)
    assert max(len(b) for b in before.values()) > 36_000 > max(
        len(b) for n, b in before.items() if n.endswith(".bin"))
    script = FSIZE.format(root=str(ROOT), args=["fix", str(folder), *ARGS])
    env = {**os.environ, **({} if tmpfile else {"CKPTOOL_NO_TMPFILE": "1"})}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=env, check=False)
    assert json.loads(done.stdout) == 3, done.stderr
    assert done.stderr.splitlines() == [
        f"ckptool: error: cannot write {folder}: file too large",
        "hint: the filesystem (or `ulimit -f`) caps the size of a file: write elsewhere "
        "(nothing was left half-written)"]
    assert contents(folder) == before


def test_a_full_disk_while_a_bin_shard_is_appended_to(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        run_cli: Callable[..., CliResult]) -> None:
    folder = tmp_path / "shards"
    names = make_shards(folder, "bin")
    before = contents(folder)
    real, calls = os.pwrite, []

    def pwrite(fd: int, data: Any, offset: int) -> int:
        calls.append(offset)
        if len(calls) == 4:  # the second shard's new records: its end copy is written
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    code, _, err = run_cli("fix", str(folder), *ARGS)
    assert code == 3
    assert disk_full_lines(err, folder / names[1], "hint: free space on that filesystem, or "
                           "write elsewhere (nothing was left half-written)"), err
    assert contents(folder) == before
    for name in names[:-1]:
        zipfile.ZipFile(folder / name).close()  # (a longer one: "Bad magic number")


def test_a_ctrl_c_between_a_shards_commit_and_its_step_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        run_cli: Callable[..., CliResult]) -> None:
    from ckptool.write import commit

    folder = tmp_path / "shards"
    make_shards(folder, "st")
    before = contents(folder)
    real = commit.AtomicOutput.commit

    def commit_(self: commit.AtomicOutput) -> None:
        real(self)
        if journal.is_temporary(self.target.name):  # a shard's, named: not yet a step
            raise KeyboardInterrupt

    monkeypatch.setattr(commit.AtomicOutput, "commit", commit_)
    code, _, err = run_cli("fix", str(folder), *ARGS)
    assert code == 130 and f"interrupted: {folder} is unchanged" in err, err
    assert contents(folder) == before


def test_a_ctrl_c_while_fix_finishes_an_earlier_crash_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        run_cli: Callable[..., CliResult]) -> None:
    folder = tmp_path / "shards"
    crashed(folder, "st", "journal-written")
    interrupt_at(monkeypatch, "renaming", send_sigint)
    code, _, err = run_cli("fix", str(folder), *ARGS)
    assert code == 130  # (and never "run the command again": test_fix_in_place_review_j)
    assert f"ckptool: error: interrupted: finished an interrupted fix of {folder} " in err, err
    monkeypatch.undo()
    assert keys_of(run_cli, folder) == ("after", [])


def test_a_ctrl_c_once_the_command_is_done_says_the_fix_is_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        run_cli: Callable[..., CliResult]) -> None:
    main = sys.modules["ckptool.cli.main"]
    folder = tmp_path / "shards"
    make_shards(folder, "st")
    real = main.cli.main

    def late(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        raise KeyboardInterrupt  # after the command returned, before main did

    monkeypatch.setattr(main.cli, "main", late)
    code, out, err = run_cli("fix", str(folder), *ARGS[:-1], "--json")
    assert code == 130 and json.loads(out)["output"] == str(folder)
    assert f"ckptool: error: interrupted after {folder} was fixed" in err, err


LATE = """
import os, signal, sys
sys.path.insert(0, {root!r})
import ckptool.cli.main
main = sys.modules["ckptool.cli.main"]
real = main._end
def end(code):  # a Ctrl-C as the process ends
    main._end = real
    os.kill(os.getpid(), signal.SIGINT)
    real(code)
main._end = end
sys.argv = ["ckptool", *{args!r}]
main.entry()
"""


@pytest.mark.parametrize("mode", ["-q", "--json"])
def test_a_ctrl_c_as_the_process_ends_is_said(tmp_path: Path, mode: str) -> None:
    folder = tmp_path / "shards"
    make_shards(folder, "st")
    script = LATE.format(root=str(ROOT), args=["fix", str(folder), *ARGS[:-1], mode])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 130, done.stderr
    assert done.stderr.splitlines() == [
        f"ckptool: error: interrupted after {folder} was fixed",
        "hint: the fix is complete; only its report was cut short"]
    if mode == "--json":
        assert json.loads(done.stdout)["output"] == str(folder)


# --- names, copies, read-only -------------------------------------------------

def test_a_hint_quotes_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     run_cli: Callable[..., CliResult]) -> None:
    folder = tmp_path / "we ird dir"
    crashed(folder, "st", "journal-written")

    def refused(*args: Any) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(args[0]))

    monkeypatch.setattr(os, "replace", refused)
    code, _, err = run_cli("inspect", str(folder))
    assert code == 3 and f"(ckptool inspect {shell_word(str(folder))})" in err, err


def test_long_shard_names(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    """Names as long as the filesystem takes: the temporary names are short."""
    folder = tmp_path / "shards"
    folder.mkdir()
    hub.save_torch_state_dict(state_dict(), folder, max_shard_size="5KB",
                              filename_pattern="m" * 220 + "{suffix}.safetensors")
    assert max(len(n) for n in os.listdir(folder)) > 235
    code, _, err = run_cli("fix", str(folder), *ARGS)
    assert code == 0, err
    assert keys_of(run_cli, folder)[0] == "after"


def test_a_journal_copied_with_its_directory_is_not_applied(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    """A journal applies where it was written: not in a copy, nor in a
    download that carries one."""
    folder, copy = tmp_path / "shards", tmp_path / "copy"
    crashed(folder, "st", "journal-written")
    shutil.copytree(folder, copy)
    before = contents(copy)
    code, _, err = run_cli("inspect", str(copy))
    assert code == 3 and "the journal of an in-place fix of another directory" in err, err
    assert contents(copy) == before
    assert keys_of(run_cli, folder)[0] == "after"  # the original: finished


@pytest.mark.parametrize("step", ["renaming", "prepared"])
def test_a_directory_ckptool_may_not_write(tmp_path: Path, step: str,
                                           monkeypatch: pytest.MonkeyPatch,
                                           run_cli: Callable[..., CliResult]) -> None:
    """Another user's directory (or a read-only mount): nothing is tried,
    and the error says what to do."""
    folder = tmp_path / "shards"
    crashed(folder, "bin", step)
    before = contents(folder)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    code, _, err = run_cli("diagnose", str(folder))
    verb, done = ("finish", "finished") if step == "renaming" else ("roll back", "rolled back")
    assert code == 3, err
    assert err.splitlines() == [
        f"ckptool: error: {folder} has an interrupted fix ckptool cannot {verb} here "
        "(permission denied): ckptool fix --add-prefix x. --in-place was cut short, and "
        f"{folder} is not read until that fix is {done}",
        f"hint: run ckptool inspect {folder} where it may write there (as its owner): it "
        "does that and says so"]
    assert contents(folder) == before


def test_ctrl_c_leaves_no_journal_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         run_cli: Callable[..., CliResult]) -> None:
    """A real SIGINT while the shards are written beside: rolled back at once."""
    folder = tmp_path / "shards"
    make_shards(folder, "bin")
    before = contents(folder)
    interrupt_at(monkeypatch, "prepared", lambda: signal.raise_signal(signal.SIGINT))
    code, _, err = run_cli("fix", str(folder), *ARGS)
    assert code == 130 and f"interrupted: {folder} is unchanged" in err, err
    assert contents(folder) == before


def test_without_locks_a_live_fix_is_left_alone(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                run_cli: Callable[..., CliResult]) -> None:
    """A filesystem that cannot lock (some NFS mounts): the journal's process
    tells a fix that still runs (left alone) from one that died (rolled back)."""
    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    folder = tmp_path / "shards"
    crashed(folder, "bin", "prepared")
    before = contents(folder)
    record = json.loads((folder / journal.JOURNAL).read_text())
    alive = {**record, "pid": os.getpid()}  # as if the fix still ran
    (folder / journal.JOURNAL).write_text(json.dumps(alive))
    code, _, err = run_cli("inspect", str(folder))
    assert code == 3 and f"is being fixed in place by another ckptool process (pid " \
                         f"{os.getpid()}: ckptool fix --add-prefix x. --in-place)" in err, err
    assert contents(folder) == {**before, journal.JOURNAL: json.dumps(alive).encode()}
    (folder / journal.JOURNAL).write_text(json.dumps(record))  # its process is gone
    code, _, err = run_cli("inspect", str(folder))
    assert code == 0 and ROLLED_BACK.format(folder) in err, err
    assert journal.JOURNAL not in os.listdir(folder)
