"""Two checkpoints in one directory are refused with both named (exit 3, a
hint saying which path reads one alone), never one of them read as the
directory; what frameworks put side by side by design still reads as its
model. Each directory is made of real writers' output: huggingface_hub's
save_torch_state_dict, torch.distributed.checkpoint's dcp.save, torch.save,
and the committed DeepSpeed, per-rank and HuggingFaceStorageWriter fixtures."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import huggingface_hub as hub
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import CliResult

import ckptool
from ckptool.errors import InputError

FIXTURES = Path(__file__).resolve().parent / "fixtures"
DS_TAG = FIXTURES / "deepspeed" / "z2_fp32" / "global_step2"
PER_RANK = FIXTURES / "multifile" / "per_rank_dtensor" / "fsdp2_ws2"
HF_STORAGE = FIXTURES / "multifile" / "hf_storage" / "distributed"
INDEX = "model.safetensors.index.json"


def hf(folder: Path) -> Path:
    """huggingface_hub's shards and index (two shards)."""
    folder.mkdir(parents=True, exist_ok=True)
    hub.save_torch_state_dict({"a": torch.ones(300, 16), "b": torch.zeros(300, 16)}, folder,
                              max_shard_size="20KB")
    return folder


def distributed(folder: Path) -> Path:
    """dcp.save in this one process: a .metadata and its .distcp file."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in one process"
        dcp.save({"x": torch.ones(4, 4), "y": torch.arange(3.0)}, checkpoint_id=folder,
                 no_dist=True)
    return folder


def copy_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        shutil.copy(p, dst / p.name)


def single(folder: Path, name: str = "model.pt") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"w": torch.ones(2, 2)}, folder / name)
    return folder


@pytest.fixture
def hf_and_dcp(tmp_path: Path) -> Path:
    return distributed(hf(tmp_path / "both"))


@pytest.mark.parametrize("command", [["inspect"], ["inspect", "--json"], ["diagnose"],
                                     ["convert"]])
def test_an_index_and_a_dcp_side_by_side_are_refused(
        hf_and_dcp: Path, tmp_path: Path, command: list[str],
        run_cli: Callable[..., CliResult]) -> None:
    out = tmp_path / "out.safetensors"
    args = [*command, str(hf_and_dcp)] + ([str(out)] if command == ["convert"] else [])
    code, stdout, stderr = run_cli(*args)
    assert code == 3 and stdout == ""
    error, hint = stderr.splitlines()
    assert error.startswith(f"ckptool: error: {hf_and_dcp} holds two checkpoints, ")
    assert "a torch.distributed.checkpoint (.metadata and 1 .distcp file)" in error
    assert f"a Hugging Face sharded checkpoint ({INDEX})" in error
    assert hint == (f"hint: name one: ckptool inspect {hf_and_dcp / INDEX}, or move the other "
                    "into a directory of its own")
    assert not out.exists() and not list(tmp_path.glob("out*"))


def test_the_index_named_reads_the_hugging_face_model(
        hf_and_dcp: Path, tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    ckpt = ckptool.open(hf_and_dcp / INDEX)
    assert ckpt.format == "hf-safetensors" and sorted(t.key for t in ckpt.tensors) == ["a", "b"]
    code, _, err = run_cli("convert", str(hf_and_dcp / INDEX), str(tmp_path / "m.safetensors"))
    assert code == 0, err


def layouts(tmp_path: Path, case: str) -> tuple[Path, list[str], str | None]:
    """A directory holding two checkpoints: (it, what the error names, the
    path the hint names, if one reads alone)."""
    d = tmp_path / case
    ds_files, dcp_what = "a DeepSpeed checkpoint (mp_rank_00_model_states.pt", \
        "a torch.distributed.checkpoint (.metadata"
    if case == "index+deepspeed":
        copy_files(DS_TAG, hf(d))
        return d, [ds_files, f"Hugging Face sharded checkpoint ({INDEX})"], str(d / INDEX)
    if case == "deepspeed+file":
        copy_files(DS_TAG, d)
        single(d, "pytorch_model.bin")
        return d, [ds_files, "the checkpoint file pytorch_model.bin"], \
            str(d / "pytorch_model.bin")
    if case == "dcp+per-rank":
        copy_files(PER_RANK, distributed(d))
        return d, [dcp_what, "a checkpoint saved per rank (model_world_size_2_rank_0.pt, "
                             "model_world_size_2_rank_1.pt)"], None
    if case == "index+hf-storage":
        copy_files(HF_STORAGE, hf(d))
        return d, ["HuggingFaceStorageWriter shards (shard-00001-model-00001-of-00001."
                   "safetensors", f"Hugging Face sharded checkpoint ({INDEX})"], str(d / INDEX)
    if case == "file+dcp":
        distributed(single(d))
        return d, [dcp_what, "the checkpoint file model.pt"], str(d / "model.pt")
    if case == "dcp+deepspeed-tag":
        shutil.copytree(DS_TAG, distributed(d) / "global_step2")
        return d, [dcp_what, "a DeepSpeed checkpoint (global_step2/)"], str(d / "global_step2")
    if case == "index+file":  # no config.json says which one transformers loads
        single(hf(d), "consolidated.pt")
        return d, [f"({INDEX})", "the checkpoint file consolidated.pt"], str(d / INDEX)
    assert case == "accelerate+dcp"
    distributed(distributed(d / "pytorch_model_fsdp_0").parent)
    return d, [dcp_what, "accelerate's sharded checkpoint (pytorch_model_fsdp_0/)"], \
        str(d / "pytorch_model_fsdp_0")


CASES = ["index+deepspeed", "deepspeed+file", "dcp+per-rank", "index+hf-storage", "file+dcp",
         "dcp+deepspeed-tag", "index+file", "accelerate+dcp"]


@pytest.mark.parametrize("case", CASES)
def test_any_two_checkpoints_side_by_side_are_refused(tmp_path: Path, case: str) -> None:
    d, names, named = layouts(tmp_path, case)
    with pytest.raises(InputError) as caught:
        ckptool.open(d)
    message, hint = caught.value.message, caught.value.hint
    assert message.startswith(f"{d} holds two checkpoints, ") and \
        message.endswith("ckptool cannot tell which one is the model")
    assert all(n in message for n in names), message
    if named is None:
        assert hint == "move one of them into a directory of its own, and name that directory"
    else:
        assert hint.startswith(f"name one: ckptool inspect {named}, or move the other")
        assert ckptool.open(named).tensors  # and that path reads it alone


def test_three_are_all_named(tmp_path: Path) -> None:
    d = distributed(single(hf(tmp_path / "three")))
    with pytest.raises(InputError, match=r"holds three checkpoints, a torch.distributed.checkpoint"
                                         r" .*, a Hugging Face sharded .* and the checkpoint "
                                         r"file model.pt: ") as caught:
        ckptool.open(d)
    assert "move the others" in caught.value.hint


# -- what frameworks put side by side by design --------------------------------

def test_a_dcp_with_its_frameworks_files_is_the_dcp(tmp_path: Path) -> None:
    """Megatron-core's common.pt and a Trainer's optimizer.pt and rng_state.pth
    beside the .metadata are the run's, not another model."""
    d = distributed(tmp_path / "dcp")
    for name in ("common.pt", "optimizer.pt", "rng_state.pth"):
        torch.save({"step": torch.tensor(3)}, d / name)
    ckpt = ckptool.open(d)
    assert ckpt.format == "dcp" and sorted(t.key for t in ckpt.tensors) == ["x", "y"]


def test_a_trainer_folder_with_deepspeeds_tag_is_its_model(tmp_path: Path) -> None:
    """A Trainer's checkpoint-N/: the model (sharded here) beside DeepSpeed's
    global_stepN/ and the latest file naming it."""
    d = hf(tmp_path / "checkpoint-2")
    shutil.copytree(DS_TAG, d / "global_step2")
    (d / "latest").write_text("global_step2")
    ckpt = ckptool.open(d)
    assert ckpt.format == "hf-safetensors"
    assert any("also holds a DeepSpeed checkpoint (global_step2/" in n
               for n in ckpt.metadata["notes"])


def test_a_configured_folder_reads_the_index_transformers_loads(tmp_path: Path) -> None:
    """Mistral's repositories: the shards and their index, consolidated.safetensors
    beside them, and a config.json; transformers loads the index."""
    d = hf(tmp_path / "mistral")
    torch.save({"w": torch.ones(2)}, d / "consolidated.pt")
    (d / "config.json").write_text('{"model_type": "mistral", "architectures": '
                                   '["MistralForCausalLM"]}')
    ckpt = ckptool.open(d)
    assert ckpt.format == "hf-safetensors" and sorted(t.key for t in ckpt.tensors) == ["a", "b"]
