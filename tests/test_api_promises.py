"""The Python API keeps its word (issue 26, item 5): ``load_state_dict(...,
strict=False)`` gives what the model's ``load_state_dict(strict=False)``
takes, saying what it left out; a ``map_location`` this machine cannot use
is a ``CkptoolError`` with the way out, in every layout, before torch fails."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import load_samples_module, saved_on

import ckptool
from ckptool.check.loading import StateDictMismatchWarning
from ckptool.read.placement import LoadError

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"
MULTI = ROOT / "tests" / "fixtures" / "multifile"
make_samples = load_samples_module()


# -- strict=False -------------------------------------------------------------

def test_strict_false_leaves_out_what_the_model_cannot_take() -> None:
    """finetuned_v2 has fc with 12 classes, TinyNet 10: those keys are left
    out (and said), so the model's own strict=False load takes the result."""
    net = make_samples.TinyNet()
    with pytest.warns(StateDictMismatchWarning) as caught:
        sd = ckptool.load_state_dict(SAMPLES / "finetuned_v2.pth", net, strict=False)
    assert "fc.weight" not in sd and "fc.bias" not in sd and "temperature" not in sd
    result = net.load_state_dict(sd, strict=False)  # no size mismatch
    assert {"fc.weight", "fc.bias"} <= set(result.missing_keys) and not result.unexpected_keys
    assert torch.equal(net.conv.weight, sd["conv.weight"])
    warning = caught[0].message
    assert isinstance(warning, StateDictMismatchWarning)
    text = str(warning)
    assert "2 shaped differently (fc.weight, fc.bias)" in text
    assert "1 the model does not have (temperature)" in text
    assert {"shape-mismatch", "unexpected-keys"} <= {f.code for f in warning.findings}


def test_strict_false_says_nothing_when_all_fits() -> None:
    net = make_samples.TinyNet()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sd = ckptool.load_state_dict(SAMPLES / "dataparallel_cuda2.pth", net, strict=False)
    net.load_state_dict(sd, strict=True)


# -- map_location this machine cannot use --------------------------------------

@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One checkpoint of each layout, as the real writers make them."""
    hub = pytest.importorskip("huggingface_hub")
    root = tmp_path_factory.mktemp("layouts")
    sd = make_samples.TinyNet().state_dict()
    for name in ("hf_bin", "hf_st"):
        (root / name).mkdir()
    with saved_on("cuda:1"):  # HF .bin shards a GPU box wrote
        hub.save_torch_state_dict(sd, root / "hf_bin", max_shard_size="1KB",
                                  safe_serialization=False)
    hub.save_torch_state_dict(sd, root / "hf_st", max_shard_size="1KB")
    return {
        "torch zip": SAMPLES / "dataparallel_cuda2.pth",
        "torch legacy": SAMPLES / "legacy_compiled_ddp.pth",
        "safetensors": SAMPLES / "tinynet.safetensors",
        "hf bin shards": root / "hf_bin",
        "hf safetensors shards": root / "hf_st",
        "dcp": SAMPLES / "dcp_tinynet",
        "deepspeed": SAMPLES / "deepspeed_zero3",
        "per-rank": MULTI / "per_rank_dtensor" / "fsdp2_ws2",
        "hf storage writer": MULTI / "hf_storage" / "distributed",
    }


LAYOUTS = ["torch zip", "torch legacy", "safetensors", "hf bin shards", "hf safetensors shards",
           "dcp", "deepspeed", "per-rank", "hf storage writer"]
LOADERS: dict[str, Callable[..., Any]] = {"load": lambda p, ml: ckptool.load(p, map_location=ml),
                                          "load_state_dict": lambda p, ml: ckptool.load_state_dict(
                                              p, map_location=ml)}


@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_device_this_machine_lacks_is_a_ckptool_error(layouts: dict[str, Path], layout: str,
                                                        loader: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    path, load = layouts[layout], LOADERS[loader]
    for where in ("cuda:0", "cuda", torch.device("cuda:0"), {"cuda:2": "cuda:0", "cuda:1": "cuda:0",
                                                              "cpu": "cuda:0", "cuda:0": "cuda:1"}):
        with pytest.raises(LoadError) as info:
            load(path, where)
        assert "this machine has no CUDA device" in info.value.message, (where, info.value)
        assert info.value.hint == "pass map_location='cpu'"
    for where in ("mps", "cuda:x", "gpu", "cuda:-1"):
        with pytest.raises(LoadError) as info:
            load(path, where)
        assert f"map_location {where!r}" in info.value.message
        assert info.value.hint == "pass map_location='cpu'"
    # what works still works
    assert load(path, "cpu")


@pytest.mark.parametrize("layout", ["torch zip", "safetensors", "dcp"])
def test_a_function_that_fails_is_a_ckptool_error(layouts: dict[str, Path], layout: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A map_location function that asks torch for a GPU this machine lacks:
    torch's error, said as ckptool's, whatever the layout."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)

    def to_gpu(storage: Any, tag: str) -> Any:
        raise AssertionError("Torch not compiled with CUDA enabled")  # as storage.cuda(0) does

    for load in LOADERS.values():
        with pytest.raises(LoadError) as info:
            load(layouts[layout], to_gpu)
        assert info.value.message.startswith("map_location's function failed on a storage "
                                             "saved on ")
        assert "Torch not compiled with CUDA enabled" in info.value.message
        assert load(layouts[layout], lambda storage, tag: storage)  # one that works, works


@pytest.mark.parametrize("layout", ["torch zip", "hf bin shards", "dcp", "deepspeed"])
def test_an_index_past_the_count(layouts: dict[str, Path], layout: str,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine with one GPU: cuda:3 is past it, and the hint names cuda:0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for load in LOADERS.values():
        with pytest.raises(LoadError) as info:
            load(layouts[layout], "cuda:3")
        assert info.value.message == ("map_location 'cuda:3': this machine has 1 CUDA device "
                                      "(cuda:0)")
        assert info.value.hint == "pass map_location='cuda:0'"


def test_a_saved_device_this_machine_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(LoadError) as info:  # saved on cuda:2, two GPUs here
        ckptool.load(SAMPLES / "dataparallel_cuda2.pth")
    assert info.value.message == ("the checkpoint was saved on cuda:2: this machine has 2 CUDA "
                                  "devices (cuda:0, cuda:1)")
    assert info.value.hint == ("pass map_location='cpu', or map the tag: "
                               "map_location={'cuda:2': 'cuda:0'}")
