"""Per-rank torch.save of DTensor state dicts (FSDP2, distribute_tensor on
1-D and 2-D meshes, an AdamW state), written by torch's real writers under
torchrun (tests/fixtures/multifile/make_distributed.py): read as one
checkpoint, joined exactly; one rank's file alone says what it is."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CliResult
from helpers import saved_on
from safetensors.torch import load_file

import ckptool
from ckptool.check.diagnosis import diagnose
from ckptool.check.gpus.machine import Machine
from ckptool.cli import main

HERE = Path(__file__).parent / "fixtures" / "multifile" / "per_rank_dtensor"
CASES = ["fsdp2_ws2", "placements_ws2", "mesh2d_ws4", "optim_ws2"]
CPU = Machine((), False, None, "none", "")


def flat(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}/"))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


def reference(case: str) -> dict[str, torch.Tensor]:
    return flat(torch.load(HERE / f"{case}.reference.pt", weights_only=True))


@pytest.mark.parametrize("case", CASES)
def test_the_ranks_read_as_one_checkpoint_with_global_shapes(case: str) -> None:
    ckpt = ckptool.open(HERE / case)
    placements = json.loads((HERE / f"{case}.placements.json").read_text())
    assert ckpt.format == "dtensor-ranks" and ckpt.warnings == []
    shapes = {t.key.replace("/", "."): list(t.shape) for t in ckpt.tensors}  # as the json names
    for key, facts in placements.items():
        assert shapes[key] == facts["shape"], key
    assert not ckpt.unsafe_globals
    assert not [g for g in ckpt.globals if g.category == "custom"]  # torch's own classes


@pytest.mark.parametrize("case", [*CASES, "fsdp1_ws2"])
def test_load_joins_every_placement_exactly(case: str) -> None:
    """Shard(0) and Shard(1) uneven, empty shards, Replicate(), 2-D meshes,
    [Shard(0), Shard(0)], FSDP2's padded local storages, an AdamW state."""
    got = flat(ckptool.load(HERE / case))
    want = reference(case)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)


@pytest.mark.parametrize("case", ["fsdp2_ws2", "mesh2d_ws4"])
def test_convert_writes_the_whole_tensors(tmp_path: Path, case: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.safetensors"
    assert main(["convert", str(HERE / case), str(out)]) == 0, capsys.readouterr().err
    written, want = load_file(out), reference(case)
    assert written.keys() == want.keys() and all(torch.equal(written[k], want[k]) for k in want)


def test_diagnose_says_to_join_them_and_its_fix_works(tmp_path: Path) -> None:
    folder = tmp_path / "ranks"
    shutil.copytree(HERE / "fsdp2_ws2", folder)
    d = diagnose(ckptool.open(folder), CPU)
    assert [f.code for f in d.findings] == ["per-rank-checkpoint"]
    assert d.fix_command is not None
    args = d.fix_command.split()[1:]
    assert main(args) == 0
    written = load_file(str(d.fix_output))
    assert all(torch.equal(written[k], v) for k, v in reference("fsdp2_ws2").items())


def test_fix_of_the_ranks_points_to_convert(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fix", str(HERE / "fsdp2_ws2"), "--strip-prefix", "0."]) == 3
    assert "ckptool convert" in capsys.readouterr().err


def test_one_ranks_file_says_what_it_is(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    one = HERE / "fsdp2_ws2" / "model_world_size_2_rank_1.pt"
    ckpt = ckptool.open(one)
    assert ckpt.warnings == []  # its local shards are its DTensors', not unreached
    assert any("rank 1's shards" in n for n in ckpt.metadata["notes"])
    assert main(["convert", str(one), str(tmp_path / "x.safetensors")]) == 3
    err = capsys.readouterr().err
    assert "DTensor" in err and "every rank's file" in err
    assert not (tmp_path / "x.safetensors").exists()


def test_a_missing_or_foreign_rank_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ranks"
    shutil.copytree(HERE / "mesh2d_ws4", folder)
    (folder / "model_world_size_4_rank_3.pt").unlink()
    with pytest.raises(ckptool.CkptoolError, match="over 4 ranks, and the directory holds 3"):
        ckptool.open(folder)
    shutil.copy(folder / "model_world_size_4_rank_2.pt", folder / "model_world_size_4_rank_3.pt")
    with pytest.raises(ckptool.CkptoolError, match="holds rank 2's shards, not rank 3's"):
        ckptool.open(folder)


def test_shards_that_leave_a_gap_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Boxes computed from a damaged spec that leave rows no rank holds:
    refused, never filled with whatever memory holds."""
    from ckptool.read.layouts import shards

    box = shards.dtensor_box

    def short(key: str, rec: Any, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        offsets, sizes = box(key, rec, name)
        return ((offsets[0] + 1, *offsets[1:]), sizes) if name.endswith("rank_1.pt") \
            else (offsets, sizes)

    monkeypatch.setattr(shards, "dtensor_box", short)
    with pytest.raises(ckptool.CkptoolError, match="do not make it whole"):
        ckptool.open(HERE / "fsdp2_ws2")


def test_fsdp1_sharded_tensors_join_without_running_anything() -> None:
    """FSDP1's ShardedTensors name their process group's state as
    getattr(ShardedTensor, 'ProcessGroupState') (protocol 2): a nested class,
    not code; their shards record their own offsets."""
    ckpt = ckptool.open(HERE / "fsdp1_ws2")
    assert not ckpt.unsafe_globals
    assert not [g for g in ckpt.globals if g.category == "custom"]
    getattr_ = next(g for g in ckpt.globals if g.name == "builtins.getattr")
    assert getattr_.category == "data" and getattr_.uses == ("called",)
    assert "getattr(G, 'name')" in getattr_.reason
    one = ckptool.open(HERE / "fsdp1_ws2" / "pytorch_model_fsdp_rank1.bin")
    assert any("ShardedTensors" in n and "rank 1's" in n for n in one.metadata["notes"])


def test_load_builds_a_per_rank_tree_as_builder_does() -> None:
    """The joined tree keeps what Builder keeps: a state dict's _metadata
    (load_state_dict reads its versions) and one object per shared value."""
    import ckptool as api

    tree = api.load(Path(__file__).parent / "fixtures" / "multifile" / "per_rank_dtensor"
                    / "fsdp2_ws2")
    assert isinstance(tree, dict) and isinstance(getattr(tree, "_metadata", None), dict)


def on_gpus(case: str, folder: Path) -> Path:
    """``case``'s rank files saved again as each rank's GPU saves them: rank
    r's storages tagged cuda:r (torch.save on a GPU box)."""
    folder.mkdir()
    for rank_file in sorted((HERE / case).iterdir()):
        rank = int(rank_file.stem.rsplit("_", 1)[1])
        tree = torch.load(rank_file, weights_only=False)
        with saved_on(f"cuda:{rank}"):
            torch.save(tree, folder / rank_file.name)
    return folder


@pytest.mark.filterwarnings("ignore:.*DeviceMesh")
def test_ranks_saved_on_gpus_keep_their_devices(tmp_path: Path,
                                                run_cli: Callable[..., CliResult]) -> None:
    """Each joined tensor is where rank 0's piece was saved (cuda:0), as a
    single file saved on a GPU is: inspect and diagnose say so, convert
    notes it, and ckptool.load needs a map_location on a CPU machine, as
    torch.load of each rank's file does."""
    folder = on_gpus("optim_ws2", tmp_path / "ranks")
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(folder / "model_world_size_2_rank_1.pt", weights_only=False)
    ckpt = ckptool.open(folder)
    joined = [t for t in ckpt.tensors if t.chunks]
    assert joined and {t.location for t in joined} == {"cuda:0"}
    assert {s.location for s in ckpt.storages.values()} == {"cuda:0"}  # a step count too
    assert any("rank 0 on cuda:0, rank 1 on cuda:1" in n for n in ckpt.metadata["notes"])
    code, out, _ = run_cli("inspect", "--json", str(folder))
    assert code == 0 and set(json.loads(out)["bytes_by_location"]) == {"cuda:0"}
    d = diagnose(ckpt, CPU)
    assert [t.location for t in d.tags] == ["cuda:0"] and d.tags[0].error
    assert "CUDA" in d.load_errors()[0]
    code, out, err = run_cli("convert", str(folder), str(tmp_path / "out.safetensors"))
    assert code == 0, err
    assert "storages saved on cuda:0 are written as on cpu" in " ".join(out.split())
    with pytest.raises(ckptool.CkptoolError, match="saved on cuda:0") as raised:
        ckptool.load(folder)
    assert "map_location='cpu'" in (raised.value.hint or "")
    got, want = flat(ckptool.load(folder, map_location="cpu")), reference("optim_ws2")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.filterwarnings("ignore:.*DeviceMesh")
def test_ranks_saved_on_one_device_need_no_note(tmp_path: Path) -> None:
    folder = tmp_path / "ranks"
    folder.mkdir()
    for rank_file in (HERE / "fsdp2_ws2").iterdir():
        tree = torch.load(rank_file, weights_only=False)
        with saved_on("cuda:3"):
            torch.save(tree, folder / rank_file.name)
    ckpt = ckptool.open(folder)
    assert {t.location for t in ckpt.tensors} == {"cuda:3"}
    assert not any("different devices" in n for n in ckpt.metadata.get("notes", ()))
