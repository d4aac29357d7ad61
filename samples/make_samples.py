"""Regenerate the bundled sample checkpoints: ``python samples/make_samples.py``.

Each sample is a small, realistic case ckptool is built for. CUDA-tagged
files are written on a CPU-only machine by swapping torch's location tag
function while saving (the tag is only a string in the pickle).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.serialization
from safetensors.torch import save_file
from torch import nn

HERE = Path(__file__).resolve().parent


class TinyNet(nn.Module):
    """Conv, batch norm and a linear head: parameters and buffers."""

    def __init__(self, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(self.conv(x)).mean((2, 3)))


class TinyNetV2(TinyNet):
    """TinyNet fine-tuned into a new version: a 12-class head, batch norm
    without running statistics, and a learnable temperature on the logits."""

    def __init__(self) -> None:
        super().__init__(classes=12)
        self.bn = nn.BatchNorm2d(8, track_running_stats=False)
        self.temperature = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) / self.temperature


@contextlib.contextmanager
def saved_on(tag: str) -> Iterator[None]:
    """Make torch.save record ``tag`` as every storage's location."""
    original = torch.serialization.location_tag
    torch.serialization.location_tag = lambda storage: tag  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.serialization.location_tag = original


def attribute_dict_class() -> type:
    """A stand-in for Lightning's AttributeDict that pickles under its real name."""
    name = "pytorch_lightning.utilities.parsing"
    parts = name.split(".")
    for i in range(1, len(parts) + 1):  # pickle imports the module to check the name
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    cls = type("AttributeDict", (dict,), {"__module__": name})
    sys.modules[name].AttributeDict = cls  # type: ignore[attr-defined]
    return cls


class RunsCode:
    """Pickles as a call to os.system: what a hostile checkpoint carries.

    The command only prints a line; ckptool reports the call without running it.
    """

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, ("echo 'ckptool sample: torch.load just ran a shell command'",))


def main() -> None:
    torch.manual_seed(0)
    net = TinyNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, 3, 8, 8)).sum().backward()
    opt.step()

    # nn.DataParallel on a 4-GPU box: "module." keys, every storage on cuda:2
    dp_state = {f"module.{k}": v for k, v in net.state_dict().items()}
    with saved_on("cuda:2"):
        torch.save({
            "epoch": 12,
            "state_dict": dp_state,
            "optimizer": opt.state_dict(),
            "args": argparse.Namespace(arch="tinynet", lr=0.1, batch_size=64),
        }, HERE / "dataparallel_cuda2.pth")

    # a Lightning checkpoint: weights under state_dict with the "model." prefix
    hparams = attribute_dict_class()(width=8, classes=10, lr=0.1)
    torch.save({
        "epoch": 3, "global_step": 1200, "pytorch-lightning_version": "2.4.0",
        "state_dict": {f"model.{k}": v for k, v in net.state_dict().items()},
        "loops": {}, "callbacks": {}, "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [], "hparams_name": "kwargs", "hyper_parameters": hparams,
    }, HERE / "lightning.ckpt")

    # safetensors: header-only reading
    save_file({k: v.contiguous() for k, v in net.state_dict().items()},
              str(HERE / "tinynet.safetensors"), metadata={"format": "pt", "arch": "tinynet"})

    # pre-1.6 legacy format, torch.compile over DDP keys, saved on cuda:0
    compiled = {f"_orig_mod.module.{k}": v for k, v in net.state_dict().items()}
    with saved_on("cuda:0"):
        torch.save(compiled, HERE / "legacy_compiled_ddp.pth",
                   _use_new_zipfile_serialization=False)

    # a TorchScript archive
    torch.jit.script(net.eval()).save(str(HERE / "tinynet_script.pt"))

    # a whole pickled nn.Module in half precision, saved on cuda:1
    with saved_on("cuda:1"):
        torch.save(TinyNet().half(), HERE / "whole_model_cuda1.pth")
    # a checkpoint that runs a shell command on torch.load(weights_only=False)
    torch.save({"state_dict": net.state_dict(), "callback": RunsCode()},
               HERE / "hostile_runs_code.pth")
    # version 2 of the net, fine-tuned from it one step, saved from torch.compile
    # ("_orig_mod." keys) under "model": what `ckptool diff` compares it with
    v2 = TinyNetV2()
    with torch.no_grad():
        for name in ("conv.weight", "conv.bias", "bn.weight", "bn.bias"):
            v2.get_parameter(name).copy_(net.get_parameter(name))
    nn.functional.cross_entropy(v2(torch.randn(4, 3, 8, 8)), torch.arange(4)).backward()
    torch.optim.SGD(v2.parameters(), lr=0.01).step()
    torch.save({"model": {f"_orig_mod.{k}": v for k, v in v2.state_dict().items()},
                "step": 1300}, HERE / "finetuned_v2.pth")
    dcp_sample(net, opt)
    for path in sorted(HERE.iterdir()):
        if path.suffix != ".py":
            print(f"{path.name:28} {path.stat().st_size:>8} bytes")


def dcp_sample(net: nn.Module, opt: torch.optim.Optimizer) -> None:
    """A torch.distributed.checkpoint directory, as dcp.save writes it in one
    process: the net and its optimizer, with the epoch, in .metadata plus
    one __0_0.distcp."""
    import os
    import shutil
    import warnings

    import torch.distributed.checkpoint as dcp

    shutil.rmtree(HERE / "dcp_tinynet", ignore_errors=True)
    cwd = os.getcwd()
    os.chdir(HERE)  # .metadata records the path it was saved to: keep it relative
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no process group: one process saves it all
            dcp.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": 12},
                     checkpoint_id="dcp_tinynet")
    finally:
        os.chdir(cwd)


if __name__ == "__main__":
    main()
