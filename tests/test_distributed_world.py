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
SLURM = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0",
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


def test_the_srun_step_before_the_job() -> None:
    """A step of 3 tasks on 2 of the job's nodes, in a job of 8 tasks."""
    step = {**SLURM, "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "3",
            "SLURM_STEP_NODELIST": "gpu[08,10]"}
    assert world.detect(step) == world.Launch(2, 3, 0, "slurm", "gpu08", 17137, "gpu08")
    # srun -n1 inside that job: one process
    assert world.detect({**step, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}) is None


@pytest.mark.parametrize("step_id", [None, "", "batch", "extern"])
def test_no_srun_step_is_a_plain_process(step_id: str | None) -> None:
    """A salloc shell or an sbatch script: SLURM_PROCID=0 and the job's
    SLURM_NTASKS, but no step: one process, which must not wait for 3 more."""
    env = {**SLURM, "SLURM_PROCID": "0"}
    del env["SLURM_STEP_ID"]
    if step_id is not None:
        env["SLURM_STEP_ID"] = step_id
    assert world.detect(env) is None


@pytest.mark.parametrize("env", [TORCHRUN, SLURM, {**TORCHRUN, "RANK": "abc"}])
def test_opting_out(env: dict[str, str]) -> None:
    """ckptool run by a training job inherits its RANK, WORLD_SIZE,
    TORCHELASTIC_RUN_ID: CKPTOOL_DISTRIBUTED=0 makes it a plain process."""
    assert world.detect({**env, "CKPTOOL_DISTRIBUTED": "0"}) is None
    if env is not TORCHRUN:
        return
    assert world.detect({**env, "CKPTOOL_DISTRIBUTED": "1"}) == world.detect(env) is not None


def test_one_task_or_no_launcher_is_a_plain_process() -> None:
    assert world.detect({**SLURM, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None
    # the interactive step of a salloc (LaunchParameters=use_interactive_step)
    assert world.detect({**SLURM, "SLURM_PROCID": "0", "SLURM_STEP_ID": "4294967290",
                         "SLURM_STEP_NUM_TASKS": "1"}) is None
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
    ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}, "SLURM_STEP_NODELIST"),
    ({**SLURM, "SLURM_STEP_NUM_TASKS": "x"}, "SLURM_STEP_NUM_TASKS='x'"),
    ({**SLURM, "SLURM_STEP_NUM_TASKS": "2"}, "SLURM_PROCID=2 is not below SLURM_STEP_NUM_TASKS"),
    ({**SLURM, "SLURM_STEP_NODELIST": "n[2-"}, "SLURM_STEP_NODELIST='n[2-'"),
    ({**TORCHRUN, "CKPTOOL_DISTRIBUTED": "yes"}, "CKPTOOL_DISTRIBUTED='yes'"),
    ({"CKPTOOL_DISTRIBUTED": "00"}, "CKPTOOL_DISTRIBUTED='00'"),
])
def test_malformed_values_are_usage_errors(env: dict[str, str], named: str) -> None:
    with pytest.raises(UsageError) as caught:
        world.detect(env)
    assert named in caught.value.message and "\n" not in caught.value.message
    assert caught.value.hint


@pytest.mark.parametrize(("text", "seconds"), [("", 1800.0), ("60", 60.0), ("2.5", 2.5),
                                               ("abc", None), ("0", None), ("-5", None),
                                               ("1e3", None), ("30s", None)])
def test_join_timeout(text: str, seconds: float | None) -> None:
    if seconds is not None:
        assert world.join_timeout({"CKPTOOL_JOIN_TIMEOUT": text}) == seconds
        return
    with pytest.raises(UsageError) as caught:
        world.join_timeout({"CKPTOOL_JOIN_TIMEOUT": text})
    assert caught.value.message.startswith(f"CKPTOOL_JOIN_TIMEOUT={text!r}: ")


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
import atexit, json
from ckptool.write.distributed import world
found = world.detect()
joined = world.join(found, timeout=60)
import torch, torch.distributed as dist
atexit.register(lambda: print(json.dumps({"group at exit": dist.is_initialized()})))
joined.ensure_group()
total = torch.tensor([2.0])
dist.all_reduce(total)
print(json.dumps([joined.rank, joined.size, found.launcher, found.master_addr,
                  total.item(), joined.store.add("count", 1)]))
"""  # and close() at exit


def slurm_env(rank: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "CKPTOOL_", "TORCH_CPP_")) and
           k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONPATH": str(ROOT), "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2",
            "SLURM_LOCALID": str(rank), "SLURM_JOB_NODELIST": "127.0.0.[1],127.0.0.2",
            "SLURM_JOB_ID": "31337", "SLURM_STEP_ID": "0", "MASTER_PORT": str(port)}


LAUNCHERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
             "TORCHELASTIC_USE_AGENT_STORE", "CKPTOOL_DISTRIBUTED", "CKPTOOL_JOIN_TIMEOUT")


def become(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """This process as a launcher's rank; join sets RANK, WORLD_SIZE... in
    os.environ: set here first, so that the test's end takes them away."""
    for name in LAUNCHERS:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def become_slurm_task(monkeypatch: pytest.MonkeyPatch, rank: int, port: int) -> None:
    become(monkeypatch, slurm_env(rank, port))


def become_torchrun_worker(monkeypatch: pytest.MonkeyPatch, rank: int, size: int, port: int,
                           attempt: int) -> None:
    """A worker of torchrun's agent, whose store (``port``) lives on."""
    become(monkeypatch, {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                         "TORCHELASTIC_RUN_ID": "test", "TORCHELASTIC_USE_AGENT_STORE": "True",
                         "TORCHELASTIC_RESTART_COUNT": str(attempt)})


def test_join_meets_another_process_without_torchrun(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """srun's two tasks by hand, rank 0 this process: they find rank 0 from
    the node list and share the store; a gloo group when asked for (a DCP
    output), once. Rank 1 exits 0 (a gloo group alive at exit can abort the
    process: ``ensure_group`` closes it at exit)."""
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
        assert not dist.is_initialized()  # the store only, until a group is asked for
        joined.ensure_group()
        joined.ensure_group()
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


def test_each_torchrun_attempt_has_its_own_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun --max-restarts: the agent's store outlives the workers it
    restarts (TORCHELASTIC_RESTART_COUNT counts the attempts); what the
    first attempt left there is none of the second's."""
    import torch.distributed as dist

    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for attempt in (0, 1):
        become_torchrun_worker(monkeypatch, 0, 1, agent.port, attempt)
        found = world.detect()
        assert found is not None and found.launcher == "torchrun"
        joined = world.join(found, timeout=30)
        try:
            assert joined.store.add("started", 1) == 1
            joined.ensure_group()
            assert dist.is_initialized()
        finally:
            joined.close()
        assert agent.get(f"ckptool/attempt{attempt}/started") == b"1"
    assert not dist.is_initialized()


def test_gloo_failing_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                  capfd: pytest.CaptureFixture[str]) -> None:
    """Rank 0 came (the store says so) but never makes the group."""
    import torch.distributed as dist

    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    agent.add("ckptool/attempt0/world/arrived", 1)
    become_torchrun_worker(monkeypatch, 1, 2, agent.port, 0)
    found = world.detect()
    assert found is not None
    joined = world.join(found, timeout=1)
    with pytest.raises(UsageError) as caught:
        joined.ensure_group()
    assert caught.value.message.startswith(
        f"rank 1 of 2 met the others at 127.0.0.1:{agent.port} (torchrun) but gloo could not "
        "connect them: ")
    assert "GLOO_SOCKET_IFNAME" in caught.value.hint and "\n" not in caught.value.message
    assert not dist.is_initialized() and capfd.readouterr().err == ""


LOSES_THE_STORE = """
import sys
from ckptool.write.distributed import world
joined = world.join(world.detect())
joined.store.set("here", "1")
print("joined", flush=True)
sys.stdin.readline()
try:
    joined.store.get("never")
except RuntimeError as exc:
    print(type(exc).__name__, flush=True)
"""


def test_a_lost_store_dumps_no_cpp_stack() -> None:
    """The process that holds the store (rank 0; torchrun's agent) goes: the
    others' next request fails, and c10d logs it with its C++ stack on
    stderr unless TORCH_CPP_LOG_LEVEL says otherwise (join sets ERROR, as
    torch is imported: only then does it count)."""
    import torch.distributed as dist

    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**slurm_env(0, agent.port), "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR":
           "127.0.0.1", "TORCHELASTIC_RUN_ID": "test", "TORCHELASTIC_USE_AGENT_STORE": "True",
           "TORCHELASTIC_RESTART_COUNT": "3", "CKPTOOL_JOIN_TIMEOUT": "30"}
    rank = subprocess.Popen([sys.executable, "-c", LOSES_THE_STORE], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert rank.stdout is not None and rank.stdout.readline() == "joined\n"
        assert agent.get("ckptool/attempt3/here") == b"1"
    finally:
        del agent  # the server with it
        out, err = rank.communicate("go\n", timeout=60)
    assert (rank.returncode, out, err) == (0, "DistNetworkError\n", "")


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
    shows, the error says it. Waiting, it says so (after 10 s, then every
    minute: shorter here), in CKPTOOL_JOIN_TIMEOUT seconds it gives up."""
    monkeypatch.setattr(world, "SAY_WAITING_AFTER", 0.2)
    monkeypatch.setattr(world, "SAY_WAITING_EVERY", 0.3)
    port = free_port()
    become_slurm_task(monkeypatch, 1, port)
    monkeypatch.setenv("CKPTOOL_JOIN_TIMEOUT", "1.2")
    found = world.detect()
    assert found is not None
    with pytest.raises(UsageError) as caught:
        world.join(found)
    assert caught.value.message.startswith(
        f"rank 1 of 2 could not meet the others at 127.0.0.1:{port} (slurm): ")
    assert "start all 2 processes (within 1.2 s of each other" in caught.value.hint
    said = capfd.readouterr().err.splitlines()
    assert len(said) >= 2  # (c10d gives up a little after the timeout)
    assert set(said) == {f"ckptool: waiting for 1 process at 127.0.0.1:{port} (slurm) ..."}


def test_a_malformed_join_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    become_slurm_task(monkeypatch, 1, free_port())
    monkeypatch.setenv("CKPTOOL_JOIN_TIMEOUT", "soon")
    found = world.detect()
    assert found is not None
    with pytest.raises(UsageError, match=r"^CKPTOOL_JOIN_TIMEOUT='soon'"):
        world.join(found)


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
    """CKPTOOL_DISTRIBUTED=0 here, as in a ckptool convert --workers run by a
    training job that opted out of its launcher: the workers are ranks all
    the same."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("CKPTOOL_DISTRIBUTED", "0")
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
    assert os.environ["CKPTOOL_DISTRIBUTED"] == "0"


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
    # by cause, not time: rank 1 exited 2; rank 0, stopped because it did,
    # exited 4 (or 143, or died of the launcher's SIGTERM) as soon or sooner
    ({0: (4, 7), 1: (2, 7), 2: (-15, 7)}, 2),
    ({0: (4, 6), 2: (143, 6), 1: (3, 7)}, 3),
    ({0: (-15, 6), 1: (4, 6), 2: (2, 7)}, 2),
    ({1: (4, 7), 0: (130, 7)}, 130),
    ({1: (143, 7), 0: (4, 7)}, 4),
    ({0: (4, 6), 1: (1, 7), 2: (-9, 9)}, "rank 2 of 3 was killed by SIGKILL"),
    # the launcher's own SIGKILL, STOP_GRACE seconds after its SIGTERM, is no cause
    ({2: (1, 7), 0: (-9, 7 + launch.STOP_GRACE)}, 1),
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


def test_a_training_scripts_subprocess_is_one_plain_process(tmp_path: Path) -> None:
    """A process of a torchrun job that runs ckptool (directly, or through a
    shell) passes on its RANK and WORLD_SIZE: ckptool is not one of the
    job's ranks, and converts alone instead of waiting for peers."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9", "TORCHELASTIC_RUN_ID": "job",
           "PYTHONPATH": str(root)}
    env.pop("CKPTOOL_DISTRIBUTED", None)
    script = ("import subprocess, sys; sys.exit(subprocess.run(sys.argv[1], shell=True)"
              ".returncode)")
    for i, how in enumerate(("{py} -m ckptool", "sh -c '{py} -m ckptool \"$@\"' sh")):
        out = tmp_path / f"out{i}.safetensors"
        command = (how.format(py=sys.executable) +
                   f" convert {root / 'samples' / 'dcp_tinynet'} {out} -q")
        done = subprocess.run([sys.executable, "-c", script, command], env=env, cwd=root,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert out.exists()
