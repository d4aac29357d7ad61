"""Fixtures shared by test files: the CLI run in-process (exit code, stdout
and stderr apart) and small real checkpoints saved by torch."""

from __future__ import annotations

import dataclasses
import enum
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptool.cli import main

CliResult = tuple[int, str, str]  # exit code, stdout, stderr


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    """``run_cli("inspect", path)`` -> (exit code, stdout, stderr)."""

    def run(*args: str) -> CliResult:
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture(scope="session")
def torch_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One small state dict saved by torch as 'zip' (root folder 'model_0') and 'legacy'."""
    import torch

    folder = tmp_path_factory.mktemp("torch_files")
    sd = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.zeros(3)}
    paths = {"zip": folder / "model_0.pth", "legacy": folder / "legacy.pth"}
    torch.save(sd, paths["zip"])
    torch.save(sd, paths["legacy"], _use_new_zipfile_serialization=False)
    return paths


@pytest.fixture
def big_pt(tmp_path: Path) -> Path:
    """A torch file of eight float32 tensors of 256 KiB (w0-w7), for the
    conversions on many ranks."""
    import torch

    g = torch.Generator().manual_seed(1)
    path = tmp_path / "big.pt"
    torch.save({f"w{i}": torch.randn(256, 256, generator=g) for i in range(8)}, path)
    return path


@pytest.fixture
def ds_stubs() -> object:
    """Stand-ins for the three DeepSpeed classes its optimizer files name,
    so that a test can load, edit and save one; removed afterwards."""
    names = ["deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16",
             "deepspeed.runtime.fp16.loss_scaler", "deepspeed.runtime.zero",
             "deepspeed.runtime.zero.config", "deepspeed.utils",
             "deepspeed.utils.tensor_fragment"]
    mods = {n: types.ModuleType(n) for n in names}

    class LossScaler:
        pass

    class ZeroStageEnum(int, enum.Enum):
        disabled, optimizer_states, gradients, weights = 0, 1, 2, 3

    @dataclasses.dataclass
    class fragment_address:  # DeepSpeed's name
        numel: int
        start: int

    for cls, mod in ((LossScaler, "deepspeed.runtime.fp16.loss_scaler"),
                     (ZeroStageEnum, "deepspeed.runtime.zero.config"),
                     (fragment_address, "deepspeed.utils.tensor_fragment")):
        cls.__module__ = mod
        cls.__qualname__ = cls.__name__
        setattr(mods[mod], cls.__name__, cls)
    saved = {n: sys.modules.get(n) for n in names}
    sys.modules.update(mods)
    try:
        yield mods
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


# Local servers standing in for remote stores (HTTP ranges, Hugging Face Hub, S3, GCS),
# started once per session, reset for each test: see tests/remote_fixtures.py.
from remote_fixtures import (  # noqa: E402, F401
    fake_hub,
    fake_hub_session,
    fresh_remote,
    gcs_server,
    gcs_server_session,
    http_server,
    range_http_server_session,
    s3_server,
    s3_server_session,
)
