"""``ckptool devices`` on clusters: NVML (faked by a stand-in ``pynvml``)
before nvidia-smi (faked by a script on PATH), ``--export`` and ``--need``,
SLURM's and a container's GPUs mapped to ``cuda:N``, and ``--device-ids``
checked as ``nn.DataParallel`` checks them.

The machine: four A100s with 10362, 10058, 9990 and 9990 MiB free; torch's
answer is faked to be a CUDA build that counts the GPUs CUDA_VISIBLE_DEVICES
leaves."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptool.check.gpus import dataparallel, scheduler
from ckptool.check.gpus import machine as gpus
from ckptool.check.gpus import order as gpuorder
from ckptool.check.gpus.machine import Gpu
from tests.conftest import CliResult
from tests.test_devices import DP, MIB, UUIDS, csv, smi_script

ROOT = Path(__file__).resolve().parent.parent
FAKE_NVML = Path(__file__).resolve().parent / "fixtures" / "fake_nvml"
FREE = [10362, 10058, 9990, 9990]
A100 = "NVIDIA A100-SXM4-80GB"

Setup = Callable[..., Any]


def nvml_config(free: list[int], **extra: Any) -> dict[str, Any]:
    return {"gpus": [[A100, UUIDS[i], 81920, f] for i, f in enumerate(free)], **extra}


def fake_pynvml() -> Any:
    """A fresh copy of the stand-in module (its call log empty)."""
    spec = importlib.util.spec_from_file_location("pynvml", FAKE_NVML / "pynvml.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Setup:
    """machine(free, smi=..., nvml=..., cuda=..., driver=..., **environment):
    nvidia-smi listing GPUs with ``free`` MiB free (None: no nvidia-smi), the
    stand-in pynvml configured with ``nvml`` (None: not installed), torch a
    CUDA build (``cuda`` True), a CPU build (False) or never to be asked (None)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))  # the fakes only: never a real nvidia-smi
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setenv("NO_COLOR", "1")
    for var in scheduler.WATCHED:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(gpus, "DRIVER_DIR", str(tmp_path / "no-driver"))

    def setup(free: list[int] | None = FREE, *, smi: str | None = None,
              nvml: dict[str, Any] | None = None, cuda: bool | None = True,
              driver: bool = False,
              **environment: str) -> Any:
        if free is not None:  # the fake first, cat for its heredoc after it
            smi_script(bin_dir, smi or csv(free))
            monkeypatch.setenv("PATH", os.pathsep.join([str(bin_dir), "/usr/bin", "/bin"]))
        if driver:
            monkeypatch.setattr(gpus, "DRIVER_DIR", str(tmp_path))
        module = None
        if nvml is None:
            monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
        else:
            module = fake_pynvml()
            monkeypatch.setitem(sys.modules, "pynvml", module)
            monkeypatch.setenv("FAKE_NVML", json.dumps(nvml))
        for name, value in environment.items():
            monkeypatch.setenv(name, value)
        count = len(free) if free is not None else len(nvml["gpus"]) if nvml else 0
        listed = [Gpu(i, i, A100, UUIDS[i], None, None) for i in range(count)]

        def torch_answer() -> tuple[bool, int]:
            if cuda is None:
                raise AssertionError("torch was asked")
            count = len(gpus.parse_visible(os.environ.get("CUDA_VISIBLE_DEVICES"), listed))
            return (True, count) if cuda else (False, 0)

        monkeypatch.setattr(gpus, "_torch_cuda", torch_answer)
        return module

    return setup


# -- NVML, nvidia-smi, neither ------------------------------------------------

def test_nvml_is_asked_first(machine: Setup) -> None:
    nvml = machine([1, 2, 3, 4], nvml=nvml_config(FREE))  # nvidia-smi would say otherwise
    found = gpus.probe()
    assert found.source == "nvml" and found.note == ""
    assert [g.free_bytes for g in found.gpus] == [f * MIB for f in FREE]
    assert found.gpus[2] == Gpu(2, 2, A100, UUIDS[2], 81920 * MIB, 9990 * MIB)
    assert found.listed == found.gpus
    assert nvml.calls == ["init", "shutdown"]


def test_nvml_without_nvidia_smi(machine: Setup) -> None:
    machine(None, nvml=nvml_config(FREE), driver=True, CUDA_VISIBLE_DEVICES="2,3")
    found = gpus.probe()
    assert found.source == "nvml" and [g.physical for g in found.gpus] == [2, 3]
    assert len(found.listed) == 4


def test_nvml_old_binding_returns_bytes(machine: Setup) -> None:
    machine(None, nvml=nvml_config(FREE, bytes=True), driver=True)
    assert [(g.name, g.uuid) for g in gpus.probe().gpus][:1] == [(A100, UUIDS[0])]


def test_nvml_memory_not_supported(machine: Setup) -> None:
    machine(None, nvml=nvml_config(FREE, fail="memory"), driver=True)
    found = gpus.probe()
    assert found.source == "nvml" and found.gpus[0].free_bytes is None
    assert found.gpus[0].total_bytes is None


@pytest.mark.parametrize(("fail", "why"), [
    ("init", "NVML could not start: NVML Shared Library Not Found"),
    ("lost", "NVML failed: GPU is lost"),
])
def test_failing_nvml_falls_back_to_nvidia_smi(machine: Setup, fail: str, why: str) -> None:
    nvml = machine([500, 600, 700, 800], nvml=nvml_config(FREE, fail=fail))
    found = gpus.probe()
    assert found.source == "nvidia-smi"
    assert [g.free_bytes for g in found.gpus] == [f * MIB for f in (500, 600, 700, 800)]
    assert found.note == f"{why} (asked nvidia-smi instead)"
    assert nvml.calls[-1] == ("shutdown" if fail == "lost" else "init")


def test_absent_nvml_is_not_mentioned(machine: Setup) -> None:
    machine(FREE)
    found = gpus.probe()
    assert found.source == "nvidia-smi" and found.note == ""


def test_failing_nvml_and_failing_nvidia_smi(machine: Setup) -> None:
    machine(FREE, smi="echo 'No devices were found'; exit 6", nvml=nvml_config([], fail="init"))
    found = gpus.probe()
    assert found.source == "none" and found.gpus == ()
    assert found.note == ("NVML could not start: NVML Shared Library Not Found (asked "
                          "nvidia-smi instead); nvidia-smi failed (exit 6): No devices were found")


def test_nvml_text_and_json(machine: Setup, run_cli: Callable[..., CliResult]) -> None:
    machine(None, nvml=nvml_config(FREE), driver=True)
    code, out, _ = run_cli("devices")
    assert code == 0 and "4 GPUs visible to CUDA (from NVML)" in out
    code, out, _ = run_cli("devices", "--json")
    assert json.loads(out)["source"] == "nvml"


def run(args: list[str], path: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``args`` in a fresh process, the stand-in pynvml importable and no job's variables."""
    clean = {k: v for k, v in os.environ.items() if k not in scheduler.WATCHED}
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=60,
                          check=False, env={**clean, "PYTHONPATH": f"{ROOT}{os.pathsep}{FAKE_NVML}",
                                            "PATH": path, "PY": sys.executable,
                                            "FAKE_NVML": json.dumps(nvml_config(FREE)), **env})


@pytest.mark.skipif(os.path.exists("/proc/driver/nvidia"),
                    reason="an NVIDIA driver is loaded: NVML is rightly asked")
def test_cpu_only_machine_never_imports_nvml(tmp_path: Path) -> None:
    code = ("import sys; from ckptool.check.gpus import machine as gpus; m = gpus.probe(); "
            "print(m.source, 'pynvml' in sys.modules, 'torch' in sys.modules)")
    done = run([sys.executable, "-c", code], str(tmp_path))
    assert done.stdout.split() == ["none", "False", "False"]


# -- --export ------------------------------------------------------------------

@pytest.mark.parametrize(("visible", "exported"), [
    (None, "0,1,2,3"),  # most free first; 2 and 3 tie: by index
    ("2,3", "2,3"),  # CUDA_VISIBLE_DEVICES's own terms, never a GPU outside it
    ("3,2", "3,2"),  # a tie keeps the order it was given in
    ("3,1,2", "1,3,2"),
    ("2,0", "0,2"),
    ("1gpu,3", "1,3"),  # read as CUDA reads it
    ("GPU-7c,GPU-0a9", "GPU-0a9,GPU-7c"),  # UUID prefixes stay as written
    ("2,7,0", "2"),  # "7" names no GPU: CUDA ignores it and all after it
])
def test_export_order(machine: Setup, run_cli: Callable[..., CliResult], visible: str | None,
                      exported: str) -> None:
    machine(FREE, cuda=None, **({} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}))
    assert run_cli("devices", "--export") == (0, f"export CUDA_VISIBLE_DEVICES={exported}\n", "")


def test_export_mixed_models_by_uuid(machine: Setup) -> None:
    names = ["NVIDIA A100", "NVIDIA T4", "NVIDIA A100", "NVIDIA T4"]
    machine(FREE, smi=csv(FREE, names))
    order = gpuorder.plan_export(gpus.probe())
    assert order.value == ",".join(UUIDS)  # CUDA may number mixed models fastest first


@pytest.mark.parametrize(("need", "exported", "left"), [
    ("10GB", "0,1,2,3", ""),
    ("10.5GB", "0,1", "cuda:2, cuda:3"),  # 10.5e9 B is 10013.6 MiB
    ("10200MiB", "0", "cuda:1, cuda:2, cuda:3"),
])
def test_export_need(machine: Setup, run_cli: Callable[..., CliResult], need: str,
                     exported: str, left: str) -> None:
    machine(FREE)
    code, out, err = run_cli("devices", "--export", "--need", need)
    assert (code, out) == (0, f"export CUDA_VISIBLE_DEVICES={exported}\n")
    assert err == (f"ckptool: note: left out {left}: less than {need_size(need)} free, or "
                   "free memory unknown\n" if left else "")


def need_size(text: str) -> str:
    from ckptool.describe import human_bytes
    from ckptool.write.shards import parse_size

    return human_bytes(parse_size(text))


def test_export_no_room(machine: Setup, run_cli: Callable[..., CliResult]) -> None:
    machine(FREE, CUDA_VISIBLE_DEVICES="2,3")
    code, out, err = run_cli("devices", "--export", "--need", "11GB")
    assert (code, out) == (1, "")
    assert err == ("ckptool: error: no visible GPU has 11.0 GB free (the most is 10.5 GB, on "
                   "cuda:0)\nhint: free memory on a GPU, ask for less with --need, or load on "
                   'the CPU (map_location="cpu")\n')


def test_export_checkpoint_needs_its_tensors(machine: Setup,
                                             run_cli: Callable[..., CliResult]) -> None:
    machine([0, 0, 1, 0])  # 1 MiB free holds the sample's 2.7 kB
    assert run_cli("devices", "--export", str(DP))[:2] == (0, "export CUDA_VISIBLE_DEVICES=2\n")
    machine([0, 0, 0, 0])
    code, out, err = run_cli("devices", "--export", str(DP))
    assert (code, out) == (1, "") and "no visible GPU has 2.7 kB free" in err


def test_export_unknown_free_memory(machine: Setup, run_cli: Callable[..., CliResult]) -> None:
    machine(None, nvml=nvml_config(FREE, fail="memory"), driver=True)
    assert run_cli("devices", "--export")[:2] == (0, "export CUDA_VISIBLE_DEVICES=0,1,2,3\n")
    code, out, err = run_cli("devices", "--export", "--need", "1GB")
    assert (code, out) == (1, "") and "free memory of the visible GPUs is unknown" in err
    assert "hint: install nvidia-ml-py" in err


@pytest.mark.parametrize(("free", "visible", "hint"), [
    (None, None, "hint: run it where the GPUs are: inside the job (srun ckptool devices "
                 "--export) or on a GPU node"),
    (FREE, "", "hint: unset CUDA_VISIBLE_DEVICES, which hides them"),
])
def test_export_without_gpus(machine: Setup, run_cli: Callable[..., CliResult],
                             free: list[int] | None, visible: str | None, hint: str) -> None:
    machine(free, **({} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}))
    code, out, err = run_cli("devices", "--export")
    assert (code, out) == (1, "")
    first, second = err.splitlines()
    assert first.startswith("ckptool: error: no CUDA GPU is visible here: ")
    assert second == hint


@pytest.mark.parametrize(("args", "message"), [
    (["--export", "--json"], "--export prints one shell line, --json a report"),
    (["--export", "--device-ids", "0"], "--export prints one shell line, --device-ids a report"),
    (["--export", "--need", "1GB", str(DP)], "--need and CKPT both say how much room"),
    (["--export", "--need", "12XB"], "--need '12XB' is not a size"),
    (["--device-ids", "0,x"], "--device-ids '0,x' is not a list of GPU numbers"),
])
def test_usage_errors(machine: Setup, run_cli: Callable[..., CliResult], args: list[str],
                      message: str) -> None:
    machine(FREE)
    code, out, err = run_cli("devices", *args)
    assert (code, out) == (2, "") and err.startswith(f"ckptool: error: {message}")


def test_export_in_a_real_shell(tmp_path: Path) -> None:
    """eval "$(ckptool devices --export)" sets the variable; a failure leaves it."""
    smi_script(tmp_path, "exit 9")  # a driver is there; NVML answers, nvidia-smi would not
    path = os.pathsep.join([str(tmp_path), "/usr/bin", "/bin"])
    script = ('eval "$("$PY" -m ckptool devices --export --need "$NEED")"; '
              'echo "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"; '
              'line=$("$PY" -m ckptool devices --export --need "$NEED") && eval "$line"; '
              'echo "rc=$?"')
    done = run(["bash", "-c", script], path, NEED="10GB", CUDA_VISIBLE_DEVICES="3,1,2")
    assert done.stdout == "CUDA_VISIBLE_DEVICES=1,3,2\nrc=0\n", done.stderr
    failed = run(["bash", "-c", script], path, NEED="1TB", CUDA_VISIBLE_DEVICES="3,1,2")
    assert failed.stdout == "CUDA_VISIBLE_DEVICES=3,1,2\nrc=1\n"  # eval "" does nothing
    assert failed.stderr.count("ckptool: error: no visible GPU has 1.0 TB free") == 2


def test_export_in_report(machine: Setup, run_cli: Callable[..., CliResult]) -> None:
    machine(FREE, CUDA_VISIBLE_DEVICES="3,2,1")
    code, out, _ = run_cli("devices", "--need", "10.5GB")
    text = " ".join(out.split())
    assert code == 0 and ("export CUDA_VISIBLE_DEVICES=1 (most free memory first, those with "
                          "10.5 GB free; 2 left out; --export prints it for eval)") in text
    data = json.loads(run_cli("devices", "--json", "--need", "10.5GB")[1])
    assert data["export"] == {"need_bytes": 10_500_000_000, "order": [2], "value": "1",
                              "command": "export CUDA_VISIBLE_DEVICES=1", "left_out": [0, 1],
                              "problem": None}


# -- SLURM, containers, other schedulers ---------------------------------------

def job(**environment: str) -> scheduler.Job:
    return scheduler.read_job(environment, gpus.probe())


def slots(found: scheduler.Job) -> list[tuple[str, int | None, int | None]]:
    return [(s.gpu, s.physical, s.cuda) for s in found.slots]


SLURM = {"SLURM_JOB_ID": "812", "SLURMD_NODENAME": "gpu07", "SLURM_JOB_GPUS": "4,5,6,7",
         "GPU_DEVICE_ORDINAL": "0,1", "CUDA_VISIBLE_DEVICES": "0,1"}


def test_slurm_job_sees_its_gpus_renumbered(machine: Setup,
                                            run_cli: Callable[..., CliResult]) -> None:
    machine(FREE, **SLURM)  # the job's cgroup: nvidia-smi lists its 4 GPUs as 0-3
    found = job(**SLURM)
    assert (found.scheduler, found.job_id, found.node) == ("slurm", "812", "gpu07")
    assert (found.variable, found.given, found.view) == ("SLURM_JOB_GPUS", ("4", "5", "6", "7"),
                                                         "job")
    assert slots(found) == [("4", 0, 0), ("5", 1, 1), ("6", 2, None), ("7", 3, None)]
    assert found.notes == (
        "node GPUs 6, 7 (SLURM_JOB_GPUS) are hidden from this process by CUDA_VISIBLE_DEVICES",
        "a cuda:N, here or saved in a checkpoint, is a process's own number after its "
        "CUDA_VISIBLE_DEVICES, not a physical GPU: this process's cuda:0 is node GPU 4")
    code, out, _ = run_cli("devices", str(DP))
    text = " ".join(out.split())
    assert code == 0
    assert ("job SLURM job 812 on gpu07: SLURM_JOB_GPUS=4,5,6,7 (only the job's GPUs are "
            "listed here, renumbered from 0)") in text
    assert ("mapping node GPU 4 is cuda:0, node GPU 5 is cuda:1 (CUDA_VISIBLE_DEVICES=0,1)"
            in text)
    rows = [[c.strip() for c in line.split("│")] for line in out.splitlines()
            if line.startswith("cuda:")]
    assert [r[:3] for r in rows] == [["cuda:0", "4", "0"], ["cuda:1", "5", "1"]]
    assert ("cuda:2 is the saving process's own number (after its CUDA_VISIBLE_DEVICES), not "
            "a physical GPU") in text
    data = json.loads(run_cli("devices", "--json")[1])
    assert data["scheduler"] == {
        "name": "slurm", "job_id": "812", "node": "gpu07", "variable": "SLURM_JOB_GPUS",
        "given": ["4", "5", "6", "7"], "view": "job",
        "gpus": [{"gpu": "4", "physical": 0, "cuda": 0}, {"gpu": "5", "physical": 1, "cuda": 1},
                 {"gpu": "6", "physical": 2, "cuda": None},
                 {"gpu": "7", "physical": 3, "cuda": None}],
        "notes": list(found.notes)}
    assert [g["node"] for g in data["gpus"]] == ["4", "5"]
    assert data["environment"] == SLURM


def test_slurm_step_gpus_and_ranges(machine: Setup) -> None:
    machine(FREE[:2], SLURM_JOB_ID="9", SLURM_JOB_GPUS="4-7", SLURM_STEP_GPUS="5,7",
            CUDA_VISIBLE_DEVICES="0,1")
    found = job(SLURM_JOB_ID="9", SLURM_JOB_GPUS="4-7", SLURM_STEP_GPUS="5,7")
    assert found.variable == "SLURM_STEP_GPUS" and found.view == "job"
    assert slots(found) == [("5", 0, 0), ("7", 1, 1)]
    assert scheduler._entries("4-7") == ("4", "5", "6", "7")


def test_slurm_without_device_constraint(machine: Setup) -> None:
    machine(FREE, CUDA_VISIBLE_DEVICES="1,2")  # the node lists all 4; the job has 1 and 3
    found = job(SLURM_JOB_ID="5", SLURM_JOB_GPUS="1,3")
    assert found.view == "node" and slots(found) == [("1", 1, 0), ("3", 3, None)]
    assert "node GPU 3 (SLURM_JOB_GPUS) is hidden from this process by CUDA_VISIBLE_DEVICES" \
        in found.notes
    assert ("cuda:1 (listed as GPU 2) is not among the job's GPUs (SLURM_JOB_GPUS): another "
            "job may be using it") in found.notes


def test_slurm_counts_that_do_not_match(machine: Setup) -> None:
    machine(FREE)
    found = job(SLURM_JOB_ID="5", SLURM_JOB_GPUS="4,5")
    assert found.view is None and slots(found) == [("4", None, None), ("5", None, None)]
    assert found.notes == ("nvidia-smi lists 4 GPUs here and the job was given 2, so which is "
                           "which cannot be told",)


def test_slurm_changed_cuda_visible_devices(machine: Setup,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    machine(FREE, CUDA_VISIBLE_DEVICES="1")
    found = job(SLURM_JOB_ID="5", SLURM_JOB_GPUS="0,1", GPU_DEVICE_ORDINAL="0,1")
    assert ("CUDA_VISIBLE_DEVICES=1 is not what SLURM set (GPU_DEVICE_ORDINAL=0,1): it was "
            "changed after the job started") in found.notes
    assert "cuda:0 is node GPU 1" in found.notes[-1]
    machine(FREE[:2])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    found = job(SLURM_JOB_ID="5", SLURM_JOB_GPUS="0,1", GPU_DEVICE_ORDINAL="0,1")
    assert ("CUDA_VISIBLE_DEVICES (unset) is not what SLURM set (GPU_DEVICE_ORDINAL=0,1): it "
            "was changed after the job started") in found.notes
    assert job(SLURM_JOB_ID="5", SLURM_JOB_GPUS="0,1").notes[-1].endswith(
        "this process's cuda:0 is node GPU 0")


def test_slurm_job_without_gpus(machine: Setup, run_cli: Callable[..., CliResult]) -> None:
    machine(None, SLURM_JOB_ID="77")
    code, out, _ = run_cli("devices")
    assert code == 0 and "job         SLURM job 77: no GPUs (SLURM_JOB_GPUS is unset)" in out


def test_container_gpus_by_uuid(machine: Setup) -> None:
    machine(FREE[:2], smi=csv(FREE[:2]))
    found = job(NVIDIA_VISIBLE_DEVICES=f"{UUIDS[1]},{UUIDS[0]}")
    assert (found.scheduler, found.variable, found.view) == ("container",
                                                            "NVIDIA_VISIBLE_DEVICES", None)
    assert slots(found) == [(UUIDS[1], 1, 1), (UUIDS[0], 0, 0)]
    assert scheduler.gpu_name(found, "2") == "host GPU 2"
    assert job(NVIDIA_VISIBLE_DEVICES="all").scheduler is None


@pytest.mark.parametrize(("environment", "line"), [
    ({"PBS_JOBID": "41.pbs"}, "PBS job 41.pbs: its GPUs show through CUDA_VISIBLE_DEVICES alone"),
    ({"LSB_JOBID": "12"}, "LSF job 12: its GPUs show through CUDA_VISIBLE_DEVICES alone"),
])
def test_other_schedulers(machine: Setup, run_cli: Callable[..., CliResult],
                          environment: dict[str, str], line: str) -> None:
    machine(FREE, **environment)
    assert f"job         {line}" in run_cli("devices")[1]


def test_rocm_variables_are_noted(machine: Setup) -> None:
    machine(FREE)
    assert job(HIP_VISIBLE_DEVICES="1").notes == (
        "HIP_VISIBLE_DEVICES=1 is set: ckptool lists NVIDIA GPUs only; on a ROCm build of "
        "torch, cuda:N counts the GPUs HIP_VISIBLE_DEVICES leaves",)


# -- --device-ids ----------------------------------------------------------------

def test_device_ids_that_work(machine: Setup, run_cli: Callable[..., CliResult]) -> None:
    machine(FREE, CUDA_VISIBLE_DEVICES="2,3")
    code, out, err = run_cli("devices", "--device-ids", "1,0")
    assert (code, err) == (0, "")
    text = " ".join(out.split())
    assert ("device_ids [1, 0]: works here: cuda:1 (physical GPU 3), cuda:0 (physical GPU 2)"
            in text)
    assert 'wrap model.to("cuda:1") # device_ids[0]: before wrapping' in text
    assert "model = nn.DataParallel(model, device_ids=[1, 0])" in text
    assert "forward() raises a RuntimeError unless the module's parameters and buffers are " \
           "on cuda:1 (device_ids[0])" in text


def test_device_ids_named_physically(machine: Setup, run_cli: Callable[..., CliResult]) -> None:
    machine(FREE, CUDA_VISIBLE_DEVICES="2,3")
    code, out, _ = run_cli("devices", "--device-ids", "2,3")
    text = " ".join(out.split())
    assert code == 1
    assert "device_ids [2, 3]: fails here with AssertionError: Invalid device id" in text
    assert ("why device_ids 2, 3 are not below torch.cuda.device_count() = 2: this process has "
            "cuda:0 and cuda:1") in text
    assert ("instead device_ids=[0, 1]: if you meant physical GPUs 2, 3 (nvidia-smi's "
            "numbers), they are cuda:0, cuda:1 in this process") in text
    assert 'model.to("cuda:0")' in text
    data = json.loads(run_cli("devices", "--json", "--device-ids", "[3, 2]")[1])
    assert data["data_parallel"] == {
        "device_ids": [3, 2], "works": False, "error": "AssertionError: Invalid device id",
        "problem": "device_ids 3, 2 are not below torch.cuda.device_count() = 2: this process "
                   "has cuda:0 and cuda:1",
        "suggested": [1, 0], "reason": "if you meant physical GPUs 3, 2 (nvidia-smi's numbers), "
                                       "they are cuda:1, cuda:0 in this process",
        "module_device": "cuda:1",
        "snippet": 'model.to("cuda:1")  # device_ids[0]: before wrapping\n'
                   "model = nn.DataParallel(model, device_ids=[1, 0])",
        "warnings": [], "invalid": [3, 2]}


def test_device_ids_named_by_the_scheduler(machine: Setup) -> None:
    machine(FREE, **SLURM)
    found = gpus.probe()
    verdict = dataparallel.check(found, (4, 5), scheduler.read_job(SLURM, found))
    assert verdict.error == dataparallel.INVALID and verdict.suggested == (0, 1)
    assert verdict.reason == ("if you meant the job's node GPUs 4, 5, they are cuda:0, cuda:1 "
                              "in this process")


@pytest.mark.parametrize(("ids", "suggested", "reason"), [
    ((5, 6), (0, 1), "the first 2 of the 4 GPUs this process sees"),
    ((0, 1, 2, 3, 4), (0, 1, 2, 3), "the first 4 of the 4 GPUs this process sees"),
    ((-1,), (0,), "the first 1 of the 4 GPUs this process sees"),
])
def test_device_ids_out_of_range(machine: Setup, ids: tuple[int, ...],
                                 suggested: tuple[int, ...], reason: str) -> None:
    machine(FREE)
    verdict = dataparallel.check(gpus.probe(), ids)
    assert not verdict.works and verdict.error == dataparallel.INVALID
    assert (verdict.suggested, verdict.reason) == (suggested, reason)
    assert verdict.first == "cuda:0"


def test_device_ids_warnings(machine: Setup) -> None:
    machine(FREE, CUDA_VISIBLE_DEVICES="1,2,3")
    verdict = dataparallel.check(gpus.probe(), (1, 2))
    assert verdict.works and verdict.warnings == (
        "device_ids are this process's numbers: cuda:1 (physical GPU 2), cuda:2 (physical GPU "
        "3); if you meant physical GPUs 1, 2 (nvidia-smi's numbers), they are cuda:0, cuda:1 in "
        "this process, so use device_ids=[0, 1]",)
    assert dataparallel.check(gpus.probe(), (0, 0)).warnings[0] == (
        "device_ids repeats 0: two replicas on one GPU run no faster than one")
    machine([100, 100], smi="printf '0, A100, GPU-a, 81920, 100\\n1, T4, GPU-b, 15360, 100\\n'",
            CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES="0,1")
    assert dataparallel.check(gpus.probe(), (0, 1)).warnings == (
        "torch will warn of an imbalance: cuda:1 has less than 75% of the memory of cuda:0, "
        "and every replica waits for the slowest",)


def test_device_ids_without_cuda(machine: Setup, run_cli: Callable[..., CliResult]) -> None:
    machine(None)
    code, out, _ = run_cli("devices", "--device-ids", "0,1")
    text = " ".join(out.split())
    assert code == 1 and "device_ids [0, 1]: does not use the GPUs" in text
    assert ("torch sees no CUDA GPU here (see the note), so DataParallel ignores device_ids "
            "and runs the module on the CPU, unparallelised") in text
    assert "note no NVIDIA driver found (nvidia-smi is not on PATH)" in text
    assert "wrap" not in text
    machine(FREE, cuda=False)  # a CPU-only build of torch beside real GPUs
    assert dataparallel.check(gpus.probe(), (0,)).works is False


def test_torch_says_what_we_quote() -> None:
    """The error texts quoted are torch's own (its source, not a GPU, is checked)."""
    import importlib

    import torch.cuda

    dp = importlib.import_module("torch.nn.parallel.data_parallel")

    assert dataparallel.INVALID.split(": ")[1] in inspect.getsource(
        torch.cuda.get_device_properties)
    assert "(device_ids[0]) but found one of" in inspect.getsource(dp.DataParallel.forward)
    assert "len(self.device_ids) == 1" in inspect.getsource(dp.DataParallel.__init__)
    assert "0.75" in inspect.getsource(dp._check_balance)


# -- review fixes: a driver nothing lists, CPU-only torch, SLURM, --need, eval ----

def test_driver_without_nvml_or_smi_export_asks_no_torch(
        machine: Setup, run_cli: Callable[..., CliResult]) -> None:
    machine(None, driver=True, cuda=None)  # torch_answer raises if torch is asked
    found = gpus.probe(ask_torch=False)
    assert (found.source, found.gpus, found.cuda_available) == ("none", (), False)
    assert found.note == ("an NVIDIA driver is loaded, but NVML cannot be asked (nvidia-ml-py "
                          "is not installed) and nvidia-smi is not on PATH, so which GPUs are "
                          "here is unknown (torch is not asked)")
    code, out, err = run_cli("devices", "--export")
    assert (code, out) == (1, "")
    assert err.endswith("\nhint: install nvidia-ml-py (pip install 'ckptool[gpu]') or put "
                        "nvidia-smi on PATH\n")


def test_driver_with_failing_nvml_and_no_smi_names_both(machine: Setup) -> None:
    machine(None, nvml=nvml_config([], fail="init"), driver=True, cuda=False)
    assert gpus.probe(ask_torch=False).note == (
        "NVML could not start: NVML Shared Library Not Found (asked nvidia-smi instead); an "
        "NVIDIA driver is loaded, but NVML failed and nvidia-smi is not on PATH, so which GPUs "
        "are here is unknown (torch is not asked)")
    assert gpus.probe().note.endswith(
        "an NVIDIA driver is loaded, but NVML failed and nvidia-smi is not on PATH, and torch "
        "cannot use CUDA here")


def test_driver_without_listers_never_imports_torch_for_export(tmp_path: Path) -> None:
    """The reviewer's repro, in a fresh process: no pynvml, no nvidia-smi, a driver."""
    (tmp_path / "driver").mkdir()
    code = (f"import sys; from ckptool.check.gpus import machine as gpus; gpus.DRIVER_DIR = "
            f"{str(tmp_path / 'driver')!r}; m = gpus.probe(ask_torch=False); "
            "print(m.source, 'torch' in sys.modules, 'pynvml' in sys.modules)")
    clean = {k: v for k, v in os.environ.items() if k not in scheduler.WATCHED}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=60, check=True,
                          env={**clean, "PYTHONPATH": str(ROOT), "PATH": str(tmp_path)})
    assert done.stdout.split() == ["none", "False", "False"], done.stderr


def test_device_ids_with_cpu_only_torch_are_still_judged(
        machine: Setup, run_cli: Callable[..., CliResult]) -> None:
    machine(FREE, cuda=False, CUDA_VISIBLE_DEVICES="2,3")
    found = gpus.probe()
    assert found.device_count == 0 and len(found.gpus) == 2
    verdict = dataparallel.check(found, (1, 2))
    assert (verdict.works, verdict.error, verdict.invalid) == (False, None, (2,))
    assert verdict.suggested == (0, 1) and verdict.first == "cuda:0"
    assert verdict.problem == (
        "torch here cannot use the 2 visible GPUs (see the note), so DataParallel ignores "
        "device_ids and runs the module on the CPU, unparallelised; with a CUDA build of "
        "torch, device_ids 2 would not be below torch.cuda.device_count() = 2 (cuda:0 and "
        "cuda:1) and the constructor would raise AssertionError: Invalid device id")
    physical = dataparallel.check(found, (2, 3))  # physical numbers: their cuda:N suggested
    assert physical.suggested == (0, 1) and "physical GPUs 2, 3" in physical.reason
    valid = dataparallel.check(found, (1, 0))
    assert (valid.works, valid.invalid, valid.suggested, valid.use) == (False, (), None, (1, 0))
    assert valid.problem.endswith("with a CUDA build of torch, they would be cuda:1 (physical "
                                  "GPU 3), cuda:0 (physical GPU 2)")
    code, out, _ = run_cli("devices", "--device-ids", "1,2")
    text = " ".join(out.split())
    assert code == 1 and "device_ids [1, 2]: does not use the GPUs" in text
    assert "torch here is a CPU-only build" in text
    assert "instead device_ids=[0, 1]: the first 2 of the 2 GPUs this process sees" in text
    assert 'wrap model.to("cuda:0")' in text
    data = json.loads(run_cli("devices", "--json", "--device-ids", "1,2")[1])["data_parallel"]
    assert (data["works"], data["invalid"], data["suggested"]) == (False, [2], [0, 1])
    assert run_cli("devices", "--device-ids", "1,0")[0] == 1  # valid ids, but a CPU torch


def test_device_ids_invalid_field(machine: Setup) -> None:
    machine(FREE, CUDA_VISIBLE_DEVICES="2,3")
    found = gpus.probe()
    assert dataparallel.check(found, (0, 5, -1)).invalid == (5, -1)
    assert dataparallel.check(found, (0, 1)).invalid == ()
    machine(None)
    assert dataparallel.check(gpus.probe(), (0,)).invalid is None


@pytest.mark.parametrize(("environment", "line"), [
    ({"CUDA_VISIBLE_DEVICES": "0,1"},
     "SLURM job 5: its GPUs are not named by SLURM variables (SLURM_JOB_GPUS and "
     "SLURM_STEP_GPUS are unset); this process sees 2 GPUs through CUDA_VISIBLE_DEVICES=0,1"),
    ({}, "SLURM job 5: its GPUs are not named by SLURM variables (SLURM_JOB_GPUS and "
         "SLURM_STEP_GPUS are unset); this process sees 4 GPUs as the driver lists them "
         "(CUDA_VISIBLE_DEVICES is unset)"),
])
def test_slurm_job_whose_gpus_no_variable_names(
        machine: Setup, run_cli: Callable[..., CliResult], environment: dict[str, str],
        line: str) -> None:
    machine(FREE, SLURM_JOB_ID="5", **environment)
    code, out, _ = run_cli("devices")
    assert code == 0 and f"job {line}" in " ".join(out.split())
    assert "no GPUs" not in out


@pytest.mark.parametrize("need", ["12", "12.5", " 7 ", "0"])
def test_need_without_a_unit_is_refused(machine: Setup, run_cli: Callable[..., CliResult],
                                        need: str) -> None:
    machine(FREE)
    number = need.strip()
    for args in (["--export"], []):
        assert run_cli("devices", *args, "--need", need) == (
            2, "", f"ckptool: error: --need {need!r} has no unit\n"
                   f"hint: say {number}GB or {number}GiB\n")
    assert run_cli("devices", "--export", "--need", "12B")[0] == 0  # bytes, said outright


def test_max_shard_size_still_takes_a_plain_number() -> None:
    from ckptool.write.shards import parse_size

    assert parse_size("12") == 12  # convert's behaviour is unchanged


def test_export_help_says_ties_keep_cuda_order(run_cli: Callable[..., CliResult]) -> None:
    out = " ".join(run_cli("devices", "--help")[1].split())
    assert "most free memory first, ties keeping their cuda:N order" in out
    doc = (ROOT / "docs" / "commands" / "devices.md").read_text(encoding="utf-8")
    assert "ties keep their `cuda:N` order" in " ".join(doc.split())


HOSTILE = ["GPU-abc;touch {d}/semi", "GPU-$(touch {d}/dollar)", "GPU-`touch {d}/tick`",
           "GPU-a b'c\"d&&touch {d}/quote", "GPU-x\ntouch {d}/newline"]


def eval_export(tmp_path: Path, visible: str, nvml: dict[str, Any]) -> tuple[str, str]:
    """(the line --export printed, CUDA_VISIBLE_DEVICES after bash evals it)."""
    smi_script(tmp_path, "exit 9")  # a driver is there; NVML answers
    script = ('line=$("$PY" -m ckptool devices --export) || exit 3; printf "%s\\0" "$line"; '
              'eval "$line"; printf "%s" "$CUDA_VISIBLE_DEVICES"')
    done = run(["bash", "-c", script], os.pathsep.join([str(tmp_path), "/usr/bin", "/bin"]),
               CUDA_VISIBLE_DEVICES=visible, FAKE_NVML=json.dumps(nvml))
    assert done.returncode == 0, done.stderr
    line, _, value = done.stdout.partition("\0")
    return line, value


def test_export_of_hostile_uuids_runs_nothing_under_eval(tmp_path: Path) -> None:
    import shlex

    d = tmp_path / "made"
    d.mkdir()
    uuids = [u.format(d=d) for u in HOSTILE[:4]]
    nvml = {"gpus": [[A100, u, 81920, f] for u, f in zip(uuids, FREE, strict=True)]}
    visible = ",".join(reversed(uuids))  # the export reorders: most free first
    line, value = eval_export(tmp_path, visible, nvml)
    assert value == ",".join([uuids[0], uuids[1], uuids[3], uuids[2]])  # a tie: cuda:N order
    assert shlex.split(line) == ["export", f"CUDA_VISIBLE_DEVICES={value}"]
    # MIG entries are handed on as written, whatever they hold
    mig = ",".join(u.replace("GPU-", "MIG-", 1) for u in [*HOSTILE[:2], HOSTILE[4]]).format(d=d)
    line, value = eval_export(tmp_path, mig, nvml_config(FREE))
    assert value == mig and shlex.split(line) == ["export", f"CUDA_VISIBLE_DEVICES={mig}"]
    assert list(d.iterdir()) == []


@pytest.mark.parametrize(("visible", "exported"), [
    (" 1gpu, 03,2", "1,3,2"),
    ("3;touch {d}/x,1$(touch {d}/y)", "1,3"),
    ("+2,0`touch {d}/z`", "0,2"),
])
def test_export_normalises_numeric_entries(tmp_path: Path, visible: str, exported: str) -> None:
    d = tmp_path / "made"
    d.mkdir()
    line, value = eval_export(tmp_path, visible.format(d=d), nvml_config(FREE))
    assert (line, value) == (f"export CUDA_VISIBLE_DEVICES={exported}", exported)
    assert list(d.iterdir()) == []
