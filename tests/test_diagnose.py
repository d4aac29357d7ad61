"""``ckptool diagnose``: each finding code on a checkpoint built to trigger
it, the predicted torch.load errors against torch itself, key
reconciliation, the one fix command, and the CLI contract."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import SAMPLES, saved_on
from nets import Net, TiedLM

import ckptool
from ckptool.check import loadcheck
from ckptool.check.diagnosis import Diagnosis, diagnose
from ckptool.check.gpus import machine as gpus
from ckptool.check.gpus.machine import Gpu, Machine
from ckptool.check.modelspec import build_model, reference_keys
from ckptool.cli import main

NETS = Path(__file__).resolve().parent / "nets.py"
ROOT = NETS.parent.parent
CPU_ONLY = gpus.assumed(0)


def net_sd(width: int = 8, prefix: str = "") -> OrderedDict[str, torch.Tensor]:
    sd = Net(width).state_dict()
    out = OrderedDict((prefix + k, v) for k, v in sd.items())
    out._metadata = sd._metadata  # type: ignore[attr-defined]
    return out


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files are named as a user in their folder names them: commands print
    paths as given."""
    monkeypatch.chdir(tmp_path)


def save(obj: Any, path: Path, tag: str | None = None, **kwargs: Any) -> Path:
    """Save ``obj``; the path as a user in its folder gives it."""
    if tag is None:
        torch.save(obj, path, **kwargs)
    else:
        with saved_on(tag):
            torch.save(obj, path, **kwargs)
    return Path(os.path.relpath(path))


def run(path: Path, machine: Machine = CPU_ONLY, model: str | None = None,
        **args: Any) -> Diagnosis:
    keys = build_model(f"{NETS}:{model}", args) if model else None
    return diagnose(ckptool.open(path), machine, keys)


def codes(d: Diagnosis) -> list[str]:
    return [f.code for f in d.findings]


def finding(d: Diagnosis, code: str) -> Any:
    return next(f for f in d.findings if f.code == code)


def gpu_machine(*free_gb: float) -> Machine:
    return Machine(tuple(Gpu(i, i, "Fake GPU", None, 80 * 10**9, int(f * 10**9))
                         for i, f in enumerate(free_gb)), True, None, "nvidia-smi", "")


# -- devices -------------------------------------------------------------------

@pytest.mark.parametrize("tag", ["cuda:0", "cuda:2", "cuda", "mps", "xpu:0", "hpu:0",
                                 "mtia:0", "privateuseone:0", "foo:1"])
def test_restore_error_matches_torch_without_a_gpu(tmp_path: Path, tag: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The predicted error is the text torch.load raises, to the letter."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU host
    path = save({"w": torch.ones(2)}, tmp_path / "t.pth", tag)
    with pytest.raises(RuntimeError) as raised:
        torch.load(path)
    lands, error = loadcheck.restore_error(tag, gpus.assumed(0))
    assert lands is None
    assert error == str(raised.value)


def test_restore_error_counts_gpus_like_torch(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """With torch told it has one GPU, cuda:2 fails with the count message."""
    path = save({"w": torch.ones(2)}, tmp_path / "t.pth", "cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError) as raised:
        torch.load(path)
    _, error = loadcheck.restore_error("cuda:2", gpus.assumed(1))
    assert error == str(raised.value)
    assert "CUDA device 2 but torch.cuda.device_count() is 1" in error


def test_cpu_and_meta_load(tmp_path: Path) -> None:
    assert loadcheck.restore_error("cpu", CPU_ONLY) == ("cpu", None)
    assert loadcheck.restore_error("meta", CPU_ONLY) == ("meta", None)
    assert loadcheck.restore_error("cuda:3", gpus.assumed(4)) == ("cuda:3", None)
    assert loadcheck.restore_error("cuda", gpus.assumed(1)) == ("cuda:0", None)


def test_weights_only_allowlist_matches_torch() -> None:
    from torch._weights_only_unpickler import _get_allowed_globals

    allowed = set(_get_allowed_globals())
    assert all(loadcheck.weights_only_allows(n) for n in allowed)
    refused = ["argparse.Namespace", "torch.nn.modules.linear.Linear", "builtins.dict",
               "numpy.core.multiarray._reconstruct", "torch._utils._rebuild_foo",
               "torch.FooStorage", "torch.sparse.BoolTensor", "posix.system", "torch.float"]
    for name in refused:
        assert loadcheck.weights_only_allows(name) is (name in allowed), name


def test_device_unavailable_on_cpu_only(tmp_path: Path) -> None:
    d = run(save(net_sd(), tmp_path / "m.pth", "cuda:2"))
    assert codes(d) == ["device-unavailable"]
    f = finding(d, "device-unavailable")
    assert f.severity == "error"
    assert f.message.endswith("the file saved 9 tensors (1.4 kB) on cuda:2")
    assert "torch.cuda.is_available() is False" in d.tags[0].error
    assert f.fix == "ckptool fix m.pth --to cpu"
    assert f.snippet == "torch.load('m.pth', map_location='cpu')"
    assert d.fix_command == "ckptool fix m.pth --to cpu -o m.fixed.pth"
    assert d.exit_code == 1
    [tag] = d.tags
    assert (tag.location, tag.tensors, tag.lands) == ("cuda:2", 9, None)
    assert tag.nbytes == sum(t.numel() * t.element_size() for t in net_sd().values())


def test_command_never_targets_an_existing_file(tmp_path: Path) -> None:
    path = save(net_sd(), tmp_path / "m.pth", "cuda:2")
    (tmp_path / "m.fixed.pth").write_bytes(b"earlier result")
    (tmp_path / "m.fixed2.pth").write_bytes(b"another")
    d = run(path)
    assert d.fix_command == "ckptool fix m.pth --to cpu -o m.fixed3.pth"


def test_device_count_one_moves_to_cuda0(tmp_path: Path) -> None:
    d = run(save(net_sd(), tmp_path / "m.pth", "cuda:2"), gpus.assumed(1))
    f = finding(d, "device-unavailable")
    assert "a machine with 1 visible CUDA GPU:" in f.message
    assert "CUDA device 2 but torch.cuda.device_count() is 1" in d.tags[0].error
    assert d.fix_command == "ckptool fix m.pth --to cuda:0 -o m.fixed.pth"


def test_enough_gpus_is_clean(tmp_path: Path) -> None:
    d = run(save(net_sd(), tmp_path / "m.pth", "cuda:2"), gpus.assumed(4))
    assert codes(d) == [] and d.exit_code == 0 and d.fix_command is None
    assert d.tags[0].lands == "cuda:2"


def test_partial_failure_maps_only_the_missing_tag(tmp_path: Path) -> None:
    sd = net_sd()
    path = tmp_path / "m.pth"
    # conv on cuda:0 (exists), the rest on cuda:3 (does not)
    tags = iter(["cuda:0"] * 2 + ["cuda:3"] * 10)
    original = torch.serialization.location_tag
    torch.serialization.location_tag = lambda s: next(tags)  # type: ignore[assignment]
    try:
        torch.save(sd, path)
    finally:
        torch.serialization.location_tag = original
    d = run(Path("m.pth"), gpu_machine(10, 30))
    assert d.fix_command == "ckptool fix m.pth --map cuda:3=cuda:1 -o m.fixed.pth"
    assert "map_location={'cuda:3': 'cuda:1'}" in finding(d, "device-unavailable").snippet


def test_picks_gpu_with_most_free_memory(tmp_path: Path) -> None:
    d = run(save(net_sd(), tmp_path / "m.pth", "cuda:7"), gpu_machine(5, 40, 12))
    assert d.fix_command == "ckptool fix m.pth --to cuda:1 -o m.fixed.pth"


def test_no_gpu_with_room_means_cpu(tmp_path: Path) -> None:
    path = save({"w": torch.zeros(1000, 1000)}, tmp_path / "big.pth", "cuda:7")
    d = run(path, gpu_machine(0.0001, 0.002))  # 4 MB to place, 2 MB free at most
    assert d.fix_command == "ckptool fix big.pth --to cpu -o big.fixed.pth"


@pytest.mark.parametrize(("name", "shell", "python"), [
    ("-m.pth", "./-m.pth", "'-m.pth'"),
    ("my model.pth", "'my model.pth'", "'my model.pth'"),
    ("it's.pth", """'it'"'"'s.pth'""", '"it\'s.pth"'),
])
def test_odd_file_names(tmp_path: Path, name: str, shell: str, python: str) -> None:
    d = run(save(net_sd(), tmp_path / name, "cuda:1"))
    f = finding(d, "device-unavailable")
    assert f.fix == f"ckptool fix {shell} --to cpu"
    assert f.snippet == f"torch.load({python}, map_location='cpu')"
    assert d.fix_command is not None and d.fix_command.startswith(f"ckptool fix {shell} ")
    proc = subprocess.run([sys.executable, "-m", "ckptool", *shlex.split(d.fix_command)[1:]],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / d.fix_output).is_file()


def test_mps_on_linux(tmp_path: Path) -> None:
    d = run(save(net_sd(), tmp_path / "m.pth", "mps"), gpus.assumed(2))
    assert "on mps" in finding(d, "device-unavailable").message
    assert d.tags[0].error == "torch.UntypedStorage(): Storage device not recognized: mps"
    assert d.fix_command == "ckptool fix m.pth --to cuda:0 -o m.fixed.pth"


def test_device_memory(tmp_path: Path) -> None:
    path = save({"w": torch.zeros(1000, 1000)}, tmp_path / "big.pth", "cuda:0")
    d = run(path, gpu_machine(0.001))  # 1 MB free, 4 MB needed
    f = finding(d, "device-memory")
    assert f.severity == "warning" and "4.0 MB on cuda:0" in f.message
    assert run(path, gpu_machine(1)).findings == []


# -- wrappers and globals --------------------------------------------------------

def test_wrapped_state_dict_and_weights_only(tmp_path: Path) -> None:
    path = save({"epoch": 3, "state_dict": net_sd(), "args": argparse.Namespace(lr=0.1)},
                tmp_path / "c.pth")
    d = run(path)
    assert codes(d) == ["wrapped-state-dict", "weights-only"]
    assert finding(d, "wrapped-state-dict").snippet == \
        "model.load_state_dict(torch.load(path)['state_dict'])"
    assert "argparse.Namespace" in finding(d, "weights-only").message
    assert d.fix_command == "ckptool fix c.pth --extract -o c.fixed.pth"


def test_unsafe_globals_extracted_away() -> None:
    d = run(SAMPLES / "hostile_runs_code.pth")
    f = finding(d, "unsafe-globals")
    assert f.severity == "error" and "posix.system" in f.message
    # the paths as given: the command runs from where diagnose ran
    # a flagged file is written from only with --salvage, which re-reads the output
    assert d.fix_command == (f"ckptool fix {SAMPLES}/hostile_runs_code.pth --extract "
                             f"--salvage -o {SAMPLES}/hostile_runs_code.fixed.pth")


def test_unsafe_inside_the_state_dict_gets_no_command(tmp_path: Path) -> None:
    """When extraction cannot remove the unsafe global, no fix is offered."""
    import os

    class Evil:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.system, ("true",))

    sd = net_sd()
    sd["conv.weight"].evil = Evil()  # type: ignore[attr-defined]
    d = run(save({"state_dict": sd}, tmp_path / "e.pth"))
    assert "unsafe-globals" in codes(d)
    assert d.fix_command is None
    assert d.fix_refused and "unsafe globals" in d.fix_refused
    assert all(f.fix is None or not f.fix.startswith("ckptool fix") for f in d.findings)


def test_pickled_module(tmp_path: Path) -> None:
    d = run(SAMPLES / "whole_model_cuda1.pth")
    assert codes(d) == ["device-unavailable", "pickled-module"]
    assert d.fix_command == (f"ckptool fix {SAMPLES}/whole_model_cuda1.pth --extract --to cpu "
                             f"-o {SAMPLES}/whole_model_cuda1.fixed.pth")


def test_torchscript_gets_convert() -> None:
    d = run(SAMPLES / "tinynet_script.pt")
    f = finding(d, "torchscript")
    # into a torch.save state dict, which torch.load and fix take
    assert f.fix == (f"ckptool convert {SAMPLES}/tinynet_script.pt "
                     f"{SAMPLES}/tinynet_script.pth")
    assert d.fix_command is None


def test_a_torchscript_archive_named_pth_gets_another_name(tmp_path: Path) -> None:
    import shutil

    shutil.copy(SAMPLES / "tinynet_script.pt", tmp_path / "net.pth")
    f = finding(run(tmp_path / "net.pth"), "torchscript")
    assert f.fix == f"ckptool convert {tmp_path}/net.pth {tmp_path}/net.weights.pth"


def test_no_state_dict(tmp_path: Path) -> None:
    d = run(save([1, 2, "three"], tmp_path / "l.pth"))
    assert codes(d) == ["no-state-dict"]


def test_state_dict_in_a_list_gets_an_int_index(tmp_path: Path) -> None:
    d = run(save([net_sd(), {"lr": 0.1}], tmp_path / "l.pth"))
    assert finding(d, "wrapped-state-dict").snippet == \
        "model.load_state_dict(torch.load(path)[0])"


def test_clean_state_dict_exits_zero(tmp_path: Path) -> None:
    d = run(save(net_sd(), tmp_path / "m.pth"), model="Net", width=8)
    assert d.findings == [] and d.exit_code == 0 and d.fix_command is None
    assert d.keys is not None and len(d.keys.matched) == 9


def test_safetensors_is_clean() -> None:
    d = run(SAMPLES / "tinynet.safetensors")
    assert d.findings == [] and d.tags[0].location == "unrecorded"


# -- keys ------------------------------------------------------------------------

def test_key_prefix_without_model(tmp_path: Path) -> None:
    d = run(save(net_sd(prefix="module."), tmp_path / "m.pth"))
    f = finding(d, "key-prefix")
    assert f.severity == "warning" and "DataParallel/DDP" in f.message
    assert d.fix_command == "ckptool fix m.pth --strip-module -o m.fixed.pth"
    both = run(save(net_sd(prefix="_orig_mod.module."), tmp_path / "c.pth"))
    assert "(torch.compile over DataParallel/DDP)" in finding(both, "key-prefix").message


@pytest.mark.parametrize("prefix", ["model.", "base_model.model."])
def test_an_ambiguous_prefix_is_explained_not_fixed(tmp_path: Path, prefix: str) -> None:
    """'model.' is a Lightning attribute or a transformers decoder's own
    naming; 'base_model.model.' PEFT's own or a wrapper: without a model to
    check, both readings are said and no fix is offered (it could break a
    checkpoint that loads)."""
    d = run(save(net_sd(prefix=prefix), tmp_path / "m.pth"))
    assert codes(d) == ["ambiguous-prefix"]
    f = finding(d, "ambiguous-prefix")
    assert f.fix is None and "pass --model" in f.message and "own naming" in f.message
    assert d.fix_command is None


def test_only_the_wrapper_before_an_ambiguous_prefix_is_advised(tmp_path: Path) -> None:
    d = run(save(net_sd(prefix="module.model."), tmp_path / "m.pth"))
    assert codes(d) == ["key-prefix", "ambiguous-prefix"]
    assert finding(d, "key-prefix").fix == "ckptool fix m.pth --strip-prefix module."
    assert d.fix_command == "ckptool fix m.pth --strip-prefix module. -o m.fixed.pth"


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "_orig_mod.module.",
                                    "module._orig_mod.", "model.", "base_model.model."])
def test_key_prefix_against_model(tmp_path: Path, prefix: str) -> None:
    d = run(save(net_sd(prefix=prefix), tmp_path / "m.pth"), model="Net", width=8)
    f = finding(d, "key-prefix")
    assert f.severity == "error"
    assert "0 of 9 keys match as saved, 9 after the rewrite" in f.message
    assert codes(d) == ["key-prefix"]
    assert d.fix_command == "ckptool fix m.pth --strip-module -o m.fixed.pth"


def test_add_prefix_when_the_model_wants_one(tmp_path: Path) -> None:
    """A bare state dict against a model whose keys sit under 'model.'."""
    wrapper = tmp_path / "wrap.py"
    wrapper.write_text(f"import sys\nsys.path.insert(0, {str(NETS.parent)!r})\n"
                       "import torch\nfrom nets import Net\n"
                       "class Wrapped(torch.nn.Module):\n"
                       "    def __init__(self):\n        super().__init__()\n"
                       "        self.model = Net(8)\n")
    path = save(net_sd(), tmp_path / "m.pth")
    d = diagnose(ckptool.open(path), CPU_ONLY, build_model(f"{wrapper}:Wrapped", {}))
    assert d.keys is not None and d.keys.rewrite.add == "model."
    assert d.fix_command == "ckptool fix m.pth --add-prefix model. -o m.fixed.pth"


def test_strip_one_prefix_among_other_keys(tmp_path: Path) -> None:
    """Lightning keeps a loss module beside 'model.': strip only where present."""
    sd = net_sd(prefix="model.")
    sd["loss_fn.weight"] = torch.ones(3)
    d = run(save({"state_dict": sd}, tmp_path / "l.ckpt"), model="Net", width=8)
    assert d.keys is not None
    assert (d.keys.rewrite.strip, len(d.keys.matched)) == ("model.", 9)
    assert d.keys.unexpected == ["loss_fn.weight"]
    assert codes(d) == ["wrapped-state-dict", "key-prefix", "unexpected-keys"]
    assert d.fix_command == "ckptool fix l.ckpt --extract --strip-prefix model. -o l.fixed.ckpt"


def test_missing_and_unexpected(tmp_path: Path) -> None:
    sd = net_sd()
    del sd["fc.bias"]
    sd["extra.weight"] = torch.ones(1)
    d = run(save(sd, tmp_path / "m.pth"), model="Net", width=8)
    assert codes(d) == ["missing-keys", "unexpected-keys"]
    assert finding(d, "missing-keys").keys == ("fc.bias",)
    assert finding(d, "unexpected-keys").keys == ("extra.weight",)
    assert d.fix_command is None


def test_batchnorm_buffers_expected_and_nonpersistent_not(tmp_path: Path) -> None:
    keys = build_model(f"{NETS}:Net", {"width": 4})
    assert "bn.num_batches_tracked" in keys.shapes and "bn.running_var" in keys.shapes
    assert "scratch" not in keys.shapes
    sd = net_sd(4)
    for k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        del sd[k]
    d = run(save(sd, tmp_path / "m.pth"), model="Net", width=4)
    assert "BatchNorm running statistics" in finding(d, "missing-keys").message


def test_tied_weights(tmp_path: Path) -> None:
    keys = build_model(f"{NETS}:TiedLM", {})
    assert keys.tied == {"head.weight": ("embed.weight",), "embed.weight": ("head.weight",)}
    full = save(TiedLM().state_dict(), tmp_path / "full.pth")
    assert run(full, model="TiedLM").findings == []
    only_one = save({"embed.weight": torch.zeros(50, 16)}, tmp_path / "one.pth")
    d = run(only_one, model="TiedLM")
    assert codes(d) == ["tied-keys"]
    assert "head.weight (tied to embed.weight)" in finding(d, "tied-keys").message
    # either twin will do
    other = save({"head.weight": torch.zeros(50, 16)}, tmp_path / "other.pth")
    assert "embed.weight (tied to head.weight)" in finding(run(other, model="TiedLM"),
                                                           "tied-keys").message


def test_extra_state_is_a_key_both_ways(tmp_path: Path) -> None:
    """get_extra_state() entries are keys strict loading checks."""
    with_extra = run(save(net_sd(), tmp_path / "plain.pth"), model="WithExtra")
    assert codes(with_extra) == ["missing-keys"]
    assert finding(with_extra, "missing-keys").keys == ("_extra_state",)
    sd = net_sd()
    sd["_extra_state"] = {"version": 2}  # type: ignore[assignment]
    extra = save(sd, tmp_path / "extra.pth")
    assert run(extra, model="WithExtra").findings == []
    d = run(extra, model="Net", width=8)
    assert finding(d, "unexpected-keys").keys == ("_extra_state",)


def test_shape_mismatch_points_at_the_argument(tmp_path: Path) -> None:
    path = save({"state_dict": net_sd(12), "hyper_parameters": {"width": 12, "lr": 0.1}},
                tmp_path / "m.ckpt")
    d = run(path, model="Net", width=8)
    f = finding(d, "shape-mismatch")
    assert "every mismatched dimension is 12 in the file and 8 in the model" in f.message
    assert "the model was built with width=8" in f.message
    assert "saved settings have width=12" in f.message
    assert f.fix == "Net(width=12)"
    assert set(f.keys) == {k for k in net_sd() if k not in ("bn.num_batches_tracked", "fc.bias")}


def test_reference_checkpoint(tmp_path: Path) -> None:
    ref = save(net_sd(), tmp_path / "ref.pth")
    path = save({"model": net_sd(prefix="_orig_mod.")}, tmp_path / "new.pth")
    d = diagnose(ckptool.open(path), CPU_ONLY, reference_keys(str(ref)))
    assert codes(d) == ["wrapped-state-dict", "key-prefix"]
    assert d.fix_command == "ckptool fix new.pth --extract --strip-module -o new.fixed.pth"


def test_model_is_built_on_meta() -> None:
    """A 40 GB definition costs nothing: it never allocates its weights."""
    keys = build_model(f"{NETS}:Huge", {})
    assert keys.shapes["proj.weight"] == (100_000, 100_000)


# -- the CLI ---------------------------------------------------------------------

def test_cli_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["diagnose", "--json", "--device-count", "0",
                 str(SAMPLES / "dataparallel_cuda2.pth"),
                 "--model", f"{NETS}:Net", "--model-arg", "width=8"])
    out, err = capsys.readouterr()
    assert code == 1 and err == ""
    data = json.loads(out)
    assert data["schema_version"] == 1 and data["exit_code"] == 1
    assert [f["code"] for f in data["findings"]] == [
        "device-unavailable", "wrapped-state-dict", "weights-only", "key-prefix"]
    assert set(data["findings"][0]) == {"code", "severity", "message", "fix", "snippet", "keys"}
    assert data["fix_command"] == (f"ckptool fix {SAMPLES}/dataparallel_cuda2.pth --extract "
                                   f"--strip-module --to cpu -o {SAMPLES}/dataparallel_cuda2"
                                   ".fixed.pth")
    assert data["load"]["succeeds"] is False
    assert data["devices"] == [{"location": "cuda:2", "tensors": 15, "nbytes": 2712,
                                "lands": None, "physical": None,
                                "error": data["devices"][0]["error"]}]
    assert data["keys"]["rewrite"] == {"strip": "module.", "add": ""}
    assert data["keys"]["matched"] == 9 and data["keys"]["matched_as_saved"] == 0
    assert data["target"]["device_count"] == 0
    # every documented field, and nothing undocumented
    assert set(data) == {"schema_version", "path", "format", "target", "load", "devices",
                         "main_state_dict", "keys", "findings", "fix_command", "fix_output",
                         "fix_refused", "remaining", "exit_code", "framework", "adapter", "notes"}
    assert set(data["target"]) == {"description", "source", "device_count", "cuda_available",
                                   "cuda_visible_devices", "note", "gpus"}
    assert set(data["keys"]) == {"against", "rewrite", "expected", "matched_as_saved",
                                 "matched", "missing", "unexpected", "mismatched",
                                 "tied_missing", "renamed_at_load"}
    assert data["fix_output"] == f"{SAMPLES}/dataparallel_cuda2.fixed.pth"
    assert data["remaining"] == []


def test_cli_human_output(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["diagnose", "--device-count", "0", str(SAMPLES / "lightning.ckpt")])
    out, err = capsys.readouterr()
    assert code == 1 and err == ""
    assert "wrapped-state-dict" in out and "ambiguous-prefix" in out
    # 'model.' is not stripped without a model to say so (it may be the model's own)
    assert (f"ckptool fix {SAMPLES}/lightning.ckpt --extract "
            f"-o {SAMPLES}/lightning.fixed.ckpt") in out
    assert "still to resolve by hand: ambiguous-prefix" in out


def test_cli_clean_exit_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = save(net_sd(), tmp_path / "m.pth")
    assert main(["diagnose", str(path), "--model", f"{NETS}:Net", "-a", "width=8"]) == 0
    assert "no problems found" in capsys.readouterr().out


@pytest.mark.parametrize(("spec", "args", "message"), [
    ("nope/missing.py:Net", [], "no such model file"),
    (f"{NETS}:Nope", [], "has no attribute 'Nope'"),
    (f"{NETS}:Broken", [], "ValueError: this model is broken on purpose"),
    (f"{NETS}:Net", [], "missing 1 required positional argument: 'width'"),
    (f"{NETS}:NOT_CALLABLE", [], "is not a class or function"),
    (f"{NETS}:Net", ["-a", "depth=3"], "--model-arg does not fit"),
    ("no_such_pkg_xyz.nets:Net", [], "No module named 'no_such_pkg_xyz'"),
    ("justaname", [], "--model needs the form"),
    (f"{NETS}:Net", ["-a", "9=1"], "--model-arg needs the form"),
    (f"{NETS}:Exits", [], "SystemExit: bye"),
    (f"{NETS.parent}:Net", [], "is a directory"),
])
def test_bad_model_is_a_clean_error(capsys: pytest.CaptureFixture[str], spec: str,
                                    args: list[str], message: str) -> None:
    code = main(["diagnose", str(SAMPLES / "lightning.ckpt"), "--model", spec, *args])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("ckptool: error: ") and message in err
    assert "Traceback" not in err and "\nhint: " in err


def test_constructor_hint_offers_saved_settings(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = save({"state_dict": net_sd(12), "hyper_parameters": {"width": 12}},
                tmp_path / "m.ckpt")
    assert main(["diagnose", str(path), "--model", f"{NETS}:Net"]) == 2
    assert "the checkpoint saved --model-arg width=12" in capsys.readouterr().err


def test_model_arg_values_are_json_else_strings() -> None:
    from ckptool.check.modelspec import parse_arguments

    assert parse_arguments(["a=12", "b=true", "c=[1, 2]", "d=relu", "e=", 'f="x"']) == \
        {"a": 12, "b": True, "c": [1, 2], "d": "relu", "e": "", "f": "x"}


def test_module_spec_from_the_current_directory(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "mypkg_diag"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(NETS.read_text())
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    keys = build_model("mypkg_diag.nets:make_net", {"width": 4})
    assert keys.shapes["conv.weight"] == (4, 3, 3, 3) and keys.name == "make_net"


def test_unreadable_input_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.pth"
    bad.write_text("not a checkpoint")
    assert main(["diagnose", str(bad)]) == 3
    assert "not a checkpoint" in capsys.readouterr().err


def test_model_and_reference_together_is_usage(capsys: pytest.CaptureFixture[str]) -> None:
    lightning = str(SAMPLES / "lightning.ckpt")
    assert main(["diagnose", lightning, "--model", f"{NETS}:Net", "-r", lightning]) == 2
    assert main(["diagnose", lightning, "-a", "width=3"]) == 2
