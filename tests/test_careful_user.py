"""What a careful new user found, each with the recipe that found it: the
README's promises hold on files made the way users make them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptool
from ckptool.check import modelspec
from ckptool.check.gpus import machine as gpus

RunCli = Callable[..., tuple[int, str, str]]

MODEL = textwrap.dedent("""
    import torch

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.bn = torch.nn.BatchNorm1d(2)
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
            self.register_buffer("cache", torch.zeros(2), persistent=False)
            self.blocks[0].register_buffer("scratch", torch.zeros(1), persistent=False)
""")


@pytest.fixture
def whole(tmp_path: Path) -> dict[str, Path]:
    """A whole pickled module with non-persistent buffers, alone and in a dict."""
    (tmp_path / "m.py").write_text(MODEL)
    code = (f"import sys, torch; sys.path.insert(0, {str(tmp_path)!r}); import m\n"
            f"torch.save(m.M(), {str(tmp_path / 'whole.pth')!r})\n"
            f"torch.save({{'model': m.M(), 'epoch': 1}}, {str(tmp_path / 'in_dict.pth')!r})\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    return {"model": tmp_path / "m.py", "whole": tmp_path / "whole.pth",
            "in_dict": tmp_path / "in_dict.pth"}


def load_model(path: Path) -> torch.nn.Module:
    sys.path.insert(0, str(path.parent))
    try:
        import m  # type: ignore[import-not-found]

        return m.M()  # type: ignore[no-any-return]
    finally:
        sys.path.remove(str(path.parent))
        sys.modules.pop("m", None)


@pytest.mark.parametrize("which", ["whole", "in_dict"])
def test_a_pickled_module_is_its_state_dict(which: str, whole: dict[str, Path],
                                            tmp_path: Path, run_cli: RunCli) -> None:
    """inspect, diagnose, fix and convert agree with module.state_dict():
    persistent buffers only, _metadata included; the printed fix loads strictly."""
    path = whole[which]
    net = load_model(whole["model"])
    want = list(net.state_dict())
    ckpt = ckptool.open(path)
    assert ckpt.main_state_dict is not None and list(ckpt.main_state_dict.keys) == want
    keys = modelspec.build_model(f"{whole['model']}:M", {})
    d = ckptool.diagnose(ckpt, gpus.assumed(0), keys)
    assert d.keys is not None and d.keys.expected == d.keys.before == len(want)
    finding = next(f for f in d.findings if f.code == "pickled-module")
    index = "['model']" if which == "in_dict" else ""
    assert f"torch.load(path, weights_only=False){index}.state_dict()" in (finding.snippet or "")
    # the command as printed, run where diagnose ran
    assert d.fix_command is not None
    args = d.fix_command.split()[1:]
    code, _, err = run_cli(*args[:1], str(path.parent / args[1]), *args[2:-1],
                           str(path.parent / args[-1]))
    assert code == 0, err
    sd = torch.load(path.parent / d.fix_output)  # type: ignore[operator]
    assert list(sd) == want
    assert sd._metadata == net.state_dict()._metadata
    net.load_state_dict(sd, strict=True)
    result = ckptool.convert(str(path), str(tmp_path / f"{which}.safetensors"))
    assert result.tensors == len(want)


# -- sparse tensors ------------------------------------------------------------------

@pytest.fixture(params=["zip", "legacy"])
def sparse_file(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    sd = {"sp": torch.randn(3, 3, generator=gen).to_sparse(),
          "csr": torch.randn(4, 3, generator=gen).to_sparse_csr(), "w": torch.ones(2)}
    path = tmp_path / "sparse.pth"
    torch.save(sd, path, _use_new_zipfile_serialization=request.param == "zip")
    return path, sd


def test_sparse_tensors_are_one_tensor_each(sparse_file: tuple[Path, dict[str, Any]],
                                            run_cli: RunCli) -> None:
    path, _ = sparse_file
    ckpt = ckptool.open(path)
    assert [t.key for t in ckpt.tensors] == ["sp", "csr", "w"]
    sp = ckpt.tensors[0]
    assert (sp.layout, sp.shape, sp.nnz, sp.dtype) == ("sparse_coo", (3, 3), 9, "float32")
    assert ckpt.main_state_dict is not None and ckpt.main_state_dict.num_tensors == 3
    code, out, _ = run_cli("inspect", str(path))
    assert code == 0 and "3x3 coo, 9 nnz" in out and "4x3 csr, 12 nnz" in out
    data = json.loads(run_cli("inspect", "--json", str(path))[1])
    assert data["tensors"][0]["nnz"] == 9 and len(data["tensors"][0]["parts"]) == 2
    assert all(s["tensors"] for s in data["storages"])  # every storage viewed by a part


@pytest.mark.parametrize("flags", [["--to", "cpu"], ["--to", "cuda:0"], ["--dtype", "fp16"],
                                   ["--add-prefix", "m."]])
def test_sparse_tensors_are_rewritten(flags: list[str], sparse_file: tuple[Path, dict[str, Any]],
                                      tmp_path: Path, run_cli: RunCli) -> None:
    path, sd = sparse_file
    out = tmp_path / "out.pth"
    code, _, err = run_cli("fix", str(path), *flags, "-o", str(out))
    assert code == 0, err
    got = torch.load(out, map_location="cpu")
    prefix = "m." if "--add-prefix" in flags else ""
    for key, want in sd.items():
        t = got[prefix + key]
        assert t.layout == want.layout
        dense = t.to_dense().float() if t.layout != torch.strided else t.float()
        expected = want.to_dense() if want.layout != torch.strided else want
        assert torch.allclose(dense, expected, atol=1e-2)
    if prefix:
        return  # diff pairs names, and "m." is no wrapper it takes off
    code, out_text, _ = run_cli("diff", str(path), str(out), "--json")
    report = json.loads(out_text)
    assert report["num_only_in_a"] == report["num_only_in_b"] == 0
    if flags == ["--to", "cpu"]:
        assert code == 0 and report["num_identical"] == 3


def test_safetensors_says_it_holds_no_sparse_tensor(sparse_file: tuple[Path, dict[str, Any]],
                                                    tmp_path: Path, run_cli: RunCli) -> None:
    path, _ = sparse_file
    code, out, err = run_cli("convert", str(path), str(tmp_path / "o.safetensors"))
    assert code == 0, err
    assert "sp (a sparse_coo tensor: safetensors holds dense tensors only" in out
    assert "csr (a sparse_csr tensor" in out


def test_sparse_statistics_are_of_the_stored_values(
        sparse_file: tuple[Path, dict[str, Any]]) -> None:
    from ckptool.check.stats import tensor_stats
    from ckptool.read.tensor_data import TensorData

    path, sd = sparse_file
    ckpt = ckptool.open(path)
    with TensorData(ckpt) as data:
        stats = tensor_stats(data, ckpt.tensors[0])
    assert stats.numel == 9 and stats.note and "stored values" in stats.note
    assert stats.max == pytest.approx(float(sd["sp"].values().max()))


class Tied(torch.nn.Module):
    """A language-model head tied to its embedding, a norm with running
    statistics, and a float buffer that no name tells from a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.ones(3))


@pytest.mark.parametrize("whole_module", [False, True])
def test_parameters_are_counted_as_model_parameters_counts_them(
        whole_module: bool, tmp_path: Path, run_cli: RunCli) -> None:
    net = Tied()
    path = tmp_path / "tied.pth"
    torch.save(net if whole_module else {"model": net.state_dict()}, path)
    code, out, _ = run_cli("inspect", "--json", str(path))
    assert code == 0
    sd = json.loads(out)["main_state_dict"]
    params = sum(p.numel() for p in net.parameters())  # the tie once: 40 + 4 + 4
    buffers = sum(b.numel() for b in net.buffers())  # 4 + 4 + 1 + 3
    assert (params, buffers) == (48, 12)
    # the state dict alone cannot tell 'scale' from a weight; the module can
    unknown = 0 if whole_module else 3
    assert (sd["num_parameters"], sd["num_buffers"]) == (params + unknown, buffers - unknown)
    assert run_cli("inspect", str(path))[0] == 0
    out = run_cli("inspect", str(path))[1]
    assert f"parameters  {params + unknown} (+{buffers - unknown} in buffers)" in out
