"""``fix`` of one torch file reads each byte of it once and writes each byte of
the output once: the check of what it writes is taken from the bytes as they
are written, never by reading the output back.

Counted, not timed: the bytes this process reads through system calls
(``rchar`` of ``/proc/self/io``: read, pread, copy_file_range...) plus the
bytes it maps to read (``mmap``, which ``rchar`` does not see), and the bytes
it writes (``wchar``). A second read of every byte (the output re-read for
its CRCs, or the input read once for the copy and again for a check) comes
to twice the file."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from ckptool.write.fix import run as fix
from ckptool.write.fix.plan import FixOptions

IO = Path("/proc/self/io")
BOUND = 1.1  # times the file's size


def _io() -> dict[str, int]:
    return {key: int(value) for key, value in
            (line.split(":") for line in IO.read_text().splitlines())}


def _model(path: Path, tensors: int, numel: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    sd = {f"module.layer{i}.weight": torch.randn(numel, generator=gen) for i in range(tensors)}
    sd["module.layer0.bias"] = torch.randn(100, generator=gen)  # a small record between
    torch.save(sd, path)
    return sd


@pytest.mark.skipif(not IO.exists(), reason="counts bytes through /proc/self/io (Linux)")
@pytest.mark.parametrize("opts", [FixOptions(strip_module=True),
                                  FixOptions(strip_module=True, to="cpu")],
                         ids=["strip-module", "strip-module-to-cpu"])
def test_a_fix_reads_the_file_once_and_writes_the_output_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, opts: FixOptions) -> None:
    warm, src, out = tmp_path / "warm.pth", tmp_path / "m.pth", tmp_path / "o.pth"
    _model(warm, 2, 1000)
    fix.fix(str(warm), opts, str(tmp_path / "warm.fixed.pth"))  # every module imported
    want = _model(src, 12, 1 << 20)  # 48 MiB in 13 records
    size = src.stat().st_size

    mapped: list[int] = []

    class CountingMap(mmap.mmap):
        def __new__(cls, *args: object, **kwargs: object) -> CountingMap:
            window = super().__new__(cls, *args, **kwargs)  # type: ignore[misc]
            mapped.append(len(window))
            return window

    monkeypatch.setattr(mmap, "mmap", CountingMap)
    before = _io()
    fix.fix(str(src), opts, str(out))
    after = _io()
    monkeypatch.undo()

    read = after["rchar"] - before["rchar"] + sum(mapped)
    written = after["wchar"] - before["wchar"]
    assert read <= BOUND * size, (
        f"read {read / size:.2f}x the file ({(after['rchar'] - before['rchar']) / size:.2f}x "
        f"through system calls, {sum(mapped) / size:.2f}x mapped)")
    assert written <= BOUND * out.stat().st_size, f"wrote {written / size:.2f}x the output"
    got = torch.load(out, map_location="cpu")
    assert got.keys() == {k.removeprefix("module.") for k in want}
    assert all(torch.equal(got[k.removeprefix("module.")], v) for k, v in want.items())
