"""The core stays pure: reading a checkpoint imports none of torch, click,
rich or textual, and the JSON path of the CLI imports neither torch nor rich."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SAMPLE = Path(__file__).resolve().parent.parent / "samples" / "dataparallel_cuda2.pth"

PROBE = """
import json, sys
{setup}
print(json.dumps(sorted(m for m in ("torch", "click", "rich", "textual", "numpy")
                        if m in sys.modules)))
"""


def loaded_after(setup: str) -> list[str]:
    code = PROBE.format(setup=setup)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return json.loads(out.splitlines()[-1])


def test_core_imports_no_views_and_no_torch() -> None:
    assert loaded_after(f"import ckptool; ckptool.open({str(SAMPLE)!r})") == []


def test_json_inspect_does_not_import_torch_or_rich() -> None:
    setup = (f"from ckptool.cli import main; import io, contextlib\n"
             f"with contextlib.redirect_stdout(io.StringIO()):\n"
             f"    main(['inspect', '--json', {str(SAMPLE)!r}])")
    assert loaded_after(setup) == ["click"]


def test_core_prints_nothing() -> None:
    code = f"import ckptool; ckptool.open({str(SAMPLE)!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)
    assert proc.stdout == "" and proc.stderr == ""


def test_rewrite_api_is_public_and_loaded_on_first_use() -> None:
    code = ("import sys, ckptool\n"
            "assert 'ckptool.write.fix.run' not in sys.modules\n"
            "assert callable(ckptool.fix) and callable(ckptool.convert)\n"
            "assert ckptool.FixOptions(strip_module=True).strip_module\n"
            "assert callable(ckptool.diff_checkpoints)\n"
            "assert callable(ckptool.diagnose)\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.strip() == "ok"


def test_json_diagnose_without_a_model_does_not_import_torch_or_rich() -> None:
    setup = (f"from ckptool.cli import main; import io, contextlib\n"
             f"with contextlib.redirect_stdout(io.StringIO()):\n"
             f"    assert main(['diagnose', '--json', {str(SAMPLE)!r}]) == 1")
    assert loaded_after(setup) == ["click"]


def test_diagnose_api() -> None:
    code = (f"import ckptool\n"
            f"d = ckptool.diagnose(ckptool.open({str(SAMPLE)!r}))\n"
            f"print(d.exit_code, [f.code for f in d.findings][0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60, env={"CUDA_VISIBLE_DEVICES": "",
                                                      "PATH": "/usr/bin:/bin"}).stdout
    assert out.split() == ["1", "device-unavailable"]


def test_browser_view_model_imports_no_textual() -> None:
    """The browser's rows, filters and view state are core-like: no views."""
    assert loaded_after("import ckptool.tui, ckptool.tui.index, ckptool.tui.rows, "
                        "ckptool.tui.view") == []


def test_fix_preview_is_core() -> None:
    """The fix preview the browser shows is core: no views, no torch."""
    setup = (f"import ckptool, ckptool.write.fix.preview\n"
             f"ckptool.write.fix.preview.preview(ckptool.open({str(SAMPLE)!r}), "
             f"ckptool.FixOptions(extract='auto', strip_module=True, to='cpu'))")
    assert loaded_after(setup) == []


def test_browser_starts_without_torch() -> None:
    """torch (about a second to import) waits until statistics are asked for."""
    setup = f"from ckptool.tui import make_app; make_app({str(SAMPLE)!r})"
    assert loaded_after(setup) == ["rich", "textual"]
