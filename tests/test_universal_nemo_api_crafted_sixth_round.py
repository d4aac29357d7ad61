"""Sixth adversarial round: DeepSpeed universal checkpoints, .nemo archives
read in place, and the Python API on them. Each test fails on the code it
was written against, for the reason in its docstring."""

from __future__ import annotations

import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import CliResult
from helpers import make_nemo

import ckptool

HERE = Path(__file__).resolve().parent
UC = HERE / "fixtures" / "deepspeed_universal"
TAG = "global_step2_universal"


class _Payload:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, ("echo pwned",))


def test_a_payload_in_a_parameters_exp_avg_pt_is_in_the_verdict(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    """DeepSpeed loads a universal checkpoint by ``torch.load(...,
    weights_only=False)`` of every ``*.pt`` in ``zero/<param>/``
    (universal_checkpoint.load_hp_checkpoint_state: fp32.pt, exp_avg.pt,
    exp_avg_sq.pt, step.pt). ckptool reads only fp32.pt
    (ds_universal._read: "exp_avg.pt ... not read") and companions.py skips
    DS_UNIVERSAL folders' subfolders, so an ``os.system`` in
    ``zero/lin.weight/exp_avg.pt`` is in no verdict: inspect says nothing
    unsafe, verify says ok."""
    d = tmp_path / "u"
    shutil.copytree(UC / "z2_fp32", d)
    (d / TAG / "zero" / "lin.weight" / "exp_avg.pt").write_bytes(
        pickle.dumps({"exp_avg": _Payload()}, protocol=2))
    code, out, err = run_cli("inspect", "--json", str(d))
    assert code in (0, 3), err
    assert "posix.system" in out + err, "the payload DeepSpeed would run is in no verdict"


def test_map_location_meta_on_a_nemo_gives_meta_tensors(tmp_path: Path) -> None:
    """``torch.load(f, map_location="meta")`` gives meta tensors, and
    placement.unusable accepts "meta"; but ckptool.load of a NeMo 1 .nemo
    (model_weights.ckpt read in place) raises a bare AssertionError ("META
    device module is not loaded") from Placement.storage's
    ``storage.to(device="meta")`` (ckptool/read/placement.py), not a
    CkptoolError, and no tensors."""
    path, want = make_nemo.make("ckpt", tmp_path)
    got = ckptool.load(path, map_location="meta")
    sd = got.get("state_dict", got)
    for key, tensor in want.items():
        assert sd[key].device.type == "meta" and sd[key].shape == tensor.shape, key


def test_map_location_meta_on_a_plain_torch_file(tmp_path: Path) -> None:
    """The same for the plainest file: torch.load gives a meta tensor,
    ckptool.load raises AssertionError (placement.Placement.storage)."""
    p = tmp_path / "w.pt"
    torch.save({"a": torch.ones(2, 3)}, p)
    assert torch.load(p, map_location="meta", weights_only=True)["a"].is_meta
    try:
        got = ckptool.load(p, map_location="meta")
    except ckptool.CkptoolError:
        pytest.fail("a documented error at least, but torch loads it")
    assert got["a"].is_meta and got["a"].shape == (2, 3)
