"""The GPU probe and ``ckptool devices``: CUDA_VISIBLE_DEVICES read exactly
as torch reads it, nvidia-smi faked by a script first on PATH, torch's
answer faked by replacing ``gpus._torch_cuda``, and a CPU-only machine that
never imports torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.cuda

from ckptool.check import loadcheck
from ckptool.check.gpus import machine as gpus
from ckptool.check.gpus import scheduler
from ckptool.check.gpus.machine import Gpu, Machine
from ckptool.cli import main
from ckptool.describe import human_bytes

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
DP = SAMPLES / "dataparallel_cuda2.pth"  # every tensor saved on cuda:2
LIGHTNING = SAMPLES / "lightning.ckpt"  # every tensor saved on cpu
MIB = 1024 * 1024

UUIDS = ["GPU-0a1b2c3d-1111-2222-3333-444444444444", "GPU-0a9f0000-1111-2222-3333-444444444444",
         "GPU-7c000000-1111-2222-3333-444444444444", "GPU-d1e2f3a4-1111-2222-3333-444444444444"]
PHYSICAL = [Gpu(i, i, "NVIDIA A100-SXM4-80GB", u, 81920 * MIB, 1000 * MIB)
            for i, u in enumerate(UUIDS)]


def torch_visible(monkeypatch: pytest.MonkeyPatch, value: str) -> list[int] | list[str]:
    """What torch's own parser makes of CUDA_VISIBLE_DEVICES=value, resolved
    against PHYSICAL the way torch's NVML device count resolves it."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    parsed = torch.cuda._parse_visible_devices()
    if parsed and isinstance(parsed[0], str):
        if parsed[0].startswith("MIG-"):
            return parsed  # torch leaves MIG instances to the CUDA driver
        return torch.cuda._transform_uuid_to_ordinals(parsed, UUIDS)
    ordinals = [int(x) for x in parsed]
    for i, n in enumerate(ordinals):  # torch: the first index past the last GPU ends the list
        if n >= len(PHYSICAL):
            return ordinals[:i]
    return ordinals


VALUES = ["0", "3", "1,2", "2,0", "3,1,0,2", "1gpu2,2ampere", " 2 , 0", "+1", "1-2", "0x1",
          "-1", "0,-1,1", "gpu1", ",1", "0,", "", "0,0", "1,2,1", "0,-1,0", "0,7,1", "4",
          "GPU-0a1b", "GPU-0a9,GPU-7c", "GPU-0a", "GPU-", "GPU-ff", "GPU-7c,GPU-7c",
          "GPU-7c,GPU-7c000000", "GPU-d1e2,0", "GPU-7c,,GPU-0a1",
          "MIG-4d1a0000-aaaa-bbbb-cccc-dddddddddddd,MIG-4d1a0000-aaaa-bbbb-cccc-eeeeeeeeeeee",
          "MIG-x,MIG-x"]


@pytest.mark.parametrize("value", VALUES)
def test_parse_visible_matches_torch(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    expected = torch_visible(monkeypatch, value)
    got = gpus.parse_visible(value, PHYSICAL)
    assert [g.index for g in got] == list(range(len(got)))
    if expected and isinstance(expected[0], str):  # MIG: unresolved, kept by UUID
        assert [g.uuid for g in got] == expected and all(g.physical is None for g in got)
    else:
        assert [g.physical for g in got] == expected
        assert all(g.uuid == UUIDS[g.physical] for g in got if g.physical is not None)


def test_parse_visible_corner_cases() -> None:
    def physical(value: str | None) -> list[int | None]:
        return [g.physical for g in gpus.parse_visible(value, PHYSICAL)]

    assert physical(None) == [0, 1, 2, 3]
    assert physical("3,1") == [3, 1]
    assert gpus.parse_visible("3,1", PHYSICAL)[0].index == 0
    assert physical("--1,0") == []  # torch's own parser raises on this one
    assert physical("1,1") == [] and physical("") == []


@pytest.mark.parametrize(("value", "note"), [
    ("", 'CUDA_VISIBLE_DEVICES="" hides all 4 GPUs'),
    ("-1", 'CUDA_VISIBLE_DEVICES="-1" hides all 4 GPUs'),
    ("1,2", 'CUDA_VISIBLE_DEVICES="1,2" hides 2 of 4 GPUs'),
    ("0,0", 'CUDA_VISIBLE_DEVICES="0,0" repeats a device, so CUDA shows none'),
    ("0,7,1", 'CUDA_VISIBLE_DEVICES="0,7,1" hides 3 of 4 GPUs: "7" names no GPU here, '
              "so CUDA ignores it and every entry after it"),
    ("3,2,1,0", ""),
])
def test_visible_notes(value: str, note: str) -> None:
    assert gpus._parse(value, PHYSICAL)[1] == note


def smi_script(folder: Path, body: str) -> None:
    """A fake nvidia-smi in ``folder`` that runs ``body`` (sh)."""
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)


def csv(free_mib: list[int], names: list[str] | None = None) -> str:
    rows = [f"{i}, {(names or ['NVIDIA A100-SXM4-80GB'] * 4)[i]}, {UUIDS[i]}, 81920, {free}"
            for i, free in enumerate(free_mib)]
    return "cat <<'CSV'\n" + "\n".join(rows) + "\nCSV"


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """fake(smi_body, torch=(available, count) or None for "must not be asked")."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    monkeypatch.setattr(gpus, "DRIVER_DIR", str(tmp_path / "no-driver"))
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-smi answers, never a real NVML
    for var in scheduler.WATCHED:  # nor the job this test may run in
        if var != "CUDA_VISIBLE_DEVICES":
            monkeypatch.delenv(var, raising=False)

    def setup(smi_body: str | None, torch: tuple[bool, int] | None = None) -> None:
        if smi_body is not None:
            smi_script(bin_dir, smi_body)
        else:  # only our empty folder on PATH: no nvidia-smi anywhere
            monkeypatch.setenv("PATH", str(bin_dir))

        def answer() -> tuple[bool, int]:
            if torch is None:
                raise AssertionError("torch was asked")
            return torch

        monkeypatch.setattr(gpus, "_torch_cuda", answer)

    return setup


def test_probe_reads_nvidia_smi(fake: Callable[..., None]) -> None:
    fake(csv([100, 200, 300, 400]), torch=(True, 4))
    machine = gpus.probe()
    assert machine.source == "nvidia-smi" and machine.cuda_available
    assert machine.device_count == 4 and machine.visible_env is None and machine.note == ""
    assert machine.gpus[2] == Gpu(2, 2, "NVIDIA A100-SXM4-80GB", UUIDS[2], 81920 * MIB,
                                  300 * MIB)


def test_probe_applies_cuda_visible_devices(fake: Callable[..., None],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    fake(csv([100, 200, 300, 400]), torch=(True, 2))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    machine = gpus.probe()
    assert [(g.index, g.physical, g.free_bytes) for g in machine.gpus] == [
        (0, 2, 300 * MIB), (1, 0, 100 * MIB)]
    assert machine.visible_env == "2,0"
    assert machine.note == 'CUDA_VISIBLE_DEVICES="2,0" hides 2 of 4 GPUs'


def test_probe_hidden_gpus_never_ask_torch(fake: Callable[..., None],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    fake(csv([100, 200]), torch=None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    machine = gpus.probe()
    assert machine.gpus == () and machine.device_count == 0 and not machine.cuda_available
    assert machine.note == 'CUDA_VISIBLE_DEVICES="" hides all 2 GPUs'


def test_probe_cpu_only_torch(fake: Callable[..., None]) -> None:
    fake(csv([100, 200]), torch=(False, 0))
    machine = gpus.probe()
    assert len(machine.gpus) == 2 and not machine.cuda_available and machine.device_count == 0
    assert "torch here is a CPU-only build" in machine.note
    assert gpus.pick(machine, 1) is None


def test_probe_trusts_torch_count(fake: Callable[..., None]) -> None:
    fake(csv([100, 200, 300]), torch=(True, 2))
    machine = gpus.probe()
    assert [g.physical for g in machine.gpus] == [0, 1] and machine.device_count == 2
    assert "torch counts 2 CUDA devices where nvidia-smi and CUDA_VISIBLE_DEVICES give 3" \
        in machine.note


def test_probe_warns_about_device_order(fake: Callable[..., None],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    fake(csv([100, 200], ["NVIDIA A100", "NVIDIA T4"]), torch=(True, 2))
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in gpus.probe().note
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert gpus.probe().note == ""


@pytest.mark.parametrize(("body", "note"), [
    ("echo 'Failed to initialize NVML: Driver/library version mismatch' >&2; exit 9",
     "nvidia-smi failed (exit 9): Failed to initialize NVML: Driver/library version mismatch"),
    ("echo 'No devices were found'; exit 6", "nvidia-smi failed (exit 6): No devices were found"),
    ("echo 'this is not, csv'", "nvidia-smi printed what ckptool cannot read: 'this is not, csv'"),
])
def test_probe_broken_nvidia_smi(fake: Callable[..., None], body: str, note: str) -> None:
    fake(body, torch=None)
    machine = gpus.probe()
    assert machine == Machine((), False, None, "none", note)


def test_probe_without_nvidia_smi(fake: Callable[..., None]) -> None:
    fake(None, torch=None)
    machine = gpus.probe()
    assert machine.source == "none" and machine.gpus == () and machine.device_count == 0
    assert machine.note == "no NVIDIA driver found (nvidia-smi is not on PATH)"


def test_probe_falls_back_to_torch_where_a_driver_is_loaded(
        fake: Callable[..., None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake(None, torch=(True, 2))
    monkeypatch.setattr(gpus, "DRIVER_DIR", str(tmp_path))
    monkeypatch.setattr(gpus, "_torch_gpus", lambda n: [
        Gpu(i, None, "NVIDIA L4", None, 24 * 2**30, None) for i in range(n)])
    machine = gpus.probe()
    assert machine.source == "torch" and machine.device_count == 2
    assert "free memory unknown" in machine.note


def test_pick_most_free_then_lowest_index() -> None:
    def machine(*free: int | None) -> Machine:
        return Machine(tuple(Gpu(i, i, "g", None, 10, f) for i, f in enumerate(free)), True,
                       None, "nvidia-smi", "")

    def picked(*free: int | None) -> int | None:
        gpu = gpus.pick(machine(*free), 1)
        return None if gpu is None else gpu.index

    assert picked(5, 9, 7) == 1
    assert picked(9, 5, 9) == 0
    assert picked(None, 3) == 1  # known free memory beats unknown
    assert picked() is None
    off = Machine(machine(5).gpus, False, None, "nvidia-smi", "")
    assert gpus.pick(off, 1) is None
    assert gpus.fits(machine(5).gpus[0], 5) is True
    assert gpus.fits(machine(5).gpus[0], 6) is False
    assert gpus.fits(machine(None).gpus[0], 6) is None


def test_assumed_and_missing_devices() -> None:
    two = gpus.assumed(2)
    assert two.device_count == 2 and two.source == "assumed" and two.platform == "linux"
    assert [g.index for g in two.gpus] == [0, 1] and two.gpus[0].free_bytes is None
    assert gpus.assumed(0).cuda_available is False
    assert loadcheck.missing_devices(two, ["cuda:2", "cuda:1", "cuda", "cpu", "mps",
                                      "unrecorded"]) == ["cuda:2", "mps"]
    assert loadcheck.missing_devices(gpus.assumed(0), ["cuda"]) == ["cuda"]


TORCH_LOADED = "import sys; print('torch' in sys.modules)"


def python(code: str, env: dict[str, str]) -> str:
    root = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": root, **env}, cwd=root,
                          check=True, timeout=60)
    return proc.stdout.strip()


@pytest.mark.skipif(os.path.exists("/proc/driver/nvidia"),
                    reason="an NVIDIA driver is loaded: probe() rightly asks torch")
def test_cpu_only_machine_never_imports_torch(tmp_path: Path) -> None:
    code = f"import ckptool.check.gpus.machine as g; g.probe(); {TORCH_LOADED}"
    assert python(code, {"PATH": str(tmp_path)}) == "False"
    code = ("import io, contextlib; from ckptool.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    main(['devices', '--json', {str(DP)!r}])\n"
            "import sys; print(sorted(m for m in ('torch', 'rich', 'pynvml') if m in sys.modules))")
    assert python(code, {"PATH": str(tmp_path)}) == "[]"


def test_hidden_gpus_never_import_torch(tmp_path: Path) -> None:
    smi_script(tmp_path, csv([100, 200]))
    code = f"import ckptool.check.gpus.machine as g; assert g.probe().gpus == (); {TORCH_LOADED}"
    assert python(code, {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
                         "CUDA_VISIBLE_DEVICES": ""}) == "False"


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
        ) -> Callable[..., tuple[int, str, str]]:
    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setenv("NO_COLOR", "1")

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def two_of_four(fake: Callable[..., None], monkeypatch: pytest.MonkeyPatch,
                free_mib: list[int]) -> None:
    fake(csv(free_mib), torch=(True, 2))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")


@pytest.mark.parametrize(("free_mib", "best", "physical"), [
    ([90000, 20480, 60000, 81000], 1, 2),  # physical GPU 3 has most, but it is hidden
    ([90000, 70000, 60000, 81000], 0, 1),
])
def test_devices_command_recommends_most_free(
        fake: Callable[..., None], monkeypatch: pytest.MonkeyPatch,
        cli: Callable[..., tuple[int, str, str]], free_mib: list[int], best: int,
        physical: int) -> None:
    two_of_four(fake, monkeypatch, free_mib)
    code, out, err = cli("devices", str(DP))
    assert code == 0 and err == ""
    assert "2 GPUs visible to CUDA (from nvidia-smi)" in out
    assert ("CUDA_VISIBLE_DEVICES=1,2: physical GPU 1 is cuda:0, physical GPU 2 is cuda:1"
            in out)
    assert 'CUDA_VISIBLE_DEVICES="1,2" hides 2 of 4 GPUs' in out
    rows = [[c.strip() for c in line.split("│")] for line in out.splitlines()
            if line.startswith("cuda:")]
    name = "NVIDIA A100-SXM4-80GB"
    assert rows == [["cuda:0", "1", name, "85.9 GB", human_bytes(free_mib[1] * MIB)],
                    ["cuda:1", "2", name, "85.9 GB", human_bytes(free_mib[2] * MIB)]]
    text = " ".join(out.split())  # long sample paths wrap
    assert f"use cuda:{best} (physical GPU {physical}) · " in text and ": fits" in text
    assert "saved on cuda:2, which this machine lacks: a plain torch.load fails here" in text
    assert f'load torch.load("{DP}", map_location="cuda:{best}")' in text
    assert f"or fix ckptool fix {DP} --to cuda:{best}" in text


def test_devices_json(fake: Callable[..., None], monkeypatch: pytest.MonkeyPatch,
                      cli: Callable[..., tuple[int, str, str]]) -> None:
    two_of_four(fake, monkeypatch, [90000, 20480, 60000, 81000])
    code, out, err = cli("devices", "--json", str(DP))
    assert code == 0 and err == ""
    data = json.loads(out)
    assert data["schema_version"] == 1 and data["source"] == "nvidia-smi"
    assert data["cuda_visible_devices"] == "1,2" and data["cuda_available"] is True
    assert data["device_count"] == 2
    assert data["gpus"] == [
        {"index": 0, "physical": 1, "name": "NVIDIA A100-SXM4-80GB", "uuid": UUIDS[1],
         "total_bytes": 81920 * MIB, "free_bytes": 20480 * MIB, "node": None},
        {"index": 1, "physical": 2, "name": "NVIDIA A100-SXM4-80GB", "uuid": UUIDS[2],
         "total_bytes": 81920 * MIB, "free_bytes": 60000 * MIB, "node": None}]
    assert data["checkpoint"] == {"path": str(DP), "nbytes": 2712, "locations": ["cuda:2"],
                                  "missing_devices": ["cuda:2"]}
    assert data["recommended"] == {"device": "cuda:1", "physical": 2,
                                   "free_bytes": 60000 * MIB, "need_bytes": 2712,
                                   "fits": True}
    assert data["environment"] == {"CUDA_VISIBLE_DEVICES": "1,2"}
    assert data["scheduler"] is None and data["data_parallel"] is None
    assert data["export"]["command"] == "export CUDA_VISIBLE_DEVICES=2,1"
    code, out, _ = cli("devices", "--json")
    assert json.loads(out)["checkpoint"] is None and json.loads(out)["recommended"] is None


def test_devices_when_nothing_fits(fake: Callable[..., None], monkeypatch: pytest.MonkeyPatch,
                                   cli: Callable[..., tuple[int, str, str]]) -> None:
    two_of_four(fake, monkeypatch, [0, 0, 0, 0])
    code, out, _ = cli("devices", str(DP))
    text = " ".join(out.split())
    assert code == 0 and 'does not fit on any GPU here; load it with map_location="cpu"' in text


def test_devices_cpu_only(fake: Callable[..., None],
                          cli: Callable[..., tuple[int, str, str]]) -> None:
    fake(None, torch=None)
    code, out, err = cli("devices", str(DP))
    assert code == 0 and err == ""
    text = " ".join(out.split())
    assert "gpus none: no CUDA GPU is visible here" in text
    assert "note no NVIDIA driver found (nvidia-smi is not on PATH)" in text
    assert "saved on cuda:2, which this machine lacks: a plain torch.load fails here" in text
    assert "use cpu (no CUDA GPU torch can use here)" in text
    assert f'load torch.load("{DP}", map_location="cpu")' in text
    assert f"or fix ckptool fix {DP} --to cpu" in text
    assert "┃" not in out  # no GPU table
    code, out, _ = cli("devices", "--json", str(DP))
    data = json.loads(out)
    assert data["gpus"] == [] and data["cuda_available"] is False and data["source"] == "none"
    assert data["recommended"] == {"device": "cpu", "physical": None, "free_bytes": None,
                                   "need_bytes": None, "fits": None}
    code, out, _ = cli("devices", str(LIGHTNING))
    assert code == 0 and "saved on    cpu: loads here as saved" in out
    assert "ckptool fix" not in out
    code, out, _ = cli("devices")
    assert code == 0 and "checkpoint" not in out and "no CUDA GPU is visible here" in out


def test_devices_unreadable_checkpoint(cli: Callable[..., tuple[int, str, str]]) -> None:
    code, out, err = cli("devices", "/no/such/file.pth")
    assert code == 3 and out == "" and err.startswith("ckptool: error: ")


@pytest.mark.parametrize("width", [60, 100])
def test_devices_output_fits_width(fake: Callable[..., None], monkeypatch: pytest.MonkeyPatch,
                                   cli: Callable[..., tuple[int, str, str]], width: int) -> None:
    two_of_four(fake, monkeypatch, [90000, 20480, 60000, 81000])
    monkeypatch.setenv("COLUMNS", str(width))
    _, out, _ = cli("devices", str(DP))
    assert max(len(line) for line in out.splitlines()) <= width
