"""A launcher's rank that reaches ckptool through a program that forks
(``torchrun --no-python flock -s L ckptool ...``, ``strace -f``, ``uv run``,
``conda run``, ``apptainer exec``) is a rank all the same: it meets the
others, rather than every rank converting alone and racing for one output.
A training script that runs ckptool (through such a program or not) still
makes a plain process; a program ckptool cannot judge is an error saying
how to decide (``CKPTOOL_DISTRIBUTED``), never a guess.

Each case is a real chain of processes: a launcher (no rank variable)
starting the rank's command with ``RANK`` set, as torchrun's agent does,
and at its end ``world.detect`` as ``ckptool convert IN OUT`` calls it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckptool.write.distributed import ancestry

ROOT = Path(__file__).resolve().parent.parent

DETECT = """
from ckptool.errors import UsageError
from ckptool.write.distributed import world
try:
    found = world.detect()
except UsageError as exc:
    print("error:", exc.message, "|", exc.hint)
else:
    print("plain" if found is None else f"{found.launcher} rank {found.rank} of {found.size}")
"""
# the rank's command: ckptool's own arguments after the program
LEAF = [sys.executable, "-c", DETECT, "convert", "in.pt", "out.safetensors"]
LAUNCHER = "import os, subprocess, sys; sys.exit(subprocess.run(sys.argv[1:], env={**os.environ, " \
    "'RANK': '1', 'WORLD_SIZE': '2', 'LOCAL_RANK': '1', 'MASTER_ADDR': '127.0.0.1', " \
    "'MASTER_PORT': '9', 'TORCHELASTIC_RUN_ID': 'job'}).returncode)"
# a training script: ckptool's command is its own (here, one JSON argument)
TRAINING = "import json, subprocess, sys; sys.exit(subprocess.run(json.loads(sys.argv[1]))" \
    ".returncode)"


def launched(command: list[str]) -> str:
    """What detect says at the end of ``command``, started as a launcher's rank."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "CKPTOOL_")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", LAUNCHER, *command], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def lock(tmp_path: Path) -> str:
    return str(tmp_path / "L")


def test_flock_between_the_launcher_and_ckptool(lock: str) -> None:
    assert launched(LEAF) == "torchrun rank 1 of 2"
    assert launched(["flock", "-s", lock, *LEAF]) == "torchrun rank 1 of 2"
    # a wrapper inside a wrapper: each is looked through
    assert launched(["flock", "-s", lock, "nice", *LEAF]) == "torchrun rank 1 of 2"


def test_strace_between_the_launcher_and_ckptool() -> None:
    strace = shutil.which("strace")
    if strace is None or subprocess.run([strace, "-f", "-o", "/dev/null", "true"],
                                         capture_output=True).returncode != 0:
        pytest.skip("strace is not installed, or may not trace here")
    assert launched([strace, "-f", "-o", "/dev/null", *LEAF]) == "torchrun rank 1 of 2"


def test_a_program_told_to_run_this_very_command(tmp_path: Path) -> None:
    """``uv run``, ``conda run``: named for nothing ckptool knows, but its
    command line holds ckptool's own arguments in a row."""
    runner = tmp_path / "runner"
    shutil.copy(shutil.which("flock") or "/usr/bin/flock", runner)
    assert launched([str(runner), "-s", str(tmp_path / "L"), *LEAF]) == "torchrun rank 1 of 2"


def test_a_training_scripts_subprocess_is_still_plain(lock: str) -> None:
    assert launched([sys.executable, "-c", TRAINING, json.dumps(LEAF)]) == "plain"
    assert launched([sys.executable, "-c", TRAINING,
                     json.dumps(["flock", "-s", lock, *LEAF])]) == "plain"


def test_a_program_ckptool_cannot_judge_is_an_error(tmp_path: Path) -> None:
    """A program that is no wrapper ckptool knows, nor Python, and was not
    given ckptool's arguments as its own (here inside one ``sh -c`` string):
    the launcher's rank, or a job's process running ckptool? Said, with
    how to decide; never a guess."""
    runner = tmp_path / "runner"
    shutil.copy(shutil.which("flock") or "/usr/bin/flock", runner)
    said = launched([str(runner), "-s", str(tmp_path / "L"), "sh", "-c",
                     " ".join(f"'{a}'" for a in LEAF)])
    assert said.startswith("error: RANK is set, but ckptool cannot tell whether the launcher "
                           "started it (through 'runner', pid "), said
    assert "CKPTOOL_DISTRIBUTED=1" in said and "CKPTOOL_DISTRIBUTED=0" in said


def test_the_arguments_in_a_row() -> None:
    args = ["convert", "a", "b"]
    assert ancestry._runs(["flock", "L", "ckptool", "convert", "a", "b"], args)
    assert ancestry._runs(["uv", "run", "ckptool", "convert", "a", "b", "--json"], args)
    assert not ancestry._runs(["python", "train.py", "convert", "a"], args)
    assert not ancestry._runs(["sh", "-c", "ckptool convert a b"], args)
    assert not ancestry._runs(["convert", "a", "b"], args)  # the program itself is no argument
    assert not ancestry._runs(["x", "y"], [])
