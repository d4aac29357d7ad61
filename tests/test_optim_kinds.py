"""Every torch.optim optimizer's state is named as what it is: each is
stepped once on a tiny model, saved with torch.save (and, flat, as DCP
keeps it), and read back. An RMSprop state (square_avg, momentum_buffer) is
no "SGD with momentum"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckptool
from ckptool.read import optim

# (optimizer, its arguments, the kind ckptool must name)
OPTIMIZERS: list[tuple[str, dict[str, Any], str | None]] = [
    ("Adam", {}, "Adam/AdamW"),
    ("Adam", {"amsgrad": True}, "Adam/AdamW"),
    ("AdamW", {}, "Adam/AdamW"),
    ("Adamax", {}, "Adamax"),
    ("NAdam", {}, "NAdam"),
    ("NAdam", {"decoupled_weight_decay": True}, "NAdam"),
    ("RAdam", {}, "RAdam"),
    ("RAdam", {"decoupled_weight_decay": True}, "RAdam"),
    ("Adagrad", {}, "Adagrad"),
    ("Adadelta", {}, "Adadelta"),
    ("RMSprop", {}, "RMSprop"),
    ("RMSprop", {"momentum": 0.9}, "RMSprop"),
    ("RMSprop", {"momentum": 0.9, "centered": True}, "RMSprop"),
    ("ASGD", {}, "ASGD"),
    ("Rprop", {}, "Rprop"),
    ("SGD", {"momentum": 0.9}, "SGD with momentum"),
    ("SGD", {"momentum": 0.9, "nesterov": True}, "SGD with momentum"),
    ("SGD", {}, "SGD"),
    ("LBFGS", {}, "LBFGS"),
    ("Adafactor", {}, "Adafactor"),
    ("Muon", {}, "Muon"),
]


def stepped(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The state dict of torch.optim.<name> after one step on a tiny model
    (Muon takes 2-d parameters only)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3, bias=name != "Muon")
    opt = getattr(torch.optim, name)(model.parameters(), lr=0.01, **kwargs)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.ones(2, 4)).pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return opt.state_dict()


@pytest.mark.parametrize(("name", "kwargs", "kind"), OPTIMIZERS,
                         ids=[f"{n}{'-' + '-'.join(k) if k else ''}" for n, k, _ in OPTIMIZERS])
def test_each_optimizer_is_named(tmp_path: Path, name: str, kwargs: dict[str, Any],
                                 kind: str | None) -> None:
    state = stepped(name, kwargs)
    torch.save({"model": torch.nn.Linear(4, 3).state_dict(), "optimizer": state},
               tmp_path / "ckpt.pt")
    found = ckptool.open(tmp_path / "ckpt.pt").metadata["optimizer_states"]
    assert [(s["path"], s["kind"]) for s in found] == [("optimizer", kind)]


@pytest.mark.parametrize(("name", "kwargs", "kind"), [
    o for o in OPTIMIZERS if o[0] in ("RMSprop", "RAdam", "Muon", "SGD") and o[1]])
def test_each_optimizer_is_named_when_saved_flat(name: str, kwargs: dict[str, Any],
                                                 kind: str | None) -> None:
    """As DCP's planner paths name them: nested (optim/state/0/square_avg,
    optim/param_groups/0/lr) and flattened (optim.state.fc.weight.square_avg).
    (SGD without momentum keeps no per-parameter state: nothing to find.)"""
    state = stepped(name, kwargs)
    nested = [("optim", "state", p, n) for p, entry in state["state"].items() for n in entry]
    nested += [("optim", "param_groups", i, n) for i, g in enumerate(state["param_groups"])
               for n in g]
    flat = [("optim", f"state.weight.{n}") for entry in state["state"].values() for n in entry]
    flat += [("optim", f"param_groups.weight.{n}") for g in state["param_groups"]
             for n in g if n != "params"]
    assert [s.kind for s in optim.find_flat(nested)] == [kind]
    assert [s.kind for s in optim.find_flat(flat)] == [kind]
