"""Snapshots of ``ckptool browse`` at fixed terminal sizes, as plain text
(``ckptool.tui.textshot``): layout regressions show up as a readable diff.

After an intended change, rewrite them with
``CKPTOOL_UPDATE_SNAPSHOTS=1 python -m pytest tests/test_browse_snapshots.py``
and read the diff before committing."""

from __future__ import annotations

import asyncio
import difflib
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from ckptool.check.gpus import machine as gpus
from ckptool.tui import make_app
from ckptool.tui.textshot import screen_text
from tests.helpers import SAMPLES
from tests.test_browse import settle, until

SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"


def shot(path: Path, keys: list[str], size: tuple[int, int], wait_fix: bool = False,
         env: dict[str, str] | None = None) -> tuple[str, Any]:
    app = make_app(path, machine=gpus.assumed(0))
    out: list[str] = []

    async def run() -> None:
        async with app.run_test(size=size) as pilot:
            await settle(app, pilot)
            for key in keys:
                await pilot.press(key)
            if wait_fix:
                screen = app.screen
                await until(pilot, lambda: screen.preview is not None, "the plan")  # type: ignore[attr-defined]
            await pilot.pause(0.2)
            out.append(screen_text(app))

    asyncio.run(run())
    return out[0], app


def check(name: str, text: str) -> None:
    path = SNAPSHOTS / f"{name}.txt"
    if os.environ.get("CKPTOOL_UPDATE_SNAPSHOTS"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text + "\n", encoding="utf-8")
        return
    assert path.exists(), f"no snapshot {path.name}: run with CKPTOOL_UPDATE_SNAPSHOTS=1"
    want = path.read_text(encoding="utf-8").removesuffix("\n")
    if text != want:
        diff = "\n".join(difflib.unified_diff(want.splitlines(), text.splitlines(),
                                              "snapshot", "now", lineterm=""))
        pytest.fail(f"{path.name} changed:\n{diff}")


@pytest.fixture
def sample(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # a copy under a fixed name, opened as a user in its folder would: the
    # screens show paths as they were given
    shutil.copy(SAMPLES / "dataparallel_cuda2.pth", tmp_path / "dataparallel_cuda2.pth")
    monkeypatch.chdir(tmp_path)
    return Path("dataparallel_cuda2.pth")


def test_snapshot_first_screen_80x24(sample: Path) -> None:
    text, _ = shot(sample, [], (80, 24))
    check("browse_first_80x24", text)


def test_snapshot_flat_filtered_with_details_80x24(sample: Path) -> None:
    text, _ = shot(sample, ["t", "slash", "b", "n", "enter", "down", "down"], (80, 24))
    check("browse_flat_filter_80x24", text)


def test_snapshot_findings_80x24(sample: Path) -> None:
    text, _ = shot(sample, ["f"], (80, 24))
    check("browse_findings_80x24", text)


def test_snapshot_fix_preview_80x24(sample: Path) -> None:
    text, _ = shot(sample, ["x"], (80, 24), wait_fix=True)
    check("browse_fix_80x24", text)


def test_snapshot_fix_preview_of_shards_80x24(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The dialog on a directory of Hugging Face shards, as the docs show it."""
    import huggingface_hub as hub
    import torch

    from tests.helpers import make_samples

    folder = tmp_path / "tinynet_dp"
    folder.mkdir()
    net = torch.nn.DataParallel(make_samples.TinyNet())
    hub.save_torch_state_dict(net.state_dict(), folder, max_shard_size="1KB")
    monkeypatch.chdir(tmp_path)
    text, _ = shot(Path("tinynet_dp"), ["x"], (80, 24), wait_fix=True)
    check("browse_fix_shards_80x24", text)


def test_snapshot_wide_120x32(sample: Path) -> None:
    text, _ = shot(sample, ["down", "down", "down"], (120, 32))
    check("browse_wide_120x32", text)


def test_no_color_keeps_the_layout_and_marks_the_cursor(sample: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    plain, _ = shot(sample, [], (80, 24))
    monkeypatch.setenv("NO_COLOR", "1")
    text, app = shot(sample, [], (80, 24))
    assert app.no_color
    assert text == plain
    # with no colour to tell it apart, the cursor row is drawn in reverse video
    from ckptool.tui.table import TensorTable

    async def style() -> Any:
        a = make_app(sample, machine=gpus.assumed(0))
        async with a.run_test(size=(80, 24)) as pilot:
            await settle(a, pilot)
            return a.query_one(TensorTable).get_component_rich_style("tensor-table--cursor")

    assert asyncio.run(style()).reverse


def test_docs_show_the_snapshots() -> None:
    """The browse page's screens are these snapshots, not stale copies."""
    page = Path(__file__).resolve().parent.parent / "docs" / "commands" / "browse.md"
    readme = page.read_text(encoding="utf-8")
    for name in ("browse_first_80x24", "browse_fix_80x24", "browse_fix_shards_80x24"):
        text = (SNAPSHOTS / f"{name}.txt").read_text(encoding="utf-8")
        assert f"```\n{text}```" in readme, name


def test_wide_screen_lines_up() -> None:
    """Every line of the wide screen has the side panes' left border in the
    same column (list rows once stopped a cell short of their width, and
    what was drawn beside them slid left), and the list's header names sit
    over their columns."""
    lines = (SNAPSHOTS / "browse_wide_120x32.txt").read_text(encoding="utf-8").splitlines()
    borders = [line for line in lines[3:-1] if any(c in line for c in "│╭╰")]
    assert len(borders) == len(lines) - 4
    assert {min(line.index(c) for c in "│╭╰" if c in line) for line in borders} == {72}
    for name in ("browse_wide_120x32", "browse_first_80x24"):
        lines = (SNAPSHOTS / f"{name}.txt").read_text(encoding="utf-8").splitlines()
        header, row = lines[3], lines[4]
        assert header.index("shape") == row.index("9 tensors"), name
        assert header.index("device") == row.index("cuda:2"), name
        assert header.index("size") + 4 == row.index("1.4 kB") + 6, name
