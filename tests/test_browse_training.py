"""``ckptool browse`` on what training saves: a model's state dict beside
its optimizer's (``torch.save({"model": ..., "optimizer": ...})``, and
``dcp.save`` of ``get_state_dict(model, optim)``). The tree counts the
model's parameters only, as ``inspect`` does; the optimizer's moments are
shown as its state, never as parameters."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import CliResult
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from ckptool.tui.app import BrowseApp
from ckptool.tui.index import Node
from ckptool.tui.table import Columns, node_cells
from ckptool.tui.textshot import screen_text
from tests.test_browse import Pilot, detail, drive

# nn.Linear(4, 8), BatchNorm1d(8), nn.Linear(8, 2): 40 + 16 + 18 parameters;
# BatchNorm's running statistics and counter are 17 elements of buffers
PARAMS, BUFFERS = 74, 17


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()  # exp_avg, exp_avg_sq and step for each of the 6 parameters
    return model, opt


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("training")
    model, opt = _trained()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3},
               folder / "train.pt")
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in one process"
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder / "dcp")
        # torchtitan's default: one key per value (optim.param_groups.0.weight.lr)
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        msd, osd = get_state_dict(model, opt, options=flat)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder / "dcp_flat")
    return {"torch": folder / "train.pt", "dcp": folder / "dcp",
            "dcp_flat": folder / "dcp_flat"}


# (the file, its optimizer's node in the tree, the key of one moment)
CASES = [("torch", "optimizer", "optimizer/state/0/exp_avg"),
         ("dcp", "optim", "optim.state.0.weight.exp_avg"),
         ("dcp_flat", "optim", "optim.state.0.weight.exp_avg")]


@pytest.mark.parametrize(("kind", "optim_node", "moment"), CASES)
def test_optimizer_moments_are_no_parameters(saved: dict[str, Path],
                                             run_cli: Callable[..., CliResult], kind: str,
                                             optim_node: str, moment: str) -> None:
    path = saved[kind]
    # what inspect says of the same file: the model's parameters, the optimizer apart
    code, out, _ = run_cli("inspect", str(path))
    assert code == 0 and f"parameters  {PARAMS} (+{BUFFERS} in buffers)" in out
    assert f"optimizer   '{optim_node}' · Adam/AdamW: step, exp_avg, exp_avg_sq for 6" in out

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        index = app.index
        assert index.root.params == PARAMS  # the whole file's: the model's only
        model = index.node("model")
        assert model is not None and model.params == PARAMS and not model.optim
        optim = index.node(optim_node)
        assert optim is not None
        assert optim.params == 0  # 154 before: Adam's moments (and steps) counted
        assert optim.optim == optim.count == 18
        assert optim.optim_elements == 2 * PARAMS + 6
        assert node_cells(optim, Columns.fit(80))[1] == "optimizer"
        assert node_cells(model, Columns.fit(80))[1] == f"{PARAMS} params"
        # what the screen shows: the optimizer's row says what it is
        text = screen_text(app)
        assert "optimizer" in next(line for line in text.splitlines()
                                   if line.lstrip("▸▾ ").startswith(optim_node + " "))
        assert f"{PARAMS} params" in next(line for line in text.splitlines()
                                          if line.lstrip("▸▾ ").startswith("model "))
        # its details: no parameters, its own count
        app.jump_to(optim_node)
        await pilot.pause()
        shown = detail(app)
        assert "none: an optimizer's state, not the model's parameters" in shown
        assert "optimizer 18 tensors of its state · 154 elements" in shown
        # a moment is marked as optimizer state; a weight is not
        app.jump_to(moment)
        await pilot.pause()
        assert "optimizer state" in detail(app)
        app.jump_to("model/0.weight" if kind == "torch" else "model.0.weight")
        await pilot.pause()
        assert "optimizer state" not in detail(app)

    drive(path, script, size=(100, 44))


def test_a_file_of_optimizer_state_only(saved: dict[str, Path], tmp_path: Path) -> None:
    """An ``optimizer.pt`` beside a model: no state dict, as inspect says,
    and no parameters anywhere."""
    _, opt = _trained()
    path = tmp_path / "optimizer.pt"
    torch.save(opt.state_dict(), path)

    async def script(app: BrowseApp, pilot: Pilot) -> None:
        summary = str(app.query_one("#summary").render())
        assert "state dict none: the file is an optimizer's state" in summary
        assert app.index.root.params == 0 and app.index.root.optim == 18
        nodes = [r for r in app.query_one("#table").rows if isinstance(r, Node)]  # type: ignore[attr-defined]
        assert nodes and all(node_cells(n, Columns.fit(80))[1] == "optimizer" for n in nodes)

    drive(path, script)


def test_flat_paths_are_looked_at_never_built() -> None:
    """DCP's planner paths come from the file: one that claims a list index
    of 10**12, or a name both a tensor and a dict, is only looked at."""
    from ckptool.read.optim import find_flat

    paths = [("a",), ("a", "b"), ("x", 10**12, "y"),
             ("o", "state", "w", "exp_avg"), ("o", "state", "w", "exp_avg_sq"),
             ("o", "state", "v", "exp_avg"), ("o", "param_groups", 0, "params"),
             ("o", "param_groups", 1, "params"), ("o", "param_groups", 0, "lr"),
             # too deep to be looked for, as in a tree (read.optim.MAX_DEPTH)
             ("a", "b", "c", "d", "state", "p", "n"),
             ("a", "b", "c", "d", "param_groups", 0, "params")]
    (state,) = find_flat(paths)
    assert (state.path, state.parameters, state.param_groups) == ("o", 2, 2)
    assert state.state_names == ("exp_avg", "exp_avg_sq") and state.kind == "Adam/AdamW"
