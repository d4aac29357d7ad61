"""``ckptool explain``: each error message, as torch itself raises it where
this CPU-only machine can make it (``torch.load`` of CUDA- and mps-tagged
files, ``load_state_dict`` mismatches on real modules, ``weights_only``
refusals) and as torch's source words it otherwise (DataParallel, device
mismatches, CUDA out of memory); inside real tracebacks and noisy logs;
``--checkpoint`` printing a fix command that works as printed; the JSON
report, the ways text comes in, and the exit codes."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CliResult
from helpers import SAMPLES, make_samples, saved_on
from nets import Net
from torch import nn

from ckptool.check.explain.patterns import size_bytes
from ckptool.check.explain.run import explain
from ckptool.check.explain.scan import find_errors, normalise

ROOT = Path(__file__).resolve().parent.parent
NETS = Path(__file__).resolve().parent / "nets.py"
Run = Callable[..., CliResult]


def raised(action: Callable[[], Any]) -> str:
    """What a user's log shows when ``action`` fails: the whole traceback."""
    try:
        action()
    except Exception:  # any error torch raises is the material here
        return traceback.format_exc()
    raise AssertionError("expected an error")


def codes(text: str, **kwargs: Any) -> list[str]:
    return [f.code for f in explain(text, **kwargs).findings]


def only(text: str, code: str) -> Any:
    exp = explain(text)
    assert [f.code for f in exp.findings] == [code], exp.findings
    return exp.findings[0], exp.input


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Paths as a user in their folder gives them: fix commands print them so."""
    monkeypatch.chdir(tmp_path)


def save_on(tag: str, obj: Any, name: str = "model.pth") -> str:
    with saved_on(tag):
        torch.save(obj, name)
    return name


def count_gpus(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """torch told it has ``n`` CUDA GPUs, as on the machine the error came from."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def prefixed(sd: dict[str, torch.Tensor], prefix: str) -> OrderedDict[str, torch.Tensor]:
    return OrderedDict((prefix + k, v) for k, v in sd.items())


# -- torch.load and devices: torch's own errors ----------------------------------

def test_cuda_index_past_the_device_count(monkeypatch: pytest.MonkeyPatch) -> None:
    path = save_on("cuda:2", {"w": torch.ones(2)})
    count_gpus(monkeypatch, 2)
    text = raised(lambda: torch.load(path))
    assert "CUDA device 2 but torch.cuda.device_count() is 2" in text
    finding, facts = only(text, "device-unavailable")
    assert (facts["device"], facts["device_index"], facts["device_count"]) == ("cuda:2", 2, 2)
    assert facts["exception"] == "RuntimeError" and facts["kind"] == "device-unavailable"
    assert finding.fix == "ckptool fix CKPT --map cuda:2=cuda:0"
    assert finding.snippet == "torch.load(path, map_location={'cuda:2': 'cuda:0'})"
    assert "sees 2 CUDA GPUs (cuda:0, cuda:1)" in finding.message
    assert "CUDA_VISIBLE_DEVICES numbers the GPUs it shows from cuda:0" in finding.message


def test_cuda_file_on_a_cpu_only_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    text = raised(lambda: torch.load(save_on("cuda:1", {"w": torch.ones(2)})))
    assert "torch.cuda.is_available() is False" in text
    finding, facts = only(text, "device-unavailable")
    assert facts["device_count"] == 0 and facts["device"] == "cuda"
    assert finding.fix == "ckptool fix CKPT --to cpu"
    assert finding.snippet == "torch.load(path, map_location='cpu')"


def test_mps_file_on_linux() -> None:
    text = raised(lambda: torch.load(save_on("mps", {"w": torch.ones(2)})))
    assert "Storage device not recognized: mps" in text
    finding, facts = only(text, "device-unavailable")
    assert facts["device"] == "mps" and "only on macOS" in finding.message
    assert finding.fix == "ckptool fix CKPT --to cpu"


@pytest.mark.parametrize("tag, device", [("xpu:0", "xpu"), ("hpu:0", "hpu"),
                                         ("foo:1", "foo:1")])
def test_other_devices(tag: str, device: str) -> None:
    text = raised(lambda: torch.load(save_on(tag, {"w": torch.ones(2)})))
    assert only(text, "device-unavailable")[1]["device"] == device


# -- load_state_dict: keys and shapes on real modules ---------------------------

def test_dataparallel_prefix_to_strip() -> None:
    sd = prefixed(Net(8).state_dict(), "module.")
    text = raised(lambda: Net(8).load_state_dict(sd))
    exp = explain(text)
    assert [f.code for f in exp.findings] == ["key-prefix"]
    [finding] = exp.findings
    assert exp.input["model_class"] == "Net"
    # BatchNorm fills in num_batches_tracked, which torch then does not call missing
    assert exp.input["unexpected"] == list(sd) and exp.input["missing"] == [
        k.removeprefix("module.") for k in sd if "num_batches" not in k]
    assert "'module.' in front (DataParallel/DDP)" in finding.message
    assert "without 'module.', the 9 unexpected keys are what Net expects" in finding.message
    assert finding.fix == "ckptool fix CKPT --strip-prefix module."
    assert finding.snippet == ("model.load_state_dict({k.removeprefix('module.'): v "
                               "for k, v in sd.items()})")


def test_wrapped_model_wants_the_prefix_added() -> None:
    """A plain state dict loaded into nn.DataParallel(model): add 'module.'."""
    wrapped = nn.DataParallel(Net(8))  # no GPU: a pass-through, keys still 'module.'
    text = raised(lambda: wrapped.load_state_dict(Net(8).state_dict()))
    finding, facts = only(text, "key-prefix")
    assert facts["model_class"] == "DataParallel"
    assert finding.fix == "ckptool fix CKPT --add-prefix module."
    assert finding.snippet.startswith("model.module.load_state_dict(sd)")


def test_nested_compile_prefix_with_leftovers() -> None:
    """torch.compile over DDP, and keys the model truly lacks or has extra."""
    sd = prefixed(Net(8).state_dict(), "_orig_mod.module.")
    del sd["_orig_mod.module.bn.running_var"]
    sd["_orig_mod.module.temperature"] = torch.ones(1)
    exp = explain(raised(lambda: Net(8).load_state_dict(sd)))
    assert [f.code for f in exp.findings] == ["key-prefix", "missing-keys", "unexpected-keys"]
    prefix, missing, unexpected = exp.findings
    assert prefix.fix == "ckptool fix CKPT --strip-prefix _orig_mod.module."
    assert "torch.compile over DataParallel/DDP" in prefix.message
    assert missing.keys == ("bn.running_var",)
    assert unexpected.keys == ("_orig_mod.module.temperature",)


def test_shape_mismatch_names_the_dimension() -> None:
    model = make_samples.TinyNet()
    text = raised(lambda: model.load_state_dict(make_samples.TinyNet(classes=12).state_dict()))
    finding, facts = only(text, "shape-mismatch")
    assert facts["mismatched"] == [
        {"key": "fc.weight", "checkpoint": [12, 8], "model": [10, 8]},
        {"key": "fc.bias", "checkpoint": [12], "model": [10]}]
    assert "every mismatched dimension is 12 in the checkpoint and 10 in the model" in \
        finding.message
    assert finding.keys == ("fc.weight", "fc.bias")
    assert "if k not in ('fc.weight', 'fc.bias')}, strict=False)" in finding.snippet


def test_whole_training_dict_given_to_load_state_dict() -> None:
    checkpoint = {"epoch": 3, "state_dict": Net(8).state_dict(), "optimizer": {}}
    finding, _ = only(raised(lambda: Net(8).load_state_dict(checkpoint)), "wrapped-state-dict")
    assert finding.fix == "ckptool fix CKPT --extract"
    assert finding.snippet == "model.load_state_dict(torch.load(path)['state_dict'])"


def test_batchnorm_statistics_missing() -> None:
    sd = {k: v for k, v in Net(8).state_dict().items() if "running" not in k}
    finding, _ = only(raised(lambda: Net(8).load_state_dict(sd)), "missing-keys")
    assert "BatchNorm running statistics" in finding.message


# -- weights_only refusals --------------------------------------------------------

def test_argparse_namespace_refused() -> None:
    path = save_on("cpu", {"args": argparse.Namespace(lr=0.1), "w": torch.ones(2)})
    text = raised(lambda: torch.load(path))
    finding, facts = only(text, "weights-only")
    assert facts["globals"] == ["argparse.Namespace"]
    assert facts["exception"] == "_pickle.UnpicklingError"
    assert "argparse.Namespace (plain data, safe to allow)" in finding.message
    assert "`ckptool inspect CKPT`" in finding.message and "ckptool.load(path)" in \
        finding.message
    assert finding.fix == "ckptool fix CKPT --extract"
    assert finding.snippet.startswith(
        "torch.serialization.add_safe_globals([argparse.Namespace])")


def test_pickled_module_class_refused() -> None:
    text = raised(lambda: torch.load(SAMPLES / "whole_model_cuda1.pth", map_location="cpu"))
    finding, facts = only(text, "weights-only")
    assert facts["globals"] == ["__main__.TinyNet"]
    assert "a class from your code" in finding.message
    assert finding.snippet.startswith("ckptool.load(path)")


def test_hostile_file_refused() -> None:
    text = raised(lambda: torch.load(SAMPLES / "hostile_runs_code.pth"))
    finding, facts = only(text, "unsafe-globals")
    assert facts["blocked"] == ["posix.system"]
    assert "Never load this file with weights_only=False" in finding.message


def test_older_wordings_of_weights_only() -> None:
    """torch 2.0-2.3 said 'Unsupported class'; 2.4's message had no '(1)/(2)'."""
    old = ("_pickle.UnpicklingError: Weights only load failed. Re-running `torch.load` with "
           "`weights_only` set to `False` will likely succeed, but it can result in arbitrary "
           "code execution.Do it only if you get the file from a trusted source. "
           "WeightsUnpickler error: Unsupported class argparse.Namespace")
    assert only(old, "weights-only")[1]["globals"] == ["argparse.Namespace"]
    reduce = ("_pickle.UnpicklingError: Weights only load failed. ... WeightsUnpickler error: "
              "Trying to call reduce for unrecognized function <class 'collections.Counter'>")
    assert only(reduce, "weights-only")[1]["globals"] == ["collections.Counter"]


def test_torchscript_archive_refused() -> None:
    text = raised(lambda: torch.load(SAMPLES / "tinynet_script.pt"))
    finding, _ = only(text, "torchscript")
    assert finding.fix == "ckptool convert CKPT weights.pth"


# -- GPU placement: torch's source wordings ---------------------------------------

INVALID_ID = """\
$ CUDA_VISIBLE_DEVICES=0,1 python train.py
Traceback (most recent call last):
  File "train.py", line 14, in <module>
    model = nn.DataParallel(model, device_ids=[1, 2])
  File "/venv/site-packages/torch/nn/parallel/data_parallel.py", line 160, in __init__
    _check_balance(self.device_ids)
  File "/venv/site-packages/torch/cuda/__init__.py", line 740, in get_device_properties
    raise AssertionError("Invalid device id")
AssertionError: Invalid device id
"""


def test_invalid_device_id_renumbering() -> None:
    finding, facts = only(INVALID_ID, "invalid-device-id")
    assert facts["device_ids"] == [1, 2] and facts["cuda_visible_devices"] == "0,1"
    assert "this process sees 2 GPUs, cuda:0 to cuda:1" in finding.message
    assert "renumbered cuda:0 (GPU 0), cuda:1 (GPU 1)" in finding.message
    # the code change is the fix: exporting other GPUs can leave a SLURM allocation
    assert finding.fix == "model = nn.DataParallel(model, device_ids=[0, 1])"
    assert finding.snippet is None
    assert "(export CUDA_VISIBLE_DEVICES=1,2) and keep device_ids=[0, 1]; not under SLURM" in \
        finding.message


def test_invalid_device_id_with_visible_gpus_named_by_their_numbers() -> None:
    text = INVALID_ID.replace("=0,1", "=2,3").replace("[1, 2]", "[2, 3]")
    finding, _ = only(text, "invalid-device-id")
    assert "the GPUs 2, 3 are cuda:0, cuda:1 here" in finding.message
    assert finding.fix == "ckptool devices --device-ids 2,3"  # checks the plan here
    assert finding.snippet == "model = nn.DataParallel(model, device_ids=[0, 1])"


def test_invalid_device_ordinal_and_device_count_option() -> None:
    text = "RuntimeError: CUDA error: invalid device ordinal"
    [finding] = explain(text, device_count=4).findings
    assert finding.code == "invalid-device-id" and "sees 4 GPUs, cuda:0 to cuda:3" in \
        finding.message


PRIMARY = ("RuntimeError: module must have its parameters and buffers on device cuda:1 "
           "(device_ids[0]) but found one of them on device: cuda:0")


def test_dataparallel_primary_device() -> None:
    finding, facts = only(PRIMARY, "dataparallel-primary-device")
    assert (facts["primary_device"], facts["found_device"]) == ("cuda:1", "cuda:0")
    assert "must be on cuda:1 first" in finding.message
    assert finding.fix.startswith("model.to('cuda:1')  # before nn.DataParallel(model")
    assert finding.snippet.startswith("model = nn.DataParallel(model)  # every visible GPU")


@pytest.mark.parametrize("text, devices, argument", [
    ("RuntimeError: Expected all tensors to be on the same device, but found at least two "
     "devices, cuda:0 and cpu! (when checking argument for argument mat1 in method "
     "wrapper_CUDA_addmm)", ["cuda:0", "cpu"], "mat1"),
    ("RuntimeError: Expected all tensors to be on the same device, but found at least two "
     "devices, cuda:0 and cpu!", ["cuda:0", "cpu"], None),
    ("RuntimeError: Expected all tensors to be on the same device, but got mat1 is on cpu, "
     "different from other tensors on cuda:0 (when checking argument in method "
     "wrapper_CUDA_addmm)", ["cuda:0", "cpu"], "mat1"),
    ("RuntimeError: Expected object of device type cuda but got device type cpu for argument "
     "#1 'self' in call to _th_addmm", ["cuda", "cpu"], "self"),
    ("RuntimeError: Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor) "
     "should be the same or input should be a MKLDNN tensor and weight is a dense tensor",
     ["cuda", "cpu"], "input"),
])
def test_device_mismatch(text: str, devices: list[str], argument: str | None) -> None:
    finding, facts = only(text, "device-mismatch")
    assert facts["devices"] == devices and facts.get("argument") == argument
    assert finding.fix == f"model.to({devices[0]!r}); inputs = inputs.to({devices[0]!r})"


def test_dtype_mismatch_is_not_a_device_mismatch() -> None:
    assert codes("RuntimeError: Input type (torch.cuda.HalfTensor) and weight type "
                 "(torch.cuda.FloatTensor) should be the same") == []


OOM_NEW = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    "capacity of 79.10 GiB of which 1.20 GiB is free. Including non-PyTorch memory, this "
    "process has 77.89 GiB memory in use. Of the allocated memory 76.50 GiB is allocated by "
    "PyTorch, and 812.00 MiB is reserved by PyTorch but unallocated. If reserved but "
    "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
    "to avoid fragmentation.  See documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
OOM_OLD = (
    "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 3; 10.76 GiB total "
    "capacity; 9.71 GiB already allocated; 1.56 MiB free; 9.92 GiB reserved in total by "
    "PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb to avoid "
    "fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF")


def test_cuda_oom_new_wording_in_torch_load() -> None:
    text = ('Traceback (most recent call last):\n  File "eval.py", line 9, in <module>\n'
            "    state = torch.load(path)\n  File \"/opt/torch/serialization.py\", line 1, "
            f"in load\n{OOM_NEW}\n")
    finding, facts = only(text, "cuda-oom")
    assert facts["requested_bytes"] == 2 * 2**30 and facts["gpu"] == 0
    assert facts["total"] == "79.10 GiB" and facts["free_bytes"] == int(1.2 * 2**30)
    assert facts["during_load"] is True
    assert "allocating 2.00 GiB on GPU 0 (cuda:0 in that process), which has 79.10 GiB in " \
           "all and 1.20 GiB free" in finding.message
    assert finding.snippet.startswith("model.load_state_dict(torch.load(path, "
                                      "map_location='cpu'))")
    assert "ckptool fix CKPT --dtype bf16" in finding.message
    assert finding.fix == 'eval "$(ckptool devices --export)"'


def test_cuda_oom_old_wording_in_training() -> None:
    _, facts = only(OOM_OLD, "cuda-oom")
    assert (facts["gpu"], facts["requested"], facts["free"]) == (3, "20.00 MiB", "1.56 MiB")
    assert facts["during_load"] is False
    new = explain(OOM_NEW).findings[0]
    assert new.snippet.startswith("export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")


# -- text as it comes: logs, tracebacks, noise --------------------------------------

def test_the_last_error_of_a_log_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    namespace = raised(lambda: torch.load(save_on("cpu", {"a": argparse.Namespace()}, "a.pth")))
    count_gpus(monkeypatch, 2)
    device = raised(lambda: torch.load(save_on("cuda:2", {"w": torch.ones(1)}, "b.pth")))
    log = (f"2024-05-01 10:00:01 INFO epoch 1\n{namespace}\n2024-05-01 10:00:02 retrying\n"
           f"{device}\nwandb: Synced 5 W&B file(s)\n")
    exp = explain(log)
    assert [e.kind for e in exp.errors] == ["weights-only", "device-unavailable"]
    assert exp.input["errors_found"] == 2 and exp.input["device"] == "cuda:2"
    # and the other way round
    assert explain(f"{device}\n{namespace}").input["kind"] == "weights-only"


def test_torchrun_prefixes_colour_codes_and_crlf() -> None:
    sd = prefixed(Net(8).state_dict(), "module.")
    text = raised(lambda: Net(8).load_state_dict(sd))
    log = "\r\n".join(f"[rank0]: \x1b[31m{line}\x1b[0m" for line in text.splitlines())
    exp = explain(log)
    assert [f.code for f in exp.findings] == ["key-prefix"] and len(exp.errors) == 1


def test_a_message_written_out_by_repr() -> None:
    text = repr(RuntimeError('Error(s) in loading state_dict for Net:\n\tMissing key(s) in '
                             'state_dict: "fc.weight". \n\tUnexpected key(s) in state_dict: '
                             '"module.fc.weight". '))
    assert codes(text) == ["key-prefix"]


def test_two_state_dict_errors_stay_apart() -> None:
    one = raised(lambda: Net(8).load_state_dict(prefixed(Net(8).state_dict(), "module.")))
    two = raised(lambda: make_samples.TinyNet().load_state_dict(
        make_samples.TinyNet(classes=12).state_dict()))
    exp = explain(one + two)
    assert len(exp.errors) == 2 and [f.code for f in exp.findings] == ["shape-mismatch"]


def test_nothing_recognised() -> None:
    assert explain("ValueError: too many values to unpack").findings == []
    assert find_errors("") == []


def test_helpers() -> None:
    assert size_bytes("2.00 GiB") == 2**31 and size_bytes("512 bytes") == 512
    assert normalise("a\x1b[1mb\x1b[0m\r\nc\\n\\td") == "ab\nc\n\td"


# -- the command line ------------------------------------------------------------------

DEVICE_TEXT = ("RuntimeError: Attempting to deserialize object on CUDA device 2 but "
               "torch.cuda.device_count() is 2. Please use torch.load with map_location to "
               "map your storages to an existing device.")


def test_cli_text(run_cli: Run) -> None:
    code, out, err = run_cli("explain", DEVICE_TEXT)
    assert code == 1 and err == ""
    flat = " ".join(out.split())
    assert flat.startswith("error RuntimeError: Attempting to deserialize object on CUDA "
                           "device 2")
    assert "error device-unavailable" in flat
    assert "fix: ckptool fix CKPT --map cuda:2=cuda:0" in flat
    assert "give --checkpoint CKPT for the one command that fixes it" in flat


def test_cli_json(run_cli: Run) -> None:
    code, out, err = run_cli("explain", "--json", DEVICE_TEXT)
    assert code == 1 and err == ""
    data = json.loads(out)
    assert set(data) == {"schema_version", "input", "checkpoint", "findings", "fix_command",
                         "fix_output", "fix_refused", "remaining", "exit_code"}
    assert data["schema_version"] == 1 and data["exit_code"] == 1
    assert data["input"] == {
        "source": "argument", "kind": "device-unavailable", "error": DEVICE_TEXT,
        "device": "cuda:2", "backend": "cuda", "device_index": 2, "device_count": 2,
        "exception": "RuntimeError", "errors_found": 1}
    [finding] = data["findings"]
    assert set(finding) == {"code", "severity", "message", "fix", "snippet", "keys", "source"}
    assert (finding["code"], finding["severity"], finding["source"]) == (
        "device-unavailable", "error", "error")
    assert data["checkpoint"] is None and data["fix_command"] is None
    assert data["remaining"] == ["device-unavailable"]


def test_cli_nothing_recognised_exits_0(run_cli: Run) -> None:
    code, out, err = run_cli("explain", "KeyError: 'lr'")
    assert code == 0 and err == ""
    flat = " ".join(out.split())
    assert "no checkpoint, key or GPU error recognised" in flat and "whole traceback" in flat
    code, out, _ = run_cli("explain", "--json", "KeyError: 'lr'")
    assert code == 0 and json.loads(out)["findings"] == []
    assert json.loads(out)["input"] == {"source": "argument", "errors_found": 0}


def test_cli_stdin_and_file(run_cli: Run, monkeypatch: pytest.MonkeyPatch,
                            tmp_path: Path) -> None:
    stdin = io.TextIOWrapper(io.BytesIO(f"noise \xff\xfe\n{PRIMARY}\n".encode("latin-1")))
    monkeypatch.setattr(sys, "stdin", stdin)  # bytes that are not UTF-8: no traceback
    code, out, _ = run_cli("explain", "--json", "-")
    assert code == 1 and json.loads(out)["input"]["source"] == "stdin"
    log = tmp_path / "train.log"
    log.write_text(f"{OOM_OLD}\nstep 3\n{INVALID_ID}", encoding="utf-8")
    code, out, _ = run_cli("explain", "--json", "--file", "train.log")
    data = json.loads(out)
    assert code == 1 and data["input"]["source"] == "train.log"
    assert data["input"]["kind"] == "invalid-device-id" and data["input"]["errors_found"] == 2


@pytest.mark.parametrize("args, words", [
    ([], "no error message to explain"),
    (["   \n"], "is empty"),
    (["x", "--file", "log.txt"], "given twice"),
    ([DEVICE_TEXT, "--model", f"{NETS}:Net"], "--model needs --checkpoint"),
    ([DEVICE_TEXT, "--model-arg", "width=8", "--checkpoint", "m.pth"], "--model-arg needs"),
    ([DEVICE_TEXT, "--device-count", "-1"], "--device-count"),
])
def test_cli_usage_errors(run_cli: Run, args: list[str], words: str) -> None:
    code, out, err = run_cli("explain", *args)
    assert code == 2 and out == ""
    assert err.startswith("ckptool: error: ") and words in err and "\nhint: " in err
    assert "Traceback" not in err


def test_cli_unreadable_log_and_checkpoint(run_cli: Run) -> None:
    code, _, err = run_cli("explain", "--file", "missing.log")
    assert code == 3 and err.startswith("ckptool: error: cannot read the log missing.log")
    code, _, err = run_cli("explain", DEVICE_TEXT, "--checkpoint", "missing.pth")
    assert code == 3 and "missing.pth" in err and "Traceback" not in err


def test_explain_imports_neither_torch_nor_rich_for_json() -> None:
    code = ("import io, contextlib, sys\nfrom ckptool.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    assert main(['explain', '--json', {OOM_NEW!r}]) == 1\n"
            "print(sorted(m for m in ('torch', 'rich', 'textual') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60, cwd=ROOT).stdout
    assert out.split() == ["[]"]


# -- with the checkpoint: the one command, run as printed ------------------------------

def shell(command: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``command`` exactly as printed, through a shell, ``ckptool`` being this source tree."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "ckptool"
    shim.write_text(f'#!/bin/sh\nPYTHONPATH={ROOT} exec {sys.executable} -m ckptool "$@"\n')
    shim.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(["/bin/sh", "-c", command], cwd=Path.cwd(), env=env,
                          capture_output=True, text=True, timeout=120)


def explain_json(run_cli: Run, *args: str) -> dict[str, Any]:
    code, out, err = run_cli("explain", "--json", *args)
    assert code == 1, err
    data: dict[str, Any] = json.loads(out)
    return data


def trained(width: int = 8) -> Net:
    torch.manual_seed(width)
    net = Net(width)
    net.bn.running_mean.uniform_()
    return net


def test_checkpoint_on_cuda2_for_two_gpus(run_cli: Run, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """'device_count() is 2' is a two-GPU target: the file is moved to cuda:0,
    unwrapped and unprefixed, and the result loads there strictly."""
    net = trained()
    save_on("cuda:2", {"epoch": 4, "state_dict": prefixed(net.state_dict(), "module."),
                       "args": argparse.Namespace(lr=0.1)}, "dp.pth")
    with monkeypatch.context() as m:
        count_gpus(m, 2)
        text = raised(lambda: torch.load("dp.pth", weights_only=False))
    data = explain_json(run_cli, text, "--checkpoint", "dp.pth")
    assert data["fix_command"] == ("ckptool fix dp.pth --extract --strip-module --to cuda:0 "
                                   "-o dp.fixed.pth")
    assert data["fix_output"] == "dp.fixed.pth" and data["remaining"] == []
    assert data["checkpoint"]["target"] == {
        "description": "a machine with 2 visible CUDA GPUs", "source": "assumed",
        "device_count": 2}
    first, *also = data["findings"]
    assert (first["code"], first["source"]) == ("device-unavailable", "error")
    assert first["fix"] == "ckptool fix dp.pth --to cuda:0"
    assert {f["code"]: f["source"] for f in also} == {
        "wrapped-state-dict": "checkpoint", "weights-only": "checkpoint",
        "key-prefix": "checkpoint"}
    done = shell(data["fix_command"], tmp_path)
    assert done.returncode == 0, done.stderr
    tags: list[str] = []
    torch.load("dp.fixed.pth", map_location=lambda s, tag: tags.append(tag) or s)
    assert set(tags) == {"cuda:0"}
    state = torch.load("dp.fixed.pth", map_location="cpu")  # weights_only: nothing refused
    fresh = Net(8)
    fresh.load_state_dict(state, strict=True)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in net.state_dict().items())
    assert run_cli("diagnose", "dp.fixed.pth", "--device-count", "2")[0] == 0


def test_checkpoint_for_a_wrapped_model_gets_the_prefix_added(run_cli: Run,
                                                             tmp_path: Path) -> None:
    """No --model: the model is the one the error describes, so the command
    adds the 'module.' that nn.DataParallel's keys carry."""
    net = trained()
    torch.save(net.state_dict(), "plain.pth")
    text = raised(lambda: nn.DataParallel(Net(8)).load_state_dict(torch.load("plain.pth")))
    data = explain_json(run_cli, "--checkpoint", "plain.pth", text)
    assert data["checkpoint"]["against"] == "the model in the error (DataParallel)"
    assert data["fix_command"] == "ckptool fix plain.pth --add-prefix module. -o plain.fixed.pth"
    assert [f["code"] for f in data["findings"]] == ["key-prefix"]
    assert shell(data["fix_command"], tmp_path).returncode == 0
    wrapped = nn.DataParallel(Net(8))
    wrapped.load_state_dict(torch.load("plain.fixed.pth"), strict=True)
    assert torch.equal(wrapped.module.bn.running_mean, net.bn.running_mean)


def test_checkpoint_saved_on_mps(run_cli: Run, tmp_path: Path) -> None:
    save_on("mps", make_samples.TinyNet().state_dict(), "mac.pth")
    text = raised(lambda: torch.load("mac.pth"))
    data = explain_json(run_cli, text, "--checkpoint", "mac.pth")
    assert data["fix_command"] == "ckptool fix mac.pth --to cpu -o mac.fixed.pth"
    assert shell(data["fix_command"], tmp_path).returncode == 0
    make_samples.TinyNet().load_state_dict(torch.load("mac.fixed.pth"), strict=True)


def test_checkpoint_with_model_names_the_argument(run_cli: Run) -> None:
    torch.save(make_samples.TinyNet(classes=12).state_dict(), "v2.pth")
    text = raised(lambda: make_samples.TinyNet().load_state_dict(torch.load("v2.pth")))
    spec = f"{SAMPLES}/make_samples.py:TinyNet"
    data = explain_json(run_cli, text, "--checkpoint", "v2.pth", "--model", spec)
    [finding] = data["findings"]
    assert finding["code"] == "shape-mismatch" and finding["fix"] == "TinyNet(classes=12)"
    assert data["fix_command"] is None and data["remaining"] == ["shape-mismatch"]
    code, out, _ = run_cli("explain", text, "--checkpoint", "v2.pth", "--model", spec)
    assert code == 1 and "needs no ckptool fix for this error" in " ".join(out.split())


def test_checkpoint_the_error_is_not_about(run_cli: Run) -> None:
    torch.save(Net(8).state_dict(), "cpu.pth")
    data = explain_json(run_cli, DEVICE_TEXT, "--checkpoint", "cpu.pth")
    [finding] = data["findings"]
    assert finding["code"] == "device-unavailable" and finding["fix"] is None
    assert data["checkpoint"]["notes"] == [
        "the error says device-unavailable, which cpu.pth does not show: the error may come "
        "from another file or another machine"]
    assert data["fix_command"] is None


def test_checkpoint_text_output(run_cli: Run) -> None:
    (Path.cwd() / "dp.pth").write_bytes((SAMPLES / "dataparallel_cuda2.pth").read_bytes())
    code, out, err = run_cli("explain", DEVICE_TEXT, "--checkpoint", "dp.pth")
    assert code == 1 and err == ""
    lines = out.splitlines()
    assert "the checkpoint also has:" in lines
    assert lines[lines.index("fix everything fixable at once (writes dp.fixed.pth):") + 1] == (
        "  ckptool fix dp.pth --extract --strip-module --to cuda:0 -o dp.fixed.pth")


def test_checkpoint_whose_weights_hold_unsafe_globals(run_cli: Run) -> None:
    """Where fix would refuse (the unsafe global is inside the weights), no command."""
    class Evil:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            import os
            return (os.system, ("true",))

    sd = Net(8).state_dict()
    sd["conv.weight"].evil = Evil()  # type: ignore[attr-defined]
    torch.save({"state_dict": sd}, "evil.pth")
    text = raised(lambda: torch.load("evil.pth"))
    data = explain_json(run_cli, text, "--checkpoint", "evil.pth")
    assert data["findings"][0]["code"] == "unsafe-globals"
    assert data["findings"][0]["fix"] is None
    assert data["fix_command"] is None and "unsafe globals" in data["fix_refused"]
    out = run_cli("explain", text, "--checkpoint", "evil.pth")[1]
    assert "no ckptool fix command:" in out


def test_checkpoint_of_a_pickled_module(run_cli: Run) -> None:
    """weights_only refusing a model class: diagnose's pickled-module is that problem."""
    (Path.cwd() / "whole.pth").write_bytes((SAMPLES / "whole_model_cuda1.pth").read_bytes())
    text = raised(lambda: torch.load("whole.pth", map_location="cpu"))
    data = explain_json(run_cli, text, "--checkpoint", "whole.pth")
    [first, *also] = data["findings"]
    assert first["code"] == "weights-only" and first["fix"] == "ckptool fix whole.pth --extract"
    assert "pickled-module" not in [f["code"] for f in also]
    assert data["checkpoint"]["notes"] == []
    assert data["fix_command"].startswith("ckptool fix whole.pth --extract")


def test_checkpoint_out_of_memory_sets_the_gpu_free_memory(run_cli: Run) -> None:
    """The GPU of the message, with the free memory it gives, is the target."""
    save_on("cuda:1", Net(8).state_dict(), "big.pth")
    text = OOM_OLD.replace("GPU 3", "GPU 1").replace("1.56 MiB free", "100 bytes free")
    data = explain_json(run_cli, text, "--checkpoint", "big.pth")
    assert data["checkpoint"]["target"]["device_count"] == 2
    assert [f["code"] for f in data["findings"]] == ["cuda-oom", "device-memory"]
    assert data["findings"][1]["source"] == "checkpoint"
    assert "cuda:1, which has 100 B free" in data["findings"][1]["message"]


def test_checkpoint_against_a_reference(run_cli: Run) -> None:
    torch.save(make_samples.TinyNet(classes=12).state_dict(), "v2.pth")
    torch.save(make_samples.TinyNet().state_dict(), "v1.pth")
    text = raised(lambda: make_samples.TinyNet().load_state_dict(torch.load("v2.pth")))
    data = explain_json(run_cli, text, "--checkpoint", "v2.pth", "--reference", "v1.pth")
    assert data["checkpoint"]["against"] == "reference v1.pth"
    assert [f["code"] for f in data["findings"]] == ["shape-mismatch"]
    code, _, err = run_cli("explain", text, "--reference", "v1.pth")
    assert code == 2 and "--reference needs --checkpoint" in err


def test_a_log_that_joined_its_lines() -> None:
    text = ('RuntimeError: Error(s) in loading state_dict for Net: Missing key(s) in '
            'state_dict: "conv.weight", "fc.weight". Unexpected key(s) in state_dict: '
            '"model.conv.weight", "model.fc.weight", "loss.weight". size mismatch for '
            'bn.weight: copying a param of torch.Size([4]) from checkpoint, where the shape is '
            'torch.Size([8]) in current model.')
    exp = explain(text)
    assert exp.input["missing"] == ["conv.weight", "fc.weight"]
    assert exp.input["unexpected"] == ["model.conv.weight", "model.fc.weight", "loss.weight"]
    assert exp.input["mismatched"] == [{"key": "bn.weight", "checkpoint": [4], "model": [8]}]
    assert [f.code for f in exp.findings] == ["key-prefix", "unexpected-keys", "shape-mismatch"]
    assert "2 of the 3 unexpected keys are what Net expects" in exp.findings[0].message


def test_cli_stdin_that_is_a_terminal(run_cli: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", Terminal())
    code, _, err = run_cli("explain", "-")
    assert code == 2 and "standard input is a terminal" in err and "hint: " in err


# -- review fixes: long logs, odd input, facts the text gives -------------------------

def test_many_errors_in_a_log_take_linear_time() -> None:
    """Every error's context was read, back to the log's start: 224 s for 5 MB."""
    log = "CUDA_VISIBLE_DEVICES=0,1 python t.py\n" + "AssertionError: Invalid device id\n" * 150000
    began = time.perf_counter()
    errors = find_errors(log)
    assert time.perf_counter() - began < 10
    assert len(errors) == 150000
    assert errors[-1].facts == {"exception": "AssertionError", "cuda_visible_devices": "0,1"}
    assert errors[-1].line == "AssertionError: Invalid device id"


@pytest.mark.parametrize("line", [
    "x" * 200000 + " AssertionError: Invalid device id",  # the exception's name searched back
    "a." * 100000 + "Error: " + "AssertionError: Invalid device id",
    "Invalid device id" + " " * 200000 + "x",
    'Unexpected key(s) in state_dict: "' + 'a", "' * 50000,  # a key list never closed
    "size mismatch for " + "w" * 200000,
    "CUDA_VISIBLE_DEVICES=" + "1," * 100000 + "x\nAssertionError: Invalid device id",
])
def test_long_lines_do_not_backtrack(line: str) -> None:
    began = time.perf_counter()
    exp = explain(line + "\n")
    assert time.perf_counter() - began < 5
    if "AssertionError" in line and "CUDA_VISIBLE" not in line:
        assert exp.input["exception"] == "AssertionError"


def test_stdin_that_is_not_utf8() -> None:
    done = subprocess.run([sys.executable, "-m", "ckptool", "explain", "-"],
                          input=b"caf\xe9 \xff\n" + PRIMARY.encode(), capture_output=True,
                          timeout=60, cwd=ROOT,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8"})  # strict, as a terminal
    assert done.returncode == 1 and done.stderr == b""
    assert b"dataparallel-primary-device" in done.stdout


def test_a_state_dict_error_cut_short_is_still_explained(run_cli: Run) -> None:
    text = "RuntimeError: Error(s) in loading state_dict for Net:"
    [finding] = explain(text).findings
    assert finding.code == "state-dict-mismatch" and "paste the whole message" in \
        finding.message
    assert finding.snippet.startswith("print(model.load_state_dict(sd, strict=False))")
    code, out, _ = run_cli("explain", "--json", text)
    data = json.loads(out)
    assert code == 1 and data["exit_code"] == 1
    assert [f["code"] for f in data["findings"]] == ["state-dict-mismatch"]
    code, out, _ = run_cli("explain", text)
    assert code == 1 and "error   state-dict-mismatch" in out
    assert "does not show which keys" in " ".join(out.split())


def test_a_json_lines_log() -> None:
    """A logger that writes each record as JSON escapes the newlines and quotes."""
    error = raised(lambda: Net(8).load_state_dict(prefixed(Net(8).state_dict(), "module.")))
    log = "\n".join(json.dumps(r) for r in [
        {"level": "info", "msg": "epoch 1"}, {"level": "error", "msg": error},
        {"level": "info", "msg": "C:\\new\\tmp"}])
    assert '\\"module.conv.weight\\"' in log
    exp = explain(log)
    assert [f.code for f in exp.findings] == ["key-prefix"]
    assert exp.input["unexpected"][0] == "module.conv.weight"
    assert exp.input["exception"] == "RuntimeError"
    # one line holding a whole escaped traceback
    assert codes(json.dumps(error)) == ["key-prefix"]


def test_keys_that_hold_quotes() -> None:
    """torch writes "key" joined by ", ": a quote inside a key is no separator."""
    sd = Net(8).state_dict()
    sd['a"b.c'] = torch.ones(1)
    sd["ü.w"] = torch.ones(1)
    text = raised(lambda: Net(8).load_state_dict(sd))
    assert '"a"b.c", "ü.w"' in text
    exp = explain(text)
    assert exp.input["unexpected"] == ['a"b.c', "ü.w"]
    assert exp.findings[0].keys == ('a"b.c', "ü.w")


@pytest.mark.parametrize("log, visible", [
    ("CUDA_VISIBLE_DEVICES=$GPUS python t.py", None),
    ('CUDA_VISIBLE_DEVICES="${SLURM_JOB_GPUS}" python t.py', None),
    ("CUDA_VISIBLE_DEVICES=0,1 ./run.sh\nCUDA_VISIBLE_DEVICES=$GPUS python t.py", "0,1"),
    ('CUDA_VISIBLE_DEVICES="GPU-5ab1,MIG-GPU-77c/1/0" python t.py', "GPU-5ab1,MIG-GPU-77c/1/0"),
    ("export CUDA_VISIBLE_DEVICES=", ""),
    ("CUDA_VISIBLE_DEVICES='' python t.py", ""),
])
def test_cuda_visible_devices_needs_a_real_value(log: str, visible: str | None) -> None:
    [finding] = explain(f"{log}\nAssertionError: Invalid device id").findings
    facts = explain(f"{log}\nAssertionError: Invalid device id").input
    assert facts.get("cuda_visible_devices") == visible
    assert ("hides every GPU" in finding.message) == (visible == "")


def test_invalid_ordinal_below_the_visible_entries() -> None:
    """Two UUIDs listed, cuda:1 refused: the process saw fewer than two GPUs."""
    text = ('$ CUDA_VISIBLE_DEVICES="GPU-5ab1,GPU-77c" python t.py\nTraceback (most recent '
            'call last):\n  File "t.py", line 3, in <module>\n    torch.cuda.set_device(1)\n'
            "RuntimeError: CUDA error: invalid device ordinal\n")
    finding, facts = only(text, "invalid-device-id")
    assert facts["device_index"] == 1
    assert "does not have" not in finding.message and "cuda:0 to cuda:1" not in finding.message
    assert ("cuda:1 is within what CUDA_VISIBLE_DEVICES=GPU-5ab1,GPU-77c names 2 entries, yet "
            "CUDA refused it: the process evidently saw fewer GPUs") in finding.message
    assert finding.fix == "ckptool devices"
    said = explain("  model = nn.DataParallel(model, device_ids=[0, 1])\n"
                   "RuntimeError: CUDA error: invalid device ordinal", device_count=4).findings[0]
    assert "--device-count says the process sees 4 GPUs" in said.message


def test_input_has_the_shared_key_prefix(run_cli: Run) -> None:
    stripped = raised(lambda: Net(8).load_state_dict(prefixed(Net(8).state_dict(), "module.")))
    assert explain(stripped).input["prefix"] == {"strip": "module.", "add": "", "keys": 9}
    added = raised(lambda: nn.DataParallel(Net(8)).load_state_dict(Net(8).state_dict()))
    assert explain(added).input["prefix"] == {"strip": "", "add": "module.", "keys": 9}
    only_unexpected = ('Unexpected key(s) in state_dict: "_orig_mod.fc.weight", '
                       '"_orig_mod.fc.bias". ')
    assert explain(only_unexpected).input["prefix"] == {"strip": "_orig_mod.", "add": "",
                                                         "keys": 2}
    data = explain_json(run_cli, stripped)
    assert data["input"]["prefix"]["strip"] == "module."
    assert "prefix" not in explain(raised(lambda: make_samples.TinyNet().load_state_dict(
        make_samples.TinyNet(classes=12).state_dict()))).input


def test_dataparallel_fixes_are_code() -> None:
    text = ('Traceback (most recent call last):\n  File "t.py", line 9, in <module>\n'
            "    model = nn.DataParallel(model, device_ids=[1, 2])\n" + PRIMARY)
    finding, facts = only(text, "dataparallel-primary-device")
    assert facts["device_ids"] == [1, 2]
    assert finding.fix == "model.to('cuda:1'); model = nn.DataParallel(model, device_ids=[1, 2])"
    assert finding.snippet.startswith("model = nn.DataParallel(model, device_ids=[0, 1, 2])")
    for other in (PRIMARY, PRIMARY.replace("device: cuda:0", "device: cuda:3"),
                  PRIMARY.replace("device: cuda:0", "device: cpu"), INVALID_ID,
                  "RuntimeError: CUDA error: invalid device ordinal"):
        [f] = explain(other).findings
        for code in (f.fix, f.snippet):
            if code and not code.startswith(("ckptool ", "export ", "eval ")):
                compile(code, "<fix>", "exec")  # pasted, it runs


def test_device_count_option_for_a_saved_device() -> None:
    cpu_only = ("RuntimeError: Attempting to deserialize object on a CUDA device but "
                "torch.cuda.is_available() is False.")
    [finding] = explain(cpu_only, device_count=2).findings
    assert "sees 2 CUDA GPUs (cuda:0, cuda:1)" in finding.message
    assert finding.fix == "ckptool fix CKPT --to cuda:0"
    assert finding.snippet == "torch.load(path, map_location='cuda:0')"
    [finding] = explain(DEVICE_TEXT, device_count=0).findings
    assert finding.fix == "ckptool fix CKPT --to cpu"
