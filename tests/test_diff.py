"""``ckptool diff``: each kind of difference, prefix matching, NaN handling,
--no-values, --all, the JSON schema and the exit codes (stdout and stderr
checked apart)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import saved_on

import ckptool
from ckptool.check.diff import DiffReport, diff_checkpoints
from ckptool.check.tensor_compare import compare_values

CliRun = Callable[..., tuple[int, str, str]]


def base_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"conv.weight": torch.randn(4, 3, generator=g), "conv.bias": torch.zeros(3),
            "bn.num_batches_tracked": torch.tensor(5), "head.weight": torch.randn(2, generator=g),
            "mask": torch.tensor([True, False]), "gone": torch.ones(1)}


def save(path: Path, state: dict[str, object], prefix: str = "", tag: str | None = None) -> Path:
    sd = {f"{prefix}{k}": v for k, v in state.items()}
    if tag:
        with saved_on(tag):
            torch.save({"state_dict": sd, "epoch": 1}, path)
    else:
        torch.save({"state_dict": sd, "epoch": 1}, path)
    return path


def diff(a: Path, b: Path, **kw: bool) -> DiffReport:
    return diff_checkpoints(ckptool.open(a), ckptool.open(b), **kw)


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    """A plain state dict and a DataParallel one with one change of each kind."""
    a = base_state()
    b = {k: v.clone() for k, v in a.items() if k != "gone"}
    b["conv.weight"][1, 2] += 1e-3  # values
    b["conv.bias"] = torch.zeros(4)  # shape
    b["head.weight"] = b["head.weight"].half()  # dtype (and values: fp16 rounding)
    b["bn.num_batches_tracked"] = torch.tensor(7)  # integer values
    b["mask"] = torch.tensor([True, True])  # bool values
    b["new"] = torch.ones(2)
    return save(tmp_path / "a.pth", a), save(tmp_path / "b.pth", b, prefix="module.")


def test_every_kind_of_difference(pair: tuple[Path, Path]) -> None:
    r = diff(*pair)
    assert (r.a.prefix, r.b.prefix) == ("", "module.")
    assert [n for n, _ in r.only_in_a] == ["gone"]
    assert [(n, t.key) for n, t in r.only_in_b] == [("new", "state_dict/module.new")]
    changed = {c.name: c for c in r.changed}
    assert {n: c.changes for n, c in changed.items()} == {
        "conv.weight": ("values",), "conv.bias": ("shape",),
        "bn.num_batches_tracked": ("values",), "head.weight": ("dtype", "values"),
        "mask": ("values",),
    }
    w = changed["conv.weight"].values
    assert w is not None and w.num_different == 1 and w.numel == 12
    assert w.max_abs_diff == pytest.approx(1e-3, rel=1e-3)
    ints = changed["bn.num_batches_tracked"].values
    assert ints is not None and (ints.num_different, ints.max_abs_diff) == (1, None)
    mask = changed["mask"].values
    assert mask is not None and (mask.num_different, mask.numel) == (1, 2)
    assert changed["conv.bias"].values is None  # shapes differ: values not compared
    head = changed["head.weight"].values
    assert head is not None and 0 < (head.max_abs_diff or 0) < 1e-2
    assert r.num_matched == 5 and r.num_identical == 0
    assert r.has_differences and r.exit_code == 1


def test_prefixes_are_matched_and_equal_files_have_no_differences(tmp_path: Path) -> None:
    state = base_state()
    a = save(tmp_path / "a.pth", state, prefix="_orig_mod.module.")
    b = save(tmp_path / "b.pth", {k: v.clone() for k, v in state.items()}, prefix="model.")
    r = diff(a, b)
    assert (r.a.prefix, r.b.prefix) == ("_orig_mod.module.", "model.")
    assert (r.num_matched, r.num_identical, r.changed, r.only_in_a, r.only_in_b) == (
        6, 6, [], [], [])
    assert r.exit_code == 0


def test_prefix_kept_when_taking_it_off_matches_fewer(tmp_path: Path) -> None:
    # A's only top module happens to be called "model": not a wrapper here
    a = save(tmp_path / "a.pth", {"model.w": torch.ones(1), "model.b": torch.ones(1)})
    b = save(tmp_path / "b.pth", {"model.w": torch.ones(1), "model.b": torch.ones(1),
                                  "head.w": torch.ones(1)})
    r = diff(a, b)
    assert r.a.prefix == "" and r.num_matched == 2
    assert [n for n, _ in r.only_in_b] == ["head.w"]


def test_location_change_with_equal_values(tmp_path: Path) -> None:
    state = base_state()
    r = diff(save(tmp_path / "a.pth", state, tag="cuda:2"), save(tmp_path / "b.pth", state))
    assert {c.changes for c in r.changed} == {("location",)}
    assert all(c.values is not None and c.values.status == "equal" for c in r.changed)
    assert (r.changed[0].a.location, r.changed[0].b.location) == ("cuda:2", "cpu")


def test_nan_equals_nan_and_infinities(tmp_path: Path) -> None:
    nan, inf = float("nan"), float("inf")
    a = save(tmp_path / "a.pth", {"x": torch.tensor([nan, 1.0, inf]), "y": torch.tensor([1.0]),
                                  "z": torch.tensor([nan, 2.0, nan])})
    b = save(tmp_path / "b.pth", {"x": torch.tensor([nan, 1.0, inf]), "y": torch.tensor([inf]),
                                  "z": torch.tensor([5.0, 2.5, nan])})
    r = diff(a, b)
    assert r.num_identical == 1  # x: NaN == NaN, inf == inf
    by_name = {c.name: c.values for c in r.changed}
    assert by_name["y"] is not None and by_name["y"].max_abs_diff == inf
    z = by_name["z"]
    assert z is not None and (z.num_different, z.nan_mismatch, z.max_abs_diff) == (2, 1, 0.5)


def test_samples_diff_as_the_readme_shows() -> None:
    samples = Path(__file__).resolve().parent.parent / "samples"
    dp, lightning = samples / "dataparallel_cuda2.pth", samples / "lightning.ckpt"
    r = diff(dp, lightning)
    assert (r.a.prefix, r.b.prefix, r.num_matched) == ("module.", "model.", 9)
    assert {c.changes for c in r.changed} == {("location",)}
    # safetensors records no device: an unrecorded location is not a change
    r = diff(lightning, samples / "tinynet.safetensors")
    assert r.num_identical == 9 and r.exit_code == 0
    r = diff(lightning, samples / "finetuned_v2.pth")
    assert (r.b.state_dict, r.b.prefix) == ("model", "_orig_mod.")
    assert [n for n, _ in r.only_in_b] == ["temperature"] and len(r.only_in_a) == 3


def test_compare_values_dtypes_and_chunks() -> None:
    x = torch.randn(1000, dtype=torch.float64)
    y = x.clone()
    y[::7] += 0.25
    whole = compare_values(x, y, "float64", "float64")
    chunked = compare_values(x, y, "float64", "float64", chunk=13)
    assert whole == chunked and whole.num_different == 143
    c = torch.tensor([1 + 1j, 2 + 2j], dtype=torch.complex64)
    cv = compare_values(c, c + torch.tensor([0, 3j]), "complex64", "complex64")
    assert (cv.num_different, cv.max_abs_diff) == (1, 3.0)
    b = torch.tensor([1.0, 2.0]).bfloat16()
    assert compare_values(b, b.half(), "bfloat16", "float16").status == "equal"
    f8 = torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn)
    assert compare_values(f8, torch.tensor([1.0, 2.5]), "float8_e4m3fn", "float32").max_abs_diff \
        == 0.5
    i = torch.tensor([1, 2, 3], dtype=torch.int32)
    assert compare_values(i, i.long(), "int32", "int64").status == "equal"
    assert compare_values(i, torch.tensor([1, 2, 4]), "int32", "int64").num_different == 1


def test_no_values_reads_metadata_only(pair: tuple[Path, Path]) -> None:
    r = diff(*pair, compare_values=False)
    assert not r.values_compared
    assert {c.name: c.changes for c in r.changed} == {
        "conv.bias": ("shape",), "head.weight": ("dtype",)}
    assert all(c.values is None for c in r.changed) and r.num_identical == 3


def test_all_compares_every_tensor_by_key(tmp_path: Path) -> None:
    state = base_state()
    a = tmp_path / "a.pth"
    b = tmp_path / "b.pth"
    torch.save({"model": state, "optimizer": {"m": torch.zeros(3)}}, a)
    torch.save({"model": state, "optimizer": {"m": torch.ones(3)}}, b)
    assert diff(a, b).exit_code == 0  # the state dicts match
    r = diff(a, b, all_tensors=True)
    assert r.mode == "all" and r.a.state_dict is None
    assert [c.name for c in r.changed] == ["optimizer/m"] and r.num_identical == 6


def test_tied_weights_and_unreadable_values(tmp_path: Path) -> None:
    w = torch.randn(3, 2)
    q = torch.quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.5, 0, torch.qint8)
    a = save(tmp_path / "a.pth", {"emb": w, "out": w, "q": q})  # one storage
    b = save(tmp_path / "b.pth", {"emb": w.clone(), "out": w.clone() + 1, "q": q})
    r = diff(a, b)
    assert [c.name for c in r.changed] == ["out"] and r.num_identical == 1
    assert [n for n, _ in r.not_compared] == ["q"] and "quantized" in r.not_compared[0][1]
    plain = tmp_path / "plain.pkl"  # protocol 2 spells a storage's bytes as text
    plain.write_bytes(pickle.dumps({"w": torch.ones(2)}, protocol=2))
    rp = diff(plain, plain)
    assert rp.not_compared and "protocols 0 to 2" in rp.not_compared[0][1]
    assert rp.exit_code == 0
    plain.write_bytes(pickle.dumps({"w": torch.ones(2)}))  # bytes as they are: read
    assert diff(plain, plain).num_identical == 1


# -- the command line --------------------------------------------------------

def test_cli_exit_codes_and_streams(run_cli: CliRun, pair: tuple[Path, Path],
                                    tmp_path: Path) -> None:
    a, b = map(str, pair)
    code, out, err = run_cli("diff", a, a)
    assert (code, err) == (0, "") and "no differences" in out
    code, out, err = run_cli("diff", a, b)
    assert (code, err) == (1, "")
    assert "after taking off 'module.' (B)" in out
    assert "differences: 5 changed · 0 identical · 1 only in A · 1 only in B" in out
    assert "conv.bias" in out and "only in B" in out and "1/12 differ" in out
    code, out, err = run_cli("diff", a, str(tmp_path / "missing.pth"))
    assert (code, out) == (3, "")
    assert err.startswith("ckptool: error: ") and "no such file" in err and "hint:" in err
    empty = tmp_path / "no_weights.pth"
    torch.save({"epoch": 3}, empty)
    code, out, err = run_cli("diff", a, str(empty))
    assert (code, out) == (2, "") and "--all" in err


def test_cli_json_schema(run_cli: CliRun, pair: tuple[Path, Path]) -> None:
    code, out, err = run_cli("diff", "--json", *map(str, pair))
    assert (code, err) == (1, "")
    data = json.loads(out)
    assert list(data)[:3] == ["schema_version", "a", "b"] and data["schema_version"] == 1
    assert data["a"] == {"path": str(pair[0]), "format": "torch-zip",
                         "state_dict": "state_dict", "prefix": "", "directory": False,
                         "entry": None}
    assert data["b"]["prefix"] == "module."
    assert (data["mode"], data["values_compared"], data["has_differences"]) == (
        "state_dict", True, True)
    assert (data["num_matched"], data["num_identical"], data["num_changed"],
            data["num_only_in_a"], data["num_only_in_b"]) == (5, 0, 5, 1, 1)
    assert data["only_in_a"][0] == {"name": "gone", "key": "state_dict/gone", "shape": [1],
                                    "dtype": "float32", "location": "cpu", "layout": "strided"}
    change = next(c for c in data["changed"] if c["name"] == "conv.weight")
    assert change["changes"] == ["values"]
    assert change["a"]["key"] == "state_dict/conv.weight"
    assert change["b"]["key"] == "state_dict/module.conv.weight"
    assert set(change["values"]) == {"status", "numel", "num_different", "max_abs_diff",
                                     "nan_mismatch", "reason", "by_digest"}
    # one line per field and per list item, plus a closing line per non-empty list
    assert len(out.splitlines()) == 2 + len(data) + (1 + 1) + (1 + 1) + (5 + 1)


def test_cli_json_infinity_is_a_string(run_cli: CliRun, tmp_path: Path) -> None:
    a = save(tmp_path / "a.pth", {"y": torch.tensor([1.0])})
    b = save(tmp_path / "b.pth", {"y": torch.tensor([float("inf")])})
    code, out, _ = run_cli("diff", "--json", str(a), str(b))
    assert code == 1 and json.loads(out)["changed"][0]["values"]["max_abs_diff"] == "inf"


def test_cli_no_values_json_imports_neither_torch_nor_rich(pair: tuple[Path, Path]) -> None:
    code = ("import json, sys, io, contextlib\nfrom ckptool.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    rc = main(['diff', '--json', '--no-values', {str(pair[0])!r}, "
            f"{str(pair[1])!r}])\n"
            "print(rc, sorted(m for m in ('torch', 'rich') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)
    assert proc.stdout.strip() == "1 []"
