"""The browser's fix dialog on checkpoints of many files: Hugging Face
shards (``huggingface_hub.save_torch_state_dict``) and DCP directories
(``dcp.save``). Its preview is the directory fix's dry run, and its write is
``ckptool fix DIR -o OUT``'s: the same directory, byte for byte."""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import huggingface_hub as hub
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import CliResult

import ckptool
from ckptool.tui.app import BrowseApp
from ckptool.tui.textshot import screen_text
from ckptool.write.fix.plan import FixOptions
from ckptool.write.fix.preview import Previewer
from ckptool.write.fix.run import fix
from tests.helpers import SAMPLES, flatten
from tests.test_browse import Pilot, drive, until


def _wrapped() -> dict[str, torch.Tensor]:
    """A DataParallel model's state dict: every key under ``module.``."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                              torch.nn.Linear(8, 2))
    return torch.nn.DataParallel(net).state_dict()


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    hub.save_torch_state_dict(_wrapped(), folder, max_shard_size=200)
    assert len(list(folder.glob("*.safetensors"))) > 1
    return folder


@pytest.fixture
def dcp_wrapped(tmp_path: Path) -> Path:
    folder = tmp_path / "dcp_dp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in one process"
        dcp.save({"model": _wrapped(), "epoch": 3}, checkpoint_id=folder)
    return folder


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return flatten(ckptool.load(folder))


async def _write(app: BrowseApp, pilot: Pilot, summary: str, command: str) -> Any:
    """Open the dialog, check its plan and command, write, confirm."""
    await pilot.press("x")
    screen: Any = app.screen
    await until(pilot, lambda: screen.preview is not None, "the plan")
    await pilot.pause()
    said = str(screen.query_one("#fix-summary").render())
    assert summary in said, said
    assert f"same as: {command}" in said.replace("\n", " ")
    # no more "single files only": the dialog offers the write, and it works
    assert "single files" not in screen_text(app)
    await pilot.press("ctrl+s")
    await until(pilot, lambda: type(app.screen).__name__ == "ConfirmScreen", "the question")
    await pilot.press("y")
    await until(pilot, lambda: screen.written is not None, "the write")
    return screen


@pytest.mark.parametrize("kind", ["shards", "dcp"])
def test_fix_dialog_writes_a_directory_as_fix_does(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path,
        run_cli: Callable[..., CliResult]) -> None:
    src: Path = request.getfixturevalue("shards" if kind == "shards" else "dcp_wrapped")
    before = _tree(src)
    out = src.parent / f"{src.name}.fixed"
    # what diagnose suggests and the dialog opens with: strip the wrapper's prefix
    command = f"ckptool fix {src} --strip-prefix module. -o {out}"
    written: list[Any] = []

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        # the model's 9 tensors (DCP's epoch is a value, no tensor)
        screen = await _write(app, pilot, "9 tensors kept · 9 renamed · 0 moved", command)
        preview = screen.preview
        written.append([c.after for c in preview.changes])
        assert "wrote" in str(screen.query_one("#fix-summary").render())
        assert "9 tensors verified" in str(screen.query_one("#fix-summary").render())

    drive(src, script)
    assert _tree(src) == before  # the input is never touched
    assert sorted(os.listdir(src.parent)) == sorted([src.name, out.name])
    # every key the preview promised is the output's
    assert sorted(written[0]) == sorted(t.key for t in ckptool.open(out).tensors)
    assert all(not k.startswith(("module.", "model.module.")) for k in written[0])
    # and the output is what `ckptool fix DIR --strip-prefix module. -o OUT` writes
    cli_out = tmp_path / "by_cli"
    code, _, err = run_cli("fix", str(src), "--strip-prefix", "module.", "-o", str(cli_out))
    assert code == 0, err
    ours, theirs = _tensors(out), _tensors(cli_out)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    if kind == "shards":  # the same shards and index, byte for byte
        assert _tree(out) == _tree(cli_out)


def test_fix_dialog_on_the_dcp_sample(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    """samples/dcp_tinynet has nothing to fix: the dialog says so and
    writes nothing; a prefix typed in plans and writes as fix does."""
    src = tmp_path / "dcp_tinynet"
    shutil.copytree(SAMPLES / "dcp_tinynet", src)
    out = tmp_path / "dcp_tinynet.fixed"

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("x")
        screen: Any = app.screen
        await until(pilot, lambda: screen.preview is not None, "the plan")
        await pilot.pause()
        # the entry's name is how it loads ("model."): not offered for stripping
        assert not screen.query_one("#fix-strip").value
        assert "nothing to change" in str(screen.query_one("#fix-summary").render())
        await pilot.press("ctrl+s")
        assert type(app.screen).__name__ == "FixScreen"  # nothing to write
        # DCP records no device: the core's refusal, with its hint
        screen.query_one("#fix-move").value = True
        await until(pilot, lambda: "records no device" in str(
            screen.query_one("#fix-summary").render()), "the refusal")
        await pilot.press("ctrl+s")  # says why there is nothing to write
        assert type(app.screen).__name__ == "FixScreen"
        assert [n.message for n in app._notifications][-1] == (
            "nothing to write: DCP records no device: there is nothing to retarget")
        screen.query_one("#fix-move").value = False
        screen.query_one("#fix-prefix").value = "fc."
        screen.query_one("#fix-strip").value = True
        await until(pilot, lambda: screen.preview is not None and screen.preview.renamed == 2,
                    "the new plan")
        await pilot.press("ctrl+s")
        await until(pilot, lambda: type(app.screen).__name__ == "ConfirmScreen",
                    "the question")
        await pilot.press("y")
        await until(pilot, lambda: screen.written is not None, "the write")

    drive(src, script)
    keys = {t.key for t in ckptool.open(out).tensors}
    assert {"model.weight", "model.bias"} <= keys and "model.fc.weight" not in keys
    code, _, err = run_cli("fix", str(src), "--strip-prefix", "fc.", "-o",
                           str(tmp_path / "by_cli"))
    assert code == 0, err
    ours, theirs = _tensors(out), _tensors(tmp_path / "by_cli")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize(("opts", "planned"), [
    (FixOptions(strip_module=True), 4), (FixOptions(dtype="float16"), 4),
    (FixOptions(strip_prefixes=("module.1.",)), 4),
    (FixOptions(to="cuda:1"), 1),  # torch shards only: safetensors and DCP record no device
    (FixOptions(drop=("module.0.bias",), strip_module=True), 2),  # shards' own names
    (FixOptions(drop=("model.module.1.running_mean",)), 1),
    (FixOptions(drop=("model",)), 2),  # DCP: the entry and all under it
], ids=["strip", "cast", "strip-prefix", "to", "drop-shard-key", "drop-dcp-key",
        "drop-dcp-entry"])
def test_directory_preview_is_the_dry_run(shards: Path, dcp_wrapped: Path, tmp_path: Path,
                                          opts: FixOptions, planned: int) -> None:
    """The preview's plan is fix's dry run, and its keys and bytes are those
    of the directory fix writes (torch shards too: they record devices)."""
    bins = tmp_path / "bins"
    bins.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "unsafe serialization"
        hub.save_torch_state_dict(_wrapped(), bins, max_shard_size=200,
                                  safe_serialization=False)
    previewed = 0
    for src in (shards, bins, dcp_wrapped, SAMPLES / "dcp_tinynet"):
        ckpt = ckptool.open(src)
        try:
            dry = fix(str(src), opts, dry_run=True).plan
        except ckptool.CkptoolError as exc:
            with pytest.raises(type(exc), match=exc.message.replace(".", r"\.")):
                Previewer(ckpt).preview(opts)
            continue
        preview = Previewer(ckpt).preview(opts)
        assert (preview.plan.renames, preview.plan.dropped, preview.plan.casts,
                preview.plan.retargets) == (dry.renames, dry.dropped, dry.casts, dry.retargets)
        out = tmp_path / f"{src.name}.out"
        fix(str(src), opts, str(out))
        written = ckptool.open(out)
        assert sorted(c.after for c in preview.changes if c.after) == \
            sorted(t.key for t in written.tensors)
        assert preview.nbytes == sum(t.nbytes for t in written.tensors)
        where = {t.key: t.location for t in written.tensors}
        assert all(where[c.after] == (None if c.after_loc == "unrecorded" else c.after_loc)
                   for c in preview.changes if c.after)
        previewed += 1
    assert previewed == planned  # the others refused, as fix refuses them


def test_fix_dialog_on_a_checkpoint_fix_cannot_rewrite(tmp_path: Path) -> None:
    """DeepSpeed's ranks' partitions: the dialog says what fix says (and the
    command that works instead), and its write says why there is none."""
    src = tmp_path / "zero3"
    shutil.copytree(SAMPLES / "deepspeed_zero3", src)

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("x")
        screen: Any = app.screen
        await until(pilot, lambda: screen.refused is not None, "the refusal")
        await pilot.pause()
        said = str(screen.query_one("#fix-summary").render())
        assert "partitioned over its ranks' files" in said
        assert f"hint: consolidate it first: ckptool convert {src}" in said
        await pilot.press("ctrl+s")
        assert type(app.screen).__name__ == "FixScreen"
        assert [n.message for n in app._notifications][-1].startswith(
            f"nothing to write: {src} is a DeepSpeed checkpoint")

    drive(src, script)
    assert sorted(os.listdir(tmp_path)) == ["zero3"]


def test_shards_opened_by_their_index_are_written_beside_the_directory(
        shards: Path) -> None:
    """Browsing ``DIR/model.safetensors.index.json``: the dialog's output is
    ``DIR.fixed`` beside the directory, not a name inside the input."""
    index = next(shards.glob("*.index.json"))
    seen: list[str] = []

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        await pilot.press("x")
        screen: Any = app.screen
        await until(pilot, lambda: screen.preview is not None, "the plan")
        seen.append(screen.query_one("#fix-output").value)
        seen.append(screen._output())

    drive(index, script)
    assert seen[0] == f"{shards.name}.fixed"
    assert seen[1] == str(shards.parent / f"{shards.name}.fixed")
