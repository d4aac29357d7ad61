"""Every command ckptool prints (a diagnosis' fix, an error's hint) quotes
its paths one way (``ckptool.describe.shell_word``), so that pasted into a
shell it names the same file: a name that is not UTF-8 (``model\\xff.pth``)
as bash's ``$'...'`` with ``\\xff`` escapes, never a ``\\udcff`` that names
no file."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import CliResult

from ckptool.describe import shell_quote, shell_word

# bash runs the printed command with `ckptool` standing for a function that
# prints each of its arguments, NUL-terminated
SHOW_ARGS = 'ckptool() { printf "%s\\0" "$@"; }; '


def pasted(command: str) -> list[bytes]:
    """The arguments bash passes to ``ckptool`` when ``command`` is pasted."""
    done = subprocess.run(["bash", "-c", SHOW_ARGS + command], capture_output=True,
                          check=True, timeout=30)
    return done.stdout.split(b"\0")[:-1]


@pytest.fixture
def odd_file(tmp_path: Path) -> Path:
    """A DataParallel checkpoint whose name is not UTF-8 (byte 0xff)."""
    path = Path(os.fsdecode(os.fsencode(tmp_path) + b"/model\xff.pth"))
    torch.save({"module.w": torch.ones(2, 2), "module.b": torch.zeros(2)}, path)
    return path


def test_a_diagnosis_fix_command_names_the_file(odd_file: Path,
                                                run_cli: Callable[..., CliResult]) -> None:
    code, out, _ = run_cli("diagnose", str(odd_file))
    assert code == 1
    commands = [s for s in out.splitlines() if "ckptool " in s]
    assert len(commands) == 2 and not [s for s in commands if "\\udcff" in s]
    line = next(s.strip() for s in commands if " -o " in s)
    args = pasted(line)
    assert args[1] == os.fsencode(odd_file)
    assert args[-1] == os.fsencode(odd_file.with_name(os.fsdecode(b"model\xff.fixed.pth")))
    # and run for real, it writes that file
    code, _, err = run_cli(*(os.fsdecode(a) for a in args))
    assert (code, err) == (0, "")
    assert os.path.exists(os.fsencode(odd_file.with_name(os.fsdecode(b"model\xff.fixed.pth"))))


def test_an_error_hint_names_the_file(odd_file: Path, tmp_path: Path) -> None:
    # (a subprocess: its stderr writes the error's \\udcff as Python's stderr
    # does, where pytest's capture refuses it)
    done = subprocess.run([sys.executable, "-m", "ckptool", "convert", str(odd_file),
                           str(tmp_path / "out.pt")], capture_output=True, timeout=60,
                          cwd=Path(__file__).resolve().parent.parent, check=False)
    assert done.returncode == 2
    hint = done.stderr.decode().splitlines()[1]
    assert hint.startswith("hint: ") and "\\udcff" not in hint
    hint = hint.split("`")[1]  # hint: to keep only its state dict: `ckptool fix ... -o ...`
    assert pasted(hint)[1:3] == [os.fsencode(odd_file), b"--extract"]


def test_an_error_message_shows_the_name_escaped(run_cli: Callable[..., CliResult],
                                                 tmp_path: Path) -> None:
    """The error line itself: the bytes a name stands for as \\xHH, never a
    surrogate that cannot be printed, never a raw control code."""
    name = tmp_path / os.fsdecode(b"gone\xff\x1b[31m.pth")
    code, out, err = run_cli("inspect", str(name))
    assert (code, out) == (3, "")
    first = err.splitlines()[0]
    assert first.startswith("ckptool: error: ") and "gone\\xff\\x1b[31m.pth" in first
    assert all(line.isprintable() for line in err.splitlines())


@pytest.mark.parametrize("name", [
    "plain.pth", "with space.pth", "it's.pth", "-starts-with-dash.pth", "modèle.pth",
    "esc\x1b[31m.pth", "new\nline.pth", "\u202eevil.pth", os.fsdecode(b"lat\xe9n1 \\ '.pth"),
])
def test_every_name_pastes_back_as_its_bytes(name: str) -> None:
    word = shell_word(name)
    assert word.isprintable()  # nothing a terminal would obey, nothing it hides
    want = os.fsencode(f"./{name}" if name.startswith("-") else name)
    assert pasted(f"ckptool {word}") == [want]
    if name.isprintable():  # printable names keep shlex's quoting
        assert shell_quote(name) == shlex.quote(name)
