"""The README's and the docs' command sessions are real, and their links hold.

Every ``$ ckptool ...`` session in a plain code block of README.md or of a
page under docs/ is run again from the repository root (100 columns, no
colour) and must print exactly what the page shows. Sessions in one block
run in order (a later one may read what an earlier one wrote, always under
/tmp), so each test first replays the block's earlier sessions.

The README is the front page: it keeps one session per command, its links
to docs/ resolve, and every docs page is linked from it or from the docs
index (docs/README.md)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
DOCS_INDEX = DOCS / "README.md"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
# pages that other changes write; links to them are checked once they exist


class Session(NamedTuple):
    page: str  # path relative to the repository root
    command: str  # the command line after '$ '
    expected: str
    before: tuple[str, ...]  # the earlier commands of the same block


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of each fenced code block, fence by fence."""
    blocks, info, body = [], None, []
    for line in text.splitlines(keepends=True):
        if info is None:
            if line.startswith("```"):
                info, body = line[3:].strip(), []
        elif line.rstrip("\n") == "```":
            blocks.append((info, "".join(body)))
            info = None
        else:
            body.append(line)
    return blocks


def sessions(page: Path) -> list[Session]:
    """Each '$ ckptool' line of the page's plain code blocks, with its output."""
    found = []
    for info, block in code_blocks(page.read_text(encoding="utf-8")):
        if info or not block.startswith("$ ckptool"):
            continue
        before: list[str] = []
        for part in re.split(r"^\$ ", block, flags=re.M)[1:]:
            command, _, output = part.partition("\n")
            found.append(Session(rel(page), command, output, tuple(before)))
            before.append(command)
    return found


SESSIONS = [s for page in PAGES for s in sessions(page)]


def run(command: str) -> str:
    args = shlex.split(command)
    assert args[0] == "ckptool"
    env = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1"}
    env.pop("FORCE_COLOR", None)
    proc = subprocess.run([sys.executable, "-m", "ckptool", *args[1:]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    return "\n".join(line.rstrip() for line in (proc.stdout + proc.stderr).splitlines())


def listing() -> set[str]:
    """What a session could leave behind: the repository root and samples/."""
    return {p.name for p in ROOT.iterdir() if not p.name.startswith(".")} | {
        f"samples/{p.name}" for p in (ROOT / "samples").iterdir()}


def test_readme_has_sessions() -> None:
    readme = [s for s in SESSIONS if s.page == "README.md"]
    assert len(readme) >= 5
    commands = {shlex.split(s.command)[1] for s in readme}
    missing = {"inspect", "diagnose", "fix", "convert", "diff", "devices"} - commands
    assert not missing, f"the README has no session of: {sorted(missing)}"


@pytest.mark.parametrize("session", SESSIONS, ids=[f"{s.page}: {s.command}" for s in SESSIONS])
def test_readme_session(session: Session) -> None:
    files = listing()
    for command in session.before:
        run(command)
    assert run(session.command) == session.expected.rstrip("\n")
    assert listing() == files, "a session must write nothing into the repository"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def links(page: Path) -> list[str]:
    """The page's link targets, outside code blocks and inline code."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def anchors(page: Path) -> set[str]:
    """GitHub's ids for the page's headings."""
    found: set[str] = set()
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    for heading in re.findall(r"^#+ (.*)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n, unique = 0, slug
        while unique in found:
            n += 1
            unique = f"{slug}-{n}"
        found.add(unique)
    return found


def resolve(page: Path, target: str) -> tuple[Path, str]:
    path, _, anchor = target.partition("#")
    return ((page.parent / path).resolve() if path else page), anchor


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_links_resolve(page: Path) -> None:
    """Relative links point at files that exist, and at headings they have."""
    for target in links(page):
        path, anchor = resolve(page, target)
        assert path.exists(), f"{rel(page)}: {target} does not exist"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{rel(page)}: {target}: no such heading"


def test_docs_are_reachable() -> None:
    """Every docs page is linked from the README or from the docs index."""
    linked = {resolve(page, t)[0] for page in (README, DOCS_INDEX) for t in links(page)}
    readme_links = {resolve(README, t)[0] for t in links(README)}
    assert DOCS_INDEX in readme_links
    unlinked = [rel(p) for p in PAGES if p not in linked and p != README]
    assert not unlinked, f"not linked from README.md or docs/README.md: {unlinked}"


def test_docs_pages_link_back() -> None:
    """Every docs page links back to the README."""
    for page in PAGES[1:]:
        assert README in {resolve(page, t)[0] for t in links(page)}, rel(page)
