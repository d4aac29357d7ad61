"""Where a process of a distributed convert stands (``world.detect``), joining
the others for real (``world.join``: two processes, no torchrun), and
``convert --workers N``'s launcher (``launch.run_workers``: torch's elastic
agent, three launches in all)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from ckptool.errors import EXIT_RANK_FAILED, RankFailedError, UsageError
from ckptool.write.distributed import launch, world

ROOT = Path(__file__).resolve().parent.parent
HOST = socket.gethostname()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- detect ---------------------------------------------------------------

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none", "GROUP_RANK": "0"}
SLURM = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
         "SLURM_JOB_NODELIST": "gpu[07-08,10]", "SLURM_JOB_ID": "4242137",
         "SLURMD_NODENAME": "gpu08"}


def test_torchrun() -> None:
    assert world.detect(TORCHRUN) == world.Launch(1, 4, 1, "torchrun", "10.0.0.1", 29500, HOST)
    one = {**TORCHRUN, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    assert world.detect(one) == world.Launch(0, 1, 0, "torchrun", "10.0.0.1", 29500, HOST)


def test_any_env_launcher() -> None:
    env = {k: v for k, v in TORCHRUN.items() if k != "TORCHELASTIC_RUN_ID"}
    assert world.detect(env) == world.Launch(1, 4, 1, "env", "10.0.0.1", 29500, HOST)
    del env["LOCAL_RANK"]
    assert world.detect(env).local_rank == 0  # type: ignore[union-attr]
    # RANK=0 WORLD_SIZE=1 left in an environment is a plain process
    assert world.detect({**env, "RANK": "0", "WORLD_SIZE": "1"}) is None


def test_torchrun_under_slurm_is_torchrun() -> None:
    found = world.detect({**SLURM, **TORCHRUN})
    assert found is not None and found.launcher == "torchrun" and found.rank == 1


def test_slurm_without_torchrun() -> None:
    # the port as Lightning's SLURMEnvironment.main_port derives it: the job
    # id's last four characters + 15000
    assert world.detect(SLURM) == world.Launch(2, 4, 0, "slurm", "gpu07", 17137, "gpu08")
    assert world.detect({**SLURM, "SLURM_JOB_ID": "42"}).master_port == 15042  # type: ignore[union-attr]
    no_job = {k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"}
    assert world.detect(no_job).master_port == 12910  # type: ignore[union-attr]
    given = world.detect({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "6000"})
    assert given is not None and (given.master_addr, given.master_port) == ("head", 6000)
    older = {k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}
    older["SLURM_NODELIST"] = "rack[1-2]-n[3-4]"
    assert world.detect(older).master_addr == "rack1-n3"  # type: ignore[union-attr]


def test_one_task_or_no_launcher_is_a_plain_process() -> None:
    assert world.detect({**SLURM, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None
    assert world.detect({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"}) is None
    assert world.detect({"PATH": "/usr/bin"}) is None


@pytest.mark.parametrize(("env", "named"), [
    ({**TORCHRUN, "RANK": "abc"}, "RANK='abc'"),
    ({**TORCHRUN, "RANK": "4"}, "RANK=4 is not below WORLD_SIZE=4"),
    ({**TORCHRUN, "RANK": "-1"}, "RANK='-1'"),
    ({**TORCHRUN, "WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE='0'"),
    ({k: v for k, v in TORCHRUN.items() if k != "WORLD_SIZE"}, "WORLD_SIZE is not set"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
    ({**TORCHRUN, "MASTER_PORT": "http"}, "MASTER_PORT='http'"),
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, "MASTER_ADDR is not set"),
    ({**SLURM, "SLURM_NTASKS": "0"}, "SLURM_NTASKS='0'"),
    ({**SLURM, "SLURM_PROCID": "4"}, "SLURM_PROCID=4 is not below SLURM_NTASKS=4"),
    ({**SLURM, "SLURM_LOCALID": "x"}, "SLURM_LOCALID='x'"),
    ({**SLURM, "SLURM_JOB_NODELIST": "gpu[07-"}, "SLURM_JOB_NODELIST='gpu[07-'"),
    ({**SLURM, "SLURM_JOB_NODELIST": "gpu[9-7]"}, "SLURM_JOB_NODELIST='gpu[9-7]'"),
    ({**SLURM, "SLURM_JOB_ID": "12ab"}, "SLURM_JOB_ID='12ab'"),
    ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}, "SLURM_JOB_NODELIST"),
])
def test_malformed_values_are_usage_errors(env: dict[str, str], named: str) -> None:
    with pytest.raises(UsageError) as caught:
        world.detect(env)
    assert named in caught.value.message and "\n" not in caught.value.message
    assert caught.value.hint


@pytest.mark.parametrize(("text", "hosts"), [
    ("node[01-03,07],gpu-a,rack[1-2]-n[3-4]",
     ["node01", "node02", "node03", "node07", "gpu-a",
      "rack1-n3", "rack1-n4", "rack2-n3", "rack2-n4"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("node[5]", ["node5"]),
    ("a[1-2]b", ["a1b", "a2b"]),
    ("host0 host1,host3", ["host0", "host1", "host3"]),
    ("127.0.0.1", ["127.0.0.1"]),
    ("localhost", ["localhost"]),
])
def test_expand_nodelist(text: str, hosts: list[str]) -> None:
    assert world.expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["", "node[1-", "node1-]", "n[3-1]", "n[a-b]", "n[[1]]",
                                  "n[1-2", "n[]"])
def test_expand_nodelist_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        world.expand_nodelist(text)


# --- join -----------------------------------------------------------------

RANK_1 = """
import atexit, json, torch, torch.distributed as dist
from ckptool.write.distributed import world
atexit.register(lambda: print(json.dumps({"group at exit": dist.is_initialized()})))
found = world.detect()
joined = world.join(found, timeout=60)
total = torch.tensor([2.0])
dist.all_reduce(total)
print(json.dumps([joined.rank, joined.size, found.launcher, found.master_addr,
                  total.item(), joined.store.add("count", 1)]))
"""  # and close() at exit


def slurm_env(rank: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONPATH": str(ROOT), "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2",
            "SLURM_LOCALID": str(rank), "SLURM_JOB_NODELIST": "127.0.0.[1],127.0.0.2",
            "SLURM_JOB_ID": "31337", "MASTER_PORT": str(port)}


def become_slurm_task(monkeypatch: pytest.MonkeyPatch, rank: int, port: int) -> None:
    """This process as srun's task ``rank``; join sets RANK, WORLD_SIZE... in
    os.environ: set here first, so that the test's end takes them away."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "TORCHELASTIC_RUN_ID"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name, value in slurm_env(rank, port).items():
        monkeypatch.setenv(name, value)


def test_join_meets_another_process_without_torchrun(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """srun's two tasks by hand, rank 0 this process: they find rank 0 from
    the node list, share the store and a gloo group. Rank 1 exits 0 (a gloo
    group alive at exit can abort the process: ``join`` closes it at exit)."""
    import torch
    import torch.distributed as dist

    port = free_port()
    other = subprocess.Popen([sys.executable, "-c", RANK_1], env=slurm_env(1, port),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    become_slurm_task(monkeypatch, 0, port)
    found = world.detect()
    assert found == world.Launch(0, 2, 0, "slurm", "127.0.0.1", port, HOST)
    joined = world.join(found, timeout=60)
    try:
        total = torch.tensor([1.0])
        dist.all_reduce(total)
        count = joined.store.add("count", 1)
        # this process hosts the store: it stays until rank 1 is done
        out, err = other.communicate(timeout=60)
    finally:
        joined.close()
        joined.close()
    assert not dist.is_initialized()
    assert (other.returncode, err) == (0, ""), err
    said, at_exit = [json.loads(line) for line in out.splitlines()]
    # gloo's threads still running at exit abort it ("terminate called
    # without an active exception", 2 runs in 8): closed by then
    assert at_exit == {"group at exit": False}
    assert said[:5] == [1, 2, "slurm", "127.0.0.1", 3.0] and total.item() == 3.0
    assert sorted([count, said[5]]) == [1, 2]


def test_a_port_in_use_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                   capfd: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        become_slurm_task(monkeypatch, 0, port)
        found = world.detect()
        assert found is not None
        with pytest.raises(UsageError) as caught:
            world.join(found, timeout=5)
    assert caught.value.message.startswith(
        f"rank 0 of 2 could not meet the others at 127.0.0.1:{port} (slurm): ")
    assert "set MASTER_PORT to a free port" in caught.value.hint
    assert capfd.readouterr().err == ""


def test_nobody_listening_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                      capfd: pytest.CaptureFixture[str]) -> None:
    """Rank 1 alone: c10d logs each try with its C++ stack on fd 2; none of it
    shows, the error says it."""
    port = free_port()
    become_slurm_task(monkeypatch, 1, port)
    found = world.detect()
    assert found is not None
    with pytest.raises(UsageError) as caught:
        world.join(found, timeout=0.5)
    assert caught.value.message.startswith(
        f"rank 1 of 2 could not meet the others at 127.0.0.1:{port} (slurm): ")
    assert "start all 2 processes" in caught.value.hint
    assert capfd.readouterr().err == ""


def test_alone_with_threads() -> None:
    import torch.distributed as dist

    shared = dist.HashStore()
    counts: list[int] = []

    def rank(index: int) -> None:
        joined = world.alone_with(shared, index, 3)
        counts.append(joined.store.add("n", 1))
        joined.close()

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(counts) == [1, 2, 3] and shared.get("ckptool/n") == b"3"


# --- run_workers ----------------------------------------------------------

@pytest.fixture
def workers_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TORCHELASTIC_SIGNALS_TO_HANDLE", raising=False)


def test_workers_run_ckptool(workers_env: None, capfd: pytest.CaptureFixture[str]) -> None:
    handlers = [signal.getsignal(getattr(signal, name)) for name in launch.HANDLED]
    assert launch.run_workers(2, ["--version"]) == 0
    out, err = capfd.readouterr()
    assert out.splitlines() == ["ckptool, version 0.1.0"] * 2 and err == ""
    # the launcher's signal handlers and environment are gone again
    assert [signal.getsignal(getattr(signal, name)) for name in launch.HANDLED] == handlers
    assert "OMP_NUM_THREADS" not in os.environ
    assert "TORCHELASTIC_SIGNALS_TO_HANDLE" not in os.environ


KILLED = """
import os, pathlib, signal, sys, time
from ckptool.write.distributed.world import detect
ready = pathlib.Path(sys.argv[1])
if os.environ["RANK"] == "0":
    found = detect()
    print(found.launcher, found.rank, found.size, os.environ["OMP_NUM_THREADS"], flush=True)
    ready.touch()
    time.sleep(60)
for _ in range(600):
    if ready.exists():
        break
    time.sleep(0.05)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_worker_killed_by_a_signal(workers_env: None, tmp_path: Path,
                                     capfd: pytest.CaptureFixture[str]) -> None:
    """Rank 1 killed (kill -9, the OOM killer): the launcher then stops rank 0
    with SIGTERM, in the same second; the cause is rank 1 all the same."""
    with pytest.raises(RankFailedError) as caught:
        launch.run_workers(2, [str(tmp_path / "ready")], _command=["-c", KILLED])
    assert caught.value.message == "rank 1 of 2 was killed by SIGKILL"
    assert caught.value.hint.startswith("nothing was committed; run the same command again")
    assert caught.value.exit_code == EXIT_RANK_FAILED == 4
    out, err = capfd.readouterr()
    assert out == "torchrun 0 2 1\n" and err == ""


def test_a_worker_that_exits_with_a_code(workers_env: None, monkeypatch: pytest.MonkeyPatch,
                                         capfd: pytest.CaptureFixture[str]) -> None:
    """The worker said its error and exited 3; the launcher stopped the other
    (SIGTERM): its exit code, nothing said here. OMP_NUM_THREADS the user set
    is the workers'."""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    code = ("import os, sys, time\n"
            "if os.environ['RANK'] == '1':\n"
            "    print('omp', os.environ['OMP_NUM_THREADS'], file=sys.stderr, flush=True)\n"
            "    sys.exit(3)\n"
            "time.sleep(60)\n")
    assert launch.run_workers(2, [], _command=["-c", code]) == 3
    assert capfd.readouterr() == ("", "omp 3\n")


def failure(rank: int, exitcode: int, second: int) -> ProcessFailure:
    made = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode,
                          error_file="/nonexistent/error.json")
    made.timestamp = second
    return made


@pytest.mark.parametrize(("seen", "said"), [
    # the peer that lost rank 1 exited 3 in the same poll, and came first
    ({0: (3, 7), 1: (-9, 7), 2: (-15, 7)}, "rank 1 of 3 was killed by SIGKILL"),
    # rank 1 said its error; the launcher stopped the others
    ({1: (3, 7), 0: (-15, 7), 2: (-15, 7)}, 3),
    # a worker killed by the launcher a second later is no cause
    ({2: (1, 7), 0: (-9, 8)}, 1),
    ({2: (-15, 7), 0: (-15, 7)}, "rank 2 of 3 was killed by SIGTERM"),
    ({0: (-99, 7)}, "rank 0 of 3 was killed by signal 99"),
])
def test_the_cause_among_failures(seen: dict[int, tuple[int, int]], said: int | str) -> None:
    exc = ChildFailedError("python", {rank: failure(rank, code, second)
                                      for rank, (code, second) in seen.items()})
    if isinstance(said, int):
        assert launch._failed(exc, 3) == said
    else:
        with pytest.raises(RankFailedError, match=f"^{said}$"):
            launch._failed(exc, 3)


def test_no_workers_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="--workers 0"):
        launch.run_workers(0, ["--version"])
