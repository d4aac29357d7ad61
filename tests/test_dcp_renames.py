"""``fix`` renames of a DCP checkpoint reach its optimizer state: a model
and AdamW saved the way torch's distributed state-dict API saves them
(``get_state_dict`` -> ``dcp.save({"model": msd, "optim": osd})``), whose
optimizer state is keyed by the model's parameter names
(``optim.state.module.0.weight.exp_avg``, ``optim.param_groups.0.params``).
After the fix, ``set_state_dict`` loads model and optimizer into the model as
the new names have it: the moments land on the right parameters."""

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
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


class Wrapper(torch.nn.Module):
    """What DataParallel/DDP do to names: the model under ``module``."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.module = net


class Named(torch.nn.Module):
    """The same layers under other attribute names (for --rename)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.norm = torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)


def net() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))


def trained(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        x = torch.randn(2, 4)
        for layer in model.modules():
            if isinstance(layer, (torch.nn.Linear, torch.nn.LayerNorm)):
                x = layer(x)
        x.square().sum().backward()
        opt.step()
    return model, opt


def save(model: torch.nn.Module, opt: torch.optim.Optimizer, folder: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in one process"
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder, no_dist=True)


def load(model: torch.nn.Module, folder: Path) -> torch.optim.Optimizer:
    """Model and optimizer state from ``folder``, as torch documents it."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=folder, no_dist=True)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    return opt


def moments(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[Any]:
    """Each parameter's values and AdamW moments, in the order of the layers."""
    return [(p.detach().clone(), opt.state[p]["exp_avg"].clone(),
             opt.state[p]["exp_avg_sq"].clone(), float(opt.state[p]["step"]))
            for p in model.parameters()]


CASES = {
    # saved from -> fix args -> loaded into
    "strip-module": (lambda: Wrapper(net()), ["--strip-module"], net),
    "strip-prefix": (lambda: Wrapper(net()), ["--strip-prefix", "module."], net),
    "add-prefix": (net, ["--add-prefix", "module."], lambda: Wrapper(net())),
    "rename": (net, ["--rename", r"^0\.=first.", "--rename", r"^1\.=norm."], Named),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_optimizer_state_loads_under_the_new_names(
        case: str, tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    make, args, target = CASES[case]
    torch.manual_seed(0)
    model, opt = trained(make())
    want = moments(model, opt)
    save(model, opt, tmp_path / "ckpt")
    out = tmp_path / "fixed"
    code, stdout, err = run_cli("fix", str(tmp_path / "ckpt"), *args, "-o", str(out), "--json")
    assert (code, err) == (0, ""), err
    report = json.loads(stdout)
    renamed = {r["from"]: r["to"] for r in report["renamed"]}
    assert len([k for k in renamed if k.startswith("optim.state.")]) == 12  # 4 params x 3
    assert any("param_groups renamed" in n for n in report["notes"])

    fresh = target()
    got = moments(fresh, load(fresh, out))
    assert len(got) == len(want) == 4
    for (p, avg, sq, step), (wp, wavg, wsq, wstep) in zip(got, want, strict=True):
        assert torch.equal(p, wp) and torch.equal(avg, wavg) and torch.equal(sq, wsq)
        assert step == wstep == 2.0


def test_optimizer_names_that_are_not_the_models_are_kept_and_said(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    """An optimizer state keyed by names the model does not have (saved from
    another wrapping) is not guessed at: it stays, and the result says so."""
    torch.manual_seed(0)
    model, opt = trained(Wrapper(net()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = get_state_dict(model, opt)
        osd["state"] = {f"other.{k}": v for k, v in osd["state"].items()}
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    code, stdout, err = run_cli("fix", str(tmp_path / "ckpt"), "--strip-module",
                                "-o", str(tmp_path / "fixed"), "--json")
    assert (code, err) == (0, ""), err
    report = json.loads(stdout)
    assert not [r for r in report["renamed"] if r["from"].startswith("optim.")]
    assert any(n.startswith("optim: 4 parameter name(s) of the optimizer state are no key "
                            "of the model (e.g. 'other.module.0.bias')")
               for n in report["notes"]), report["notes"]


@pytest.mark.parametrize("case", ["strip-module", "add-prefix"])
def test_a_flat_optimizer_state_loads_under_the_new_names(
        case: str, tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    """torchtitan's default: ``flatten_optimizer_state_dict=True`` saves one
    key per value (``optim.state.module.0.weight.exp_avg``,
    ``optim.param_groups.module.0.weight.lr``); they follow the model too."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    make, args, target = CASES[case]
    torch.manual_seed(0)
    model, opt = trained(make())
    want = moments(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = get_state_dict(model, opt, options=flat)
        assert any(k.startswith("param_groups.") for k in osd)  # the flat form
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    out = tmp_path / "fixed"
    code, stdout, err = run_cli("fix", str(tmp_path / "ckpt"), *args, "-o", str(out), "--json")
    assert (code, err) == (0, ""), err
    assert any("saved flat, follows the model's keys" in n
               for n in json.loads(stdout)["notes"])
    fresh = target()
    new_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = get_state_dict(fresh, new_opt, options=flat)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=out, no_dist=True)
        set_state_dict(fresh, new_opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=flat)
    got = moments(fresh, new_opt)
    for (p, avg, sq, step), (wp, wavg, wsq, wstep) in zip(got, want, strict=True):
        assert torch.equal(p, wp) and torch.equal(avg, wavg) and torch.equal(sq, wsq)
        assert step == wstep == 2.0
