"""End to end: for each way a checkpoint fails to load, ``ckptool diagnose``
prints a fix command; run exactly as printed from the checkpoint's folder,
it writes a file that plain ``torch.load`` (no map_location) and
``load_state_dict(strict=True)`` accept on this CPU-only machine."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_samples, saved_on
from nets import Net

ROOT = Path(__file__).resolve().parent.parent
NETS = Path(__file__).resolve().parent / "nets.py"


def ckptool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "ckptool", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def prefixed(sd: dict[str, torch.Tensor], prefix: str) -> OrderedDict[str, torch.Tensor]:
    out = OrderedDict((prefix + k, v) for k, v in sd.items())
    out._metadata = OrderedDict(  # type: ignore[attr-defined]
        ((prefix[:-1] + "." + k).strip(".") if k else prefix[:-1], v)
        for k, v in sd._metadata.items())  # type: ignore[attr-defined]
    return out


def trained(width: int) -> Net:
    torch.manual_seed(width)
    net = Net(width)
    net.bn.running_mean.uniform_()
    net.bn.num_batches_tracked.fill_(17)
    return net


def diagnose_and_fix(path: Path, model_args: list[str], net: torch.nn.Module,
                     model: str = "Net") -> dict[str, Any]:
    """Diagnose, run its fix command as printed, load the result plainly."""
    args = ["--model", f"{NETS}:{model}", *[a for v in model_args for a in ("--model-arg", v)]]
    proc = ckptool("diagnose", "--json", path.name, *args, cwd=path.parent)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    command = report["fix_command"]
    assert command and command.startswith("ckptool fix ")
    # the human output prints the same command
    human = ckptool("diagnose", path.name, *args, cwd=path.parent)
    assert command in human.stdout.replace("\n", " ")

    fixed = ckptool(*shlex.split(command)[1:], cwd=path.parent)
    assert fixed.returncode == 0, fixed.stderr
    output = path.parent / report["fix_output"]
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, output.name])

    state = torch.load(output)  # plain: weights_only=True, no map_location
    fresh = type(net)(**{k: json.loads(v) for k, v in (a.split("=") for a in model_args)})
    fresh.load_state_dict(state, strict=True)
    for key, value in net.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    # and the fixed file has nothing left to fix
    again = ckptool("diagnose", output.name, *args, cwd=path.parent)
    assert again.returncode == 0, again.stdout
    return report


def test_dataparallel_on_cuda2_in_a_training_dict(tmp_path: Path) -> None:
    net = trained(8)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, 3, 4, 4)).sum().backward()
    optimizer.step()
    path = tmp_path / "dp.pth"
    with saved_on("cuda:2"):
        torch.save({"epoch": 12, "state_dict": prefixed(net.state_dict(), "module."),
                    "optimizer": optimizer.state_dict(),
                    "args": argparse.Namespace(arch="net", lr=0.1)}, path)
    with pytest.raises(RuntimeError, match=r"torch\.cuda\.is_available"):
        torch.load(path, weights_only=False)
    report = diagnose_and_fix(path, ["width=8"], net)
    assert {f["code"] for f in report["findings"]} == {
        "device-unavailable", "wrapped-state-dict", "weights-only", "key-prefix"}
    assert report["fix_command"] == \
        "ckptool fix dp.pth --extract --strip-module --to cpu -o dp.fixed.pth"


def test_lightning_checkpoint_with_constructor_arguments(tmp_path: Path) -> None:
    net = trained(12)
    hparams = make_samples.attribute_dict_class()(width=12, lr=0.01)
    path = tmp_path / "epoch=3-step=1200.ckpt"
    torch.save({
        "epoch": 3, "global_step": 1200, "pytorch-lightning_version": "2.4.0",
        "state_dict": prefixed(net.state_dict(), "model."), "loops": {}, "callbacks": {},
        "optimizer_states": [], "lr_schedulers": [], "hparams_name": "kwargs",
        "hyper_parameters": hparams}, path)
    # without the argument the model cannot be built: the hint names the saved value
    proc = ckptool("diagnose", path.name, "--model", f"{NETS}:Net", cwd=tmp_path)
    assert proc.returncode == 2
    assert "the checkpoint saved --model-arg width=12" in proc.stderr
    report = diagnose_and_fix(path, ["width=12"], net)
    assert report["fix_command"] == ("ckptool fix epoch=3-step=1200.ckpt --extract "
                                     "--strip-module -o epoch=3-step=1200.fixed.ckpt")


def test_compile_over_ddp_state_dict(tmp_path: Path) -> None:
    net = trained(8)
    path = tmp_path / "compiled.pt"
    with saved_on("cuda:1"):
        torch.save(prefixed(net.state_dict(), "_orig_mod.module."), path)
    report = diagnose_and_fix(path, ["width=8"], net)
    assert report["keys"]["rewrite"] == {"strip": "_orig_mod.module.", "add": ""}
    assert report["fix_command"] == \
        "ckptool fix compiled.pt --strip-module --to cpu -o compiled.fixed.pt"


def test_legacy_format_file(tmp_path: Path) -> None:
    net = trained(8)
    path = tmp_path / "old model.pth"
    with saved_on("cuda:3"):
        torch.save({"state_dict": prefixed(net.state_dict(), "module.")}, path,
                   _use_new_zipfile_serialization=False)
    report = diagnose_and_fix(path, ["width=8"], net)
    assert report["format"] == "torch-legacy"
    assert report["fix_command"] == ("ckptool fix 'old model.pth' --extract --strip-module "
                                     "--to cpu -o 'old model.fixed.pth'")
    with open(tmp_path / "old model.fixed.pth", "rb") as f:
        assert f.read(2) != b"PK"  # still the legacy format


def test_device_count_retargets_for_another_machine(tmp_path: Path) -> None:
    """--device-count 1: the command moves cuda:2 to cuda:0 for that machine."""
    path = tmp_path / "dp.pth"
    with saved_on("cuda:2"):
        torch.save(trained(8).state_dict(), path)
    proc = ckptool("diagnose", "--json", "--device-count", "1", path.name, cwd=tmp_path)
    report = json.loads(proc.stdout)
    assert "torch.cuda.device_count() is 1" in report["load"]["errors"][0]
    assert report["fix_command"] == "ckptool fix dp.pth --to cuda:0 -o dp.fixed.pth"
    assert ckptool(*shlex.split(report["fix_command"])[1:], cwd=tmp_path).returncode == 0
    tags = set()
    torch.load(tmp_path / "dp.fixed.pth", map_location=lambda s, loc: tags.add(loc) or s)
    assert tags == {"cuda:0"}


def test_bare_state_dict_into_a_wrapping_module(tmp_path: Path) -> None:
    """--add-prefix, spelled as diagnose prints it, run through the CLI."""
    from nets import Wrapped

    net = Wrapped()
    with torch.no_grad():
        net.model.fc.bias.fill_(0.5)
    path = tmp_path / "bare.pth"
    with saved_on("cuda:1"):
        torch.save(net.model.state_dict(), path)
    report = diagnose_and_fix(path, [], net, model="Wrapped")
    assert report["fix_command"] == \
        "ckptool fix bare.pth --add-prefix model. --to cpu -o bare.fixed.pth"


def test_some_tags_mapped(tmp_path: Path) -> None:
    """--map, spelled as diagnose prints it: only the missing tag moves."""
    path = tmp_path / "mixed.pth"
    tags = iter(["cpu"] * 3 + ["cuda:3"] * 20)
    original = torch.serialization.location_tag
    torch.serialization.location_tag = lambda s: next(tags)  # type: ignore[assignment]
    try:
        torch.save(trained(8).state_dict(), path)
    finally:
        torch.serialization.location_tag = original
    proc = ckptool("diagnose", "--json", "--device-count", "1", path.name, cwd=tmp_path)
    report = json.loads(proc.stdout)
    assert report["fix_command"] == \
        "ckptool fix mixed.pth --map cuda:3=cuda:0 -o mixed.fixed.pth"
    assert ckptool(*shlex.split(report["fix_command"])[1:], cwd=tmp_path).returncode == 0
    seen: list[str] = []
    torch.load(tmp_path / "mixed.fixed.pth",
               map_location=lambda s, loc: seen.append(loc) or s)  # type: ignore[func-returns-value]
    assert seen == ["cpu"] * 3 + ["cuda:0"] * 6
