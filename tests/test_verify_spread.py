"""``ckptool verify`` on many processes (``ckptool.check.verify.spread``):
ranks run as threads over one in-memory store (``world.alone_with``), each
computing the CRC-32 of its share only, and rank 0's report is the
one-process report, on what real writers wrote (``torch.save``,
``huggingface_hub``, ``dcp.save``), whole and damaged; plus one real
``--workers 2`` run, as a user starts it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import on_thread_ranks

from ckptool.check.verify import zipcheck
from ckptool.check.verify.problems import Report
from ckptool.check.verify.spread import SharedPool, verify_share
from ckptool.check.verify.structure import check
from ckptool.errors import CkptoolError, InputError
from ckptool.read.ziparchive import ZipArchive
from ckptool.write.distributed import world

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A torch file, .bin shards and a DCP directory, by their own writers."""
    import huggingface_hub
    import torch.distributed.checkpoint as dcp

    folder = tmp_path_factory.mktemp("spread")
    torch.manual_seed(0)
    sd = {"w": torch.randn(64, 32), "b": torch.randn(32), "emb.weight": torch.randn(100, 16),
          "head": torch.randn(40, 16)}
    torch.save(sd, folder / "model.pt")
    (folder / "hfbin").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # .bin shards "unsafe"
        huggingface_hub.save_torch_state_dict(sd, str(folder / "hfbin"), max_shard_size="5KB",
                                              safe_serialization=False)
        dcp.save({"model": sd, "step": 3}, checkpoint_id=folder / "dcp", no_dist=True)
    return folder


def copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    return dst


def flip_last_byte(path: Path, suffix: str) -> None:
    """Flip the last data byte of the zip record whose name ends with ``suffix``."""
    with open(path, "r+b") as f:
        archive = ZipArchive(f, os.path.getsize(path))
        member = next(m for m in archive.members.values() if m.name.endswith(suffix))
        at = archive.data_offset(member) + member.size - 1
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x01]))


def on_ranks(n: int, path: Path) -> tuple[Report, list[SharedPool]]:
    """Verify ``path`` on ``n`` ranks (threads): rank 0's report, each rank's pool."""
    pools: list[Any] = [None] * n

    def rank(joined: Any) -> Any:
        pools[joined.rank] = SharedPool(joined, 2)
        return verify_share(joined, str(path), 2, pools[joined.rank])

    out = on_thread_ranks(n, rank, (CkptoolError,))
    if isinstance(out[0], CkptoolError):  # the same error on every rank (said by rank 0)
        assert all(type(o) is type(out[0]) for o in out[1:]), out
        raise out[0]
    assert all(o is None for o in out[1:]), out
    return out[0], pools


def same_report(path: Path, n: int) -> tuple[Report, list[SharedPool]]:
    one = check(str(path), 2)
    many, pools = on_ranks(n, path)
    assert {p for p in many.problems} == set(one.problems)
    assert (many.layout, many.files, many.tensors, many.bytes_checked, many.notes) == (
        one.layout, one.files, one.tensors, one.bytes_checked, one.notes)
    assert sum(p.own for p in pools) == one.bytes_checked  # each byte CRC'd by one rank
    return one, pools


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_damaged_torch_file(saved: Path, tmp_path: Path, n: int,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zipcheck, "UNIT", 1024)  # records in several units: a file split
    path = copy(saved / "model.pt", tmp_path)
    flip_last_byte(path, "data/3")  # the last record: not rank 0's share
    one, pools = same_report(path, n)
    assert {(p.kind, p.tensor) for p in one.problems} == {("crc", "head")}
    assert all(p.own for p in pools)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_damaged_hf_bin_shards(saved: Path, tmp_path: Path, n: int) -> None:
    path = copy(saved / "hfbin", tmp_path)
    shard = sorted(n for n in os.listdir(path) if n.endswith(".bin"))[-1]
    flip_last_byte(path / shard, "data/0")
    one, pools = same_report(path, n)
    assert [(p.kind, p.file) for p in one.problems] == [("crc", shard)]
    assert pools[-1].own  # the last shard's rank checked it, not rank 0


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_dcp_directory_whole_and_damaged(saved: Path, tmp_path: Path, n: int) -> None:
    import pickle

    path = copy(saved / "dcp", tmp_path)
    one, pools = same_report(path, n)
    assert one.ok and all(p.own for p in pools)
    md = pickle.loads((path / ".metadata").read_bytes())
    item = max(md.storage_data.values(), key=lambda v: v.offset)  # the last item
    with open(path / item.relative_path, "r+b") as f:
        f.seek(item.offset + item.length // 2)
        byte = f.read(1)[0]
        f.seek(item.offset + item.length // 2)
        f.write(bytes([byte ^ 0x01]))
    one, _ = same_report(path, n)
    assert [p.kind for p in one.problems] == ["crc"] and one.problems[0].tensor


def test_no_checkpoint_is_the_same_error_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("no checkpoint")
    with pytest.raises(InputError) as caught:
        on_ranks(2, tmp_path / "notes.txt")
    assert caught.value.exit_code == 3


def test_an_error_of_another_rank_is_said_by_rank_0(saved: Path) -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    world.alone_with(store, 1, 2).store.set(
        "verify/1", json.dumps({"error": "cannot read it", "hint": "", "code": 3}))
    with pytest.raises(CkptoolError, match="rank 1: cannot read it") as caught:
        verify_share(world.alone_with(store, 0, 2), str(saved / "dcp"), 1)
    assert caught.value.exit_code == 3


def test_options_of_one_process_are_refused(saved: Path, run_cli: Any) -> None:
    code, _, err = run_cli("verify", str(saved / "dcp"), "--workers", "2", "--values")
    assert code == 2 and "run them on one process for now" in err


def test_a_refusal_is_said_by_rank_0_alone(saved: Path, run_cli: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("TORCHELASTIC_RUN_ID", "t"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    assert run_cli("verify", str(saved / "dcp"), "--manifest", __file__) == (2, "", "")
    monkeypatch.setenv("RANK", "0")
    code, _, err = run_cli("verify", str(saved / "dcp"), "--workers", "3")
    assert code == 2 and "--workers 3 under torchrun, which started 2" in err


def test_workers_2_as_a_user_runs_it(saved: Path, tmp_path: Path, run_cli: Any) -> None:
    path = copy(saved / "hfbin", tmp_path)
    flip_last_byte(path / sorted(n for n in os.listdir(path) if n.endswith(".bin"))[-1],
                   "data/0")
    one_code, one_out, _ = run_cli("verify", str(path), "--json")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-m", "ckptool", "verify", str(path), "--workers",
                           "2", "--json"], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)
    assert (done.returncode, done.stderr) == (one_code, "") and one_code == 1
    many, one = json.loads(done.stdout), json.loads(one_out)  # one report, by rank 0
    assert many["problems"] == one["problems"] and len(one["problems"]) == 1
    assert many == one
