"""Re-run every ``$ ckptool ...`` session of README.md and docs/ and paste
its real output back into the page (what tests/test_readme.py compares).

    .venv/bin/python tools/update_sessions.py [PAGE ...]

Run it after a change of output, then read the diff: it shows what users
will see differently. Sessions run as the test runs them (repository root,
100 columns, no colour), each block's sessions in order.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_readme import PAGES, ROOT, run


def update(page: Path) -> bool:
    text = page.read_text(encoding="utf-8")
    out, changed = [], False
    blocks = re.split(r"(^```[^\n]*\n.*?^```$)", text, flags=re.S | re.M)
    for piece in blocks:
        if piece.startswith("```\n$ ckptool"):
            body = piece[4:-3]
            parts = re.split(r"^\$ ", body, flags=re.M)[1:]
            new = ""
            for part in parts:
                command = part.partition("\n")[0]
                output = run(command)
                new += f"$ {command}\n" + (f"{output}\n" if output else "")
            changed |= new != body
            piece = f"```\n{new}```"
        out.append(piece)
    if changed:
        page.write_text("".join(out), encoding="utf-8")
    return changed


if __name__ == "__main__":
    pages = [Path(p).resolve() for p in sys.argv[1:]] or PAGES
    for page in pages:
        if update(page):
            print(f"updated {page.relative_to(ROOT)}")
