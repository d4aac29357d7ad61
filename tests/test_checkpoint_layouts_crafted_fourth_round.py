"""Crafted Megatron legacy and NeMo inputs, a fourth round of the
adversarial review of the readers (earlier rounds:
``test_megatron_crafted_inputs_are_refused.py``,
``test_megatron_crafted_inputs_second_round.py``,
``test_moe_and_nemo_ranks_crafted_inputs.py``): each is refused with one
line and its exit code (0 ok, 1 verify problems, 2 usage, 3 cannot read),
and nothing is renumbered, dropped or joined wrong without a word. Every
test here failed on the code it was written against; the comment on each
says what happened."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_nemo
from megatron_builders import whole_model, write_legacy

import ckptool
from ckptool.errors import CkptoolError


def _edit_rank(folder: Path, rank: str, edit: Any) -> None:
    path = folder / rank / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    edit(state)
    torch.save(state, path)


# -- legacy rank files: layers and experts renumbered ----------------------------------

def test_a_stage_whose_layers_skip_a_number_is_not_renumbered_unsaid(tmp_path: Path) -> None:
    # Was exit 0, decoder.layers.1 gone and stage 0's second layer shown as
    # decoder.layers.5: stage 0 (of TP 1 x PP 2, num_layers 4) numbers its
    # layers 0 and 5, not 0 and 1. legacy._pieces counts the distinct layer
    # numbers of each stage (2, so the totals agree with num_layers) and adds
    # the stage's offset to each local number as it is (0 + 5); only two
    # stages giving one name is caught (second round), not a gap. Megatron's
    # strict load refuses the file (unexpected decoder.layers.5).
    full = whole_model(layers=4)
    folder = write_legacy(tmp_path / "run", full, tp=1, pp=2)
    _edit_rank(folder, "mp_rank_00_000", lambda s: s.__setitem__(
        "model", {k.replace("layers.1.", "layers.5."): v for k, v in s["model"].items()}))
    try:
        joined = ckptool.load(str(tmp_path / "run"))
    except CkptoolError:
        return
    layers = sorted({int(k.split(".")[2]) for k in joined if k.startswith("decoder.layers.")})
    assert layers == [0, 1, 2, 3], layers  # (was [0, 2, 3, 5])
    key = "decoder.layers.1.self_attention.linear_qkv.weight"
    assert torch.equal(joined[key], full[key])


def test_expert_parallel_ranks_of_unequal_expert_counts_are_refused(tmp_path: Path) -> None:
    # Was exit 0, global expert 2 gone and expert-parallel rank 1's experts
    # shown as 3, 4 and 5 (num_experts 4): mp_rank_00_001 (EP 2 of 4 experts)
    # holds a third local expert (local_experts.2, a copy of its 1).
    # legacy._local_experts counts each rank's own experts and _pieces gives
    # its local expert e the global id ep_rank * (that count) + e = 3 + e, so
    # rank 0's experts are 0, 1 and rank 1's 3, 4, 5: nothing collides, nothing
    # is said. Megatron gives every expert-parallel rank num_experts / EP
    # experts, and its strict load refuses the extra one.
    full = whole_model(layers=2, experts=4)
    folder = write_legacy(tmp_path / "run", full, tp=1, pp=1, ep=2)

    def third_expert(state: dict[str, Any]) -> None:
        model = state["model"]
        for key in [k for k in model if ".local_experts.1." in k]:
            model[key.replace(".local_experts.1.", ".local_experts.2.")] = model[key].clone()

    _edit_rank(folder, "mp_rank_00_001", third_expert)
    try:
        joined = ckptool.load(str(tmp_path / "run"))
    except CkptoolError:
        return
    experts = sorted({int(k.split(".")[6]) for k in joined if ".local_experts." in k})
    assert experts == [0, 1, 2, 3], experts  # (was [0, 1, 3, 4, 5])
    key = "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight"
    assert torch.equal(joined[key], full[key])


def test_grouped_expert_fc1_of_swiglu_halves_under_args_without_swiglu_is_refused(
        tmp_path: Path) -> None:
    # Was exit 0, every expert's linear_fc1 joined wrong ([gate0, up0, gate1,
    # up1] for [gate0, gate1, up0, up1]): TP 2 rank files of a SwiGLU MoE run,
    # its experts under TEGroupedMLP's names (mlp.experts.linear_fc1.weight0),
    # whose args say swiglu False. The same files under SequentialMLP's names
    # are refused ("joins into 48 rows, and the run's moe_ffn_hidden_size 24
    # without SwiGLU makes 24"), but legacy._check_fc1's FC1 pattern
    # (mlp.(experts.local_experts.N.)?linear_fc1.weight$) does not match the
    # grouped name, so its halves are concatenated as one column-parallel fc1.
    import re

    full = whole_model(layers=2, experts=2)
    folder = write_legacy(tmp_path / "run", full, tp=2, pp=1, ffn_hidden_size=24,
                          moe_ffn_hidden_size=24)

    def grouped_without_swiglu(state: dict[str, Any]) -> None:
        state["args"].swiglu = False
        state["model"] = {re.sub(r"experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)",
                                 r"experts.\2\1", k): v for k, v in state["model"].items()}

    for rank in ("mp_rank_00", "mp_rank_01"):
        _edit_rank(folder, rank, grouped_without_swiglu)
    try:
        joined = ckptool.load(str(tmp_path / "run"))
    except CkptoolError:
        return
    assert torch.equal(joined["decoder.layers.0.mlp.experts.linear_fc1.weight0"],
                       full["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"])


# -- NeMo configs ------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["nemo1", "nemo2"])
def test_a_nemo_config_int_of_5000_digits_is_refused_in_one_line(
        tmp_path: Path, run_cli: Any, where: str) -> None:
    # Was a traceback: ValueError: Exceeds the limit (4300 digits) for integer
    # string conversion, from int(raw) in nemo._scalar (flat_yaml of
    # model_config.yaml, or NeMo 2's context/model.yaml): _INT matches any
    # run of digits. (The third round's 30-digit sizes got as far as the
    # rank grid; these never leave the YAML parser.)
    if where == "nemo1":
        folder = tmp_path / "ckpt"
        make_nemo.nemo1_folder(folder, "ckpt")
        config = folder / "model_config.yaml"
        config.write_text(config.read_text() + "hidden_size: " + "1" * 5000 + "\n")
    else:
        folder = tmp_path / "nemo2"
        make_nemo.nemo2_folder(folder)
        config = folder / "context" / "model.yaml"
        config.write_text(config.read_text() + "  num_layers: " + "1" * 5000 + "\n")
    code, _, err = run_cli("inspect", str(folder))
    assert code in (0, 3), err


# -- DeepSpeed native MoE -------------------------------------------------------------------

MOE = Path(__file__).parent / "fixtures" / "deepspeed_moe"
MOE0 = "moe0.deepspeed_moe.experts.deepspeed_experts."


def test_moe_expert_files_holding_each_others_experts_are_refused(tmp_path: Path) -> None:
    # Was exit 0 with moe0's experts 1 and 3 swapped (against the reference):
    # in a ZeRO 0 folder, layer_0_expert_1_mp_rank_00_model_states.pt holds
    # expert 3's names (deepspeed_experts.3.*) and layer_0_expert_3's expert
    # 1's. deepspeed_moe.missing_files checks the files' names against
    # num_experts and expert_tensors takes every name inside them, but nothing
    # ties a file's expert id to the names it holds: each expert's weights are
    # taken from the other's file, unsaid. DeepSpeed's load_checkpoint reads
    # file E for global expert E and renames only deepspeed_experts.E. to the
    # local id, so its strict load refuses these files.
    import shutil

    shutil.copytree(MOE / "w2_ep2_z0", tmp_path / "w2_ep2_z0")
    tag = tmp_path / "w2_ep2_z0" / "global_step2"
    for expert, other in ((1, 3), (3, 1)):
        path = tag / f"layer_0_expert_{expert}_mp_rank_00_model_states.pt"
        state = torch.load(path, weights_only=True)
        torch.save({k.replace(f"{MOE0}{expert}.", f"{MOE0}{other}."): v
                    for k, v in state.items()}, path)
    try:
        joined = ckptool.load(str(tag))
    except CkptoolError:
        return
    ref = torch.load(MOE / "w2_ep2_z0.reference.pt", weights_only=True)
    key = f"{MOE0}1.0.weight"
    assert torch.equal(joined[key], ref[key])
