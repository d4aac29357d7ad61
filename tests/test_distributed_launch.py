"""``ckptool convert`` run by real launchers, as separate processes joined
through torch.distributed (gloo, on this CPU):
``torchrun --no-python ckptool`` with 3 processes, two torchrun launchers with ``--nnodes 2``
standing for two machines, ``srun``'s environment set by hand, and
``--workers``; a rank killed mid-way and the re-run resuming. Each output
is compared with the one-process output: the same bytes, or for DCP (whose
file names follow the ranks) the same tensors.

Each launch costs a few seconds here (every process imports torch), so
each test checks as much as one launch shows.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from helpers import flip_record_byte

from ckptool.write.convert.run import convert as convert_one

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out["PYTHONPATH"] = str(ROOT)  # this tree, not an installed copy
    out["OMP_NUM_THREADS"] = "1"
    out.update(extra)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: list[str], **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, env=env(**extra), cwd=ROOT,
                          timeout=120)


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("launch")
    g = torch.Generator().manual_seed(0)
    model = {f"block{i}.weight": torch.randn(64, 48, generator=g) for i in range(12)}
    model["emb.weight"] = torch.randn(500, 48, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model, "step": 11}, checkpoint_id=root / "dcp", no_dist=True)
    return root / "dcp"


def test_torchrun_no_python_and_a_failed_rank(tmp_path: Path) -> None:
    """``torchrun --no-python ckptool ...``; a rank that finds its share of
    the input damaged: rank 0 says which rank and why, once, before torchrun
    stops the job; nothing is committed."""
    g = torch.Generator().manual_seed(2)
    src = tmp_path / "w.pt"
    torch.save({f"w{i}": torch.randn(128, 128, generator=g) for i in range(4)}, src)
    flip_record_byte(src, "w/data/3", at=10, mask=0xFF)  # the last tensor: rank 2's
    script = Path(sys.executable).parent / "ckptool"
    got = run([*TORCHRUN, "--nproc-per-node", "3", "--no-python", str(script), "convert",
               str(src), str(tmp_path / "out.safetensors")])
    assert got.returncode != 0
    said = [line for line in got.stderr.splitlines() if line.startswith("ckptool: error:")]
    assert said == [f"ckptool: error: rank 2 of 3 ({socket.gethostname()}): the output's "
                    "tensor w3 does not match what was written"], got.stderr
    assert "run the same command again to resume" in got.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_two_launchers_as_two_machines(dcp_dir: Path, tmp_path: Path) -> None:
    port = str(free_port())
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
              "--master-port", port]
    out = tmp_path / "shards"
    args = ["-m", "ckptool", "convert", str(dcp_dir), str(out), "--format", "hf-bin",
            "--max-shard-size", "20KB", "--dtype", "bf16", "-q"]
    nodes = [subprocess.Popen([*TORCHRUN, *common, "--node-rank", str(i), *args],
                              env=env(), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [n.communicate(timeout=120) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    convert_one(str(dcp_dir), str(tmp_path / "one"), fmt="hf-bin", max_shard_size=20000,
                dtype="bfloat16")
    names = sorted(os.listdir(tmp_path / "one"))
    assert sorted(os.listdir(out)) == names and len(names) > 3
    for name in names:
        assert (out / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name


def test_srun_without_torchrun(dcp_dir: Path, tmp_path: Path) -> None:
    """Two tasks with the environment ``srun`` gives them; the rendezvous from
    the job's node list and MASTER_PORT."""
    port = str(free_port())
    out = tmp_path / "out.safetensors"
    tasks = [subprocess.Popen(
        [sys.executable, "-m", "ckptool", "convert", str(dcp_dir), str(out), "--json"],
        env=env(SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NTASKS="2",
                SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="2",
                SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="localhost", MASTER_PORT=port),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)]
    outs = [t.communicate(timeout=120) for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], outs
    assert json.loads(outs[0][0])["distributed"]["ranks"] == 2
    assert outs[1][0] == ""  # task 1 says nothing
    convert_one(str(dcp_dir), str(tmp_path / "one.safetensors"))
    assert out.read_bytes() == (tmp_path / "one.safetensors").read_bytes()


def test_workers_killed_mid_way_then_resumed(tmp_path: Path) -> None:
    """``--workers 2``; rank 1 stopped once it recorded its first batch, then
    killed: the job fails naming it, nothing is committed; the same command
    again keeps what was verified and writes the same bytes."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(3)
    src = tmp_path / "src"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({f"t{i}": torch.randn(1024, 1024, generator=g) for i in range(12)},
                 checkpoint_id=src, no_dist=True)
    out = tmp_path / "out.safetensors"
    args = [sys.executable, "-m", "ckptool", "convert", str(src), str(out), "--dtype", "bf16",
            "--workers", "2", "--json"]
    job = subprocess.Popen(args, env=env(), cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    staging = tmp_path / ".out.safetensors.ckptool-dist.partial" / ".ckptool"
    victim = None
    deadline = time.monotonic() + 60
    while victim is None and time.monotonic() < deadline and job.poll() is None:
        for manifest in staging.glob("done-1-*.jsonl") if staging.exists() else ():
            if manifest.read_text():
                victim = _rank_pid(1, str(src))
                if victim is not None:
                    os.kill(victim, signal.SIGSTOP)  # frozen where it stands, then killed
                    os.kill(victim, signal.SIGKILL)
                break
        time.sleep(0.005)
    _, stderr = job.communicate(timeout=120)
    assert victim is not None, stderr
    assert job.returncode == 4, stderr
    assert "ckptool: error: rank 1 of 2 was killed by SIGKILL" in stderr
    assert not out.exists()
    again = run(args)
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout)["distributed"]
    assert report["resumed"] and report["per_rank"][1]["bytes_kept"] > 0
    convert_one(str(src), str(tmp_path / "one.safetensors"), dtype="bfloat16")
    assert out.read_bytes() == (tmp_path / "one.safetensors").read_bytes()
    assert not staging.parent.exists()


def _rank_pid(rank: int, needle: str) -> int | None:
    """The pid of the worker process of ``rank`` whose command line holds ``needle``."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle.encode() in cmdline and f"RANK={rank}".encode() in environ and \
                b"--workers" not in cmdline:
            return int(pid)
    return None


def test_dcp_output_resumed_rank_by_rank(tmp_path: Path) -> None:
    """A DCP output: rank 2 finds its input damaged inside the one dcp.save
    of the three ranks; rank 0 says so, once, naming rank 2, and every
    process exits with its code. Once the input is whole again, the re-run
    keeps ranks 0 and 1's files (their size and CRC as recorded) and the
    result holds the one-process output's tensors."""
    g = torch.Generator().manual_seed(4)
    src = tmp_path / "w.pt"
    torch.save({f"w{i}": torch.randn(256, 256, generator=g) for i in range(6)}, src)
    flip_record_byte(src, "w/data/5", at=10, mask=0xFF)
    out = tmp_path / "dcp"
    args = [sys.executable, "-m", "ckptool", "convert", str(src), str(out), "--format", "dcp",
            "--workers", "3"]
    failed = run(args)
    assert failed.returncode == 3, failed.stderr  # the failed rank's own code, from all
    said = [line for line in failed.stderr.splitlines() if line.startswith("ckptool:")]
    assert len(said) == 1 and said[0].startswith(
        f"ckptool: error: rank 2 of 3 ({socket.gethostname()}): storage 5 of"), failed.stderr
    assert not out.exists()
    flip_record_byte(src, "w/data/5", at=10, mask=0xFF)
    again = run([*args, "--json"])
    assert again.returncode == 0, again.stderr
    per_rank = json.loads(again.stdout)["distributed"]["per_rank"]  # one report: rank 0's
    assert sorted(os.listdir(out)) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                       "__2_0.distcp"]
    assert [r["bytes_kept"] > 0 for r in per_rank] == [True, True, False]
    convert_one(str(src), str(tmp_path / "one"), fmt="dcp")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(out, tmp_path / "many.pt")
        dcp_to_torch_save(tmp_path / "one", tmp_path / "one.pt")
    many, one = torch.load(tmp_path / "many.pt"), torch.load(tmp_path / "one.pt")
    assert many.keys() == one.keys()
    assert all(torch.equal(many[k], one[k]) for k in one)
