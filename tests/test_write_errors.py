"""A write the system refuses is one error line naming the output, a hint
about writing (never "check that the path is readable"), exit 3, and
nothing left behind: for one file, a Hugging Face directory, and a DCP
directory written by torch's own FileSystemWriter (which wraps the error in
a CheckpointException, and whose zip writer turns a failed write into
``RuntimeError: [enforce fail at inline_container.cc] unexpected pos``)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CliResult
from helpers import disk_full_lines
from torch.distributed.checkpoint import filesystem

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
DCP = SAMPLES / "dcp_tinynet"
FULL = "hint: free space on that filesystem, or write elsewhere (nothing was left half-written)"


def model(path: Path) -> Path:
    torch.manual_seed(0)
    torch.save({"module.w": torch.randn(128, 128), "module.b": torch.randn(128)}, path)
    return path


class FullDisk:
    """A stream of torch's FileSystemWriter on a disk that fills up: writes
    of the file named ``fails`` (every file: None) raise ENOSPC."""

    def __init__(self, stream: Any, fail: bool) -> None:
        self.stream, self.fail = stream, fail

    def write(self, data: Any) -> int:
        if self.fail:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return int(self.stream.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@pytest.fixture(params=["chunks", "metadata"])
def full_disk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """torch's writer writing to a full disk: the .distcp chunks, or only
    .metadata (written last, once every chunk is on disk)."""
    real = filesystem.FileSystem.create_stream

    @contextmanager
    def create_stream(self: Any, path: Any, mode: str) -> Iterator[Any]:
        fail = request.param == "chunks" or str(path).endswith(".metadata.tmp")
        with real(self, path, mode) as stream:
            yield FullDisk(stream, fail)

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)
    return str(request.param)


@pytest.mark.parametrize("command", ["convert", "fix"])
def test_a_full_disk_under_torchs_dcp_writer(
        command: str, full_disk: str, tmp_path: Path,
        run_cli: Callable[..., CliResult]) -> None:
    out = tmp_path / "out"
    args = (["convert", str(model(tmp_path / "m.pth")), str(out), "--format", "dcp"]
            if command == "convert" else ["fix", str(DCP), "--add-prefix", "x.", "-o", str(out)])
    code, stdout, err = run_cli(*args)
    assert (code, stdout) == (3, "")
    assert disk_full_lines(err, out, FULL), err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["m.pth"] if command == "convert"
                                                           else [])


def test_an_error_of_the_input_inside_torchs_writer_stays_the_inputs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        run_cli: Callable[..., CliResult]) -> None:
    """What torch's writer wraps is unwrapped: a corrupt input found while its
    bytes are read is the input's error, a Ctrl-C is an interruption."""
    from ckptool.errors import CorruptCheckpointError
    from ckptool.write import sources

    def corrupt(*args: Any, **kwargs: Any) -> Any:
        raise CorruptCheckpointError("m.pth: a storage ends early", "the file is truncated")

    monkeypatch.setattr(sources.TensorSource, "values", corrupt)
    src = model(tmp_path / "m.pth")
    code, _, err = run_cli("convert", str(src), str(tmp_path / "out"), "--format", "dcp")
    assert (code, err) == (3, "ckptool: error: m.pth: a storage ends early\n"
                              "hint: the file is truncated\n")

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(sources.TensorSource, "values", interrupted)
    code, _, err = run_cli("convert", str(src), str(tmp_path / "out"), "--format", "dcp")
    assert code == 130 and "Traceback" not in err and "CheckpointException" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pth"]


@pytest.mark.parametrize("output", ["file", "torch", "hf", "dcp", "fix", "fix-dcp"])
def test_a_name_too_long_names_the_output(output: str, tmp_path: Path,
                                          run_cli: Callable[..., CliResult]) -> None:
    src = model(tmp_path / "m.pth")
    long = tmp_path / ("x" * 300)
    out, args = {
        "file": (f"{long}.safetensors", ["convert", str(src)]),
        "torch": (f"{long}.pt", ["convert", str(DCP)]),
        "hf": (str(long), ["convert", str(src), "--format", "hf"]),
        "dcp": (str(long), ["convert", str(src), "--format", "dcp"]),
        "fix": (f"{long}.pth", ["fix", str(src), "--strip-module", "-o"]),
        "fix-dcp": (str(long), ["fix", str(DCP), "--add-prefix", "x.", "-o"]),
    }[output]
    code, stdout, err = run_cli(*args, out)
    assert (code, stdout) == (3, "")
    assert err.splitlines() == [f"ckptool: error: cannot write {out}: file name too long",
                                "hint: choose a shorter output name (nothing was left "
                                "half-written)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pth"]


@pytest.mark.parametrize("where", ["writer", "copy_thread"])
def test_a_full_disk_under_one_file(where: str, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch,
                                    run_cli: Callable[..., CliResult]) -> None:
    from ckptool.write import copy
    from ckptool.write.fix import run as fix

    def full(*args: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "writer":
        monkeypatch.setattr(fix, "_finish_zip", full)
    else:  # the storage copy runs on its own thread: its error reaches the CLI
        monkeypatch.setattr(copy.Copier, "_pwrite", full)
        monkeypatch.setattr(copy, "copy_pieces", full)
    src = model(tmp_path / "m.pth")
    out = tmp_path / "fixed.pth"
    code, stdout, err = run_cli("fix", str(src), "--strip-module", "-o", str(out))
    assert (code, stdout) == (3, "")
    assert disk_full_lines(err, out, FULL), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pth"]


def test_a_full_disk_under_a_fix_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          run_cli: Callable[..., CliResult]) -> None:
    """The metadata-only rewrite appends to the input itself: its error names
    the input (and claims nothing about what a rewrite in place left)."""
    src = model(tmp_path / "m.pth")

    def full(*args: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    code, stdout, err = run_cli("fix", str(src), "--strip-module", "--in-place")
    assert (code, stdout) == (3, "")
    assert disk_full_lines(err, src, "hint: free space on that filesystem, or write elsewhere")


FSIZE = """
import json, resource, sys
sys.path.insert(0, {root!r})
from ckptool.cli.main import main
resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))
print(json.dumps([main(args) for args in {runs!r}]))
"""


def test_a_size_limit_the_kernel_enforces(tmp_path: Path) -> None:
    """No stand-in: the kernel refuses the write past ``ulimit -f`` (EFBIG),
    under torch's DCP writer and ckptool's own."""
    src = model(tmp_path / "m.pth")
    runs = [["convert", str(src), str(tmp_path / "dcp"), "--format", "dcp"],
            ["convert", str(src), str(tmp_path / "o.safetensors")],
            ["convert", str(src), str(tmp_path / "hf"), "--format", "hf"]]
    script = FSIZE.format(root=str(Path(__file__).resolve().parent.parent), runs=runs)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert json.loads(done.stdout) == [3, 3, 3], done.stderr
    hint = ("hint: the filesystem (or `ulimit -f`) caps the size of a file: write elsewhere "
            "(nothing was left half-written)")
    assert done.stderr.splitlines() == [
        f"ckptool: error: cannot write {tmp_path / 'dcp'}: file too large", hint,
        f"ckptool: error: cannot write {tmp_path / 'o.safetensors'}: file too large", hint,
        f"ckptool: error: cannot write {tmp_path / 'hf' / 'model.safetensors'}: file too large",
        hint]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pth"]
