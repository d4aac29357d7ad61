"""Framework folders read as the framework means them, on what the real
libraries wrote (tests/fixtures/frameworks/: transformers 4.57, peft,
accelerate, a real Trainer run; expected.json holds what they reported).

- a Trainer checkpoint-N/ and an accelerate save_state folder read as their
  model, every other file listed by role and scanned;
- names as the framework means them: no advice to strip 'model.' from a
  transformers model, nor 'base_model.model.' from a PEFT adapter, and no
  fix command for an ambiguous prefix without a model;
- ties by the framework's rule: the input embedding is kept, in every layout;
- an optimizer's state is not a model's weights.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CliResult
from safetensors import safe_open

import ckptool
from ckptool.check.diagnosis import diagnose
from ckptool.check.gpus.machine import Machine
from ckptool.cli import main
from ckptool.read.layouts import framework

HERE = Path(__file__).parent / "fixtures" / "frameworks"
EXPECTED = json.loads((HERE / "expected.json").read_text())
CPU = Machine((), False, None, "none", "")
TRAINER = HERE / "trainer_checkpoint" / "checkpoint-2"
GOOD_FOLDERS = ["llama_tied", "llama_tied_bin", "llama_tied_bin_sharded", "llama_untied",
                "bert", "gpt2", "peft_lora", "trainer_checkpoint/checkpoint-2"]


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def stored_keys(name: str) -> set[str]:
    facts = EXPECTED[name.split("/")[0]]
    return {k for keys in facts["stored_keys"].values() for k in keys}


# -- folders -------------------------------------------------------------------

def test_a_trainer_checkpoint_is_its_model_with_every_file_listed() -> None:
    ckpt = ckptool.open(TRAINER)
    assert ckpt.path.endswith("model.safetensors")
    assert set(ckpt.state_dict()) == stored_keys("trainer_checkpoint")
    fw = ckpt.framework
    assert fw is not None and fw.kind == "trainer"
    assert (fw.model_class, fw.model_type, fw.tie_word_embeddings) == (
        "LlamaForCausalLM", "llama", True)
    roles = {c.path: c.role for c in fw.companions}
    assert roles == {
        "config.json": "model config", "generation_config.json": "generation config",
        "optimizer.pt": "optimizer state", "scheduler.pt": "LR scheduler state",
        "rng_state.pth": "RNG state (Trainer)", "training_args.bin": "training arguments (Trainer)",
        "trainer_state.json": "trainer state (JSON)"}
    by_name = {c.path: c for c in fw.companions}
    assert by_name["optimizer.pt"].detail == (
        "Adam/AdamW: step, exp_avg, exp_avg_sq for 20 parameters, 2 param groups")
    # what torch.load(weights_only=True) refuses in them is named, never run
    assert "transformers.training_args.TrainingArguments" in by_name["training_args.bin"].custom
    assert not any(c.unsafe for c in fw.companions)
    assert all(c.format for c in fw.companions if c.path.endswith((".pt", ".pth", ".bin")))


def test_an_accelerate_state_folder_is_its_model() -> None:
    ckpt = ckptool.open(HERE / "accelerate_state")
    assert set(ckpt.state_dict()) == stored_keys("accelerate_state")
    fw = ckpt.framework
    assert fw is not None and fw.kind == "accelerate"
    assert {c.path: c.role for c in fw.companions} == {
        "optimizer.bin": "optimizer state", "scheduler.bin": "LR scheduler state",
        "random_states_0.pkl": "RNG state (accelerate)"}
    # accelerate torch.saves its random states (a .pkl in name only), numpy's among them
    assert next(c for c in fw.companions if c.path == "random_states_0.pkl").format == \
        "torch-zip"


def test_a_peft_adapter_is_named_with_its_config() -> None:
    ckpt = ckptool.open(HERE / "peft_lora")
    fw = ckpt.framework
    assert fw is not None and fw.kind == "peft"
    assert fw.adapter == {"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                          "target_modules": ["q_proj", "v_proj"], "base_model": "tiny-llama",
                          "task_type": "CAUSAL_LM"}
    assert fw.own_prefix == "base_model.model.model."


def test_inspect_shows_the_folder_its_files_and_their_roles(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["inspect", str(TRAINER), "--limit", "1"], capsys)
    assert code == 0 and err == ""
    assert "a transformers Trainer checkpoint (checkpoint-2/)" in out
    assert "('model.' is LlamaForCausalLM's own naming, config.json)" in " ".join(out.split())
    assert "optimizer.pt" in out and "RNG state (Trainer)" in out
    code, out, _ = run(["inspect", "--json", str(TRAINER)], capsys)
    data = json.loads(out)
    assert data["framework"]["kind"] == "trainer"
    assert {c["path"] for c in data["framework"]["companions"]} >= {
        "optimizer.pt", "rng_state.pth", "training_args.bin"}


def test_a_file_named_directly_takes_its_folders_config() -> None:
    fw = ckptool.open(HERE / "llama_tied" / "model.safetensors").framework
    assert fw is not None and fw.own_prefix == "model." and fw.companions == ()
    assert ckptool.open(HERE / "optimizer_only.pt").framework is None


def test_a_fixed_copy_beside_the_model_does_not_hide_it(tmp_path: Path) -> None:
    """transformers loads model.safetensors whatever else the folder holds;
    the other checkpoint file is listed (and scanned), not refused."""
    folder = tmp_path / "llama"
    shutil.copytree(HERE / "llama_tied", folder)
    shutil.copy(folder / "model.safetensors", folder / "model.fixed.safetensors")
    ckpt = ckptool.open(folder)
    assert ckpt.path.endswith(os.sep + "model.safetensors")
    assert ckpt.framework is not None
    extra = next(c for c in ckpt.framework.companions if c.path == "model.fixed.safetensors")
    assert extra.role == ("ckptool fix's output (transformers' from_pretrained loads it only "
                          "with variant='fixed')")  # model.<variant>.safetensors, by its name
    os.remove(folder / "config.json")  # no framework says which: ambiguous, refused
    with pytest.raises(ckptool.CkptoolError, match="2 checkpoint files"):
        ckptool.open(folder)


@pytest.mark.parametrize(("files", "configured", "model"), [
    (["model.safetensors", "optimizer.pt", "rng_state.pth", "training_args.bin"], False,
     "model.safetensors"),
    (["model.safetensors", "optimizer.bin", "random_states_0.pkl"], False, "model.safetensors"),
    (["model.safetensors", "pytorch_model.bin"], True, "model.safetensors"),
    (["model.safetensors", "pytorch_model.bin"], False, None),
    (["adapter_model.bin", "adapter_model.safetensors"], True, "adapter_model.safetensors"),
    (["a.pth", "b.pth"], True, None),
    (["model.safetensors", "model_1.safetensors", "optimizer.bin", "optimizer_1.bin"], False,
     "model.safetensors"),
])
def test_pick_model(files: list[str], configured: bool, model: str | None) -> None:
    assert framework.pick_model(files, configured) == model


def test_an_unsafe_file_beside_the_model_is_named(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A Trainer resuming from the folder torch.loads rng_state.pth: a payload
    there is the folder's problem, though the model file is clean."""
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(TRAINER, folder)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    with open(folder / "rng_state.pth", "wb") as f:
        pickle.dump({"python": Payload()}, f, protocol=2)
    code, out, _ = run(["inspect", str(folder)], capsys)
    assert code == 0 and "rng_state.pth" in out and "UNSAFE" in out
    code, out, _ = run(["diagnose", "--json", str(folder)], capsys)
    found = {f["code"]: f for f in json.loads(out)["findings"]}
    assert code == 1 and "rng_state.pth" in found["unsafe-companion"]["message"]
    assert not marker.exists()


# -- names ---------------------------------------------------------------------

@pytest.mark.parametrize("name", GOOD_FOLDERS)
def test_no_fix_is_advised_for_what_the_framework_wrote(name: str) -> None:
    """Each of these loads into its framework class exactly
    (check_loads.py): diagnose must find nothing to fix in it."""
    d = diagnose(ckptool.open(HERE / name), CPU)
    assert [f.code for f in d.findings] == []
    assert d.fix_command is None


def test_without_evidence_model_prefix_is_explained_not_stripped() -> None:
    """accelerate writes no config: 'model.' could be either; no fix."""
    d = diagnose(ckptool.open(HERE / "accelerate_state"), CPU)
    assert [f.code for f in d.findings] == ["ambiguous-prefix"]
    assert d.findings[0].fix is None and d.fix_command is None


# -- ties ----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama_tied_bin", "llama_tied_bin_sharded"])
@pytest.mark.parametrize("fmt", ["safetensors", "hf"])
def test_ties_keep_the_input_embedding(tmp_path: Path, name: str, fmt: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """pytorch_model.bin pickles lm_head.weight first and the index lists it
    first: transformers loads model.embed_tokens.weight and ties lm_head to
    it, so that name is the one stored."""
    out = tmp_path / ("out.safetensors" if fmt == "safetensors" else "out")
    args = ["convert", str(HERE / name), str(out)] + (["--format", "hf"] if fmt == "hf" else [])
    code, _, err = run(args, capsys)
    assert code == 0, err
    path = out if fmt == "safetensors" else out / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
        embedding = f.get_tensor("model.embed_tokens.weight")
        meta = f.metadata()
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    assert keys == stored_keys(name) - {"lm_head.weight"}
    reference = torch.load(next(HERE.joinpath(name).glob("pytorch_model*.bin")),
                           weights_only=True)
    if "model.embed_tokens.weight" in reference:
        assert torch.equal(embedding, reference["model.embed_tokens.weight"])
    # the tie is recorded (huggingface_hub's way in an HF folder, ckptool's in a file)
    tied = meta if fmt == "hf" else json.loads(meta["ckptool.aliases"])
    assert tied["lm_head.weight"] == "model.embed_tokens.weight"


# -- optimizer state -----------------------------------------------------------

def test_an_optimizer_state_is_not_weights(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = ckptool.open(HERE / "optimizer_only.pt")
    assert ckpt.main_state_dict is None
    assert ckpt.metadata["optimizer_states"] == [{
        "path": "", "parameters": 4, "param_groups": 1,
        "state_names": ["step", "exp_avg", "exp_avg_sq"], "kind": "Adam/AdamW", "flat": False}]
    with pytest.raises(ckptool.CkptoolError, match=r"optimizer state .*not a model's weights"):
        ckptool.load_state_dict(HERE / "optimizer_only.pt")
    code, _, err = run(["fix", str(HERE / "optimizer_only.pt"), "--extract",
                        "-o", str(tmp_path / "x.pth")], capsys)
    assert code == 2 and "optimizer state" in err and not (tmp_path / "x.pth").exists()


def test_the_trainers_optimizer_points_at_the_model() -> None:
    d = diagnose(ckptool.open(TRAINER / "optimizer.pt"), CPU)
    f = next(f for f in d.findings if f.code == "no-state-dict")
    assert "Adam/AdamW" in f.message and str(TRAINER / "model.safetensors") in f.message


def test_an_optimizer_beside_the_weights_is_never_the_state_dict(tmp_path: Path) -> None:
    """{"model": sd, "optimizer": opt} and an optimizer saved alone under
    any name: its per-parameter dicts never rank as the weights."""
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.ones(1, 3)).sum().backward()
    opt.step()
    torch.save({"weights_of_run": net.state_dict(), "o": opt.state_dict()}, tmp_path / "a.pt")
    ckpt = ckptool.open(tmp_path / "a.pt")
    assert ckpt.main_state_dict is not None and ckpt.main_state_dict.path == "weights_of_run"
    assert ckpt.metadata["optimizer_states"][0]["kind"] == "SGD with momentum"


# -- writing what the framework reads back -------------------------------------

@pytest.mark.parametrize(("name", "fmt", "files"), [
    ("diffusers_ddpm/unet", "hf", {"config.json", "diffusion_pytorch_model.safetensors"}),
    ("diffusers_ddpm/unet_bin", "hf-bin", {"config.json", "diffusion_pytorch_model.bin"}),
    ("peft_lora", "hf", {"adapter_config.json", "adapter_model.safetensors", "README.md"}),
    ("llama_tied_bin_sharded", "hf",
     {"config.json", "generation_config.json", "model.safetensors"}),
    ("bert", "hf-bin", {"config.json", "pytorch_model.bin"}),
])
def test_a_framework_folder_converts_to_what_its_loader_finds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, fmt: str,
        files: set[str]) -> None:
    """from_pretrained looks for its own file names and its config beside
    them (check_loads.py / check_pipelines.py load these outputs exactly);
    the config files are copied byte for byte."""
    out = tmp_path / "out"
    code, text, err = run(["convert", str(HERE / name), str(out), "--format", fmt], capsys)
    assert code == 0, err
    assert {p.name for p in out.iterdir()} == files
    for config in files - {n for n in files if n.startswith(("model.", "pytorch_model",
                                                              "diffusion_", "adapter_model"))}:
        assert (out / config).read_bytes() == (HERE / name / config).read_bytes()
    assert "copied" in text
    a, b = ckptool.load_state_dict(HERE / name), ckptool.load_state_dict(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sharded_output_keeps_the_frameworks_stem(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "unet"
    code, _, err = run(["convert", str(HERE / "diffusers_ddpm" / "unet"), str(out),
                        "--format", "hf", "--max-shard-size", "100KB"], capsys)
    assert code == 0, err
    names = sorted(p.name for p in out.iterdir())
    assert "diffusion_pytorch_model.safetensors.index.json" in names
    assert "diffusion_pytorch_model-00001-of-00002.safetensors" in names
    assert len(ckptool.open(out).tensors) == 114


class Tied(torch.nn.Module):
    def __init__(self, head: bool = True) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        if head:
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight


def test_ties_a_converted_file_records_load_back(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """.pth (shared storage) -> .safetensors (the tie in __metadata__) ->
    load_state_dict: both names, one tensor, as torch.load of the .pth gives;
    a model without the tied name gets no key it would refuse."""
    torch.save(Tied().state_dict(), tmp_path / "t.pth")
    assert main(["convert", str(tmp_path / "t.pth"), str(tmp_path / "t.safetensors")]) == 0
    capsys.readouterr()
    sd = ckptool.load_state_dict(tmp_path / "t.safetensors")
    assert set(sd) == {"embed.weight", "head.weight"} and sd["head.weight"] is sd["embed.weight"]
    bare = Tied(head=False)
    sd = ckptool.load_state_dict(tmp_path / "t.safetensors", model=bare)
    assert set(sd) == {"embed.weight"}
    bare.load_state_dict(sd, strict=True)


def test_a_sentence_transformers_folder_lists_every_modules_weights() -> None:
    """modules.json: the transformer at the top is the model read; the Dense
    layer in 2_Dense/ is listed (and read like the model), not ignored."""
    ckpt = ckptool.open(HERE / "sentence_transformers")
    fw = ckpt.framework
    assert fw is not None and fw.kind == "sentence-transformers"
    assert len(ckpt.tensors) == 39
    dense = next(c for c in fw.companions if c.path == "2_Dense/model.safetensors")
    assert dense.role == "module 2 (Dense) weights" and dense.format == "safetensors"
    assert dense.detail == "2 tensors: linear.bias 8, linear.weight 8x16"


def test_a_fixed_copy_of_a_framework_folder_keeps_its_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fixed"
    assert main(["fix", str(HERE / "llama_tied_bin_sharded"), "--dtype", "bf16",
                 "-o", str(out)]) == 0, capsys.readouterr().err
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "pytorch_model.bin.index.json"} <= names
    before = json.loads((HERE / "llama_tied_bin_sharded" / "config.json").read_text())
    assert json.loads((out / "config.json").read_text()) == {**before, "dtype": "bfloat16"}
    assert {t.dtype for t in ckptool.open(out).tensors} == {"bfloat16"}


def test_a_config_of_another_architecture_is_no_evidence(tmp_path: Path) -> None:
    """A BERT config beside keys under 'model.': a BERT keeps its weights
    under 'bert.', so 'model.' is no evidence of anything: explained, not
    waved through."""
    folder = tmp_path / "m"
    shutil.copytree(HERE / "llama_tied", folder)
    shutil.copy(HERE / "bert" / "config.json", folder / "config.json")
    d = diagnose(ckptool.open(folder), CPU)
    assert [f.code for f in d.findings] == ["ambiguous-prefix"]
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    assert diagnose(ckptool.open(folder), CPU).findings == []


def test_a_fifo_in_a_framework_folder_is_never_opened(tmp_path: Path) -> None:
    folder = tmp_path / "st"
    shutil.copytree(HERE / "sentence_transformers", folder)
    os.remove(folder / "2_Dense" / "model.safetensors")
    os.mkfifo(folder / "2_Dense" / "model.safetensors")
    os.mkfifo(folder / "extra.bin")
    ckpt = ckptool.open(folder)  # would block for ever on opening a FIFO
    assert len(ckpt.tensors) == 39


def test_a_hostile_config_shows_no_junk(tmp_path: Path) -> None:
    folder = tmp_path / "a"
    shutil.copytree(HERE / "peft_lora", folder)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": [1, 2], "r": "x", "target_modules": [{"a": 1}, "q_proj"],
         "base_model_name_or_path": 7}))
    fw = ckptool.open(folder).framework
    assert fw is not None and fw.adapter == {"peft_type": "unknown",
                                             "target_modules": ["q_proj"]}


def test_a_fixed_model_beside_an_accelerate_folders_model(
        tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    """fix of an accelerate save_state folder writes model.fixed.safetensors in
    it; the folder still reads as the model accelerate loads by name."""
    folder = tmp_path / "state"
    shutil.copytree(HERE / "accelerate_state", folder)
    code, _, err = run_cli("fix", str(folder), "--dtype", "bf16", "-q")
    assert (code, err) == (0, "") and (folder / "model.fixed.safetensors").exists()
    ckpt = ckptool.open(folder)
    assert ckpt.path == str(folder / "model.safetensors")
    assert ckpt.framework is not None and ckpt.framework.kind == "accelerate"
