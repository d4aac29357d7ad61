"""``ckptool.write.fix.preview``: a fix planned from the checkpoint already read is the
plan ``fix.fix(..., dry_run=True)`` makes from a faithful read of the
file: the same renames, drops, extraction, device moves (and casts, notes,
errors), and every input tensor's key in the output."""

from __future__ import annotations

import argparse
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import SAMPLES, saved_on

import ckptool
from ckptool.errors import CkptoolError
from ckptool.read.walk import walk
from ckptool.write.fix.plan import FixOptions
from ckptool.write.fix.preview import Previewer, preview
from ckptool.write.fix.run import fix

OPTIONS = {
    "nothing": FixOptions(),
    "strip": FixOptions(strip_module=True),
    "strip-prefix": FixOptions(strip_prefixes=("module.",)),
    "strip-two": FixOptions(strip_prefixes=("_orig_mod.", "module.")),
    "add-prefix": FixOptions(add_prefix="net."),
    "to": FixOptions(to="cpu"),
    "maps": FixOptions(maps=(("cuda:2", "cuda:0"), ("cuda:7", "cpu"))),
    "extract": FixOptions(extract="auto"),
    "browser-default": FixOptions(extract="auto", strip_prefixes=("module.",), to="cpu"),
    "rename": FixOptions(renames=((r"\.bn\.", ".norm."),)),
    "drop": FixOptions(drop=("optimizer",)),
    "dtype": FixOptions(dtype="float16"),
    "everything": FixOptions(extract="auto", strip_module=True, add_prefix="m.",
                             maps=(("cuda:1", "cpu"),)),
    "collide": FixOptions(strip_prefixes=("module.conv.", "module.fc.")),
}
SAMPLE_FILES = sorted(p for p in SAMPLES.iterdir() if p.suffix != ".py" and p.is_file())


def expected(path: Path, opts: FixOptions) -> tuple[Any, ...]:
    """What the dry run of ``ckptool fix`` plans (or the error it raises)."""
    try:
        plan = fix(str(path), opts, dry_run=True).plan
    except CkptoolError as exc:
        return ("error", type(exc).__name__, exc.message, exc.hint)
    keys = sorted(key for key, _ in walk(plan.root).tensors)
    return (plan.renames, plan.dropped, plan.extracted, plan.retargets, plan.casts,
            plan.notes, keys)


def previewed(previewer: Previewer, opts: FixOptions) -> tuple[Any, ...]:
    try:
        p = previewer.preview(opts)
    except CkptoolError as exc:
        return ("error", type(exc).__name__, exc.message, exc.hint)
    keys = sorted([c.after for c in p.changes if c.after is not None] + p.added)
    assert p.tensors == len(keys)
    return (p.plan.renames, p.plan.dropped, p.plan.extracted, p.plan.retargets, p.plan.casts,
            p.plan.notes, keys)


def check(path: Path, options: dict[str, FixOptions] = OPTIONS) -> None:
    ckpt = ckptool.open(path)
    tensors_before = [(t.key, t.location) for t in ckpt.tensors]
    root_before = _snapshot(ckpt.root)
    one = Previewer(ckpt)  # one previewer for all, as the browser keeps it
    for name, opts in options.items():
        want = expected(path, opts)
        assert previewed(one, opts) == want, f"{path.name}: {name}"
        assert previewed(Previewer(ckpt), opts) == want, f"{path.name}: {name}, fresh"
    # the checkpoint it was given is as it was read
    assert [(t.key, t.location) for t in ckpt.tensors] == tensors_before
    assert _snapshot(ckpt.root) == root_before


def _snapshot(root: Any) -> list[tuple[str, int]]:
    walked = walk(root)
    return [(k, id(v)) for k, v in walked.tensors] + [(k, id(v)) for k, v in walked.entries]


@pytest.mark.parametrize("path", SAMPLE_FILES, ids=[p.name for p in SAMPLE_FILES])
def test_preview_is_the_dry_run_for_every_sample(path: Path) -> None:
    check(path)


def test_dataparallel_state_dict_on_cuda2_with_optimizer(tmp_path: Path) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                              torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(net.parameters())
    net(torch.randn(5, 3)).sum().backward()
    opt.step()
    path = tmp_path / "dp.pth"
    with saved_on("cuda:2"):
        torch.save({"epoch": 4, "state_dict": torch.nn.DataParallel(net).state_dict(),
                    "optimizer": opt.state_dict()}, path)
    check(path, {**OPTIONS, "drop-one-key": FixOptions(drop=("state_dict/module.0.bias",)),
                 "drop-from-a-list": FixOptions(drop=("optimizer/param_groups/0",)),
                 "drop-twice": FixOptions(drop=("optimizer/state/0", "optimizer/state/1")),
                 "drop-missing": FixOptions(drop=("optimizer/nothing",)),
                 "drop-then-strip": FixOptions(drop=("state_dict",), strip_module=True)})
    # a dropped key keeps the state dict's _metadata, as the dry run's does
    ckpt = ckptool.open(path)
    opts = FixOptions(drop=("state_dict/module.0.bias",))
    ours = preview(ckpt, opts).plan.root["state_dict"]
    theirs = fix(str(path), opts, dry_run=True).plan.root["state_dict"]
    assert ours._metadata == theirs._metadata and "module.0.bias" not in ours
    assert "module.0.bias" in ckpt.root["state_dict"]


def test_lightning_style_checkpoint(tmp_path: Path) -> None:
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 1))
    path = tmp_path / "run.ckpt"
    torch.save({
        "epoch": 2, "global_step": 200, "pytorch-lightning_version": "2.1.0",
        "state_dict": OrderedDict((f"model.{k}", v) for k, v in net.state_dict().items()),
        "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(4, 3, 3, 3)}},
                              "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "hyper_parameters": argparse.Namespace(width=4, extra={"note": "x", "w": torch.ones(2)}),
    }, path)
    check(path, {**OPTIONS, "strip-model": FixOptions(strip_prefixes=("model.",), to="cuda:1"),
                 "drop-in-a-namespace": FixOptions(drop=("hyper_parameters/extra/w",)),
                 "drop-a-namespace": FixOptions(drop=("hyper_parameters",)),
                 "extract-other": FixOptions(extract="optimizer_states/0/state/0")})


def test_aliased_and_nested_trees(tmp_path: Path) -> None:
    """A state dict seen twice, nested in a tuple, and with a non-tensor entry."""
    sd = {"module.a": torch.zeros(2), "module.b": torch.ones(3)}
    shared = tmp_path / "shared.pth"
    torch.save({"state_dict": sd, "ema": {"copy": sd}}, shared)
    check(shared, {"strip": FixOptions(strip_module=True),
                   "drop": FixOptions(drop=("ema",), strip_module=True),
                   "drop-in-both": FixOptions(drop=("state_dict/module.a",))})
    p = preview(ckptool.open(shared), FixOptions(strip_module=True))
    assert p.added == ["ema/copy/module.a", "ema/copy/module.b"] and p.tensors == 4
    nested = tmp_path / "tuple.pth"
    torch.save(({"model": sd}, {"step": 3, "w": [torch.zeros(1), torch.ones(1)]}), nested)
    check(nested, {"strip": FixOptions(strip_module=True),
                   "drop-in-tuple": FixOptions(drop=("1/w/0",), strip_module=True),
                   "drop-tuple-item": FixOptions(drop=("1",))})
    extra = tmp_path / "extra.pth"
    torch.save({"state_dict": {"module.w": torch.zeros(2),
                               "module.x._extra_state": {"t": torch.ones(1)}}}, extra)
    check(extra, {"strip": FixOptions(strip_module=True),
                  "extract": FixOptions(extract="auto", add_prefix="p.")})


def test_changes_pair_every_input_tensor_with_its_output(tmp_path: Path) -> None:
    ckpt = ckptool.open(SAMPLES / "dataparallel_cuda2.pth")
    p = preview(ckpt, OPTIONS["browser-default"])
    first = p.changes[0]
    assert (first.before, first.after, first.before_loc, first.after_loc) == (
        "state_dict/module.conv.weight", "conv.weight", "cuda:2", "cpu")
    assert [c.after for c in p.changes if c.before.startswith("optimizer/")] == [None] * 6
    assert (p.kept, p.renamed, p.moved, p.left_out) == (9, 9, 9, 6)
    assert p.summary() == ("9 tensors kept · 9 renamed · 9 moved · 6 left out · "
                           "extracts 'state_dict'")
    kept = {t.storage for t in ckpt.tensors if t.key.startswith("state_dict/")}
    assert p.nbytes == sum(ckpt.storages[s].nbytes for s in kept if s) < ckpt.total_bytes
    assert p.added == []


def test_safetensors_and_torchscript_refuse_as_the_fix_does() -> None:
    st = ckptool.open(SAMPLES / "tinynet.safetensors")
    with pytest.raises(CkptoolError, match="safetensors files record no device"):
        preview(st, FixOptions(to="cpu"))
    assert preview(st, FixOptions(add_prefix="m.")).renamed == len(st.tensors)
    with pytest.raises(CkptoolError, match="this is a TorchScript archive"):
        preview(ckptool.open(SAMPLES / "tinynet_script.pt"), FixOptions())


def test_an_unsafe_global_in_a_tensors_attributes_refuses_as_the_fix_does(
        tmp_path: Path) -> None:
    """``t.note = X`` pickles X with the tensor: the plan keeps X wherever the
    tensor goes, and neither the dry run nor the preview offers to write it."""
    import os

    canary = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.system, (f"touch {canary}",))

    w = torch.ones(2, 3)
    w.note = Evil()  # type: ignore[attr-defined]
    path = tmp_path / "evil.pth"
    torch.save({"state_dict": {"module.w": w, "module.b": torch.zeros(3)}, "epoch": 1}, path)
    options = {name: OPTIONS[name] for name in ("nothing", "strip", "extract", "to", "drop")}
    check(path, options)
    with pytest.raises(CkptoolError, match=r"run code when loaded \(posix\.system\)"):
        preview(ckptool.open(path), FixOptions(extract="auto"))
    # salvaging cannot take it out either: it travels with the tensor
    with pytest.raises(CkptoolError, match=r"unsafe globals: posix\.system"):
        preview(ckptool.open(path), FixOptions(extract="auto", salvage=True))
    assert not canary.exists()


def test_a_directory_is_previewed_as_fix_plans_it() -> None:
    """Shards and DCP: the directory fix's dry run (tests/test_browse_fix_dirs.py
    compares it with what is written); a checkpoint partitioned over its
    ranks' files is refused as fix refuses it, with its hint."""
    ckpt = ckptool.open(SAMPLES / "dcp_tinynet")
    opts = FixOptions(strip_prefixes=("fc.",))
    planned = Previewer(ckpt).preview(opts).plan.renames
    assert planned == fix(str(SAMPLES / "dcp_tinynet"), opts, dry_run=True).plan.renames
    assert len(planned) == 2  # model.fc.weight -> model.weight, and its bias
    deepspeed = SAMPLES / "deepspeed_zero3"
    with pytest.raises(CkptoolError, match="partitioned over its ranks' files") as raised:
        Previewer(ckptool.open(deepspeed)).preview(FixOptions(strip_module=True))
    assert raised.value.hint.startswith(f"consolidate it first: ckptool convert {deepspeed}")
