"""``ckptool.load`` against ``torch.load(weights_only=False)``, and
``ckptool.load_state_dict`` against models with each prefix and wrapper, in
every layout ckptool reads."""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import load_samples_module
from nets import DSTiny, Net, TiedLM, Wrapped

import ckptool
from ckptool.check.gpus import machine as gpus
from ckptool.check.loading import StateDictMismatch
from ckptool.read.materialize import LoadError
from ckptool.read.values import StandIn

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"
DS = ROOT / "tests" / "fixtures" / "deepspeed"
make_samples = load_samples_module()


@pytest.fixture
def sample_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The classes the samples pickle, importable as in their user's environment."""
    monkeypatch.setattr(sys.modules["__main__"], "TinyNet", make_samples.TinyNet, raising=False)
    make_samples.attribute_dict_class()


def same_tree(ours: Any, theirs: Any, where: str = "") -> None:
    """Equal trees: tensors by dtype, shape, stride, offset, values, class;
    stand-ins by name and state; everything else by value."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor), where
        assert type(ours) is type(theirs), where  # nn.Parameter where the file has one
        assert (ours.dtype, ours.shape, ours.stride(), ours.storage_offset()) == \
            (theirs.dtype, theirs.shape, theirs.stride(), theirs.storage_offset()), where
        assert ours.requires_grad == theirs.requires_grad, where
        assert torch.equal(ours.detach(), theirs.detach()), where
        return
    if isinstance(ours, StandIn):
        name = f"{type(theirs).__module__}.{type(theirs).__qualname__}"
        assert ours.qualname == name, where
        state = theirs.__dict__ if hasattr(theirs, "__dict__") else None
        if isinstance(ours.state, dict) and state is not None:
            for k, v in ours.state.items():
                same_tree(v, state[k], f"{where}.{k}")
        return
    if isinstance(theirs, dict):
        assert type(ours) is type(theirs) and list(ours) == list(theirs), where
        for k in theirs:
            same_tree(ours[k], theirs[k], f"{where}/{k}")
        return
    if isinstance(theirs, (list, tuple)):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            same_tree(a, b, f"{where}/{i}")
        return
    if isinstance(theirs, np.ndarray):
        assert isinstance(ours, np.ndarray), where  # same values and type (byte order aside)
        assert (ours.dtype.kind, ours.dtype.itemsize) == (theirs.dtype.kind,
                                                          theirs.dtype.itemsize), where
        assert np.array_equal(ours, theirs), where
        return
    if isinstance(theirs, argparse.Namespace):
        assert isinstance(ours, argparse.Namespace), where
        same_tree(vars(ours), vars(theirs), where)
        return
    assert ours == theirs, where


def sharing(tree: Any) -> set[frozenset[str]]:
    """Groups of paths whose tensors share one storage."""
    found: dict[int, set[str]] = collections.defaultdict(set)

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            found[obj.untyped_storage().data_ptr()].add(path)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}/{i}")
    walk(tree, "")
    return {frozenset(g) for g in found.values() if len(g) > 1}


TORCH_FILES = ["dataparallel_cuda2.pth", "finetuned_v2.pth", "legacy_compiled_ddp.pth",
               "lightning.ckpt", "whole_model_cuda1.pth"]


@pytest.mark.usefixtures("sample_classes")
@pytest.mark.parametrize("name", TORCH_FILES)
@pytest.mark.parametrize("mmap", [True, False])
def test_load_is_torch_load(name: str, mmap: bool) -> None:
    ours = ckptool.load(SAMPLES / name, map_location="cpu", mmap=mmap)
    theirs = torch.load(SAMPLES / name, map_location="cpu", weights_only=False)
    if isinstance(theirs, torch.nn.Module):  # a pickled module: its state
        assert isinstance(ours, StandIn) and ours.qualname.endswith("TinyNet")
        same_tree(ours.state["_parameters"], theirs.__dict__["_parameters"])
        same_tree(ours.state["_buffers"], theirs.__dict__["_buffers"])
        return
    same_tree(ours, theirs)
    assert sharing(ours) == sharing(theirs)


def test_views_ties_parameters_and_values(tmp_path: Path) -> None:
    base = torch.arange(24.0).reshape(4, 6)
    emb = torch.nn.Parameter(torch.randn(5, 3))
    obj = {
        "base": base, "t": base.t(), "row": base[1], "cols": base[:, 2:4],
        "tied": {"a": emb, "b": emb}, "half": torch.ones(3, dtype=torch.bfloat16),
        "grad": torch.ones(2, requires_grad=True), "empty": torch.empty(0, 4),
        "np": np.arange(6, dtype=">i4").reshape(2, 3), "fortran": np.asfortranarray(
            np.ones((2, 3))), "ns": argparse.Namespace(lr=0.1, sizes=[1, 2]),
        "sd": torch.nn.Linear(2, 3).state_dict(), "epoch": 7,
    }
    torch.save(obj, tmp_path / "x.pt")
    ours = ckptool.load(tmp_path / "x.pt")
    theirs = torch.load(tmp_path / "x.pt", weights_only=False)
    same_tree(ours, theirs)
    assert sharing(ours) == sharing(theirs)
    assert ours["tied"]["a"] is ours["tied"]["b"]
    assert ours["sd"]._metadata == theirs["sd"]._metadata


def test_map_location(tmp_path: Path) -> None:
    path = SAMPLES / "dataparallel_cuda2.pth"
    with pytest.raises(LoadError) as info:  # saved on cuda:2; no GPU here
        ckptool.load(path)
    assert "cuda:2" in info.value.message and "map_location" in info.value.hint
    for where in ("cpu", torch.device("cpu"), {"cuda:2": "cpu"}):
        loaded = ckptool.load(path, map_location=where)
        assert loaded["state_dict"]["module.fc.weight"].device.type == "cpu"
    seen = []

    def keep(storage: torch.UntypedStorage, tag: str) -> torch.UntypedStorage:
        seen.append(tag)
        return storage

    ckptool.load(path, map_location=keep)
    assert set(seen) == {"cuda:2"}
    with pytest.raises(LoadError, match="not a device"):
        ckptool.load(path, map_location=3)


def test_hostile_file_refused_nothing_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    torch.save({"state_dict": {"w": torch.ones(2)}, "x": Payload()}, tmp_path / "bad.pt")
    with pytest.raises(LoadError) as info:
        ckptool.load(tmp_path / "bad.pt")
    assert "system" in info.value.message and not marker.exists()
    # its weights alone run nothing: load_state_dict takes them
    assert torch.equal(ckptool.load_state_dict(tmp_path / "bad.pt")["w"], torch.ones(2))
    assert not marker.exists()


def test_safetensors_and_directories() -> None:
    st = ckptool.load(SAMPLES / "tinynet.safetensors")
    assert isinstance(st["conv.weight"], torch.Tensor)
    ds = ckptool.load(SAMPLES / "deepspeed_zero3")
    ref = torch.load(DS / "z3_bf16.reference.pt", weights_only=True)
    for key, tensor in ref.items():
        assert torch.equal(ds[key], tensor) and ds[key].dtype == tensor.dtype
    assert ds["head.weight"] is ds["emb.weight"]


# -- load_state_dict --------------------------------------------------------

@pytest.mark.parametrize("name", ["dataparallel_cuda2.pth", "lightning.ckpt",
                                  "legacy_compiled_ddp.pth", "dcp_tinynet",
                                  "tinynet.safetensors", "whole_model_cuda1.pth"])
def test_load_state_dict_fits_the_model(name: str) -> None:
    model = make_samples.TinyNet()
    sd = ckptool.load_state_dict(SAMPLES / name, model)
    model.load_state_dict(sd, strict=True)
    assert all(v.device.type == "cpu" for v in sd.values())


def test_load_state_dict_of_deepspeed_and_ties(tmp_path: Path) -> None:
    model = DSTiny()
    sd = ckptool.load_state_dict(DS / "lightning_z3.ckpt", model, dtype="bf16")
    model.load_state_dict(sd, strict=True)
    assert sd["lin.weight"].dtype == torch.bfloat16 and sd["counts"].dtype == torch.int64
    # a tied weight the file keeps once (safetensors) is filled from its twin
    lm = TiedLM()
    from safetensors.torch import save_file
    save_file({"embed.weight": lm.embed.weight.detach().clone()}, tmp_path / "lm.safetensors")
    sd = ckptool.load_state_dict(tmp_path / "lm.safetensors", TiedLM())
    assert sd["head.weight"] is sd["embed.weight"]
    TiedLM().load_state_dict(sd, strict=True)


def test_load_state_dict_adds_a_prefix(tmp_path: Path) -> None:
    torch.save(Net(8).state_dict(), tmp_path / "net.pt")
    wrapped = Wrapped(8)
    sd = ckptool.load_state_dict(tmp_path / "net.pt", wrapped)
    assert all(k.startswith("model.") for k in sd)
    wrapped.load_state_dict(sd, strict=True)


def test_load_state_dict_refuses_what_does_not_fit() -> None:
    with pytest.raises(StateDictMismatch) as info:
        ckptool.load_state_dict(SAMPLES / "finetuned_v2.pth", make_samples.TinyNet())
    codes = {f.code for f in info.value.findings}
    assert {"missing-keys", "unexpected-keys", "shape-mismatch"} <= codes
    assert "shape-mismatch" in info.value.message
    # strict=False: only the keys the model has, as load_state_dict(strict=False) takes them
    model = make_samples.TinyNet()
    with pytest.warns(UserWarning, match="left out"):  # what it left out, said
        sd = ckptool.load_state_dict(SAMPLES / "finetuned_v2.pth", model, strict=False)
    assert set(sd) <= set(model.state_dict())
    with pytest.raises(ckptool.CkptoolError):
        ckptool.load_state_dict(SAMPLES / "lightning.ckpt", torch.ones(2))
    with pytest.raises(ckptool.CkptoolError):
        ckptool.load_state_dict(SAMPLES / "lightning.ckpt", dtype="float99")


# -- every tensor reached ----------------------------------------------------

class Metric:
    """torchmetrics keeps its states as plain attributes, not buffers."""

    def __init__(self) -> None:
        self.total = torch.zeros(3)
        self._defaults = {"total": torch.zeros(3)}


class WithAttributes(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        self.scale = torch.ones(4)  # an attribute, not a parameter or buffer
        self.register_buffer("scratch", torch.zeros(2), persistent=False)
        self.metric = Metric()


def test_every_storage_is_viewed_by_a_listed_tensor(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules["__main__"], "Metric", Metric, raising=False)
    monkeypatch.setattr(sys.modules["__main__"], "WithAttributes", WithAttributes, raising=False)
    Metric.__module__ = WithAttributes.__module__ = "__main__"
    model = WithAttributes()
    torch.save({"state_dict": model.state_dict(), "model": model,
                "hyper_parameters": {"metric": Metric()}}, tmp_path / "m.pt")
    ckpt = ckptool.open(tmp_path / "m.pt")
    keys = {t.key for t in ckpt.tensors}
    assert {"model/scale", "model/scratch", "model/metric/total",
            "model/metric/_defaults/total", "hyper_parameters/metric/total"} <= keys
    assert all(s.tensors for s in ckpt.storages.values()), "a storage no listed tensor views"
    assert not ckpt.warnings
    assert ckpt.main_state_dict is not None and ckpt.main_state_dict.path == "state_dict"
    # load builds them all; fix writes them all back
    loaded = ckptool.load(tmp_path / "m.pt")
    assert torch.equal(loaded["model"].state["scale"], torch.ones(4))
    result = ckptool.fix(str(tmp_path / "m.pt"), ckptool.FixOptions(dtype="bfloat16"),
                         str(tmp_path / "f.pt"))
    fixed = ckptool.open(tmp_path / "f.pt")
    assert len(fixed.storages) == len(ckpt.storages) and result.output


def test_a_storage_no_object_names_is_reported(tmp_path: Path) -> None:
    import zipfile

    torch.save({"w": torch.ones(2)}, tmp_path / "x.pt")
    with zipfile.ZipFile(tmp_path / "x.pt", "a") as z:
        z.writestr("x/data/99", b"\0" * 16)
    ckpt = ckptool.open(tmp_path / "x.pt")
    assert any("x/data/99" in w and "never reads" in w for w in ckpt.warnings)
    d = ckptool.diagnose(ckpt, gpus.assumed(0))
    found = [f for f in d.findings if f.code == "unreached-storage"]
    assert found and found[0].fix is None  # harmless: torch never reads it
    assert torch.equal(ckptool.load(tmp_path / "x.pt")["w"], torch.ones(2))


def test_writing_to_a_loaded_tensor_never_touches_the_file(tmp_path: Path) -> None:
    import hashlib

    path = tmp_path / "x.pth"
    torch.save({"w": torch.zeros(1000)}, path)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    loaded = ckptool.load(path)  # mmapped privately: copy on write
    loaded["w"].add_(5)
    assert torch.equal(loaded["w"], torch.full((1000,), 5.0))
    del loaded
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    assert torch.equal(ckptool.load(path)["w"], torch.zeros(1000))


@pytest.mark.parametrize("path", [SAMPLES / "dcp_tinynet",
                                  ROOT / "tests" / "fixtures" / "multifile" / "dcp_4ranks"])
def test_load_of_dcp_is_dcp_to_torch_save(path: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, tmp_path / "whole.pt")
    theirs = torch.load(tmp_path / "whole.pt", weights_only=True)
    same_tree(ckptool.load(path), theirs)


def test_reading_leaves_the_cycle_collector_as_it_was(tmp_path: Path) -> None:
    import gc

    assert gc.isenabled()
    ckptool.open(SAMPLES / "lightning.ckpt")
    assert gc.isenabled()
    (tmp_path / "bad.pt").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(ckptool.CkptoolError):
        ckptool.open(tmp_path / "bad.pt")
    assert gc.isenabled()
    gc.disable()
    try:
        ckptool.load(SAMPLES / "lightning.ckpt", map_location="cpu")
        assert not gc.isenabled()
    finally:
        gc.enable()
