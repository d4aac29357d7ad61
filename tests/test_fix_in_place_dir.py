"""``fix DIR --in-place`` on Hugging Face shards is all or nothing (issue 26).

Shards written by huggingface_hub (safetensors, and torch zip ``.bin``
shards: those are rewritten metadata-only, their new pickle appended) are
fixed by a ``ckptool fix`` process that dies as ``kill -9`` would at each
step of the commit (``CKPTOOL_TEST_CRASH_AT``), and at seeded random
moments (SIGKILL). Afterwards ``inspect`` reads the directory as entirely
before or entirely after the fix (finishing a fix whose journal was
written, and saying so), no temporary file is read, and running the fix
again completes it, once. A Ctrl-C says what it left: ``DIR is unchanged``
before the commit, ``after DIR was fixed`` during or after it (exit 130).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CliResult

from ckptool.read.layouts import journal

hub = pytest.importorskip("huggingface_hub")
ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--add-prefix", "x.", "--in-place", "-q"]
STEPS = [("prepare-written", "before"), ("prepared", "before"), ("journal-written", "after"),
         ("renaming", "after"), ("renamed", "after")]
ROLLED_BACK, FINISHED = "rolled back an interrupted fix", "finished an interrupted fix"

def state_dict() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(32, 16, generator=gen) for i in range(8)}


def make_shards(folder: Path, kind: str) -> list[str]:
    """Four shards of two tensors and their index; returns the file names."""
    folder.mkdir()
    hub.save_torch_state_dict(state_dict(), folder, max_shard_size="5KB",
                              safe_serialization=kind == "st")
    names = sorted(os.listdir(folder))
    assert len(names) == 5
    return names


def spawn(folder: Path, step: str | None = None) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k not in (journal.CRASH_ENV,)}
    if step:
        env[journal.CRASH_ENV] = step
    return subprocess.Popen([sys.executable, "-m", "ckptool", "fix", str(folder), *ARGS],
                            cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def keys_of(run_cli: Callable[..., CliResult], folder: Path) -> tuple[str, list[str]]:
    """'before' or 'after' (every key one way: anything else fails), and the notes."""
    code, out, err = run_cli("inspect", "--json", str(folder))
    assert code == 0, err
    report = json.loads(out)
    keys = {t["key"] for t in report["tensors"]}
    old = set(state_dict())
    if keys == old:
        state = "before"
    else:
        assert keys == {f"x.{k}" for k in old}, sorted(keys)
        state = "after"
    return state, report["metadata"].get("notes", [])


def assert_fixed_once(folder: Path, names: list[str], kind: str) -> None:
    """Only the checkpoint's own files, each tensor under its new name, as saved."""
    assert sorted(os.listdir(folder)) == names
    got: dict[str, torch.Tensor] = {}
    for name in names:
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            got.update(load_file(folder / name))
        elif name.endswith(".bin"):
            got.update(torch.load(folder / name, weights_only=True))
    want = {f"x.{k}": v for k, v in state_dict().items()}
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def contents(folder: Path) -> dict[str, bytes]:
    return {n: (folder / n).read_bytes() for n in sorted(os.listdir(folder))}


@pytest.mark.parametrize("kind", ["st", "bin"])
def test_kill_at_each_step_leaves_before_or_after(tmp_path: Path, kind: str,
                                                  run_cli: Callable[..., CliResult]) -> None:
    for step, expected in STEPS:
        folder = tmp_path / f"{kind}-{step}"
        names = make_shards(folder, kind)
        before = contents(folder)
        proc = spawn(folder, step)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 137, (step, err.decode())
        assert journal.JOURNAL in os.listdir(folder), step
        again = tmp_path / f"{kind}-{step}-again"  # (a journal is its directory's: no copy)
        make_shards(again, kind)
        assert spawn(again, step).wait(timeout=60) == 137
        # the first reader rolls the fix back or finishes it, and says which
        state, notes = keys_of(run_cli, folder)
        assert state == expected, step
        said = ROLLED_BACK if expected == "before" else FINISHED
        assert [n for n in notes if "interrupted fix" in n] == [
            n for n in notes if n.startswith(said)] and len(notes) == 1, (step, notes)
        if expected == "before":  # byte for byte (an appended .bin shard is cut back)
            assert contents(folder) == before, step
        assert sorted(os.listdir(folder)) == names
        assert keys_of(run_cli, folder) == (expected, [])  # once
        # the same fix run again: makes it, or finishes it and says so; never twice
        code, out, err = run_cli("fix", str(again), *ARGS[:-1], "--json")
        assert code == 0, (step, err)
        assert f"ckptool: note: {said} of {again}" in err, err
        report = json.loads(out)
        assert bool(report["renamed"]) == (expected == "before"), step
        assert any("it was this same fix" in n for n in report["notes"]) == (
            expected == "after")
        assert_fixed_once(again, names, kind)


def test_random_kills_leave_before_or_after(tmp_path: Path,
                                            run_cli: Callable[..., CliResult]) -> None:
    rng = random.Random(26)
    folder = tmp_path / "reference"
    make_shards(folder, "st")
    t0 = time.perf_counter()
    proc = spawn(folder)
    assert proc.wait(timeout=60) == 0
    took = time.perf_counter() - t0
    states = []
    for i in range(6):
        folder = tmp_path / f"run{i}"
        names = make_shards(folder, "st")
        proc = spawn(folder)
        time.sleep(rng.uniform(0.3, 1.0) * took)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        pending = (folder / journal.JOURNAL).exists()
        index = json.loads((folder / names[-1]).read_text())["weight_map"]
        if not pending and all(k.startswith("x.") for k in index):
            states.append("after")  # killed once it was done
        elif i % 2:  # the same fix again: makes it, or finishes it, or rolls back and makes it
            code, _, err = run_cli("fix", str(folder), *ARGS)
            assert code == 0 and ("ckptool: note: " in err) == pending, err
            states.append(f"fixed again{' (journal)' if pending else ''}")
        else:  # a reader first: it settles the journal, and says so
            state, notes = keys_of(run_cli, folder)
            assert bool(notes) == pending
            states.append(f"{state}{' (journal)' if pending else ''}")
            if state == "before":
                assert run_cli("fix", str(folder), *ARGS)[0] == 0
        assert_fixed_once(folder, names, "st")
    print(f"\nreference {took:.3f}s; after each kill: {states}")


# --- Ctrl-C ------------------------------------------------------------------

def interrupt_at(monkeypatch: pytest.MonkeyPatch, step: str, action: Callable[[], Any]) -> None:
    real = journal.crash_point

    def point(name: str) -> None:
        if name == step:
            action()
        real(name)

    monkeypatch.setattr(journal, "crash_point", point)


def raise_ctrl_c() -> None:
    raise KeyboardInterrupt


def send_sigint() -> None:  # a real Ctrl-C, as the terminal sends it
    os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("kind", ["st", "bin"])
def test_ctrl_c_before_the_commit_leaves_the_directory_unchanged(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch,
        run_cli: Callable[..., CliResult]) -> None:
    folder = tmp_path / "shards"
    make_shards(folder, kind)
    before = contents(folder)
    interrupt_at(monkeypatch, "prepared", raise_ctrl_c)
    code, out, err = run_cli("fix", str(folder), *ARGS)
    assert code == 130 and out == ""
    assert f"ckptool: error: interrupted: {folder} is unchanged" in err, err
    # byte for byte: what it wrote beside is gone, an appended .bin shard cut back
    assert contents(folder) == before
    assert keys_of(run_cli, folder) == ("before", [])


def test_ctrl_c_during_the_commit_is_held_until_the_directory_is_fixed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        run_cli: Callable[..., CliResult]) -> None:
    folder = tmp_path / "shards"
    names = make_shards(folder, "st")
    interrupt_at(monkeypatch, "journal-written", send_sigint)
    code, out, err = run_cli("fix", str(folder), *ARGS)
    assert code == 130 and out == ""
    assert f"ckptool: error: interrupted after {folder} was fixed" in err, err
    assert "the fix is complete" in err
    assert keys_of(run_cli, folder) == ("after", [])
    assert_fixed_once(folder, names, "st")


def test_ctrl_c_after_the_fix_says_it_is_fixed(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               run_cli: Callable[..., CliResult]) -> None:
    from ckptool.cli import fix_text

    folder = tmp_path / "shards"
    make_shards(folder, "bin")

    def interrupted(*args: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(fix_text, "render_fix", interrupted)
    code, out, err = run_cli("fix", str(folder), *ARGS[:-1])
    assert code == 130 and out == ""
    assert f"ckptool: error: interrupted after {folder} was fixed" in err, err
    assert keys_of(run_cli, folder)[0] == "after"


def test_a_different_fix_after_a_crash_is_not_stacked_on_it(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    folder = tmp_path / "shards"
    make_shards(folder, "st")
    proc = spawn(folder, "journal-written")
    proc.communicate(timeout=60)
    code, out, err = run_cli("fix", str(folder), "--add-prefix", "y.", "--in-place")
    assert code == 3 and out == ""
    assert FINISHED in err and "this fix was not applied on top of it" in err, err
    assert keys_of(run_cli, folder) == ("after", [])  # x. only, as the first fix asked


def test_a_fix_killed_before_its_commit_is_rolled_back_by_the_next_reader(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    """A fix killed before its commit leaves its new shards beside the old
    ones; readers skip them, and the first one rolls the fix back."""
    folder = tmp_path / "shards"
    names = make_shards(folder, "st")
    before = contents(folder)
    proc = spawn(folder, "prepared")
    proc.communicate(timeout=60)
    temps = [n for n in os.listdir(folder) if n not in names and n != journal.JOURNAL]
    assert temps and all(journal.is_temporary(n) for n in temps)
    code, out, err = run_cli("inspect", str(folder / names[0]))  # one shard: read as it is
    assert code == 0 and "layers.0.weight" in out, err
    assert keys_of(run_cli, folder)[0] == "before"
    assert contents(folder) == before
    assert run_cli("fix", str(folder), *ARGS)[0] == 0
    assert_fixed_once(folder, names, "st")


def test_a_journal_that_names_other_files_is_refused(tmp_path: Path,
                                                     run_cli: Callable[..., CliResult]) -> None:
    """A journal is trusted only to rename ckptool's temporary files over the
    checkpoint's own: reading a directory never moves anything else."""
    folder = tmp_path / "shards"
    names = make_shards(folder, "st")
    (folder / "notes.txt").write_text("mine")
    index = names[-1]
    temps = [journal.new_temp(), journal.new_temp()]
    text = (folder / index).read_bytes()  # a new index naming the same shards
    steps = [journal.Step("notes.txt", 2, temp=temps[0]),
             journal.Step(index, len(text), temp=temps[1])]
    (folder / temps[0]).write_text("{}")
    (folder / temps[1]).write_bytes(text)
    steps = [replace(s, ino=(folder / s.temp).stat().st_ino,  # as ckptool records them
                     old=((folder / s.name).stat().st_ino, (folder / s.name).stat().st_size))
             for s in steps]
    record = journal.Record(journal.COMMIT, folder.stat().st_ino, 1, "host", index, "", "",
                            [*names, "notes.txt"], temps=temps, steps=steps)
    (folder / journal.JOURNAL).write_bytes(record.dumps())
    before = contents(folder)
    code, _, err = run_cli("inspect", str(folder))
    assert code == 3 and "names a change ckptool never makes ('notes.txt'" in err, err
    assert contents(folder) == before


# --- one file: the same messages ---------------------------------------------

@pytest.fixture
def one_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.pth"
    torch.save({f"module.{k}": v for k, v in state_dict().items()}, path)
    return path


def loaded_keys(path: Path) -> set[str]:
    return set(torch.load(path, weights_only=True))


@pytest.mark.parametrize("how", ["metadata-only", "rewrite"])
def test_one_file_ctrl_c_before_the_commit(one_file: Path, how: str,
                                           monkeypatch: pytest.MonkeyPatch,
                                           run_cli: Callable[..., CliResult]) -> None:
    from ckptool.write import verify
    from ckptool.write.fix import inplace

    if how == "metadata-only":  # new records written, the file not yet cut
        monkeypatch.setattr(inplace, "_step", lambda name: raise_ctrl_c()
                            if name == "content-written" else None)
        args = ["--strip-module"]
    else:  # a cast: a new file, interrupted while it is verified
        monkeypatch.setattr(verify, "check_bytes", lambda *a: raise_ctrl_c())
        args = ["--strip-module", "--dtype", "bf16"]
    code, _, err = run_cli("fix", str(one_file), *args, "--in-place")
    assert code == 130
    assert f"ckptool: error: interrupted: {one_file} is unchanged" in err, err
    assert loaded_keys(one_file) == {f"module.{k}" for k in state_dict()}
    assert os.listdir(one_file.parent) == ["model.pth"]


@pytest.mark.parametrize("how", ["metadata-only", "rewrite"])
def test_one_file_ctrl_c_during_the_commit_is_held(one_file: Path, how: str,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   run_cli: Callable[..., CliResult]) -> None:
    from ckptool.write import commit

    if how == "metadata-only":  # the commit is an ftruncate
        real_truncate = os.ftruncate

        def truncate(fd: int, size: int) -> None:
            send_sigint()
            real_truncate(fd, size)

        monkeypatch.setattr(os, "ftruncate", truncate)
        args = ["--strip-module"]
    else:  # the commit is a rename
        real_commit = commit.AtomicOutput.commit

        def commit_(self: commit.AtomicOutput) -> None:
            send_sigint()
            real_commit(self)

        monkeypatch.setattr(commit.AtomicOutput, "commit", commit_)
        args = ["--strip-module", "--dtype", "bf16"]
    code, _, err = run_cli("fix", str(one_file), *args, "--in-place")
    assert code == 130
    assert f"ckptool: error: interrupted after {one_file} was fixed" in err, err
    assert loaded_keys(one_file) == set(state_dict())


def test_a_temporary_file_beside_one_checkpoint_is_not_a_second_one(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    """What ``kill -9`` leaves of a one-file fix where O_TMPFILE is missing:
    the directory still holds one checkpoint."""
    from safetensors.torch import save_file

    save_file(state_dict(), tmp_path / "model.safetensors")
    shutil.copyfile(tmp_path / "model.safetensors",
                    tmp_path / ".model.safetensors.0a1b2c3d.ckptool-tmp")
    code, out, err = run_cli("inspect", str(tmp_path))
    assert code == 0, err
    assert "ckptool-tmp" not in out


@pytest.mark.parametrize("which", ["alias", "stored"])
def test_dropping_a_tied_name_in_place(tmp_path: Path, which: str,
                                       run_cli: Callable[..., CliResult]) -> None:
    """huggingface_hub stores a tie once and records the other name in the
    index's metadata. Dropping that name changes the index only; dropping the
    stored one would rename the tensor in its shard: refused, nothing changed."""
    folder = tmp_path / "tied"
    folder.mkdir()
    sd = state_dict()
    sd["head.weight"] = sd["layers.0.weight"]
    hub.save_torch_state_dict(sd, folder, max_shard_size="5KB")
    index_path = folder / "model.safetensors.index.json"
    (alias, stored), = [(k, v) for k, v in json.loads(index_path.read_text())["metadata"].items()
                        if isinstance(v, str)]
    before = {n: (folder / n).read_bytes() for n in os.listdir(folder)}
    code, _, err = run_cli("fix", str(folder), "--drop", alias if which == "alias" else stored,
                           "--in-place", "-q")
    if which == "stored":
        assert code == 2 and f"{alias} is tied to {stored}" in err, err
        assert {n: (folder / n).read_bytes() for n in os.listdir(folder)} == before
        return
    assert code == 0, err
    assert {n: (folder / n).read_bytes() for n in before if n != index_path.name} == {
        n: b for n, b in before.items() if n != index_path.name}
    assert alias not in json.loads(index_path.read_text())["metadata"]
    code, out, err = run_cli("inspect", "--json", str(folder))
    assert code == 0, err
    assert {t["key"] for t in json.loads(out)["tensors"]} == set(sd) - {alias}
