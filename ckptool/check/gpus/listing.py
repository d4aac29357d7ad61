"""The physical GPUs the NVIDIA driver lists: from NVML (the ``nvidia-ml-py``
binding, module ``pynvml``) where it is installed, else from ``nvidia-smi``.

Both list the GPUs in the same order (PCI bus order, nvidia-smi's index)
and neither looks at ``CUDA_VISIBLE_DEVICES`` or creates a CUDA context.
``pynvml`` is optional and imported only when called, which ``gpus.probe``
does only where a driver is there. Each query returns ``(gpus, "")`` or
``(None, why)`` when it cannot be asked, never raising for a missing or
broken driver; ``query_smi`` gives ``([], why)`` when nvidia-smi is there
but fails.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

SMI_QUERY = ("--query-gpu=index,name,uuid,memory.total,memory.free",
             "--format=csv,noheader,nounits")
SMI_TIMEOUT_S = 10.0
NO_NVML = "nvidia-ml-py is not installed"  # the one NVML answer not worth a note
NO_DRIVER = "no NVIDIA driver found (nvidia-smi is not on PATH)"
_MIB = 1024 * 1024


@dataclass(frozen=True)
class Gpu:
    index: int  # logical index: torch's cuda:<index>
    physical: int | None  # nvidia-smi's index (PCI bus order); None if unknown
    name: str
    uuid: str | None
    total_bytes: int | None
    free_bytes: int | None  # None when unknown


def query_nvml() -> tuple[list[Gpu] | None, str]:
    """(GPUs, "") from NVML; (None, why) when nvidia-ml-py is not installed
    or NVML fails (no library, driver/library mismatch, a GPU lost...)."""
    try:
        import pynvml
    except ImportError:
        return None, NO_NVML
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return None, f"NVML could not start: {exc}"
    try:
        return [_nvml_gpu(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())], ""
    except pynvml.NVMLError as exc:
        return None, f"NVML failed: {exc}"
    finally:
        # what NVML said is already read: a failed shutdown changes none of it
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def _nvml_gpu(pynvml: Any, i: int) -> Gpu:
    handle = pynvml.nvmlDeviceGetHandleByIndex(i)
    total: int | None
    free: int | None
    try:
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        total, free = int(memory.total), int(memory.free)
    except pynvml.NVMLError_NotSupported:  # as nvidia-smi's "[N/A]"
        total = free = None
    uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
    return Gpu(i, i, _text(pynvml.nvmlDeviceGetName(handle)),
               uuid if uuid.startswith(("GPU-", "MIG-")) else None, total, free)


def _text(value: str | bytes) -> str:
    """nvidia-ml-py before 11.515 returns bytes, later versions str."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def query_smi() -> tuple[list[Gpu] | None, str]:
    """(GPUs, "") from nvidia-smi; (None, why) when it is missing,
    ([], why) when it fails or says something we cannot read."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, NO_DRIVER
    try:
        proc = subprocess.run([smi, *SMI_QUERY], capture_output=True, text=True,
                              timeout=SMI_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return [], f"nvidia-smi did not answer within {SMI_TIMEOUT_S:g} s"
    except OSError as exc:
        return [], f"nvidia-smi could not run: {exc.strerror or exc}"
    if proc.returncode != 0:
        return [], f"nvidia-smi failed (exit {proc.returncode}): {_first_line(proc)}"
    gpus = []
    for line in proc.stdout.splitlines():
        if not line.strip():
            continue
        gpu = _smi_row(line)
        if gpu is None:
            return [], f"nvidia-smi printed what ckptool cannot read: {line.strip()!r}"
        gpus.append(gpu)
    return gpus, ""


def _smi_row(line: str) -> Gpu | None:
    fields = [f.strip() for f in line.split(",")]
    if len(fields) < 5 or not fields[0].isdigit():
        return None
    index = int(fields[0])
    name = ", ".join(fields[1:-3])  # a name with a comma stays whole
    uuid = fields[-3] if fields[-3].startswith(("GPU-", "MIG-")) else None
    return Gpu(index, index, name, uuid, _mib(fields[-2]), _mib(fields[-1]))


def _mib(text: str) -> int | None:
    return int(text) * _MIB if text.isdigit() else None  # "[N/A]" on some boards


def _first_line(proc: subprocess.CompletedProcess[str]) -> str:
    for text in (proc.stderr, proc.stdout):
        for line in text.splitlines():
            if line.strip():
                return line.strip()
    return "no message"
