"""The CLI imports only what the command it runs uses: ``import
ckptool.cli.main``, ``ckptool --version`` and ``ckptool --help`` load no
command, no read layer, no data model and no rich, and ``--help`` still
lists every command with the short help click would make from it;
``inspect --json`` of one file loads none of the readers of checkpoints of
many files (a folder's layout loads its own reader alone), no torch and no rich.

(How fast that makes a run is measured by ``bench/bench_startup.py``.)
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import click
import pytest

from ckptool.cli.main import COMMANDS, cli

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import contextlib, io, json, sys
{setup}
print(json.dumps(sorted(sys.modules)))
"""

# what none of the probes below may load
VIEWS = ("rich", "textual", "torch", "numpy")
LAYERS = ("ckptool.read", "ckptool.write", "ckptool.check", "ckptool.tui")


def loaded_after(setup: str) -> list[str]:
    """The modules a fresh interpreter holds after ``setup`` (the source tree's ckptool)."""
    out = subprocess.run([sys.executable, "-c", PROBE.format(setup=setup)], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    loaded: list[str] = json.loads(out.splitlines()[-1])
    return loaded


def heavy(loaded: list[str]) -> list[str]:
    return [m for m in loaded
            if m.split(".")[0] in VIEWS or m == "ckptool.model"
            or any(m == layer or m.startswith(layer + ".") for layer in LAYERS)]


def test_importing_the_cli_loads_no_layer_no_model_and_no_rich() -> None:
    loaded = loaded_after("import ckptool.cli.main")
    assert not [m for m in loaded if m.startswith(
        ("ckptool.write", "ckptool.check.verify", "ckptool.tui"))]
    assert heavy(loaded) == []


# what every run loads below the CLI: what a Ctrl-C says (``cli.main``)
INTERRUPTS = {"ckptool.write", "ckptool.write.interrupt", "ckptool.read",
              "ckptool.read.layouts", "ckptool.read.layouts.dirlock"}


@pytest.mark.parametrize("argv", [["--version"], ["--help"]])
def test_version_and_help_load_no_command(argv: list[str]) -> None:
    setup = ("from ckptool.cli import main\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n"
             f"    assert main({argv!r}) == 0")
    loaded = loaded_after(setup)
    assert [m for m in loaded if m in {f"ckptool.cli.{name}" for name in COMMANDS}] == []
    assert set(heavy(loaded)) <= INTERRUPTS


def test_the_package_loads_its_reader_and_model_on_first_use() -> None:
    assert heavy(loaded_after("import ckptool")) == []
    import ckptool
    from ckptool import TensorInfo, open
    from ckptool.model import Checkpoint
    from ckptool.read.reader import open_checkpoint

    assert ckptool.open is open is open_checkpoint and ckptool.Checkpoint is Checkpoint
    assert TensorInfo.__module__ == "ckptool.model"
    assert set(ckptool.__all__) <= set(dir(ckptool)) | set(ckptool._LAZY)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_listed_summary_is_the_first_sentence_of_the_commands_help(name: str) -> None:
    command = importlib.import_module(f"ckptool.cli.{name}").command
    assert command.short_help is None and not command.hidden and not command.deprecated
    assert COMMANDS[name] == command.get_short_help_str(limit=10**6)


@pytest.mark.parametrize("width", [30, 50, 80, 120, 400])
def test_help_lists_commands_as_click_would_from_the_commands(width: int) -> None:
    def section(format_commands: object) -> str:
        ctx = click.Context(cli, info_name="ckptool", terminal_width=width,
                            max_content_width=width)
        formatter = ctx.make_formatter()
        format_commands(ctx, formatter)  # type: ignore[operator]
        return formatter.getvalue()

    lazy = section(cli.format_commands)
    assert lazy == section(lambda ctx, f: click.Group.format_commands(cli, ctx, f))
    assert lazy.startswith("Commands:\n") and lazy.count("\n") == len(COMMANDS) + 1


SAMPLES = ROOT / "samples"
# what the read of one file loads of ``ckptool.read.layouts``: the package,
# what tells a folder from a file (``recognise``, ``layout``, ``names``), what tells a
# framework's file by its name (``framework``, ``loaders``: ``companions``),
# and what a Ctrl-C says (``dirlock``); a safetensors file with
# ``__metadata__`` also what tells one of torch's HuggingFaceStorageWriter
# shards (``hf_storage``, and ``base`` under it)
ONE_FILE = {"ckptool.read.layouts", *(f"ckptool.read.layouts.{name}" for name in (
    "recognise", "layout", "names", "framework", "loaders", "dirlock"))}
STORAGE_WRITER = {"ckptool.read.layouts.hf_storage", "ckptool.read.layouts.base"}
# the reader of each layout of many files, and what only it uses
READERS = {
    "dcp": {"dcp", "dcp_metadata", "embedded"},
    "deepspeed": {"deepspeed", "deepspeed_files", "zero"},
    "hf_sharded": {"hf_sharded"},
    "per_rank": {"per_rank", "shards"},
}


def inspect_json_loads(path: Path) -> list[str]:
    return loaded_after("from ckptool.cli import main\n"
                        "with contextlib.redirect_stdout(io.StringIO()):\n"
                        f"    assert main(['inspect', '--json', {str(path)!r}]) == 0")


def layouts(loaded: list[str]) -> set[str]:
    return {m for m in loaded if m.startswith("ckptool.read.layouts")}


@pytest.mark.parametrize("name", ["finetuned_v2.pth", "legacy_compiled_ddp.pth",
                                  "tinynet_script.pt", "whole_model_cuda1.pth",
                                  "lightning.ckpt", "tinynet.safetensors"])
def test_inspect_json_of_one_file_loads_no_reader_of_many_files(name: str) -> None:
    loaded = inspect_json_loads(SAMPLES / name)
    allowed = ONE_FILE | (STORAGE_WRITER if name.endswith(".safetensors") else set())
    assert layouts(loaded) <= allowed
    assert [m for m in loaded if m.split(".")[0] in VIEWS] == []  # no torch, no rich
    assert not [m for m in loaded if m.startswith(("ckptool.check", "ckptool.tui"))]


@pytest.mark.parametrize(("name", "reader"), [("dcp_tinynet", "dcp"),
                                              ("deepspeed_zero3", "deepspeed")])
def test_inspect_json_of_a_folder_loads_its_own_layout_s_reader_alone(name: str,
                                                                      reader: str) -> None:
    found = layouts(inspect_json_loads(SAMPLES / name))
    others = {f"ckptool.read.layouts.{m}" for r, ms in READERS.items() if r != reader
              for m in ms}
    assert {f"ckptool.read.layouts.{m}" for m in READERS[reader]} <= found
    assert found & others == set()
    assert "ckptool.read.layouts.hf_storage" not in found
