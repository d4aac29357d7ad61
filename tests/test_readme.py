"""The README's command sessions are real: every ``$ ckptool ...`` block is
run again from the repository root (100 columns, no colour) and must print
exactly what the README shows."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def sessions() -> list[tuple[str, str]]:
    """(command line, expected output) for each '$ ckptool' line in code blocks."""
    found = []
    for block in re.findall(r"```\n(.*?)```", README, re.S):
        if not block.startswith("$ ckptool"):
            continue
        parts = re.split(r"^\$ ", block, flags=re.M)[1:]
        for part in parts:
            command, _, output = part.partition("\n")
            found.append((command, output))
    return found


SESSIONS = sessions()


def test_readme_has_sessions() -> None:
    assert len(SESSIONS) >= 5


@pytest.mark.parametrize(("command", "expected"), SESSIONS, ids=[c for c, _ in SESSIONS])
def test_readme_session(command: str, expected: str) -> None:
    args = shlex.split(command)
    assert args[0] == "ckptool"
    env = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1"}
    env.pop("FORCE_COLOR", None)
    proc = subprocess.run([sys.executable, "-m", "ckptool", *args[1:]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    actual = "\n".join(line.rstrip() for line in (proc.stdout + proc.stderr).splitlines())
    assert actual == expected.rstrip("\n")
