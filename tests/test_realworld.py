"""Files written by the libraries that write them for real (Lightning with
omegaconf and torchmetrics, numpy random states, DeepSpeed's loss scalers
and enums, whole pickled modules; see tests/fixtures/make_realworld.py):
no false alarm. Their classes run code when torch loads them, and ckptool
says so, but none is ``unsafe``: a warning that cries wolf on every
Lightning checkpoint would train users to ignore it."""

from __future__ import annotations

from pathlib import Path

import pytest

import ckptool
from ckptool.check.gpus import machine as gpus

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FILES = sorted(p for p in FIXTURES.iterdir() if p.suffix in (".pth", ".ckpt"))
SAMPLES = sorted(p for p in (FIXTURES.parent.parent / "samples").iterdir()
                 if p.suffix != ".py" and p.name != "hostile_runs_code.pth")


def test_the_fixtures_are_there() -> None:
    assert {p.name for p in FILES} >= {
        "lightning_trainer.ckpt", "lightning_module_whole.pth", "deepspeed_values.pth",
        "numpy_omegaconf_torchmetrics.pth", "whole_modules.pth"}


@pytest.mark.parametrize("path", FILES + SAMPLES, ids=lambda p: p.name)
def test_no_false_alarm(path: Path) -> None:
    ckpt = ckptool.open(path)
    assert ckpt.unsafe_globals == [], [(g.name, g.reason) for g in ckpt.globals]
    assert ckpt.main_state_dict is not None
    codes = [f.code for f in ckptool.diagnose(ckpt, gpus.assumed(0)).findings]
    assert "unsafe-globals" not in codes


def test_what_runs_is_said() -> None:
    ckpt = ckptool.open(FIXTURES / "deepspeed_values.pth")
    found = {g.name: g for g in ckpt.globals}
    enum = found["deepspeed.runtime.zero.config.ZeroStageEnum"]
    assert (enum.category, enum.uses) == ("custom", ("called",))
    scaler = found["deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"]
    assert (scaler.category, scaler.uses) == ("custom", ("created", "built"))


def test_lightning_hyperparameters_are_read() -> None:
    ckpt = ckptool.open(FIXTURES / "lightning_trainer.ckpt")
    assert ckpt.main_state_dict is not None and ckpt.main_state_dict.path == "state_dict"
    hp = next(e for e in ckpt.entries if e.key == "hyper_parameters")
    assert "omegaconf.dictconfig.DictConfig" in hp.summary and "ckptool" not in hp.summary
