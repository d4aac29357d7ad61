"""Every name of a tie is listed: a name a checkpoint of many files records
as tied to a stored tensor (DeepSpeed's ``shared_params``, a Hugging Face
index's ``metadata``) is a tensor of the checkpoint, sharing its twin's
storage, as two tied keys of one torch file are; inspect (text and JSON),
diff, the tensor values, ``ckptool.load``, ``load_state_dict`` and browse see
it, and ``convert`` still writes it as one tie. The DeepSpeed fixtures are
DeepSpeed's own saves of a model whose ``head.weight`` is ``emb.weight``
(tests/fixtures/deepspeed/make_deepspeed.py); DeepSpeed's zero_to_fp32 puts
the tied name in its state dict the same way (``state_dict[pair[0]] =
state_dict[pair[1]]``), and so does the committed reference."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import huggingface_hub as hub
import pytest
import torch
from conftest import CliResult
from safetensors import safe_open

import ckptool
from ckptool.check.modelspec import module_keys
from ckptool.read.tensor_source import TensorValues

DS = Path(__file__).resolve().parent / "fixtures" / "deepspeed"
TIED = ["z1_fp32", "z2_fp32", "z3_fp32", "z2_bf16", "z3_bf16_ws4", "bf16opt", "z0_fp32",
        "lightning_z3.ckpt"]


def prefix(name: str) -> str:
    return "_forward_module." if name.startswith("lightning") else ""


@pytest.mark.parametrize("name", TIED)
def test_deepspeeds_tied_name_is_a_tensor_sharing_its_twins_storage(name: str) -> None:
    p = prefix(name)
    ckpt = ckptool.open(DS / name)
    by_key = {t.key: t for t in ckpt.tensors}
    head, emb = by_key[f"{p}head.weight"], by_key[f"{p}emb.weight"]
    assert head.storage == emb.storage and (head.shape, head.dtype) == (emb.shape, emb.dtype)
    assert head.chunks == emb.chunks
    assert f"{p}head.weight" in ckpt.state_dict()
    assert list(ckpt.storages[emb.storage].tensors) == [f"{p}emb.weight", f"{p}head.weight"]
    assert not [e for e in ckpt.entries if e.type == "alias"]
    reference = torch.load(DS / f"{name}.reference.pt", weights_only=True)
    assert set(ckpt.state_dict()) >= set(reference)  # every name zero_to_fp32 gives
    with TensorValues(ckpt) as values:
        assert torch.equal(values.values(head), reference[f"{p}head.weight"])


def test_inspect_lists_it_in_text_and_json(run_cli: Callable[..., CliResult]) -> None:
    code, out, err = run_cli("inspect", str(DS / "z3_bf16"), "--limit", "0")
    assert (code, err) == (0, "")
    rows = {line.split()[0]: line for line in out.splitlines() if line.endswith(" 0,1")}
    assert rows["head.weight"].split("│")[4] == rows["emb.weight"].split("│")[4]  # shares #n
    assert "#" in rows["head.weight"]
    code, out, err = run_cli("inspect", "--json", str(DS / "z3_bf16"))
    data = json.loads(out)
    tensors = {t["key"]: t for t in data["tensors"]}
    assert tensors["head.weight"]["storage"] == tensors["emb.weight"]["storage"] == "emb.weight"
    storage = next(s for s in data["storages"] if s["id"] == "emb.weight")
    assert storage["tensors"] == ["emb.weight", "head.weight"]
    assert data["main_state_dict"]["num_tensors"] == 12


def test_load_and_load_state_dict_give_one_tensor_under_both_names() -> None:
    sd = ckptool.load(DS / "z2_fp32")
    assert sd["head.weight"] is sd["emb.weight"]
    weights = ckptool.load_state_dict(DS / "z2_fp32")
    assert weights["head.weight"].data_ptr() == weights["emb.weight"].data_ptr()
    assert torch.equal(weights["head.weight"], torch.load(
        DS / "z2_fp32.reference.pt", weights_only=True)["head.weight"])


def test_diff_pairs_it_by_name(run_cli: Callable[..., CliResult], tmp_path: Path) -> None:
    sd = torch.load(DS / "z2_fp32.reference.pt", weights_only=True)
    sd["head.weight"] = sd["head.weight"].clone()
    sd["head.weight"][0, 0] += 1  # untied and changed: the diff finds it by its name
    torch.save(sd, tmp_path / "changed.pt")
    code, out, err = run_cli("diff", "--json", str(DS / "z2_fp32"), str(tmp_path / "changed.pt"))
    assert (code, err) == (1, "")  # a difference found
    data = json.loads(out)
    assert [c["name"] for c in data["changed"]] == ["head.weight"], data
    assert data["only_in_a"] == data["only_in_b"] == []


@pytest.mark.parametrize("name", ["z3_bf16", "z0_fp32"])
@pytest.mark.parametrize("into", ["m.safetensors", "m.pt", "hf"])
def test_convert_writes_it_as_one_tie(tmp_path: Path, into: str, name: str,
                                      run_cli: Callable[..., CliResult]) -> None:
    out = tmp_path / into
    code, _, err = run_cli("convert", str(DS / name), str(out),
                           *(["--max-shard-size", "2KB"] if into == "hf" else []))
    assert code == 0, err
    if into == "m.safetensors":  # stored once, the tie recorded
        with safe_open(out, "pt") as f:
            assert "head.weight" not in set(f.keys())
            assert json.loads(f.metadata()["ckptool.aliases"]) == {"head.weight": "emb.weight"}
    elif into == "m.pt":
        sd = torch.load(out, weights_only=True)
        assert sd["head.weight"].data_ptr() == sd["emb.weight"].data_ptr()
    back = ckptool.open(out)
    keys = [t.key for t in back.tensors]
    assert len({t.storage for t in back.tensors}) == len(keys) - int("head.weight" in keys)
    assert "head.weight" in keys  # one file: recorded in __metadata__, and listed
    source = ckptool.open(DS / name).state_dict()  # head.weight's bytes are not written again
    assert back.total_bytes == sum(t.nbytes for k, t in source.items() if k != "head.weight")


def test_a_hugging_face_index_tie_is_listed_too(tmp_path: Path,
                                                run_cli: Callable[..., CliResult]) -> None:
    """huggingface_hub drops a tied name from safetensors shards and records
    it in the index's metadata: it is listed, in its twin's shard and storage;
    converted, the name the shards store is the one written, the other its tie."""
    emb = torch.randn(64, 8)
    folder = tmp_path / "hf"
    folder.mkdir()
    hub.save_torch_state_dict({"model.embed_tokens.weight": emb, "lm_head.weight": emb,
                               "b": torch.randn(300, 8)}, folder, max_shard_size="4KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    dropped, kept = next((k, v) for k, v in index["metadata"].items() if k != "total_size")
    assert (dropped, kept) == ("model.embed_tokens.weight", "lm_head.weight")  # hub's choice
    assert dropped not in index["weight_map"]
    ckpt = ckptool.open(folder)
    by_key = {t.key: t for t in ckpt.tensors}
    assert by_key[dropped].storage == by_key[kept].storage
    assert by_key[dropped].file == by_key[kept].file == index["weight_map"][kept]
    assert ckpt.total_bytes == index["metadata"]["total_size"]
    sd = ckptool.load(folder)
    assert sd[dropped] is sd[kept] and torch.equal(sd["model.embed_tokens.weight"], emb)
    out = tmp_path / "m.safetensors"
    code, _, err = run_cli("convert", str(folder), str(out))
    assert code == 0, err
    with safe_open(out, "pt") as f:
        assert set(f.keys()) == {kept, "b"}
        assert json.loads(f.metadata()["ckptool.aliases"]) == {dropped: kept}


def test_browse_shows_it() -> None:
    from test_multifile_views import drive, expect_stats

    app, text = drive(DS / "z2_fp32", "head.weight")
    expect_stats(app.stats["head.weight"], torch.load(
        DS / "z2_fp32.reference.pt", weights_only=True)["emb.weight"])
    assert "shared with emb.weight" in " ".join(text.split())


# ---- one safetensors file: huggingface_hub drops a tied name and records it
# in __metadata__ (dropped -> kept); convert records its own under
# ckptool.aliases. Either is listed, loaded, converted and fixed as a tie.

@pytest.fixture
def hub_single(tmp_path: Path) -> Path:
    emb = torch.nn.Parameter(torch.randn(8, 4))
    folder = tmp_path / "single"
    folder.mkdir()
    hub.save_torch_state_dict({"embed.weight": emb, "head.weight": emb,
                               "x.bias": torch.zeros(3)}, folder)
    path = folder / "model.safetensors"
    with safe_open(path, "pt") as f:  # the writer's own record of the tie
        assert f.metadata()["head.weight"] == "embed.weight" and "head.weight" not in set(f.keys())
    return path


def tied_net() -> torch.nn.Module:
    net = torch.nn.Module()
    net.embed = torch.nn.Embedding(8, 4)
    net.head = torch.nn.Linear(4, 8, bias=False)
    net.head.weight = net.embed.weight
    net.x = torch.nn.Module()
    net.x.bias = torch.nn.Parameter(torch.ones(3))
    return net


def test_a_single_safetensors_files_recorded_tie_is_listed(hub_single: Path) -> None:
    ckpt = ckptool.open(hub_single)
    by_key = {t.key: t for t in ckpt.tensors}
    assert by_key["head.weight"].storage == by_key["embed.weight"].storage
    assert ckpt.aliases == {"head.weight": "embed.weight"}
    sd = ckptool.load(hub_single)
    assert sd["head.weight"].data_ptr() == sd["embed.weight"].data_ptr()
    net = tied_net()
    net.load_state_dict(ckptool.load_state_dict(hub_single, model=net))  # strict
    assert torch.equal(net.head.weight, sd["embed.weight"])


@pytest.mark.parametrize("out", ["o.pt", "o_hf", "o_hf_sharded", "o_hf-bin", "o_dcp"])
def test_it_converts_as_a_tie(hub_single: Path, tmp_path: Path, out: str,
                              run_cli: Callable[..., CliResult]) -> None:
    args = {"o.pt": [], "o_hf": ["--format", "hf"], "o_hf-bin": ["--format", "hf-bin"],
            "o_hf_sharded": ["--format", "hf", "--max-shard-size", "150B"],
            "o_dcp": ["--format", "dcp"]}[out]
    code, _, err = run_cli("convert", str(hub_single), str(tmp_path / out), "-q", *args)
    assert (code, err) == (0, "")
    code, text, err = run_cli("diff", str(hub_single), str(tmp_path / out))
    assert code == 0 and "3 identical" in text, text + err


@pytest.mark.parametrize(("options", "names"), [
    (["--add-prefix", "m."], {"m.embed.weight", "m.head.weight", "m.x.bias"}),
    (["--dtype", "bf16"], {"embed.weight", "head.weight", "x.bias"}),
    (["--rename", "^embed=tok"], {"tok.weight", "head.weight", "x.bias"}),
])
def test_a_fix_carries_the_tie_with_its_tensor(hub_single: Path, tmp_path: Path,
                                               options: list[str], names: set[str],
                                               run_cli: Callable[..., CliResult]) -> None:
    out = tmp_path / "fixed.safetensors"
    code, _, err = run_cli("fix", str(hub_single), *options, "-o", str(out))
    assert (code, err) == (0, "")
    ckpt = ckptool.open(out)
    assert {t.key for t in ckpt.tensors} == names
    head = next(n for n in names if n.endswith("head.weight"))
    by_key = {t.key: t for t in ckpt.tensors}
    assert by_key[head].storage == by_key[ckpt.aliases[head]].storage


@pytest.mark.parametrize("shard_size", [None, 150])
def test_a_model_without_the_tied_name_loads_it_strictly(tmp_path: Path,
                                                          shard_size: int | None) -> None:
    """A recorded tie is no stored weight: a model that lacks the name loads
    the file strictly, as safetensors' load_file of it does (one file, or
    shards whose index records the tie), and diagnose finds no unexpected key."""
    emb = torch.nn.Parameter(torch.randn(8, 4))
    sd = {"embed.weight": emb, "head.weight": emb, "x.bias": torch.zeros(3)}
    if shard_size is None:
        hub.save_torch_state_dict(sd, tmp_path)
        path = tmp_path / "model.safetensors"
    else:
        ckptool.convert(str(_saved(tmp_path, sd)), str(tmp_path / "hf"), fmt="hf",
                        max_shard_size=shard_size)
        path = tmp_path / "hf"
    assert ckptool.open(path).aliases == {"head.weight": "embed.weight"}
    bare = tied_net()
    del bare.head
    bare.load_state_dict(ckptool.load_state_dict(path, model=bare), strict=True)
    report = ckptool.diagnose(ckptool.open(path), model=module_keys(bare))
    assert not [f for f in report.findings if f.code == "unexpected-keys"]


def _saved(tmp_path: Path, sd: dict[str, torch.Tensor]) -> Path:
    torch.save(sd, tmp_path / "t.pth")
    return tmp_path / "t.pth"


def test_a_recorded_tie_under_a_wrapper_prefix_is_no_unexpected_key(tmp_path: Path) -> None:
    """``module.head.weight`` recorded as tied, for a model without a head:
    diagnose (which strips ``module.`` to fit) and load_state_dict agree that
    it is no weight of its own."""
    emb = torch.nn.Parameter(torch.randn(8, 4))
    hub.save_torch_state_dict({"module.embed.weight": emb, "module.head.weight": emb,
                               "module.x.bias": torch.zeros(3)}, tmp_path)
    path = tmp_path / "model.safetensors"
    bare = tied_net()
    del bare.head
    report = ckptool.diagnose(ckptool.open(path), model=module_keys(bare))
    assert report.keys is not None and report.keys.unexpected == []
    bare.load_state_dict(ckptool.load_state_dict(path, model=bare), strict=True)
    # and a model that has the head matches it, as load_state_dict gives it
    report = ckptool.diagnose(ckptool.open(path), model=module_keys(tied_net()))
    assert report.keys is not None and "head.weight" in report.keys.matched
