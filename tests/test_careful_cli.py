"""What a careful new user found in the command line's output and options:
tables readable at 80 columns, commands that paste and run from where they
were printed, output names that say what they hold."""

from __future__ import annotations

import re
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckptool.cli.common import fold_key
from ckptool.write.fix.outputs import default_output, fresh_output
from ckptool.write.fix.plan import FixOptions
from ckptool.write.fix.preview import preview
from tests.conftest import CliResult
from tests.helpers import SAMPLES

RunCli = Callable[..., CliResult]
LONG = ["encoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
        "encoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.final_layernorm.running_mean_of_the_statistics",
        "bn.running_mean", "bn.running_var"]


@pytest.fixture
def long_keys(tmp_path: Path) -> Path:
    path = tmp_path / "long.pth"
    torch.save({name: torch.zeros(2) for name in LONG}, path)
    return path


def test_fold_key_breaks_after_dots_and_slashes() -> None:
    assert fold_key("bn.running_mean", 12) == "bn.\nrunning_mean"
    assert fold_key("state_dict/a.b", 12) == "state_dict/\na.b"
    assert fold_key("a.b.c", 80) == "a.b.c"
    assert fold_key("x" * 25, 10) == "x" * 10 + "\n" + "x" * 10 + "\n" + "x" * 5


@pytest.mark.parametrize("command", ["inspect", "diff"])
def test_keys_fold_at_dots_at_80_columns(command: str, long_keys: Path, tmp_path: Path,
                                         run_cli: RunCli,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    if command == "diff":
        other = tmp_path / "other.pth"
        torch.save({name: torch.ones(2) for name in LONG}, other)
        code, out, _ = run_cli("diff", str(long_keys), str(other))
        assert code == 1
    else:
        code, out, _ = run_cli("inspect", str(long_keys))
        assert code == 0
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert not [line for line in lines if line.endswith(" ")]  # no padding into a pipe
    # every name between dots is whole on one line: 'running_mea' / 'n' never happens
    cells = " ".join(line.split("│")[0].strip() for line in lines)
    for key in LONG:
        for name in key.split("."):
            assert re.search(rf"(^|[\s.]){name}($|[\s.])", cells), (name, out)
    if command == "diff":
        assert out.count(" differ ") + out.count(" differ\n") >= len(LONG)  # values cells whole


def test_diagnose_commands_run_from_where_it_ran(tmp_path: Path, run_cli: RunCli,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "runs").mkdir()
    shutil.copy(SAMPLES / "dataparallel_cuda2.pth", tmp_path / "runs" / "dp.pth")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "60")  # narrower than any command
    code, out, _ = run_cli("diagnose", "runs/dp.pth", "--device-count", "0")
    assert code == 1
    commands = [line[line.index("ckptool fix"):] for line in out.splitlines()
                if "ckptool fix" in line]
    assert commands and all(c.startswith("ckptool fix runs/dp.pth ") for c in commands)
    whole = [c for c in commands if "--extract" in c and "--to" in c][-1]
    assert whole.endswith(" -o runs/dp.fixed.pth")  # one line, beside the input
    code, _, err = run_cli(*shlex.split(whole)[1:])
    assert code == 0, err
    assert (tmp_path / "runs" / "dp.fixed.pth").exists()
    # once that name is taken, the next command writes a fresh one
    code, out, _ = run_cli("diagnose", "runs/dp.pth", "--device-count", "0", "--json")
    assert '"fix_output": "runs/dp.fixed2.pth"' in out


@pytest.mark.parametrize(("src", "out"), [
    ("model.pth", "model.fixed.pth"),
    ("runs/x.pth.tar", "runs/x.fixed.pth.tar"),
    ("a.b.safetensors", "a.b.fixed.safetensors"),
    ("weights", "weights.fixed"),
    ("ckpt.v2", "ckpt.fixed.v2"),
])
def test_default_output_goes_before_the_checkpoint_suffixes(src: str, out: str) -> None:
    assert default_output(src) == out


def test_fresh_output_never_names_an_existing_file(tmp_path: Path) -> None:
    src = tmp_path / "m.pth"
    assert fresh_output(str(src)) == str(tmp_path / "m.fixed.pth")
    (tmp_path / "m.fixed.pth").touch()
    (tmp_path / "m.fixed2.pth").symlink_to(tmp_path / "nowhere")  # a dangling link counts
    assert fresh_output(str(src)) == str(tmp_path / "m.fixed3.pth")


def test_extraction_alone_renames_nothing() -> None:
    import ckptool

    ckpt = ckptool.open(str(SAMPLES / "dataparallel_cuda2.pth"))
    assert preview(ckpt, FixOptions(extract="state_dict")).renamed == 0
    both = preview(ckpt, FixOptions(extract="state_dict", strip_prefixes=("module.",)))
    assert both.renamed == 9


@pytest.mark.parametrize(("made", "named"), [("safetensors", "out.pth"),
                                            ("torch", "out.safetensors")])
def test_fix_refuses_an_output_named_for_the_other_format(made: str, named: str,
                                                          tmp_path: Path,
                                                          run_cli: RunCli) -> None:
    src = tmp_path / ("in.safetensors" if made == "safetensors" else "in.pth")
    if made == "safetensors":
        from safetensors.torch import save_file
        save_file({"module.w": torch.zeros(2)}, src)
    else:
        torch.save({"module.w": torch.zeros(2)}, src)
    for extra in ([], ["--dry-run"]):
        code, out, err = run_cli("fix", str(src), "--strip-module", "-o",
                                 str(tmp_path / named), *extra)
        assert (code, out) == (2, "")
        assert "named for" in err and "ckptool convert" in err
    assert not (tmp_path / named).exists()


def _stdin(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    import io
    import sys

    class Stdin(io.TextIOWrapper):
        def isatty(self) -> bool:
            return False

    monkeypatch.setattr(sys, "stdin", Stdin(io.BytesIO(data)))


def test_standard_input_is_read_through_a_temporary_copy(run_cli: RunCli, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    data = (SAMPLES / "dataparallel_cuda2.pth").read_bytes()
    _stdin(monkeypatch, data)
    code, out, err = run_cli("inspect", "-", "--json")
    assert (code, err) == (0, "")
    assert '"path": "<stdin>"' in out and '"num_tensors": 15' in out
    _stdin(monkeypatch, data)
    code, out, err = run_cli("fix", "-", "--strip-module", "-o", str(tmp_path / "out.pth"))
    assert code == 0, err
    assert "conv.weight" in torch.load(tmp_path / "out.pth", map_location="cpu",
                                       weights_only=False)["state_dict"]
    _stdin(monkeypatch, b"garbage\n")
    code, out, err = run_cli("inspect", "-")
    assert code == 3 and err.startswith("ckptool: error: <stdin> is not a checkpoint")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.pth"]  # copies removed
    for command, why in (("diagnose", "read the file again"), ("browse", "terminal")):
        code, _, err = run_cli(command, "-")
        assert code == 2 and why in err
    _stdin(monkeypatch, data)
    code, _, err = run_cli("fix", "-", "--strip-module")
    assert code == 2 and "-o OUT" in err


def test_a_pipe_and_devices(run_cli: RunCli, tmp_path: Path) -> None:
    import os
    import threading

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    data = (SAMPLES / "dataparallel_cuda2.pth").read_bytes()
    writer = threading.Thread(target=fifo.write_bytes, args=(data,))
    writer.start()
    code, out, err = run_cli("inspect", str(fifo), "--json")
    writer.join()
    assert (code, err) == (0, "") and f'"path": "{fifo}"' in out
    code, out, err = run_cli("inspect", "/dev/zero")
    assert (code, out) == (3, "")
    assert "/dev/zero is a character device, not a checkpoint file" in err and "hint:" in err


def test_an_unreadable_file_is_a_bad_input(run_cli: RunCli, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from ckptool.read import fs

    path = tmp_path / "secret.pth"
    shutil.copy(SAMPLES / "dataparallel_cuda2.pth", path)
    os_access = __import__("os").access
    monkeypatch.setattr("os.access", lambda p, mode, **kw: p != str(path)
                        and os_access(p, mode, **kw))  # as for another user

    def refuse(file: object, *args: object, **kwargs: object) -> object:
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(file))
        return builtins.open(file, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(fs, "open", refuse, raising=False)
    code, out, err = run_cli("inspect", str(path))
    assert (code, out) == (3, "")
    assert f"{path}: permission denied" in err and "hint:" in err


@pytest.mark.parametrize(("pattern", "count"), [
    ("module.conv*", 2), ("*.bias", 3), ("BN", 0), ("bn", 5), ("*running_*", 2), ("running_*", 0),
    ("state_dict/*", 9), ("momentum", 6), ("optimizer/state/0/*", 1)])
def test_inspect_filter_is_the_browsers(pattern: str, count: int, run_cli: RunCli) -> None:
    import json

    from ckptool.keys import Filter

    code, out, _ = run_cli("inspect", str(SAMPLES / "dataparallel_cuda2.pth"), "--json",
                           "--filter", pattern)
    assert code == 0
    report = json.loads(out)
    keys = [t["key"] for t in report["tensors"]]
    assert len(keys) == count
    code, everything, _ = run_cli("inspect", str(SAMPLES / "dataparallel_cuda2.pth"), "--json")
    keep = Filter(pattern)
    assert keys == [t["key"] for t in json.loads(everything)["tensors"] if keep.test(t["key"])]


def test_limit_applies_to_groups(run_cli: RunCli) -> None:
    code, out, _ = run_cli("inspect", str(SAMPLES / "dataparallel_cuda2.pth"),
                           "--depth", "3", "--limit", "2")
    assert code == 0
    rows = [line for line in out.splitlines() if "│" in line]
    assert len(rows) == 2 and "more" in out.splitlines()[-1]


def test_extract_that_took_the_file_says_so(run_cli: RunCli) -> None:
    sample = str(SAMPLES / "dataparallel_cuda2.pth")
    code, out, err = run_cli("fix", "--extract", sample)
    assert (code, out) == (2, "")
    assert f"--extract took {sample} for the entry to extract" in err
    assert f"ckptool fix {sample} --extract" in err and "--extract=PATH" in err


@pytest.mark.parametrize(("args", "message"), [
    (["--to", "cpu", "--map", "cuda:2=cpu"], "--to moves every storage and --map only some"),
    (["--map", "cuda:2=cpu", "--map", "cuda:2=cuda:0"], "--map gives cuda:2 more than one"),
    (["--extract", "--drop", "state_dict"], "--drop state_dict removes the entry --extract keeps"),
    (["--extract=state_dict/module.conv.weight", "--drop", "state_dict"],
     "removes the entry --extract keeps"),
])
def test_conflicting_options_are_errors(args: list[str], message: str, run_cli: RunCli,
                                        tmp_path: Path) -> None:
    src = tmp_path / "dp.pth"
    shutil.copy(SAMPLES / "dataparallel_cuda2.pth", src)
    for dry in ([], ["--dry-run"]):
        code, out, err = run_cli("fix", str(src), *args, *dry)
        assert (code, out) == (2, "") and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dp.pth"]


def test_a_drop_outside_the_extracted_entry_is_noted(run_cli: RunCli) -> None:
    code, out, _ = run_cli("fix", str(SAMPLES / "dataparallel_cuda2.pth"), "--extract",
                           "--drop", "optimizer", "--dry-run")
    assert code == 0
    assert "--drop optimizer: left out anyway, --extract keeps only state_dict" in out


def test_a_reference_compares_as_diff_does(run_cli: RunCli, tmp_path: Path) -> None:
    """diagnose --reference dp.pth takes dp.pth's own wrapper prefix off, as
    `ckptool diff` does, and never asks to add it."""
    plain = tmp_path / "plain.pth"
    code, _, err = run_cli("fix", str(SAMPLES / "dataparallel_cuda2.pth"), "--extract",
                           "--strip-module", "-o", str(plain))
    assert code == 0, err
    code, out, _ = run_cli("diagnose", str(plain), "--reference",
                           str(SAMPLES / "dataparallel_cuda2.pth"), "--device-count", "4")
    assert code == 0 and "--add-prefix" not in out
    assert "(without its 'module.' prefix): 9 expected · 9 match as saved" in " ".join(
        out.split())
    assert run_cli("diff", str(plain), str(SAMPLES / "dataparallel_cuda2.pth"))[0] == 0


def test_help_names_only_the_commands_own_options(run_cli: RunCli) -> None:
    code, out, _ = run_cli("convert", "--help")
    assert code == 0 and "--in-place" not in out and "--force" in out
    code, out, _ = run_cli("fix", "--help")
    assert "(--force, --in-place)" in " ".join(out.split())


def test_declared_dependencies_cover_what_is_imported() -> None:
    import tomllib

    data = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    declared = {re.split(r"[<>=!~ \[]", d)[0].lower() for d in data["project"]["dependencies"]}
    imported = set()
    for module in (Path(__file__).parent.parent / "ckptool").rglob("*.py"):
        imported |= set(re.findall(r"^\s*(?:from|import) (\w+)", module.read_text(), re.M))
    third_party = imported & {"torch", "safetensors", "textual", "click", "rich", "numpy"}
    assert third_party - {"numpy"} <= declared  # numpy: only when a file holds arrays


def test_counts_of_one_are_singular(run_cli: RunCli, tmp_path: Path) -> None:
    one = tmp_path / "one.pth"
    torch.save({"w": torch.ones(2)}, one)
    code, out, _ = run_cli("inspect", str(one))
    assert "1 in 1 storage ·" in out and "(1 tensor)" in out
    code, out, _ = run_cli("fix", str(one), "--to", "cpu", "-o", str(tmp_path / "o.pth"))
    assert code == 0 and "1 storage verified" in out
    code, out, _ = run_cli("convert", str(one), str(tmp_path / "o.safetensors"))
    assert code == 0 and "1 tensor verified" in out
    assert "1 tensors" not in out and "1 storages" not in out
