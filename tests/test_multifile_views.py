"""diff, diagnose, devices and browse on checkpoints of many files: Hugging
Face shards written by huggingface_hub's own ``save_torch_state_dict``
(safetensors and .bin, one saved as on cuda:2), DCP written by
``torch.distributed.checkpoint.save`` in one process, and the 4-rank fixture.
Values are compared with what torch itself reads or consolidates."""

from __future__ import annotations

import asyncio
import json
import shlex
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import CliResult
from helpers import saved_on
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import ckptool
from ckptool.check.diagnosis import diagnose
from ckptool.check.diff import diff_checkpoints
from ckptool.check.gpus import machine as gpus
from ckptool.check.stats import checkpoint_stats
from ckptool.cli import main
from ckptool.tui import make_app
from ckptool.tui.app import BrowseApp
from ckptool.tui.textshot import screen_text

hub = pytest.importorskip("huggingface_hub")
safetensors_torch = pytest.importorskip("safetensors.torch")

FOUR = Path(__file__).resolve().parent / "fixtures" / "multifile" / "dcp_4ranks"
CPU_ONLY = ["--device-count", "0"]


def state_dict(tied: bool = True) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    emb = torch.randn(1000, 16)  # 64 000 bytes: a shard of its own at 40KB
    sd = {"model.embed.weight": emb, "layers.0.w": torch.randn(300, 16),
          "layers.1.w": torch.randn(300, 16).to(torch.bfloat16),
          "layers.1.b": torch.arange(7, dtype=torch.int64)}
    if tied:
        sd["lm_head.weight"] = emb
    return sd


class Small(torch.nn.Module):
    def __init__(self, hidden: int = 3) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, hidden)
        self.norm = torch.nn.LayerNorm(hidden)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("views")
    out = {name: root / name for name in ("st", "bin", "cuda", "dcp")}
    for name in ("st", "bin", "cuda"):
        out[name].mkdir()
    out["single"] = root / "single.pt"
    torch.save(state_dict(), out["single"])
    out["untied"] = root / "untied.pt"
    torch.save(state_dict(tied=False), out["untied"])
    hub.save_torch_state_dict(state_dict(), out["st"], max_shard_size="40KB")
    # .bin shards: huggingface_hub drops a tied name without a word, so untied
    hub.save_torch_state_dict(state_dict(tied=False), out["bin"], max_shard_size="40KB",
                              safe_serialization=False)
    with saved_on("cuda:2"):  # what a GPU box's save records in every shard
        hub.save_torch_state_dict(state_dict(tied=False), out["cuda"], max_shard_size="40KB",
                                  safe_serialization=False)
    torch.manual_seed(1)
    model = Small()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in one process"
        dcp.save({"model": model.state_dict(), "step": 3}, checkpoint_id=out["dcp"])
    out["dcp.pt"] = root / "dcp.pt"
    dcp_to_torch_save(out["dcp"], out["dcp.pt"])
    out["model.py"] = root / "small.py"
    out["model.py"].write_text("import torch\n\n\nclass Small(torch.nn.Module):\n"
                               "    def __init__(self, hidden=3):\n        super().__init__()\n"
                               "        self.fc = torch.nn.Linear(4, hidden)\n"
                               "        self.norm = torch.nn.LayerNorm(hidden)\n")
    return out


def shard_of(folder: Path, name: str) -> Path:
    index = next(folder.glob("*.index.json"))
    return folder / json.loads(index.read_text())["weight_map"][name]


# -- diff --------------------------------------------------------------------

@pytest.mark.parametrize("shards, single", [("st", "single"), ("bin", "untied")])
def test_diff_a_file_and_its_shards_match(made: dict[str, Path], shards: str, single: str,
                                          run_cli: Callable[..., CliResult]) -> None:
    for a, b in ((made[single], made[shards]), (made[shards], made[single])):
        code, out, err = run_cli("diff", "--json", str(a), str(b))
        assert (code, err) == (0, "")
        data = json.loads(out)
        assert data["values_compared"] and not data["has_differences"]
        assert data["not_compared"] == []  # every value read from its shard and compared
        assert data["num_identical"] == data["num_matched"] == len(state_dict(single == "single"))
    side = data["a"]
    assert side["directory"] is True and side["format"].startswith("hf-")


def test_diff_pairs_a_tied_name_the_index_records(made: dict[str, Path],
                                                  run_cli: Callable[..., CliResult]) -> None:
    code, out, err = run_cli("diff", str(made["single"]), str(made["st"]))
    assert (code, err) == (0, "")
    out = " ".join(out.split())  # as one line, however the terminal wrapped it
    assert "state dict: the whole checkpoint" in out
    # the tied name the index records is a tensor of the checkpoint: paired by its name
    assert "matched 5 names" in out and "5 identical · 0 only in A · 0 only in B" in out


@pytest.mark.parametrize("shards", ["st", "bin"])
def test_diff_reports_a_value_changed_in_one_shard(made: dict[str, Path], shards: str,
                                                   tmp_path: Path,
                                                   run_cli: Callable[..., CliResult]) -> None:
    changed = tmp_path / shards
    shutil.copytree(made[shards], changed)
    shard = shard_of(changed, "layers.0.w")
    if shards == "st":
        tensors = safetensors_torch.load_file(shard)
        tensors["layers.0.w"][5, 3] += 0.5
        safetensors_torch.save_file(tensors, shard, metadata={"format": "pt"})
    else:
        tensors = torch.load(shard, weights_only=True)
        tensors["layers.0.w"][5, 3] += 0.5
        torch.save(tensors, shard)
    code, out, err = run_cli("diff", "--json", str(made[shards]), str(changed))
    assert (code, err) == (1, "")
    data = json.loads(out)
    assert [(c["name"], c["changes"]) for c in data["changed"]] == [("layers.0.w", ["values"])]
    values = data["changed"][0]["values"]
    assert values["num_different"] == 1 and values["max_abs_diff"] == pytest.approx(0.5, 1e-5)
    assert data["num_identical"] == data["num_matched"] - 1


def test_diff_dcp_and_torch_consolidation(made: dict[str, Path], tmp_path: Path,
                                          run_cli: Callable[..., CliResult]) -> None:
    # the model's names: DCP's "model." entry and the file's 'model' dict line up
    code, out, err = run_cli("diff", "--json", str(made["dcp"]), str(made["dcp.pt"]))
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert data["num_identical"] == 4 and data["not_compared"] == []
    assert data["a"]["entry"] == "model" and data["b"]["state_dict"] == "model"
    # every tensor: DCP's flattened keys compared as the nested keys they were saved as
    code, out, err = run_cli("diff", "--all", str(made["dcp.pt"]), str(made["dcp"]))
    assert (code, err) == (0, "")
    assert "matched  4 keys" in out and "0 only in A · 0 only in B" in out
    assert "DCP keys compared as the nested keys they were saved as" in out
    # and a value changed in the consolidated file is found
    whole = torch.load(made["dcp.pt"], weights_only=True)
    whole["model"]["fc.bias"][1] = 9.0
    edited = tmp_path / "edited.pt"
    torch.save(whole, edited)
    code, out, err = run_cli("diff", "--json", str(made["dcp"]), str(edited))
    assert code == 1
    assert [c["name"] for c in json.loads(out)["changed"]] == ["fc.bias"]


def test_diff_four_ranks_against_torch(tmp_path: Path) -> None:
    """DTensor rows, columns, grids, uneven and empty chunks, a ShardedTensor:
    every value equal to what dcp_to_torch_save consolidates."""
    out = tmp_path / "four.pt"
    dcp_to_torch_save(FOUR, out)  # our own fixture: torch may unpickle it
    report = diff_checkpoints(ckptool.open(FOUR), ckptool.open(out), all_tensors=True)
    assert not report.has_differences and not report.not_compared
    assert report.num_identical == report.num_matched == len(ckptool.open(FOUR).tensors) == 27


# -- diagnose ----------------------------------------------------------------

def test_diagnose_gpu_saved_bin_shards(made: dict[str, Path], tmp_path: Path,
                                       run_cli: Callable[..., CliResult]) -> None:
    code, out, err = run_cli("diagnose", "--json", *CPU_ONLY, str(made["cuda"]))
    assert (code, err) == (1, "")
    data = json.loads(out)
    ckpt = ckptool.open(made["cuda"])
    shards = {t.file for t in ckpt.tensors}
    assert len(shards) == 2  # the finding covers the tensors of every shard
    assert data["devices"][0]["location"] == "cuda:2"
    assert data["devices"][0]["tensors"] == len(ckpt.tensors) == 4
    (finding,) = data["findings"]
    assert finding["code"] == "device-unavailable" and "shards" in finding["message"]
    assert "load_torch_model" in finding["snippet"] and "safe=False" in finding["snippet"]
    assert data["load"]["loader"] == "huggingface_hub.load_torch_model"
    code, text, err = run_cli("diagnose", *CPU_ONLY, str(made["cuda"]))
    assert f"torch.load('{made['cuda']}'" not in text  # torch.load takes no directory
    text = " ".join(text.split())  # (a long path wraps the lines)
    assert "checkpoint " in text and "3 files" in text and "torch.load of a shard" in text
    # the one command it prints writes a fixed copy of the directory that is clean
    folder = tmp_path / "copy"
    shutil.copytree(made["cuda"], folder)
    data = json.loads(run_cli("diagnose", "--json", *CPU_ONLY, str(folder))[1])
    assert data["fix_command"] == f"ckptool fix {folder} --to cpu -o {folder}.fixed"
    assert data["fix_refused"] is None
    words = shlex.split(data["fix_command"])
    assert run_cli(*words[1:], "-q")[0] == 0
    code, out, err = run_cli("diagnose", *CPU_ONLY, f"{folder}.fixed")
    assert (code, err) == (0, "") and "no problems found" in out


def test_diagnose_shards_against_a_model(made: dict[str, Path], tmp_path: Path,
                                         run_cli: Callable[..., CliResult]) -> None:
    spec = tmp_path / "net.py"
    spec.write_text(
        "import torch\n\n\nclass Net(torch.nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.model = torch.nn.Module()\n"
        "        self.model.embed = torch.nn.Embedding(1000, 16)\n"
        "        self.layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])\n"
        "        self.layers[0].w = torch.nn.Parameter(torch.zeros(300, 16))\n"
        "        self.layers[1].w = torch.nn.Parameter(torch.zeros(300, 17))\n"
        "        self.extra = torch.nn.Linear(2, 2)\n")
    code, out, err = run_cli("diagnose", "--json", *CPU_ONLY, str(made["bin"]),
                             "--model", f"{spec}:Net")
    assert code == 1 and err == ""
    data = json.loads(out)
    keys = data["keys"]
    assert keys["missing"] == ["extra.weight", "extra.bias"]
    assert keys["unexpected"] == ["layers.1.b"]
    # keys of both shards are compared: the embedding (shard 1), the rest (shard 2)
    assert keys["mismatched"] == [{"key": "layers.1.w", "file": [300, 16], "model": [300, 17]}]
    assert keys["matched"] == 2
    messages = " ".join(f["message"] for f in data["findings"])
    assert "not in the checkpoint" in messages


def test_diagnose_dcp_says_it_records_no_device(made: dict[str, Path],
                                                run_cli: Callable[..., CliResult]) -> None:
    code, out, err = run_cli("diagnose", "--json", *CPU_ONLY, str(made["dcp"]))
    assert (code, err) == (0, "")
    data = json.loads(out)
    # no device invented, and the 'model.' entry the keys were saved under is no wrapper
    assert data["findings"] == [] and data["devices"][0]["lands"] is None
    assert data["main_state_dict"]["entry_prefix"] == "model."
    assert data["load"]["loader"] == "torch.distributed.checkpoint.load"
    code, out, err = run_cli("diagnose", *CPU_ONLY, str(made["dcp"]))
    assert code == 0
    assert "no device recorded" in out and "the 'model' entry" in out
    assert "plain torch.load here" not in out and "key-prefix" not in out
    assert "torch.distributed.checkpoint.load and load_state_dict" in out


def test_diagnose_dcp_against_a_model(made: dict[str, Path],
                                      run_cli: Callable[..., CliResult]) -> None:
    spec = f"{made['model.py']}:Small"
    code, out, err = run_cli("diagnose", "--json", *CPU_ONLY, str(made["dcp"]), "--model", spec)
    assert (code, err) == (0, "")
    assert json.loads(out)["keys"]["matched_as_saved"] == 4
    code, out, err = run_cli("diagnose", "--json", *CPU_ONLY, str(made["dcp"]), "--model", spec,
                             "-a", "hidden=5")
    assert code == 1
    data = json.loads(out)
    assert [m["key"] for m in data["keys"]["mismatched"]] == [
        "fc.weight", "fc.bias", "norm.weight", "norm.bias"]
    assert [f["code"] for f in data["findings"]] == ["shape-mismatch"]


def test_diagnose_dcp_of_a_wrapped_model_names_the_wrapper(tmp_path: Path) -> None:
    sd = {f"module.{k}": v for k, v in Small().state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": sd}, checkpoint_id=tmp_path / "ddp")
    result = diagnose(ckptool.open(tmp_path / "ddp"), gpus.assumed(0))
    (finding,) = result.findings
    assert finding.code == "key-prefix" and "'module.'" in finding.message
    assert "'model' entry" in finding.message
    # the command it prints writes a DCP directory whose model loads bare
    assert result.fix_command == f"ckptool fix {tmp_path / 'ddp'} --strip-module -o " \
        f"{tmp_path / 'ddp'}.fixed"
    assert main([*shlex.split(result.fix_command)[1:], "-q"]) == 0
    net, target = Small(), {"model": {k: torch.zeros_like(v)
                                      for k, v in Small().state_dict().items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=f"{tmp_path / 'ddp'}.fixed", no_dist=True)
    net.load_state_dict(target["model"], strict=True)
    assert all(torch.equal(v, sd[f"module.{k}"]) for k, v in target["model"].items())


# -- devices -----------------------------------------------------------------

def test_devices_on_directories(made: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                run_cli: Callable[..., CliResult]) -> None:
    monkeypatch.setattr(gpus, "probe", lambda **_: gpus.assumed(0))
    code, out, err = run_cli("devices", "--json", str(made["cuda"]))
    assert (code, err) == (0, "")
    data = json.loads(out)["checkpoint"]
    assert data["locations"] == ["cuda:2"] and data["missing_devices"] == ["cuda:2"]
    code, out, err = run_cli("devices", str(made["cuda"]))
    out = " ".join(out.split())
    assert "in 3 files" in out and "torch.load of a shard fails here" in out
    assert "safe=False" in out and f"or fix ckptool fix {made['cuda']} --to cpu" in " ".join(
        out.split())
    code, out, err = run_cli("devices", str(made["dcp"]))
    assert (code, err) == (0, "")
    out = " ".join(out.split())
    assert "DCP saves none" in out and "torch.distributed.checkpoint.load" in out


# -- browse ------------------------------------------------------------------

def drive(path: Path, key: str, size: tuple[int, int] = (120, 40)) -> tuple[BrowseApp, str]:
    """Open ``path`` in the browser, compute ``key``'s statistics; the screen,
    then the header, details and findings panes' text (unwrapped)."""
    app = make_app(path, machine=gpus.assumed(0))
    shot: dict[str, str] = {}

    async def run() -> None:
        async with app.run_test(size=size) as pilot:
            for _ in range(500):
                if app.loaded.is_set() and app.diagnosis is not None:
                    break
                await pilot.pause(0.02)
            app.jump_to(key)
            await pilot.pause()
            await pilot.press("s")
            for _ in range(500):
                if app.stats.get(key) is not None:
                    break
                await pilot.pause(0.02)
            await pilot.pause()
            panes = [str(app.query_one(f"#{name}").render())
                     for name in ("summary", "detail", "findings")]
            shot["text"] = screen_text(app) + "\n" + "\n".join(panes)

    asyncio.run(run())
    return app, shot["text"]


def expect_stats(stats: Any, values: torch.Tensor) -> None:
    assert not isinstance(stats, str), stats
    wide = values.double()
    assert stats.numel == values.numel()
    assert stats.min == pytest.approx(wide.min().item())
    assert stats.max == pytest.approx(wide.max().item())
    assert stats.mean == pytest.approx(wide.mean().item())
    assert stats.std == pytest.approx(wide.std().item())


def test_browse_dcp(made: dict[str, Path]) -> None:
    app, text = drive(made["dcp"], "model.fc.weight")
    expect_stats(app.stats["model.fc.weight"], dcp_weights(made)["fc.weight"])
    assert "4 tensors in 2 files" in text and "the 'model' entry" in text
    assert "1 chunk in __0_0.distcp" in text
    assert "DCP records no device" in text and "safetensors" not in text
    assert "torch.load loads" not in text


def dcp_weights(made: dict[str, Path]) -> dict[str, torch.Tensor]:
    return torch.load(made["dcp.pt"], weights_only=True)["model"]


def test_browse_hf_shards(made: dict[str, Path]) -> None:
    app, text = drive(made["cuda"], "layers.0.w")
    expect_stats(app.stats["layers.0.w"], state_dict(tied=False)["layers.0.w"])
    assert "4 tensors in 3 files" in text and "the whole checkpoint" in text
    assert f"file      {shard_of(made['cuda'], 'layers.0.w').name}" in text
    assert "device-unavailable" in text


def test_stats_of_four_ranks_match_torch(tmp_path: Path) -> None:
    """A tensor in chunks of four ranks' files: its statistics are the whole
    tensor's, as torch consolidates it."""
    out = tmp_path / "four.pt"
    dcp_to_torch_save(FOUR, out)
    whole = torch.load(out, weights_only=True)
    ckpt = ckptool.open(FOUR)
    grid = next(t for t in ckpt.tensors if t.key == "dt.grid")
    assert len(grid.chunks) == 4
    expect_stats(checkpoint_stats(ckpt, grid), whole["dt"]["grid"])
