"""The CLI as users meet it: exit codes, stdout and stderr kept apart,
JSON schema, filters, colour and width handling."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import saved_on

from ckptool.cli import main

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
DP = SAMPLES / "dataparallel_cuda2.pth"


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "ckptool", *args], capture_output=True,
                          text=True, env=full_env, timeout=60)


def test_inspect_human_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(DP)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "state_dict/module.conv.weight" in out
    assert "'state_dict' · prefix 'module.' · 9 tensors" in out
    assert "parameters  330 (+17 in buffers)" in out
    assert "cuda:2" in out
    assert "argparse.Namespace(arch='tinynet'" in out


def test_inspect_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--json", str(DP)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    data = json.loads(out)
    assert data["schema_version"] == 1
    assert data["format"] == "torch-zip"
    assert data["main_state_dict"]["path"] == "state_dict"
    assert data["main_state_dict"]["prefix"] == "module."
    assert data["main_state_dict"]["num_tensors"] == 9
    assert data["unsafe_globals"] == []
    assert data["bytes_by_location"] == {"cuda:2": data["total_bytes"]}
    tensor = data["tensors"][0]
    assert {"key", "shape", "dtype", "location", "nbytes", "storage"} <= set(tensor)
    assert tensor["key"] == "state_dict/module.conv.weight"
    assert tensor["shape"] == [8, 3, 3, 3] and tensor["dtype"] == "float32"
    assert {e["key"]: e["value"] for e in data["entries"]}["epoch"] == 12


def test_filter_glob_and_substring(capsys: pytest.CaptureFixture[str]) -> None:
    main(["inspect", "--json", "--filter", "state_dict/*bn*", str(DP)])
    keys = [t["key"] for t in json.loads(capsys.readouterr().out)["tensors"]]
    assert keys and all(k.startswith("state_dict/module.bn.") for k in keys)
    main(["inspect", "--json", "--filter", "exp_avg", str(DP)])
    assert all("exp_avg" in t["key"] for t in json.loads(capsys.readouterr().out)["tensors"])
    assert main(["inspect", "--filter", "nothing-like-this", str(DP)]) == 0
    assert "no tensors match 'nothing-like-this'" in capsys.readouterr().out


def test_depth_groups(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--depth", "3", str(DP)]) == 0
    out = capsys.readouterr().out
    assert "state_dict/module.conv " in out and "state_dict/module.bn " in out
    assert "state_dict/module.conv.weight" not in out


def test_limit(capsys: pytest.CaptureFixture[str]) -> None:
    main(["inspect", "--limit", "2", str(DP)])
    assert "… 13 more tensors" in capsys.readouterr().out


def test_unsafe_and_custom_globals_are_shown(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("true",))

    path = tmp_path / "evil.pth"
    torch.save({"w": torch.ones(1), "x": Evil()}, path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "UNSAFE" in out and "posix.system" in out
    main(["inspect", "--json", str(path)])
    assert json.loads(capsys.readouterr().out)["unsafe_globals"] == ["posix.system"]


@pytest.mark.parametrize(("args", "code", "message"), [
    (["inspect", "/no/such/file.pth"], 3, "no such file"),
    (["inspect", str(Path(__file__))], 3, "not a checkpoint"),
    (["inspect", str(SAMPLES)], 3, "is a directory holding"),
    (["inspect"], 2, "Missing argument"),
    (["inspect", "--depth", "0", str(DP)], 2, "--depth"),
    (["frobnicate"], 2, "No such command"),
])
def test_errors(args: list[str], code: int, message: str) -> None:
    proc = run(*args)
    assert proc.returncode == code
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 2, proc.stderr
    assert lines[0].startswith("ckptool: error: ") and message in lines[0]
    assert lines[1].startswith("hint: ")
    assert "Traceback" not in proc.stderr


def test_traceback_flag_shows_traceback() -> None:
    proc = run("--traceback", "inspect", "/no/such/file.pth")
    assert proc.returncode == 3
    assert "Traceback" in proc.stderr and "ckptool: error:" in proc.stderr


def test_version() -> None:
    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("ckptool, version ")


COLOR_SGR = re.compile(r"\x1b\[[0-9;]*(3[0-9]|9[0-7]|38;)")


def test_no_color_is_respected() -> None:
    forced = run("inspect", str(DP), env={"FORCE_COLOR": "1", "COLUMNS": "120"})
    assert COLOR_SGR.search(forced.stdout)  # the control: colours do appear
    plain = run("inspect", str(DP), env={"FORCE_COLOR": "1", "NO_COLOR": "1",
                                         "COLUMNS": "120"})
    assert plain.returncode == 0 and not COLOR_SGR.search(plain.stdout)


@pytest.mark.parametrize("width", [60, 80, 200])
def test_output_fits_terminal_width(width: int) -> None:
    proc = run("inspect", str(DP), env={"COLUMNS": str(width)})
    assert proc.returncode == 0
    assert max(len(line) for line in proc.stdout.splitlines()) <= width


def test_storages_shared_are_marked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = torch.arange(6.0)
    path = tmp_path / "tied.pth"
    with saved_on("cuda:0"):
        torch.save({"a": base, "b": base[2:]}, path)
    main(["inspect", str(path)])
    out = capsys.readouterr().out
    assert re.search(r"\ba .*#1\s*$", out, re.M) and re.search(r"\bb .*#1 @2", out)


# one_shot: the cycle collector off while a report runs, and its objects
# frozen when the command is the whole process

def test_one_shot_freezes_only_for_the_whole_process(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    from ckptool.cli import common

    was = gc.isenabled()
    before = gc.get_freeze_count()
    with common.one_shot():
        assert not gc.isenabled()
        kept = [[i] for i in range(1000)]  # tracked objects a read would make
    assert gc.isenabled() == was
    assert gc.get_freeze_count() == before  # a test's process is not the command's
    monkeypatch.setattr(common, "_WHOLE_PROCESS", [True])
    try:
        with common.one_shot():
            kept = [[i] for i in range(1000)]
        assert gc.isenabled() == was
        assert gc.get_freeze_count() >= before + len(kept)
    finally:
        gc.unfreeze()


def test_in_process_main_freezes_nothing() -> None:
    import gc

    before = gc.get_freeze_count()
    assert main(["inspect", "--json", str(DP)]) == 0
    assert main(["diagnose", "--json", "--device-count", "4", str(DP)]) in (0, 1)
    assert gc.get_freeze_count() == before


def test_the_executable_freezes_what_a_report_made() -> None:
    code = (
        "import atexit, gc, sys\n"
        "frozen = []\n"
        "real = gc.freeze\n"
        "def freeze():\n"
        "    frozen.append(len(gc.get_objects()))\n"
        "    real()\n"
        "gc.freeze = freeze\n"
        "atexit.register(lambda: print('frozen', frozen, gc.isenabled(), file=sys.stderr))\n"
        "sys.argv = ['ckptool', 'inspect', '--json', sys.argv[1]]\n"
        "from ckptool.cli import entry\n"
        "entry()\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(DP)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["num_tensors"] == 15
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("frozen [") and line.endswith("] True"), line
    assert int(line.split("[")[1].split("]")[0]) > 1000  # once, with the read's objects


def test_tallies_count_blank_devices_as_unrecorded() -> None:
    from ckptool.model import NO_LOCATION, Checkpoint, StorageInfo, TensorInfo

    storages = {sid: StorageInfo(sid, dtype, loc, n, None, ())
                for sid, dtype, loc, n in (("0", "float32", "cpu", 8), ("1", "float16", None, 4),
                                           ("2", "float32", "", 2), ("3", "int8", "cuda:0", 16))}
    tensors = [TensorInfo(f"t{sid}", (1,), s.dtype, (1,), 0, sid, s.location, s.nbytes)
               for sid, s in storages.items()]
    ckpt = Checkpoint("x", "torch-zip", 0, tensors, storages, [], [], None)
    assert ckpt.bytes_by_location == {"cuda:0": 16, "cpu": 8, NO_LOCATION: 6}
    assert ckpt.tensors_by_location == {NO_LOCATION: 2, "cpu": 1, "cuda:0": 1}
    assert ckpt.bytes_by_dtype == {"int8": 16, "float32": 10, "float16": 4}
    assert ckpt.total_bytes == 30


@pytest.mark.parametrize("args", [["inspect", str(SAMPLES / "lightning.ckpt")],
                                  ["inspect", "--json", str(SAMPLES / "lightning.ckpt")]])
def test_a_reader_that_goes_away_is_no_error(args: list[str]) -> None:
    """`ckptool inspect x | head`: the reader closed the pipe before the
    report was written; exit 0 and nothing on stderr, text or JSON."""
    proc = subprocess.Popen([sys.executable, "-m", "ckptool", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=SAMPLES.parent)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # gone before a byte is written
    err = proc.stderr.read()
    assert (proc.wait(timeout=60), err) == (0, b"")
