"""A full disk says what the output needs and what its filesystem has
left, on one process and on many: ``cannot write OUT: no space left on
device (needs 2.1 MB, 310.4 MB free on /x)``."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from test_distributed_convert import on_ranks

from ckptool.describe import human_bytes
from ckptool.errors import OutputError
from ckptool.write import copy
from ckptool.write.convert.run import convert

NEEDS = 8 * 256 * 256 * 4


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*args: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(copy, "copy_pieces", full)
    monkeypatch.setattr(copy.Copier, "_pwrite", full)


@pytest.fixture
def src(tmp_path: Path) -> Path:
    path = tmp_path / "big.pt"
    torch.save({f"w{i}": torch.ones(256, 256) * i for i in range(8)}, path)
    return path


def _figures(message: str, tmp_path: Path) -> None:
    mount = str(tmp_path)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    m = re.search(r"\(needs (.+), (.+) free on (\S+)\)$", message)
    assert m is not None, message
    assert m.group(1) == human_bytes(NEEDS) and m.group(3) == mount
    free = shutil.disk_usage(tmp_path).free
    assert m.group(2).split()[1] == human_bytes(free).split()[1]  # same unit, nearly the same


@pytest.mark.usefixtures("full_disk")
def test_one_process_says_what_the_output_needs_and_what_is_free(src: Path,
                                                                 tmp_path: Path) -> None:
    with pytest.raises(OutputError) as caught:
        convert(str(src), str(tmp_path / "out.safetensors"))
    assert caught.value.message.startswith(f"cannot write {tmp_path / 'out.safetensors'}: "
                                           "no space left on device (")
    _figures(caught.value.message, tmp_path)


@pytest.mark.usefixtures("full_disk")
def test_many_processes_say_the_figures_and_how_to_resume(src: Path, tmp_path: Path) -> None:
    results = on_ranks(2, src, tmp_path / "out.safetensors")
    assert isinstance(results[0], OutputError), results[0]
    _figures(results[0].message, tmp_path)
    assert "()" not in results[0].hint and "run the same command again" in results[0].hint
