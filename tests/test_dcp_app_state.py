"""The DCP recipe's layout (pytorch.org/tutorials/recipes/
distributed_checkpoint_recipe.html): ``dcp.save({"app": AppState(model,
optimizer)})``, where AppState is a ``Stateful`` whose ``state_dict()`` is
``{"model": msd, "optim": osd}`` from ``get_state_dict``. The model's state
dict is the ``app.model`` entry (its optimizer's state beside it under
``app.optim``), end to end: inspect, convert, load_state_dict, diagnose
--model, diff."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import CliResult
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

import ckptool

MODEL_SOURCE = '''
import torch.nn as nn


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(16, 16)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))
'''


class ToyModel(torch.nn.Module):
    """The recipe's model: 408 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = torch.nn.Linear(16, 16)
        self.relu = torch.nn.ReLU()
        self.net2 = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


class AppState(Stateful):
    """The recipe's wrapper: model and optimizer state under one entry."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 flat: bool = False) -> None:
        self.model, self.optimizer = model, optimizer
        self.options = StateDictOptions(flatten_optimizer_state_dict=flat)

    def state_dict(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"], options=self.options)


def trained() -> tuple[ToyModel, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = ToyModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.rand(8, 16)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.fixture(params=[False, True], ids=["nested", "flat"])
def app_state(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, ToyModel]:
    model, optimizer = trained()
    folder = tmp_path / "checkpoint"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in one process"
        dcp.save({"app": AppState(model, optimizer, request.param)}, checkpoint_id=folder,
                 no_dist=True)
    return folder, model


def test_the_model_is_the_app_model_entry(app_state: tuple[Path, ToyModel],
                                          run_cli: Callable[..., CliResult]) -> None:
    folder, model = app_state
    ckpt = ckptool.open(folder)
    sd = ckpt.main_state_dict
    assert sd is not None and ckpt.metadata["state_dict_entry"] == "app.model"
    assert sorted(sd.keys) == sorted(f"app.model.{k}" for k in model.state_dict())
    assert sd.num_parameters == 408
    assert [(s["path"], s["kind"]) for s in ckpt.metadata["optimizer_states"]] == [
        ("app/optim", "Adam/AdamW")]
    code, out, _ = run_cli("inspect", str(folder))
    assert code == 0 and "the 'app.model' entry · 4 tensors" in out
    assert "parameters  408" in out


def test_convert_writes_the_models_names(app_state: tuple[Path, ToyModel], tmp_path: Path,
                                         run_cli: Callable[..., CliResult]) -> None:
    folder, model = app_state
    out = tmp_path / "model.safetensors"
    code, _, err = run_cli("convert", str(folder), str(out))
    assert code == 0, err
    written, want = load_file(out), model.state_dict()
    assert written.keys() == want.keys()
    assert all(torch.equal(written[k], want[k]) for k in want)


def test_load_state_dict_loads_into_the_model(app_state: tuple[Path, ToyModel]) -> None:
    folder, model = app_state
    fresh = ToyModel()
    sd = ckptool.load_state_dict(folder, fresh)
    fresh.load_state_dict(sd)  # strict: nothing missing, nothing unexpected
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                  model.state_dict().values(), strict=True))


def test_diagnose_with_the_model_finds_nothing(app_state: tuple[Path, ToyModel],
                                               tmp_path: Path,
                                               run_cli: Callable[..., CliResult]) -> None:
    folder, _ = app_state
    (tmp_path / "toy.py").write_text(MODEL_SOURCE)
    code, out, err = run_cli("diagnose", "--json", str(folder), "--model",
                             f"{tmp_path / 'toy.py'}:ToyModel")
    assert code == 0, out + err
    report = json.loads(out)
    assert report["findings"] == []
    assert report["main_state_dict"]["entry_prefix"] == "app.model."
    assert report["keys"]["matched_as_saved"] == 4 and report["keys"]["unexpected"] == []


def test_diff_with_the_models_own_file(app_state: tuple[Path, ToyModel], tmp_path: Path,
                                       run_cli: Callable[..., CliResult]) -> None:
    folder, model = app_state
    torch.save(model.state_dict(), tmp_path / "model.pt")
    code, out, err = run_cli("diff", str(folder), str(tmp_path / "model.pt"))
    assert code == 0, out + err
    assert "0 changed · 4 identical" in out


def test_a_model_entry_without_an_optimizer_beside_stays_whole(tmp_path: Path) -> None:
    """Only an optimizer's state beside them makes an entry's parts the
    candidates: ``{"model": {"encoder": ..., "decoder": ...}}`` is one model."""
    parts = {"encoder": torch.nn.Linear(3, 3).state_dict(),
             "decoder": torch.nn.Linear(3, 2).state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": parts}, checkpoint_id=tmp_path / "c", no_dist=True)
    ckpt = ckptool.open(tmp_path / "c")
    assert ckpt.metadata["state_dict_entry"] == "model"
    assert ckpt.main_state_dict is not None and ckpt.main_state_dict.num_tensors == 4


class Wrapped(torch.nn.Module):
    """The recipe's model under ``module`` (as DDP names it)."""

    def __init__(self) -> None:
        super().__init__()
        self.module = ToyModel()


def test_a_fix_renames_inside_the_nested_entry(app_state: tuple[Path, ToyModel],
                                               tmp_path: Path,
                                               run_cli: Callable[..., CliResult]) -> None:
    """fix --add-prefix of the recipe's checkpoint: the model's keys (and its
    optimizer's, nested or flat) renamed inside ``app.model``, so the
    AppState of the wrapped model loads it, moments and all."""
    folder, model = app_state
    out = tmp_path / "fixed"
    code, _, err = run_cli("fix", str(folder), "--add-prefix", "module.", "-o", str(out))
    assert (code, err) == (0, ""), err
    ckpt = ckptool.open(out)
    assert ckpt.metadata["state_dict_entry"] == "app.model"
    assert sorted(ckpt.main_state_dict.keys) == sorted(  # type: ignore[union-attr]
        f"app.model.module.{k}" for k in model.state_dict())
    flat = any("param_groups." in str(p[-1]) for p in (ckpt.tree_paths or {}).values())
    fresh = Wrapped()
    optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"app": AppState(fresh, optimizer, flat)}, checkpoint_id=out, no_dist=True)
    want = trained()[1]
    for p, q in zip(fresh.module.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    for p, q in zip(fresh.parameters(), [p for g in want.param_groups for p in g["params"]],
                    strict=True):
        assert torch.equal(optimizer.state[p]["exp_avg"], want.state[q]["exp_avg"])
