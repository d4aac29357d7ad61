"""``ckptool browse``: the real Textual app driven with its pilot
(``App.run_test``), plus the CLI command that starts it.

Each test runs the app headless at a fixed size, against a machine with no
GPU (``gpus.assumed(0)``) so that findings do not depend on where the
tests run."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from textual.widgets import Input

import ckptool
from ckptool.check.gpus import machine as gpus
from ckptool.cli import main
from ckptool.model import TensorInfo
from ckptool.tui import make_app
from ckptool.tui.app import BrowseApp
from ckptool.tui.index import Node
from ckptool.tui.table import TensorTable
from ckptool.tui.textshot import screen_text
from tests.helpers import SAMPLES, saved_on

DP = SAMPLES / "dataparallel_cuda2.pth"

Pilot = Any
Script = Callable[[BrowseApp, Pilot], Awaitable[None]]


def drive(path: Path | str, script: Script, size: tuple[int, int] = (80, 24),
          **kwargs: Any) -> BrowseApp:
    """Run the app on ``path``, wait for the read and the findings, run ``script``."""
    kwargs.setdefault("machine", gpus.assumed(0))
    app = make_app(path, **kwargs)

    async def run() -> None:
        async with app.run_test(size=size) as pilot:
            await settle(app, pilot)
            await script(app, pilot)

    asyncio.run(run())
    return app


async def settle(app: BrowseApp, pilot: Pilot, findings: bool = True) -> None:
    for _ in range(400):
        if app.return_code is not None:
            return
        if app.loaded.is_set() and (not findings or app.diagnosis is not None
                                    or app.findings_error is not None):
            break
        await pilot.pause(0.02)
    else:
        raise AssertionError("the app did not finish reading")
    await pilot.pause()


async def until(pilot: Pilot, cond: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if cond():
            return
        await pilot.pause(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def table(app: BrowseApp) -> TensorTable:
    return app.query_one(TensorTable)


def row_keys(app: BrowseApp) -> list[str]:
    return [r.path if isinstance(r, Node) else r.key for r in table(app).rows]


def detail(app: BrowseApp) -> str:
    return str(app.query_one("#detail").render())


# -- reading and layout -------------------------------------------------------

def test_opens_with_summary_tree_and_findings() -> None:
    async def script(app: BrowseApp, pilot: Pilot) -> None:
        summary = str(app.query_one("#summary").render())
        assert "dataparallel_cuda2.pth · torch-zip" in summary
        assert "15 tensors" in summary and "saved on cuda:2" in summary
        # the model's parameters, not the optimizer's moments as well (676)
        assert "'state_dict' · prefix module. · 9 tensors · 330 params +17 buffers" in summary
        assert "676" not in summary
        # single-child chains open by themselves: state_dict > module > conv...
        assert row_keys(app)[:4] == ["state_dict", "state_dict/module",
                                     "state_dict/module.conv",
                                     "state_dict/module.conv.weight"]
        findings = str(app.query_one("#findings").render())
        assert "device-unavailable" in findings and "wrapped-state-dict" in findings
        assert f"fix everything: ckptool fix {DP}" in findings

    drive(DP, script)


def test_navigation_and_tensor_details() -> None:
    async def script(app: BrowseApp, pilot: Pilot) -> None:
        assert "tensors" in detail(app)  # a module node first
        await pilot.press("down", "down", "down")
        item = table(app).current
        assert isinstance(item, TensorInfo) and item.key == "state_dict/module.conv.weight"
        text = detail(app)
        assert "8x3x3x3 · float32 · 216 elements · 864 B" in text
        assert "(27, 9, 3, 1) · offset 0 · contiguous" in text
        assert "cuda:2 → torch.load fails here" in text
        assert "press s" in text
        await pilot.press("end")
        assert table(app).cursor == len(table(app).rows) - 1
        await pilot.press("home")
        assert table(app).cursor == 0

    drive(DP, script)


def test_where_a_tensor_lands_on_a_machine_with_a_gpu() -> None:
    async def script(app: BrowseApp, pilot: Pilot) -> None:
        app.jump_to("state_dict/module.fc.bias")
        await pilot.pause()
        assert "cuda:2 → plain torch.load puts it on cuda:2" in detail(app)

    drive(DP, script, machine=gpus.assumed(3))


def test_collapse_and_open_modules() -> None:
    async def script(app: BrowseApp, pilot: Pilot) -> None:
        before = len(table(app).rows)
        await pilot.press("down", "down")  # state_dict/module.conv
        assert table(app).current.path == "state_dict/module.conv"  # type: ignore[union-attr]
        await pilot.press("enter")
        assert len(table(app).rows) == before - 2
        await pilot.press("right")
        assert len(table(app).rows) == before
        await pilot.press("down", "left")  # from the tensor back to its module
        assert table(app).current.path == "state_dict/module.conv"  # type: ignore[union-attr]
        await pilot.press("left")  # and closed
        assert len(table(app).rows) == before - 2

    drive(DP, script)


def test_flat_view_sorts_and_node_detail() -> None:
    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("t")
        assert not app.view.tree
        assert all(isinstance(r, TensorInfo) for r in table(app).rows)
        assert len(table(app).rows) == 15
        await pilot.press("o", "o")  # file -> name -> size
        assert app.view.sort == "size"
        sizes = [r.nbytes for r in table(app).rows]  # type: ignore[union-attr]
        assert sizes == sorted(sizes, reverse=True)
        await pilot.press("o")
        assert app.view.sort == "device"
        await pilot.press("o")
        assert app.view.sort == "file"
        await pilot.press("t")  # back to the tree, the cursor on the same tensor
        assert isinstance(table(app).rows[0], Node)
        assert table(app).current.key == "state_dict/module.conv.weight"  # type: ignore[union-attr]
        await pilot.press("home")
        assert "tensors" in detail(app) and "params" in detail(app)

    drive(DP, script)


def test_filter_as_you_type_then_clear() -> None:
    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("t", "slash")
        assert app.query_one("#filter").has_focus
        await pilot.press("b", "n")
        assert row_keys(app) == [f"state_dict/module.bn.{n}" for n in (
            "weight", "bias", "running_mean", "running_var", "num_batches_tracked")]
        await pilot.press(".", "w")
        assert row_keys(app) == ["state_dict/module.bn.weight"]
        await pilot.press("enter")  # keeps the filter, back to the list
        assert table(app).has_focus and app.view.filter.pattern == "bn.w"
        assert "filter 'bn.w': 1 of 15 tensors matches" in str(
            app.query_one("#status").render())
        await pilot.press("escape")
        assert not app.view.filter and len(table(app).rows) == 15

    drive(DP, script)


def test_glob_filter_in_the_tree_opens_matching_modules() -> None:
    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("slash", *"*.bias", "enter")
        keys = row_keys(app)
        tensors = [k for k in keys if k.endswith(".bias")]
        assert tensors == ["state_dict/module.conv.bias", "state_dict/module.bn.bias",
                           "state_dict/module.fc.bias"]
        assert "state_dict/module.fc" in keys  # closed before: opened by the filter

    drive(DP, script)


def test_jump_to_a_key_clears_the_filter_and_opens_its_modules() -> None:
    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("slash", "c", "o", "n", "v", "enter")
        await pilot.press("g")
        await pilot.press(*"running_v", "enter")
        await pilot.pause()
        assert table(app).current.key == "state_dict/module.bn.running_var"  # type: ignore[union-attr]
        assert not app.view.filter

    drive(DP, script)


def test_jump_completes_from_the_start_of_keys() -> None:
    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("g", *"state_dict/module.f")
        await pilot.pause()
        screen_input = app.screen.query_one("#jump-input")
        assert screen_input._suggestion == "state_dict/module.fc.weight"  # type: ignore[attr-defined]
        await pilot.press("right", "enter")  # accept the suggestion
        await pilot.pause()
        assert table(app).current.key == "state_dict/module.fc.weight"  # type: ignore[union-attr]

    drive(DP, script)


def test_statistics_on_request_read_that_tensor_only() -> None:
    expected = torch.load(DP, map_location="cpu", weights_only=False)["state_dict"][
        "module.fc.weight"]

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        assert app.stats == {}  # nothing computed up front
        app.jump_to("state_dict/module.fc.weight")
        await pilot.pause()
        await pilot.press("s")
        await until(pilot, lambda: not isinstance(
            app.stats.get("state_dict/module.fc.weight"), (str, type(None))), "stats")
        await pilot.pause()
        stats = app.stats["state_dict/module.fc.weight"]
        assert not isinstance(stats, str)
        assert stats.min == pytest.approx(expected.min().item())
        assert stats.max == pytest.approx(expected.max().item())
        assert stats.mean == pytest.approx(expected.double().mean().item())
        assert stats.std == pytest.approx(expected.double().std().item())
        text = detail(app)
        assert f"{expected.min().item():.6g}" in text and "0 NaN · 0 Inf" in text
        assert list(app.stats) == ["state_dict/module.fc.weight"]

    drive(DP, script)


def test_statistics_of_a_module_row_are_refused_politely() -> None:
    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("s")
        assert app.stats == {}

    drive(DP, script)


def test_copy_key_and_help_and_quit() -> None:
    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("down", "down", "down", "c")
        assert app.clipboard == "state_dict/module.conv.weight"
        # OSC 52 cannot tell whether the terminal took it: the text is shown,
        # and where it was sent
        (note,) = list(app._notifications)
        assert note.message.startswith("state_dict/module.conv.weight\n")
        assert "terminal's clipboard" in note.message and "select" in note.message
        await pilot.press("question_mark")
        assert type(app.screen).__name__ == "HelpScreen"
        assert "filter as you type" in screen_text(app)
        await pilot.press("escape")
        assert type(app.screen).__name__ == "Screen"
        await pilot.press("q")

    app = drive(DP, script)
    assert app.return_code == 0


def test_findings_switch_in_a_narrow_terminal() -> None:
    async def script(app: BrowseApp, pilot: Pilot) -> None:
        assert not app.query_one("#findings-box").display
        await pilot.press("f")
        assert app.query_one("#findings-box").display
        assert not app.query_one("#detail-box").display
        await pilot.press("f")
        assert app.query_one("#detail-box").display
        assert table(app).has_focus

    drive(DP, script)


def test_wide_terminal_shows_details_beside_the_list() -> None:
    async def script(app: BrowseApp, pilot: Pilot) -> None:
        assert app.query_one("#main").has_class("-wide")
        assert app.query_one("#findings-box").display and app.query_one("#detail-box").display
        assert table(app).region.width < 100

    drive(DP, script, size=(140, 40))


def test_unreadable_file_stops_the_app_with_exit_3(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pth"
    data = DP.read_bytes()
    bad.write_bytes(data[: len(data) // 2])

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        pass

    app = drive(bad, script)
    assert app.return_code == 3
    assert app.error is not None and "bad.pth" in app.error.message


def test_a_read_the_system_refuses_stops_the_app_with_exit_3(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptool.read.reader as reader

    def refused(path: str, on_tensors: Any = None) -> Any:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(reader, "open_checkpoint", refused)

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        pass

    app = drive(DP, script)
    assert app.return_code == 3
    assert app.error is not None and app.error.message.endswith("Input/output error")


def test_findings_say_why_they_are_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptool.check.diagnosis as diagnosis

    def gone(*args: Any, **kwargs: Any) -> Any:
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(diagnosis, "diagnose", gone)

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        assert "cannot diagnose: No such file or directory" in str(
            app.query_one("#findings").render())

    drive(DP, script)


def test_model_findings_and_model_errors(tmp_path: Path) -> None:
    from ckptool.check import modelspec

    spec = f"{SAMPLES / 'make_samples.py'}:TinyNet"

    def good(ckpt: Any) -> Any:
        return modelspec.build_model(spec, {}, {})

    async def check_good(app: BrowseApp, pilot: Pilot) -> None:
        findings = str(app.query_one("#findings").render())
        assert "key-prefix" in findings

    drive(DP, check_good, model=good)

    def bad(ckpt: Any) -> Any:
        return modelspec.build_model(f"{SAMPLES / 'make_samples.py'}:NoSuchNet", {}, {})

    async def check_bad(app: BrowseApp, pilot: Pilot) -> None:
        findings = str(app.query_one("#findings").render())
        assert "NoSuchNet" in findings and "hint:" in findings

    drive(DP, check_bad, model=bad)


def test_partial_rows_show_before_the_read_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader hands over batches while it reads: they are listed at once."""
    import ckptool.read.reader as reader

    real = reader.open_checkpoint
    release = threading.Event()

    def slow_open(path: str, on_tensors: Any = None) -> Any:
        ckpt = real(path)
        assert on_tensors is not None
        on_tensors(ckpt.tensors[:4])
        release.wait(10)
        return ckpt

    monkeypatch.setattr(reader, "open_checkpoint", slow_open)
    app = make_app(DP, machine=gpus.assumed(0))

    async def run() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: len(app.index) == 4, "the first batch")
            await pilot.pause(0.15)
            assert app.ckpt is None
            assert "state_dict/module.conv.weight" in [
                r.key for r in table(app).rows if isinstance(r, TensorInfo)]
            assert "reading… 4 tensors so far" in str(app.query_one("#summary").render())
            release.set()
            await settle(app, pilot)
            assert len(app.index) == 15 and app.ckpt is not None

    asyncio.run(run())


def test_a_preview_that_was_exact_is_kept(tmp_path: Path) -> None:
    """A plain state dict: every tensor comes in a batch, so the tree built
    while reading is the final one and is not rebuilt."""
    path = tmp_path / "sd.pth"
    torch.save({f"module.l{i}.weight": torch.zeros(2) for i in range(2500)}, path)

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        assert app._taken >= 3  # batches of 1000
        assert len(app.index) == 2500
        assert [t.key for t in app.index.tensors] == [t.key for t in app.ckpt.tensors]  # type: ignore[union-attr]
        assert "2,500 tensors" in str(app.query_one("#summary").render())
        await pilot.press("t", "end")
        assert table(app).current.key == "module.l2499.weight"  # type: ignore[union-attr]

    drive(path, script)


# -- fixing from the browser ------------------------------------------------------

def test_fix_preview_lists_keys_before_and_after(tmp_path: Path) -> None:
    src = tmp_path / "dp.pth"
    shutil.copy(DP, src)

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("x")
        screen = app.screen
        assert type(screen).__name__ == "FixScreen"
        # the diagnosis's fix: extract, strip module., move to the CPU
        await until(pilot, lambda: screen.preview is not None, "the plan")  # type: ignore[attr-defined]
        await pilot.pause()
        summary = str(screen.query_one("#fix-summary").render())
        assert "9 tensors kept · 9 renamed · 9 moved · 6 left out" in summary
        # the paths as the browser was given them
        assert f"--extract --strip-prefix module. --to cpu -o {tmp_path / 'dp.fixed.pth'}" \
            in summary
        lines = list(screen.query_one("#fix-preview").lines)
        assert lines[0] == "state_dict/module.conv.weight  ⇒  conv.weight   [cuda:2 → cpu]"
        assert any(line.startswith("optimizer/") and "(left out)" in line for line in lines)
        # untick extract and the move: only the renames remain
        screen.query_one("#fix-extract").value = False
        screen.query_one("#fix-move").value = False
        await pilot.pause(0.1)
        await until(pilot, lambda: screen.preview is not None, "the new plan")  # type: ignore[attr-defined]
        await pilot.pause()
        lines = list(screen.query_one("#fix-preview").lines)
        assert lines[0] == ("state_dict/module.conv.weight  ⇒  state_dict/conv.weight   "
                            "[cuda:2]")
        await pilot.press("escape")
        assert type(app.screen).__name__ == "Screen"

    drive(src, script)
    assert not (tmp_path / "dp.fixed.pth").exists()  # a preview writes nothing
    assert sorted(os.listdir(tmp_path)) == ["dp.pth"]


def test_fix_dialog_proposes_a_name_no_write_would_refuse(tmp_path: Path) -> None:
    src = tmp_path / "dp.pth"
    shutil.copy(DP, src)
    (tmp_path / "dp.fixed.pth").write_bytes(b"an earlier fix")

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("x")
        screen = app.screen
        await until(pilot, lambda: screen.preview is not None, "the plan")  # type: ignore[attr-defined]
        assert screen.query_one("#fix-output").value == "dp.fixed2.pth"
        await pilot.press("escape")

    drive(src, script)
    assert (tmp_path / "dp.fixed.pth").read_bytes() == b"an earlier fix"


def test_fix_writes_through_the_core_after_confirmation(tmp_path: Path) -> None:
    src = tmp_path / "dp.pth"
    shutil.copy(DP, src)
    original = src.read_bytes()

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("x")
        screen = app.screen
        await until(pilot, lambda: screen.preview is not None, "the plan")  # type: ignore[attr-defined]
        await pilot.press("ctrl+s")
        assert type(app.screen).__name__ == "ConfirmScreen"
        # what the output will hold, from the plan: not the input's 15 tensors
        assert "Write dp.fixed.pth (9 tensors, about 1.4 kB)?" in screen_text(app)
        await pilot.press("n")  # said no: nothing written
        assert type(app.screen).__name__ == "FixScreen"
        assert not (tmp_path / "dp.fixed.pth").exists()
        await pilot.press("f2")  # the other write key
        assert type(app.screen).__name__ == "ConfirmScreen"
        await pilot.press("escape")
        assert type(app.screen).__name__ == "FixScreen"
        await pilot.press("ctrl+s", "y")
        await until(pilot, lambda: screen.written is not None, "the write")  # type: ignore[attr-defined]
        await pilot.pause()
        assert "storages verified" in str(screen.query_one("#fix-summary").render())
        await pilot.press("escape")

    drive(src, script)
    out = tmp_path / "dp.fixed.pth"
    assert src.read_bytes() == original
    sd = torch.load(out)  # plain load: weights only, default device
    model = torch.nn.Module()
    assert sorted(sd)[:2] == ["bn.bias", "bn.num_batches_tracked"]
    assert all(v.device.type == "cpu" for v in sd.values())
    with saved_on("cpu"):
        ref = torch.load(DP, map_location="cpu", weights_only=False)["state_dict"]
    for k, v in ref.items():
        assert torch.equal(sd[k.removeprefix("module.")], v)
    del model


def test_fix_dialog_salvages_a_flagged_file_only_when_asked(tmp_path: Path) -> None:
    """A flagged file: the dialog offers salvage (ticked, as diagnose suggests);
    unticked, the preview is refused; ticked, the output holds the weights
    only, written by ckptool, and names no unsafe global."""
    from tests.test_safety_containers import zip_injected
    from tests.test_safety_corpus import CORPUS

    canary = tmp_path / "CANARY"
    clean = tmp_path / "clean.pth"
    torch.save({"w": torch.ones(2, 3), "b": torch.zeros(3)}, clean)
    src = tmp_path / "flagged.pth"
    zip_injected(CORPUS["os_system"].build(canary), clean, src)
    original = src.read_bytes()

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("x")
        screen = app.screen
        await until(pilot, lambda: screen.preview is not None, "the plan")  # type: ignore[attr-defined]
        salvage = screen.query_one("#fix-salvage")
        assert salvage.value and screen.opts.salvage  # type: ignore[attr-defined]
        salvage.value = False
        await until(pilot, lambda: "writes nothing from it" in str(
            screen.query_one("#fix-summary").render()), "the refusal")
        assert screen.preview is None  # type: ignore[attr-defined]
        salvage.value = True
        await until(pilot, lambda: screen.preview is not None, "the plan")  # type: ignore[attr-defined]
        await pilot.press("ctrl+s", "y")
        await until(pilot, lambda: screen.written is not None, "the write")  # type: ignore[attr-defined]
        await pilot.press("escape")

    drive(src, script, size=(100, 30))
    assert src.read_bytes() == original
    out = tmp_path / "flagged.fixed.pth"
    assert ckptool.open(out).unsafe_globals == []
    assert set(torch.load(out, weights_only=True)) == {"w", "b"}
    assert not canary.exists()


def test_fix_errors_show_in_the_dialog(tmp_path: Path) -> None:
    src = tmp_path / "dp.pth"
    shutil.copy(DP, src)

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("x")
        screen = app.screen
        await until(pilot, lambda: screen.preview is not None, "the plan")  # type: ignore[attr-defined]
        device = screen.query_one("#fix-device")
        device.value = "warp:9000x"
        await until(pilot, lambda: "warp:9000x" in str(
            screen.query_one("#fix-summary").render()), "the error")
        assert screen.preview is None  # type: ignore[attr-defined]
        device.value = "cpu"
        screen.query_one("#fix-extract").value = False
        await until(pilot, lambda: screen.preview is not None, "the plan")  # type: ignore[attr-defined]
        # the optimizer state holds no unsafe global, but args is a Namespace: fine;
        # an existing output asks before replacing it
        (tmp_path / "dp.fixed.pth").write_bytes(b"keep me")
        await pilot.press("ctrl+s")
        assert "exists and will be replaced" in screen_text(app)
        await pilot.press("n", "escape")

    drive(src, script)
    assert (tmp_path / "dp.fixed.pth").read_bytes() == b"keep me"


# -- what a review of the browser found ---------------------------------------------

class _RunsCode:
    """Pickles as a call to os.system (touching ``canary``), as a hostile
    checkpoint does; torch.save only writes the call, nothing runs it."""

    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.canary}",))


def test_unsafe_globals_warning_is_its_own_first_line(tmp_path: Path) -> None:
    """A long state-dict line must not push the warning out of the header."""
    path, canary = tmp_path / "compiled_ddp.pth", tmp_path / "ran"
    sd = {f"_orig_mod.module.{n}": torch.zeros(2) for n in ("conv.weight", "conv.bias")}
    torch.save({"epoch": 3, "model_state_dict": sd, "callback": _RunsCode(canary)}, path)

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        lines = screen_text(app).splitlines()
        assert app.ckpt is not None and app.ckpt.unsafe_globals == ["posix.system"]
        assert lines[0].startswith(" ⚠ 1 unsafe global: posix.system")
        assert lines[1].startswith(" compiled_ddp.pth · torch-zip")
        assert "'model_state_dict' · prefix _orig_mod.module. · 2 tensors" in lines[3]
        assert lines[4].startswith("module / key")  # the header grew by one line
        assert app.query_one("#summary").size.height == 4

    drive(path, script)
    assert not canary.exists()


def test_resizing_switches_the_layout_at_once() -> None:
    async def script(app: BrowseApp, pilot: Pilot) -> None:
        main = app.query_one("#main")
        assert not main.has_class("-wide")
        for width, wide in ((130, True), (80, False), (125, True), (119, False)):
            await pilot.resize_terminal(width, 30)
            await pilot.pause()
            assert main.has_class("-wide") == wide, width

    drive(DP, script)


def test_write_key_works_from_inside_a_text_field(tmp_path: Path) -> None:
    """ctrl+w deletes a word in a text field: writing is ctrl+s (or F2),
    which no field takes, and an emptied prefix says so."""
    src = tmp_path / "dp.pth"
    shutil.copy(DP, src)

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("x")
        screen: Any = app.screen
        await until(pilot, lambda: screen.preview is not None, "the plan")
        prefix = screen.query_one("#fix-prefix")
        assert prefix.placeholder == "prefix to strip, e.g. module."
        prefix.focus()
        await pilot.press("end", "ctrl+w")  # the field's own key: a word goes
        assert prefix.value == ""
        await until(pilot, lambda: "prefix is empty" in str(
            screen.query_one("#fix-summary").render()), "the warning")
        prefix.value = "module."
        await until(pilot, lambda: screen.preview is not None
                    and screen.opts.strip_prefixes == ("module.",), "the plan again")
        prefix.focus()
        await pilot.press("ctrl+s")
        assert type(app.screen).__name__ == "ConfirmScreen"
        assert prefix.value == "module."
        await pilot.press("y")
        await until(pilot, lambda: screen.written is not None, "the write")

    drive(src, script)
    assert sorted(torch.load(tmp_path / "dp.fixed.pth"))[:2] == ["bn.bias",
                                                                 "bn.num_batches_tracked"]


def test_fix_preview_uses_the_read_checkpoint_and_plans_one_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No preview reads the file again (no dry run); edits in a burst make one
    preview, never two at once; renaming the output makes none; the write
    still goes through fix.fix."""
    import ckptool.write.fix.run as rewrite
    from ckptool.tui.fixscreen import DEBOUNCE_S
    from ckptool.write.fix.preview import Previewer

    src = tmp_path / "dp.pth"
    shutil.copy(DP, src)
    calls: list[dict[str, Any]] = []
    real_fix, real_preview = rewrite.fix, Previewer.preview

    def fix(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real_fix(*args, **kwargs)

    running, most = [0], [0]
    lock = threading.Lock()

    def preview(self: Previewer, opts: Any) -> Any:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            time.sleep(0.05)
            return real_preview(self, opts)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(rewrite, "fix", fix)
    monkeypatch.setattr(Previewer, "preview", preview)

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        calls.clear()  # the diagnosis checks its command with a dry run: not the dialog
        await pilot.press("x")
        screen: Any = app.screen
        await until(pilot, lambda: screen.preview is not None, "the plan")
        await pilot.pause(DEBOUNCE_S + 0.1)  # a plan the fields' first values asked for
        await until(pilot, lambda: screen.preview is not None, "the plan, settled")
        made = screen.previews
        prefix, device = screen.query_one("#fix-prefix"), screen.query_one("#fix-device")
        typed = time.monotonic()
        for text in ("m", "mo", "mod", "modu", "modul", "module", "module."):
            prefix.value = text  # a burst of keystrokes
        device.value = "cuda:1"
        await pilot.pause(0.1)
        if time.monotonic() - typed < DEBOUNCE_S:  # (a loaded machine may sleep longer)
            assert screen.previews == made  # still typing, as far as it knows
        await until(pilot, lambda: screen.preview is not None and screen.opts.to == "cuda:1",
                    "the plan of the last edit")
        assert screen.previews == made + 1
        screen.query_one("#fix-extract").value = False  # two changes while one runs
        screen.query_one("#fix-move").value = False
        await until(pilot, lambda: screen.preview is not None and screen.opts.to is None
                    and screen.opts.extract is None, "the plan of the last change")
        made = screen.previews
        screen.query_one("#fix-output").value = "renamed.pth"
        await pilot.pause(0.4)
        assert screen.previews == made  # same plan, another name
        assert f"-o {tmp_path / 'renamed.pth'}" in str(screen.query_one("#fix-summary").render())
        await pilot.press("ctrl+s", "y")
        await until(pilot, lambda: screen.written is not None, "the write")

    drive(src, script)
    assert most[0] == 1
    assert [kw.get("dry_run", False) for kw in calls] == [False]  # only the write
    assert (tmp_path / "renamed.pth").exists()


def test_write_says_what_it_waits_for_and_takes_progress_from_any_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before its bytes are copied, a write reads the file again (no progress
    to show): the dialog says so and counts the seconds. The core may report
    progress from a thread of its own."""
    import ckptool.write.fix.run as rewrite

    src = tmp_path / "dp.pth"
    shutil.copy(DP, src)
    real = rewrite.fix
    reading, copying = threading.Event(), threading.Event()
    seen: list[str] = []

    def fix(*args: Any, progress: Any = None, **kwargs: Any) -> Any:
        if kwargs.get("dry_run"):  # the diagnosis checking its command
            return real(*args, progress=progress, **kwargs)
        reading.wait(10)  # the faithful read
        copier = threading.Thread(target=progress, args=(50, 100))  # neither app nor worker
        copier.start()
        copier.join()
        copying.wait(10)
        return real(*args, progress=progress, **kwargs)

    monkeypatch.setattr(rewrite, "fix", fix)

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("x")
        screen: Any = app.screen
        await until(pilot, lambda: screen.preview is not None, "the plan")
        await pilot.press("ctrl+s", "y")
        summary = screen.query_one("#fix-summary")
        await until(pilot, lambda: "1 s" in str(summary.render()), "a second of reading")
        seen.append(str(summary.render()))
        assert screen.query_one("#fix-prefix").disabled  # no edits while it writes
        bar = screen.query_one("#fix-progress")
        assert not bar.display  # no "--%" bar while nothing can be measured
        reading.set()
        await until(pilot, lambda: bar.progress == 50, "the progress")
        assert bar.total == 100 and "copying tensor bytes" in str(summary.render())
        copying.set()
        await until(pilot, lambda: screen.written is not None, "the write")

    drive(src, script)
    assert "reading dp.pth again, faithfully, before its bytes are copied… 1 s" in seen[0]
    assert (tmp_path / "dp.fixed.pth").exists()


def test_closing_the_fix_dialog_while_it_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptool.write.fix.preview import Previewer

    real = Previewer.preview
    release = threading.Event()  # the dialog's first plan ends once it closed
    armed = threading.Event()  # (the findings' own plans before it run free)

    def slow(self: Previewer, opts: Any) -> Any:
        if armed.is_set():
            release.wait(10)
        return real(self, opts)

    monkeypatch.setattr(Previewer, "preview", slow)

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        armed.set()
        await pilot.press("x")
        screen: Any = app.screen
        await pilot.press("escape")
        assert type(app.screen).__name__ == "Screen"
        release.set()
        await pilot.pause(0.5)  # the plan it dropped ends: nothing to show it in
        assert screen.preview is None
        await pilot.press("x")  # again: the same previewer serves it
        await until(pilot, lambda: app.screen.preview is not None, "the plan")  # type: ignore[attr-defined]
        await pilot.press("escape", "q")

    app = drive(DP, script)
    assert app.return_code == 0


def test_tab_completes_in_the_jump_dialog_and_candidates_show() -> None:
    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("g", *"state_dict/module.f")
        await pilot.pause()
        box = app.screen.query_one("#jump-input")
        shown = str(app.screen.query_one("#jump-candidates").render())
        assert "state_dict/module.fc.weight" in shown and "state_dict/module.fc.bias" in shown
        await pilot.press("tab")  # as far as the keys that start so agree
        assert box.value == "state_dict/module.fc."  # type: ignore[attr-defined]
        await pilot.press("tab")  # then the first of them
        assert box.value == "state_dict/module.fc.weight"  # type: ignore[attr-defined]
        await pilot.press("backspace", "backspace", "backspace", "backspace", "backspace",
                          "backspace", "b", "right")  # → takes the suggestion too
        assert box.value == "state_dict/module.fc.bias"  # type: ignore[attr-defined]
        await pilot.press("enter")
        await pilot.pause()
        assert table(app).current.key == "state_dict/module.fc.bias"  # type: ignore[union-attr]
        await pilot.press("g", *"running_v")
        await pilot.pause()
        assert "keys that contain it" in str(app.screen.query_one("#jump-candidates").render())

    drive(DP, script)


def test_findings_pane_shows_what_diagnose_shows() -> None:
    """Python alternatives, the key comparison with the model, what the fix
    leaves to do by hand, and the machine judged for."""
    from ckptool.check.modelspec import ModelKeys

    def model(ckpt: Any) -> ModelKeys:
        shapes = {k.removeprefix("module."): t.shape for k, t in ckpt.state_dict().items()}
        return ModelKeys("model nets:Net", {**shapes, "head.weight": (3, 3), "fc.bias": (11,)})

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        text = str(app.query_one("#findings").render())
        assert text.startswith("keys model nets:Net: 10 expected · 0 match as saved · "
                               "9 after the rewrite · 1 missing · 0 unexpected · 1 shape")
        assert f"  or:  torch.load('{DP}', map_location='cpu')" in text
        assert f"fix everything: ckptool fix {DP} --extract" in text
        assert "still to resolve by hand: missing-keys, shape-mismatch" in text
        assert "target     a machine with 0 visible CUDA GPUs" in text
        assert "torch.load fails: RuntimeError: Attempting to deserialize" in text
        assert "saved on   cuda:2: 15 tensors · 2.7 kB · torch.load fails here" in text

    drive(DP, script, model=model)


def test_filtered_tree_shows_open_modules_that_open_and_close() -> None:
    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("slash", "b", "n", "enter")
        bn = [f"state_dict/module.bn.{n}" for n in (
            "weight", "bias", "running_mean", "running_var", "num_batches_tracked")]
        assert row_keys(app) == ["state_dict", "state_dict/module", "state_dict/module.bn", *bn]
        text = screen_text(app)
        assert "▾ state_dict" in text and "    ▾ bn" in text and "▸" not in text
        status = str(app.query_one("#status").render())
        assert "filter 'bn': 5 of 15 tensors match" in status  # tensors, not the 8 rows
        await pilot.press("home", "down", "down")  # on bn
        await pilot.press("enter")  # closes it, under the filter too
        assert row_keys(app) == ["state_dict", "state_dict/module", "state_dict/module.bn"]
        assert "    ▸ bn" in screen_text(app)
        await pilot.press("right")
        assert row_keys(app)[3:] == bn
        await pilot.press("down", "down", "left")  # from a tensor to its module
        assert table(app).current.path == "state_dict/module.bn"  # type: ignore[union-attr]
        await pilot.press("left", "up", "left")  # close bn, then module
        assert row_keys(app) == ["state_dict", "state_dict/module"]
        await pilot.press("slash", "z", "z", "z")  # another filter (typed over the old)
        assert len(table(app).rows) == 0
        assert "no tensor matches 'zzz'" in screen_text(app)
        assert "filter 'zzz': no tensor matches" in str(app.query_one("#status").render())
        await pilot.press("backspace", "backspace", "backspace", *"bn")
        assert len(table(app).rows) == 8  # every match open again

    drive(DP, script)


def test_help_fits_80x24_without_wrapping_an_entry() -> None:
    from rich.text import Text

    from ckptool.tui.screens import HELP

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("question_mark")
        await pilot.pause()
        text = screen_text(app)
        for line in Text.from_markup(HELP).plain.splitlines():
            assert line.rstrip() in text, line
        assert app.screen.query_one("#help-body").max_scroll_y == 0  # nothing to scroll to

    drive(DP, script)


def test_statistics_show_at_80x24() -> None:
    async def script(app: BrowseApp, pilot: Pilot) -> None:
        app.jump_to("state_dict/module.fc.weight")
        await pilot.pause()
        await pilot.press("s")
        await until(pilot, lambda: "0 NaN" in detail(app), "the statistics")
        await pilot.pause()
        text = screen_text(app)
        assert "stats     min " in text and "counts    0 NaN · 0 Inf · 0 zeros" in text
        assert "saved on  cuda:2" in text

    drive(DP, script)


def test_findings_pane_scrolls_by_line_and_by_page() -> None:
    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("f")
        box = app.query_one("#findings-box")
        assert box.has_focus and box.max_scroll_y > 10
        page = box.scrollable_content_region.height - 1
        await pilot.press("down", "down")
        assert box.scroll_y == 2
        await pilot.press("pagedown")
        assert box.scroll_y == 2 + page
        await pilot.press("up")
        assert box.scroll_y == 1 + page
        await pilot.press("pageup")
        assert box.scroll_y == 1
        await pilot.press("end")
        assert box.scroll_y == box.max_scroll_y
        await pilot.press("home")
        assert box.scroll_y == 0

    drive(DP, script)


def test_narrow_cells_say_what_they_can() -> None:
    from ckptool.tui.index import Index
    from ckptool.tui.table import Columns, node_cells, tensor_cells

    many = Index([TensorInfo(f"m.l{i}.w", (2,), "float32", (1,), 0, f"s{i}", None, 8)
                  for i in range(100_000)])
    node = many.node("m")
    assert node is not None
    narrow, wide = Columns.fit(40), Columns.fit(120)
    assert node_cells(node, narrow)[0] == "100.0k"
    assert node_cells(node, wide)[0] == "100.0k tensors"
    assert node_cells(node, wide)[2] == "-"  # safetensors record no device
    assert tensor_cells(many.tensors[0])[2] == "-"

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        lines = screen_text(app).splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("module / key"))
        rows = lines[start + 1:start + 9]
        assert all(" - " in row and "unreco" not in row and "…" not in row for row in rows)

    drive(SAMPLES / "tinynet.safetensors", script)


def test_statistics_errors_are_tried_again_and_never_computed_twice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptool.check.stats as stats
    from ckptool.errors import CkptoolError

    real = stats.tensor_stats
    calls: list[str] = []
    release = threading.Event()

    def flaky(data: Any, tensor: TensorInfo, **kwargs: Any) -> Any:
        calls.append(tensor.key)
        if len(calls) == 1:
            raise CkptoolError("the disk hiccuped")
        release.wait(10)
        return real(data, tensor, **kwargs)

    monkeypatch.setattr(stats, "tensor_stats", flaky)
    key = "state_dict/module.fc.weight"

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        app.jump_to(key)
        await pilot.pause()
        await pilot.press("s")
        await until(pilot, lambda: app.stats.get(key) == "cannot compute: the disk hiccuped",
                    "the error")
        await pilot.press("s")  # tried again
        await until(pilot, lambda: len(calls) == 2, "the second try")
        assert "computing…" in detail(app)
        await pilot.press("s", "s")  # under way: not again
        await pilot.pause(0.1)
        release.set()
        await until(pilot, lambda: isinstance(app.stats.get(key), stats.TensorStats), "stats")
        await pilot.press("s")  # done: nothing to do
        await pilot.pause(0.1)

    drive(DP, script)
    assert calls == [key, key]


def test_fix_preview_keeps_rows_in_a_small_terminal(tmp_path: Path) -> None:
    src = tmp_path / "dp.pth"
    shutil.copy(DP, src)

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("x")
        screen: Any = app.screen
        await until(pilot, lambda: screen.preview is not None, "the plan")
        await pilot.pause()
        rows = [line for line in screen_text(app).splitlines() if "⇒" in line]
        assert len(rows) >= 4
        assert "Write… (ctrl+s)" in screen_text(app)

    drive(src, script, size=(60, 15))


# -- the command ---------------------------------------------------------------

class Ran:
    def __init__(self) -> None:
        self.apps: list[BrowseApp] = []


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> Ran:
    record = Ran()

    def fake_run(self: BrowseApp, *args: Any, **kwargs: Any) -> int:
        record.apps.append(self)
        return 0

    monkeypatch.setattr(BrowseApp, "run", fake_run)
    monkeypatch.setattr("ckptool.cli.browse._is_terminal", lambda: True)
    return record


def test_cli_builds_the_app_for_the_file(ran: Ran) -> None:
    assert main(["browse", str(DP)]) == 0
    (app,) = ran.apps
    assert app.path == str(DP)
    assert app.machine is None  # probed on a worker, not assumed
    assert app.model_loader is None


def test_cli_passes_device_count_and_model(ran: Ran) -> None:
    spec = f"{SAMPLES / 'make_samples.py'}:TinyNet"
    assert main(["browse", str(DP), "--device-count", "2", "--model", spec,
                 "--model-arg", "width=8"]) == 0
    (app,) = ran.apps
    assert app.machine is not None and app.machine.device_count == 2
    assert app.model_loader is not None


def test_cli_reports_a_read_error_from_the_app(ran: Ran, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from ckptool.errors import CorruptCheckpointError

    def failing_run(self: BrowseApp, *args: Any, **kwargs: Any) -> int:
        self.error = CorruptCheckpointError("x.pth: cannot read pickle", "fetch it again")
        return 3

    monkeypatch.setattr(BrowseApp, "run", failing_run)
    assert main(["browse", str(DP)]) == 3
    err = capsys.readouterr().err
    assert err == "ckptool: error: x.pth: cannot read pickle\nhint: fetch it again\n"


@pytest.mark.parametrize(("keys", "code"), [(["q"], 0), (["ctrl+c"], 130),
                                             (["slash", "a", "ctrl+c"], 130),
                                             (["SIGINT"], 130)])
def test_cli_exits_with_the_apps_return_code(monkeypatch: pytest.MonkeyPatch, keys: list[str],
                                             code: int) -> None:
    """``ckptool browse`` run in-process: the real app, headless, quit by a key."""
    def headless(self: BrowseApp, *args: Any, **kwargs: Any) -> int | None:
        self.machine = gpus.assumed(0)

        async def run() -> None:
            async with self.run_test(size=(80, 24)) as pilot:
                await settle(self, pilot)
                if keys == ["SIGINT"]:  # kill -INT from outside, not the key
                    os.kill(os.getpid(), signal.SIGINT)
                else:
                    await pilot.press(*keys)
                await until(pilot, lambda: self.return_code is not None, "the app to exit")

        asyncio.run(run())
        return self.return_value

    monkeypatch.setattr(BrowseApp, "run", headless)
    monkeypatch.setattr("ckptool.cli.browse._is_terminal", lambda: True)
    missed: list[int] = []  # a SIGINT the app did not take lands here, not in pytest
    previous = signal.signal(signal.SIGINT, lambda *_: missed.append(1))
    try:
        assert main(["browse", str(DP)]) == code
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not missed


@pytest.mark.parametrize(("args", "code", "message"), [
    (["browse", "missing.pth"], 3, "missing.pth: no such file"),
    (["browse", str(DP), "--model-arg", "a=1"], 2, "--model-arg needs --model"),
    (["browse", str(DP), "--model", "a:B", "--reference", str(DP)], 2, "both say"),
])
def test_cli_errors_before_the_screen_opens(ran: Ran, capsys: pytest.CaptureFixture[str],
                                            args: list[str], code: int, message: str) -> None:
    assert main(args) == code
    assert message in capsys.readouterr().err
    assert ran.apps == []


def test_cli_refuses_without_a_terminal(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("ckptool.cli.browse._is_terminal", lambda: False)
    assert main(["browse", str(DP)]) == 2
    err = capsys.readouterr().err
    assert "browse needs a terminal" in err and "ckptool inspect" in err


def test_cli_text_file_is_refused_before_the_screen(ran: Ran, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "notes.pth"
    text.write_text("hello")
    assert main(["browse", str(text)]) == 3
    assert "not a checkpoint" in capsys.readouterr().err
    assert ran.apps == []


# -- typed text is text, however fast it comes ---------------------------------------

def burst(app: BrowseApp, text: str) -> None:
    """Keys as a terminal delivers a paste or fast typing: all queued at once."""
    from textual import events

    names = {"/": "slash", "\r": "enter", ".": "full_stop"}
    for ch in text:
        app.post_message(events.Key(names.get(ch, ch), ch if ch != "\r" else None))


@pytest.mark.parametrize("text", ["/quant", "/xyz", "/fc", "/a/b.weight", "/layers.9999."])
def test_fast_typing_after_slash_goes_to_the_filter(text: str) -> None:
    async def script(app: BrowseApp, pilot: Pilot) -> None:
        burst(app, text)
        await pilot.pause(0.3)
        assert app.is_running and app.screen is app.screen_stack[0]
        assert app.query_one("#filter", Input).value == text[1:]

    drive(DP, script)


def test_fast_typing_after_g_goes_to_the_jump_dialog() -> None:
    async def script(app: BrowseApp, pilot: Pilot) -> None:
        burst(app, "gfc.w/q")
        await pilot.pause(0.3)
        assert app.is_running and type(app.screen).__name__ == "JumpScreen"
        assert app.screen.query_one("#jump-input", Input).value == "fc.w/q"

    drive(DP, script)


def test_keys_after_enter_belong_to_the_list_again() -> None:
    async def script(app: BrowseApp, pilot: Pilot) -> None:
        burst(app, "/bias\rt")
        await pilot.pause(0.3)
        assert app.query_one("#filter", Input).value == "bias"
        assert not app.view.tree  # "t" after Enter switched to the flat list

    drive(DP, script)


def test_ctrl_c_quits() -> None:
    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("slash", "a", "ctrl+c")
        await pilot.pause()

    app = drive(DP, script)
    assert app.return_code == 130
