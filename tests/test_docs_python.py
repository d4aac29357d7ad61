"""The Python API page's snippets run as they are, from the repository root,
in a fresh interpreter (the browser's ``run()`` is left out: it needs a
terminal, and the browser's own tests drive it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "python-api.md"


def test_python_api_snippets_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    assert len(blocks) >= 3
    code = "\n".join(line for block in blocks for line in block.splitlines()
                     if not line.rstrip().endswith(".run()"))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_modules_named_by_the_old_layout_still_import() -> None:
    code = ("from ckptool import gpus, modelspec\n"
            "assert gpus.assumed(2).device_count == 2 and callable(modelspec.build_model)")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
