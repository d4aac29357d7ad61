"""The CLI imports only what the command it runs uses: ``import
ckptool.cli.main``, ``ckptool --version`` and ``ckptool --help`` load no
command, no read layer, no data model and no rich, and ``--help`` still
lists every command with the short help click would make from it.

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
