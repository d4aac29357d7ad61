"""``verify --values`` (``ckptool.check.verify.values``): NaN, Inf, all-zero
tensors and untied tensors of equal values, on what real writers make
(torch.save, safetensors, huggingface_hub, dcp.save, ``ckptool convert``,
DeepSpeed's and torch's distributed fixtures), each damage found and named,
ties never reported, nothing crashing."""

from __future__ import annotations

import math
import os
import shutil
import struct
import threading
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import huggingface_hub as hub
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import ckptool
from ckptool.check.verify import valuescan
from ckptool.check.verify.problems import Problem
from ckptool.check.verify.values import check_values, tie_classes
from ckptool.cli import main
from ckptool.read.layouts import embedded
from ckptool.read.tensor_source import TensorValues

FIXTURES = Path(__file__).resolve().parent / "fixtures"
DS, MULTI = FIXTURES / "deepspeed", FIXTURES / "multifile"


def verify(path: Path | str, jobs: int = 1) -> tuple[list[Problem], dict[str, Any]]:
    return check_values(ckptool.open(path), jobs)


def kinds(problems: list[Problem]) -> dict[tuple[str, str | None], Problem]:
    return {(p.kind, p.tensor): p for p in problems}


def dcp_save(sd: dict[str, torch.Tensor], path: Path) -> None:
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(path))


def poke(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 32, generator=g), "v": torch.randn(64, 32, generator=g),
            "u": torch.randn(300, generator=g)}


# -- NaN and Inf -------------------------------------------------------------
def test_nan_and_inf_found_named_counted_across_slices(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(valuescan, "SLICE", 1024)  # 8 KiB tensors read in 8 slices
    sd = weights()
    sd["w"].view(-1)[[5, 700, 2047]] = math.nan  # first, middle and last slice
    sd["v"].view(-1)[1500] = math.inf
    sd["v"].view(-1)[3] = -math.inf
    sd["v"].view(-1)[4] = -math.inf
    torch.save(sd, tmp_path / "m.pt")
    problems, summary = verify(tmp_path / "m.pt")
    assert summary["nan"] == {"w": 3} and summary["inf"] == {"v": 3}
    found = kinds(problems)
    assert found[("nan", "w")].message == "3 NaN of 2,048 float32 values"
    assert found[("inf", "v")].message == "3 Inf of 2,048 float32 values (1 +Inf, 2 -Inf)"
    assert {p.severity for p in problems} == {"error"} and found[("nan", "w")].file == "m.pt"
    assert summary["tensors_read"] == 3 and summary["bytes_read"] == (2 * 2048 + 300) * 4


def test_nan_and_inf_in_one_tensor_both_counted(tmp_path: Path) -> None:
    t = torch.ones(100)
    t[[1, 2]] = math.nan
    t[50] = math.inf
    torch.save({"t": t}, tmp_path / "m.pt")
    _, summary = verify(tmp_path / "m.pt")
    assert (summary["nan"], summary["inf"]) == ({"t": 2}, {"t": 1})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e5m2,
                                   torch.float8_e4m3fn, torch.float64])
def test_nan_in_half_and_float8_safetensors(tmp_path: Path, dtype: torch.dtype) -> None:
    t = torch.randn(40, 8).to(dtype)
    t.view(-1)[17] = math.nan
    save_file({"a.weight": t, "b.weight": torch.randn(8, 8).to(dtype)},
              tmp_path / "m.safetensors")
    problems, summary = verify(tmp_path / "m.safetensors")
    assert summary["nan"] == {"a.weight": 1}
    assert kinds(problems)[("nan", "a.weight")].file == "m.safetensors"


def test_clean_checkpoint_has_no_problems(tmp_path: Path) -> None:
    torch.save(weights(), tmp_path / "m.pt")
    problems, summary = verify(tmp_path / "m.pt", jobs=2)
    assert problems == [] and summary["skipped"] == {} and summary["tensors_read"] == 3


def test_jobs_give_the_same_answer_and_torch_threads_are_put_back(tmp_path: Path) -> None:
    sd = {f"l{i}": torch.randn(50) for i in range(12)}
    sd["l3"][7] = math.nan
    sd["l9"] = sd["l2"].clone()
    torch.save(sd, tmp_path / "m.pt")
    before = torch.get_num_threads()
    one, four = verify(tmp_path / "m.pt", 1), verify(tmp_path / "m.pt", 4)
    assert one == four and one[1]["nan"] == {"l3": 1}
    assert one[1]["same_values"] == [["l2", "l9"]]
    assert torch.get_num_threads() == before
    seen = []  # and new threads start with it
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert seen == [before]


def test_views_and_transposed_tensors(tmp_path: Path) -> None:
    base = torch.randn(10, 6)
    base[9, 5] = math.nan
    torch.save({"t": base.t(), "row": base[9], "head": base[:2]}, tmp_path / "m.pt")
    _, summary = verify(tmp_path / "m.pt")
    assert summary["nan"] == {"t": 1, "row": 1} and summary["tensors_read"] == 3


# -- all-zero -----------------------------------------------------------------
def test_all_zero_tensors_are_warnings_with_a_hint_where_it_helps(tmp_path: Path) -> None:
    sd = {"fc.weight": torch.zeros(8, 4), "fc.bias": torch.zeros(8), "ok": torch.randn(8),
          "neg": torch.tensor([0.0, -0.0]), "one": torch.zeros(1), "ids": torch.zeros(5,
                                                                                     dtype=torch.int64)}
    torch.save(sd, tmp_path / "m.pt")
    problems, summary = verify(tmp_path / "m.pt")
    assert summary["all_zero"] == ["fc.weight", "fc.bias", "neg", "ids"]
    found = kinds(problems)
    assert all(p.severity == "warning" and p.kind == "all-zero" for p in problems)
    assert found[("all-zero", "fc.bias")].message == \
        "every one of its 8 values is zero (biases often start at zero)"
    assert "never written reads as zeros" in found[("all-zero", "fc.weight")].message
    assert found[("all-zero", "ids")].message == "every one of its 5 values is zero"
    assert summary["same_values"] == []  # zeros are said once, not as copies


def test_optimizer_moments_at_zero_say_why(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    for s in opt.state.values():
        s["exp_avg_sq"].zero_()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "m.pt")
    problems, _ = verify(tmp_path / "m.pt")
    said = {p.tensor: p.message for p in problems if p.kind == "all-zero"}
    assert said and all(k.endswith("exp_avg_sq") for k in said)
    assert all(m.endswith("(optimizer moments are zero until the first step)")
               for m in said.values())


def test_zero_element_and_scalar_tensors(tmp_path: Path) -> None:
    torch.save({"empty": torch.empty(0, 3), "scalar": torch.tensor(0.0),
                "nothing": torch.empty(0)}, tmp_path / "m.pt")
    problems, summary = verify(tmp_path / "m.pt")
    assert problems == [] and summary["tensors_read"] == 3 and summary["bytes_read"] == 4


# -- same values ----------------------------------------------------------------
def test_untied_copy_found_naming_both(tmp_path: Path) -> None:
    sd = weights()
    sd["copy_of_w"] = sd["w"].clone()
    sd["w_as_double"] = sd["w"].double()  # another dtype: not the same tensor
    sd["w_reshaped"] = sd["w"].clone().reshape(32, 64)  # another shape
    torch.save(sd, tmp_path / "m.pt")
    problems, summary = verify(tmp_path / "m.pt")
    assert summary["same_values"] == [["w", "copy_of_w"]]
    (p,) = problems
    assert (p.kind, p.severity, p.tensor, p.file) == ("same-values", "warning", "copy_of_w",
                                                      "m.pt")
    assert p.message.startswith("the same values as w (float32 64x32), and nothing in the "
                                "checkpoint ties them")


def test_copies_differing_in_one_byte_away_from_the_samples_are_not_reported(
        tmp_path: Path) -> None:
    w = torch.randn(1 << 18)  # 1 MiB: fingerprinted from samples
    near = w.clone()
    near[12345] += 1.0
    torch.save({"w": w, "near": near}, tmp_path / "m.pt")
    problems, summary = verify(tmp_path / "m.pt")
    assert problems == [] and summary["same_values"] == []


def test_a_group_of_copies_is_one_problem(tmp_path: Path) -> None:
    w = torch.randn(20, 5)
    torch.save({"a": w, "b": w.clone(), "c": w.clone(), "d": w.clone()}, tmp_path / "m.pt")
    problems, summary = verify(tmp_path / "m.pt")
    assert summary["same_values"] == [["a", "b"], ["a", "c"], ["a", "d"]]
    (p,) = problems
    assert p.tensor == "b" and "as have 2 more tensors (c, d)" in p.message


def test_constant_tensors_are_not_copies(tmp_path: Path) -> None:
    torch.save({f"ln{i}.weight": torch.ones(32) for i in range(4)}, tmp_path / "m.pt")
    problems, summary = verify(tmp_path / "m.pt")
    assert problems == [] and summary["same_values"] == []


def test_torch_shared_storage_is_a_tie_read_once(tmp_path: Path) -> None:
    emb = torch.randn(50, 8)
    torch.save({"model.embed_tokens.weight": emb, "lm_head.weight": emb}, tmp_path / "m.pt")
    emb[0, 0] = math.nan
    torch.save({"model.embed_tokens.weight": emb, "lm_head.weight": emb},
               tmp_path / "nan.pt")
    problems, summary = verify(tmp_path / "m.pt")
    assert problems == [] and summary["tensors_read"] == 1
    classes = tie_classes(ckptool.open(tmp_path / "m.pt"))
    assert classes["lm_head.weight"] == classes["model.embed_tokens.weight"]
    problems, summary = verify(tmp_path / "nan.pt")
    assert summary["nan"] == {"model.embed_tokens.weight": 1}
    assert problems[0].message.endswith("; tied to lm_head.weight")


def test_names_the_checkpoint_records_as_aliases_are_not_copies(tmp_path: Path) -> None:
    w = torch.randn(20, 5)
    torch.save({"a": w, "b": w.clone()}, tmp_path / "m.pt")
    ckpt = ckptool.open(tmp_path / "m.pt")
    assert check_values(ckpt)[1]["same_values"] == [["a", "b"]]
    problems, summary = check_values(replace(ckpt, aliases={"b": "a"}))
    assert (problems, summary["same_values"]) == ([], [])


def test_huggingface_hub_ties_are_not_copies(tmp_path: Path) -> None:
    emb = torch.randn(50, 8)
    for name, shard in (("one", "10GB"), ("sharded", "2KB")):
        (tmp_path / name).mkdir()
        sd = {"model.embed_tokens.weight": emb, "lm_head.weight": emb,
              "x": torch.randn(50, 8)}
        hub.save_torch_state_dict(sd, tmp_path / name, max_shard_size=shard)
        problems, summary = verify(tmp_path / name)
        assert (problems, summary["same_values"]) == ([], [])
    ckpt = ckptool.open(tmp_path / "one")
    assert ckpt.aliases  # huggingface_hub recorded the tie in __metadata__


def test_convert_outputs_recording_ties_are_not_copies(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    emb = torch.randn(64, 16)
    torch.save({"model.embed_tokens.weight": emb, "lm_head.weight": emb,
                "x": torch.randn(64, 16)}, tmp_path / "t.pt")
    assert main(["convert", str(tmp_path / "t.pt"), str(tmp_path / "o.safetensors")]) == 0
    assert main(["convert", str(tmp_path / "t.pt"), str(tmp_path / "shards"),
                 "--max-shard-size", "4KB"]) == 0
    capsys.readouterr()
    for out in ("o.safetensors", "shards"):
        ckpt = ckptool.open(tmp_path / out)
        assert ckpt.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
        problems, summary = check_values(ckpt)
        assert problems == [] and summary["tensors_read"] == 2


def test_dcp_writes_ties_as_copies_and_says_so(tmp_path: Path) -> None:
    emb = torch.randn(50, 8)
    dcp_save({"model.embed_tokens.weight": emb, "lm_head.weight": emb}, tmp_path / "d")
    (p,) = verify(tmp_path / "d")[0]
    assert (p.kind, p.tensor, p.file) == ("same-values", "lm_head.weight", "__0_0.distcp")
    assert p.message.endswith("(DCP writes tied weights as copies: expected if the model "
                              "ties its embeddings)")


# -- layouts of many files ---------------------------------------------------------
def test_dcp_nan_and_copy(tmp_path: Path) -> None:
    sd = weights()
    sd["u"][299] = math.nan
    sd["again"] = sd["v"].clone()
    dcp_save(sd, tmp_path / "d")
    problems, summary = verify(tmp_path / "d")
    assert summary["nan"] == {"u": 1} and summary["same_values"] == [["v", "again"]]
    assert kinds(problems)[("nan", "u")].file == "__0_0.distcp"


def dcp_element(directory: Path, t: Any, chunk: Any) -> int:
    """Where a DCP chunk's first element lies in its file."""
    raw, offsets = embedded.read_item(str(directory / chunk.file), chunk.file,
                                      chunk.byte_offset, chunk.byte_length)
    return offsets[raw.root.storage.key] + raw.root.storage_offset * 4


@pytest.mark.parametrize("key", ["dt.grid", "dt.cols", "model.fc.weight"])
def test_dcp_of_four_ranks_names_the_rank_file(tmp_path: Path, key: str) -> None:
    shutil.copytree(MULTI / "dcp_4ranks", tmp_path / "d")
    t = next(t for t in ckptool.open(tmp_path / "d").tensors if t.key == key)
    chunk = t.chunks[1]
    poke(tmp_path / "d" / chunk.file, dcp_element(tmp_path / "d", t, chunk),
         struct.pack("<f", math.nan))
    problems, summary = verify(tmp_path / "d", jobs=2)
    assert summary["nan"] == {key: 1}
    assert kinds(problems)[("nan", key)].file == chunk.file


def test_per_rank_dtensor_files(tmp_path: Path) -> None:
    shutil.copytree(MULTI / "per_rank_dtensor" / "fsdp2_ws2", tmp_path / "r")
    assert verify(tmp_path / "r")[0] == []
    t = ckptool.open(tmp_path / "r").tensors[0]
    chunk = t.chunks[1]
    poke(tmp_path / "r" / chunk.file, chunk.byte_offset + 4, struct.pack("<f", -math.inf))
    problems, summary = verify(tmp_path / "r")
    assert summary["inf"] == {t.key: 1} and problems[0].file == chunk.file


@pytest.mark.parametrize("name", ["z2_fp32", "z3_bf16", "z0_fp32", "z1_ws4"])
def test_deepspeed_module_copies_and_ties_are_not_copies(name: str) -> None:
    problems, summary = verify(DS / name)
    assert [p for p in problems if p.kind == "same-values"] == []
    assert summary["skipped"] == {} and summary["nan"] == {}


def test_deepspeed_module_weights_do_equal_the_masters() -> None:
    ckpt = ckptool.open(DS / "z2_fp32")  # what the test above is about
    by_key = {t.key: t for t in ckpt.tensors}
    with TensorValues(ckpt) as values:
        module = values.values(by_key["<mp_rank_00_model_states.pt>/module/lin.weight"])
        assert torch.equal(module, values.values(by_key["lin.weight"]))


def test_deepspeed_nan_in_a_partition_names_the_rank_file(tmp_path: Path) -> None:
    shutil.copytree(DS / "z2_fp32", tmp_path / "z")
    t = next(t for t in ckptool.open(tmp_path / "z").tensors if t.key == "lin.weight")
    chunk = t.chunks[1]
    poke(tmp_path / "z" / "global_step2" / os.path.basename(chunk.file),
         chunk.byte_offset, struct.pack("<f", math.nan))
    problems, summary = verify(tmp_path / "z")
    assert summary["nan"] == {"lin.weight": 1}
    assert kinds(problems)[("nan", "lin.weight")].file == chunk.file


# -- what cannot be read ---------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support")
def test_complex_quantized_sparse_meta_nested_never_crash(tmp_path: Path) -> None:
    c = torch.randn(6, dtype=torch.complex64)
    c[2] = complex(math.nan, 0)
    sparse = torch.randn(4, 4).to_sparse()
    sparse.values()[3] = math.inf
    sd = {"c": c, "q": torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8),
          "sparse": sparse, "csr": torch.randn(3, 3).to_sparse_csr(),
          "meta": torch.empty(3, device="meta"), "flags": torch.tensor([True, False]),
          "u16": torch.tensor([0, 0], dtype=torch.int32).view(torch.uint16)}
    torch.save(sd, tmp_path / "m.pt")
    problems, summary = verify(tmp_path / "m.pt")
    assert summary["nan"] == {"c": 1} and summary["inf"] == {"sparse": 1}
    assert set(summary["skipped"]) == {"q", "meta"}
    assert "quantized" in summary["skipped"]["q"]
    assert "in the stored values (values)" in kinds(problems)[("inf", "sparse")].message
    assert summary["all_zero"] == ["u16"]


def test_a_file_changed_after_reading_is_a_problem_per_tensor(tmp_path: Path) -> None:
    torch.save(weights(), tmp_path / "m.pt")
    ckpt = ckptool.open(tmp_path / "m.pt")
    os.truncate(tmp_path / "m.pt", ckpt.file_size // 2)  # a writer cut it after the read
    problems, summary = check_values(ckpt, jobs=2)
    assert [(p.kind, p.tensor, p.file) for p in problems] == [
        ("unreadable", k, "m.pt") for k in ("w", "v", "u")]
    assert "changed since it was read" in problems[0].message
    assert summary["tensors_read"] == 0


def test_a_damaged_dcp_chunk_is_a_problem_and_the_rest_is_read(tmp_path: Path) -> None:
    shutil.copytree(MULTI / "dcp_4ranks", tmp_path / "d")
    t = next(t for t in ckptool.open(tmp_path / "d").tensors if t.key == "dt.grid")
    poke(tmp_path / "d" / t.chunks[2].file, t.chunks[2].byte_offset, b"garbage!" * 8)
    problems, summary = verify(tmp_path / "d")
    (p,) = problems
    assert (p.kind, p.tensor, p.severity) == ("unreadable", "dt.grid", "error")
    assert t.chunks[2].file in p.message
    assert summary["tensors_read"] == len(ckptool.open(tmp_path / "d").tensors) - 1


def test_fingerprint_is_the_same_however_the_bytes_are_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(1 << 17)  # 512 KiB: sampled, windows across slices
    torch.save({"w": w}, tmp_path / "m.pt")
    monkeypatch.setattr(valuescan, "SLICE", 3000 * 4)
    ckpt = ckptool.open(tmp_path / "m.pt")
    with TensorValues(ckpt) as source:
        streamed = valuescan.scan(source, ckpt.tensors[0], True).fingerprint
    whole = valuescan.Print(w.numel() * 4)
    whole.feed(0, w.numpy().data.cast("B"))
    assert streamed == whole.digest()
