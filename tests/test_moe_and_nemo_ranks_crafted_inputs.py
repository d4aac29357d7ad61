"""Crafted DeepSpeed native-MoE folders and NeMo 1 per-rank folders, an
adversarial review of ``deepspeed_moe`` (with ``deepspeed`` and
``deepspeed_files``) and of NeMo's rank files joined as Megatron's legacy
ranks (``nemo``, ``legacy``, ``layout``): each is refused with one line and
its exit code (0 ok, 1 verify problems, 2 usage, 3 cannot read), in bounded
time and memory, and nothing is joined, dropped or read from the wrong file
without a word. Every test here failed on the code it was written against;
the comment on each says what happened."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import cli_in_subprocess, make_nemo

import ckptool
from ckptool.errors import CkptoolError

ROOT = Path(__file__).resolve().parent.parent
MOE = Path(__file__).parent / "fixtures" / "deepspeed_moe"
MEGATRON = Path(__file__).parent / "fixtures" / "megatron"
MODEL_STATES = "mp_rank_00_model_states.pt"
OPTIM0 = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
MOE0 = "moe0.deepspeed_moe.experts.deepspeed_experts."


# -- DeepSpeed native MoE ----------------------------------------------------------

def _copy(tmp_path: Path, variant: str) -> Path:
    shutil.copytree(MOE / variant, tmp_path / variant)
    return tmp_path / variant / "global_step2"


def _edit(path: Path, edit: Callable[[Any], Any]) -> None:
    state = torch.load(path, weights_only=False)
    edit(state)
    torch.save(state, path)


def _expert_group(state: Any) -> Any:
    return state["optimizer_state_dict"]["base_optimizer_state"]["param_groups"][1]


@pytest.mark.usefixtures("ds_stubs")
@pytest.mark.parametrize("paddings", [7, [None] * 16, ["a"] * 16],
                         ids=["int", "nones", "strings"])
def test_moe_expert_group_paddings_that_are_not_ints_are_refused(
        tmp_path: Path, paddings: Any, run_cli: Any) -> None:
    # Was a traceback: TypeError (object of type 'int' has no len(); '<' not
    # supported between 'NoneType'/'str' and 'int'). deepspeed_moe.master_weights
    # hands param_alignment_paddings[g] of the expert group to zero.stage12
    # unchecked; deepspeed._trainable checks the other groups' only after it.
    tag = _copy(tmp_path, "w2_ep2_z2")

    def edit(state: Any) -> None:
        state["optimizer_state_dict"]["param_alignment_paddings"][1] = paddings

    _edit(tag / OPTIM0, edit)
    code, _, err = run_cli("inspect", str(tag))
    assert code == 3, err
    assert "param_alignment_paddings is" in err


@pytest.mark.usefixtures("ds_stubs")
def test_moe_expert_id_of_5000_digits_is_refused(tmp_path: Path, run_cli: Any) -> None:
    # Was a traceback: ValueError: Exceeds the limit (4300 digits) for integer
    # string conversion, from int(m.group("id")) in deepspeed_moe.local_counts
    # (and global_name): a name of param_shapes' expert group whose expert id
    # LOCAL_ID's \d+ matched is 5000 digits long.
    tag = _copy(tmp_path, "w2_ep2_z2")
    old = f"{MOE0}1.0.weight"

    def edit(state: Any) -> None:
        group = state["param_shapes"][1]
        items = [(f"{MOE0}{'1' * 5000}.0.weight" if k == old else k, v)
                 for k, v in group.items()]
        group.clear()
        group.update(items)

    _edit(tag / MODEL_STATES, edit)
    code, _, err = run_cli("inspect", str(tag))
    assert code == 3, err


@pytest.mark.usefixtures("ds_stubs")
def test_moe_group_named_ep_size_of_5000_digits_is_refused(tmp_path: Path,
                                                           run_cli: Any) -> None:
    # Was a traceback: ValueError: Exceeds the limit (4300 digits) for integer
    # string conversion, from int(m.group(1)) in deepspeed_moe.ep_size (the
    # expert group's name ep_size_999...9).
    tag = _copy(tmp_path, "w2_ep2_z2")
    _edit(tag / OPTIM0, lambda s: _expert_group(s).update(name="ep_size_" + "9" * 5000))
    code, _, err = run_cli("inspect", str(tag))
    assert code == 3, err
    assert "ep_size" in err


@pytest.mark.usefixtures("ds_stubs")
def test_moe_num_experts_of_65536_layers_of_65536_is_bounded(tmp_path: Path) -> None:
    # Was killed after the timeout (unbounded time and memory from a 27 kB
    # file): deepspeed_moe.missing_files builds the list of every expert file
    # num_experts implies (65536 x 65536 = 4.3 billion names) before comparing
    # it with the 8 files there, and rebuilds set(present) for each of them.
    # ([65536] * 64, 4 million names, already took 2.6 s and printed the whole
    # list in the message.)
    tag = _copy(tmp_path, "w2_ep2_z2")
    _edit(tag / MODEL_STATES, lambda s: s.__setitem__("num_experts", [65536] * 65536))
    code, err = cli_in_subprocess("inspect", str(tag), timeout=4)
    assert code == 3, err


@pytest.mark.usefixtures("ds_stubs")
def test_moe_two_partitions_under_one_global_id_are_refused(tmp_path: Path) -> None:
    # Was exit 0, moe0's global expert 1 dropped without a word and global
    # expert 3 shown as expert 4: rank 0's param_shapes name moe0's local
    # experts 0 and 2 (not 0 and 1); deepspeed_moe.local_counts counts 2 of
    # them, place() gives expert-parallel rank 0's "2" the global id 0*2+2 = 2
    # and rank 1's local 0 the global id 1*2+0 = 2 too, and the second
    # overwrites the first in its dict. (Expert files renamed to match:
    # num_experts [3, 4], layer_0_expert_1's names say expert 4.)
    tag = _copy(tmp_path, "w2_ep2_z2")

    def model_states(state: Any) -> None:
        group = state["param_shapes"][1]
        items = [(k.replace(f"{MOE0}1.", f"{MOE0}2."), v) for k, v in group.items()]
        group.clear()
        group.update(items)
        state["num_experts"] = [3, 4]

    def expert_file(state: Any) -> None:
        for key in list(state):
            state[key.replace(f"{MOE0}1.", f"{MOE0}4.")] = state.pop(key)

    _edit(tag / MODEL_STATES, model_states)
    (tag / "layer_0_expert_3_mp_rank_00_model_states.pt").unlink()
    _edit(tag / "layer_0_expert_1_mp_rank_00_model_states.pt", expert_file)
    with pytest.raises(CkptoolError):
        joined = ckptool.load(str(tag))
        print(sorted(k for k in joined if k.startswith(MOE0)))  # 0, 2, 4: 1 gone


@pytest.mark.usefixtures("ds_stubs")
def test_moe_model_states_named_mp_rank_0_are_not_read_for_deepspeeds(
        tmp_path: Path) -> None:
    # Was exit 0 with head.bias all 7.0: beside mp_rank_00_model_states.pt (the
    # file DeepSpeed's load_checkpoint reads: "mp_rank_{:02d}") lies a crafted
    # mp_rank_0_model_states.pt. deepspeed_files.read_files keys both by
    # int("0") == int("00"), in sorted order, so the crafted one (sorted
    # after: '_' > '0') replaces the real one; the real one is listed with
    # no word at all, and its weights (ZeRO 0: the values) are never read.
    # (zero_pp_rank_0_mp_rank_0_optim_states.pt replaces rank 0's optimizer
    # states the same way.)
    tag = _copy(tmp_path, "w2_ep2_z0")
    state = torch.load(tag / MODEL_STATES, weights_only=False)
    state["module"]["head.bias"] = torch.full((10,), 7.0)
    torch.save(state, tag / "mp_rank_0_model_states.pt")
    try:
        joined = ckptool.load(str(tag))
    except CkptoolError:
        return  # refused: two files for one rank
    ref = torch.load(MOE / "w2_ep2_z0.reference.pt", weights_only=True)
    assert torch.equal(joined["head.bias"], ref["head.bias"])


def test_moe_experts_are_ordered_in_linear_time() -> None:
    # Was killed after the timeout (about 14 s): deepspeed_moe.ordered scans
    # the whole module list backwards for every name not in it (next(... for n
    # in reversed(module) ...)), quadratic: a ZeRO 0 folder whose model states
    # hold 20000 tiny views of one storage and one expert file 20000 more
    # (1.7 MB each) took 4.9 s to inspect, 10000 of each 1.7 s.
    code = ("from ckptool.read.layouts.deepspeed_moe import ordered\n"
            "n = 40000\n"
            "ordered([f'm.{i}' for i in range(n)], [f'x.{i}' for i in range(n)])\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True,
                       capture_output=True, timeout=3)
    except subprocess.TimeoutExpired:
        pytest.fail("ordered() of 40000 + 40000 names ran past 3 s")


# -- NeMo 1 per-rank files ---------------------------------------------------------

@pytest.fixture(scope="module")
def nemo_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A NeMo 1 folder of TP 2 x PP 2 rank files (tp_rank_XX_pp_rank_YYY/)."""
    return make_nemo.from_megatron(MEGATRON / "legacy",
                                   tmp_path_factory.mktemp("nemo") / "run")


def _reference() -> dict[str, torch.Tensor]:
    ref = torch.load(MEGATRON / "reference" / "model.pt", weights_only=True)
    return {k: v for k, v in ref.items() if isinstance(v, torch.Tensor)}


def _nemo_copy(ranks: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(ranks, run)
    return run


def _set_config(run: Path, key: str, value: str) -> None:
    config = run / "model_config.yaml"
    lines = [f"{key}: {value}" if line.startswith(f"{key}:") else line
             for line in config.read_text().splitlines()]
    config.write_text("\n".join(lines) + "\n")


def _edit_rank(run: Path, rank: str, edit: Callable[[dict[str, Any]], Any]) -> None:
    path = run / rank / "model_weights.ckpt"
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)


def test_nemo_a_key_without_the_model_prefix_does_not_replace_the_models(
        nemo_ranks: Path, tmp_path: Path) -> None:
    # Was exit 0 with decoder.final_layernorm.weight all zeros: the last stage's
    # files hold model.decoder.final_layernorm.weight (the model's) and a
    # crafted decoder.final_layernorm.weight; legacy._models strips "model."
    # in a dict comprehension, so the two become one name and the later (the
    # crafted one) wins without a word. NeMo's strict load_state_dict refuses
    # the unexpected key.
    run = _nemo_copy(nemo_ranks, tmp_path)
    for rank in ("tp_rank_00_pp_rank_001", "tp_rank_01_pp_rank_001"):
        _edit_rank(run, rank, lambda s: s.__setitem__(
            "decoder.final_layernorm.weight",
            torch.zeros_like(s["model.decoder.final_layernorm.weight"])))
    try:
        joined = ckptool.load(str(run))
    except CkptoolError:
        return
    ref = _reference()
    assert torch.equal(joined["decoder.final_layernorm.weight"],
                       ref["decoder.final_layernorm.weight"])


def test_nemo_a_tensor_under_a_non_str_key_is_not_dropped_unsaid(
        nemo_ranks: Path, tmp_path: Path, run_cli: Any) -> None:
    # Was exit 0, the tensor nowhere: a rank file holds a tensor under the int
    # key 7; legacy._pieces skips keys that are not str, and a NeMo join's
    # root is {} (the rest of the file is not listed), so it is in neither
    # the state dict, the entries nor a note. (A str key ckptool cannot place
    # is refused.)
    run = _nemo_copy(nemo_ranks, tmp_path)
    _edit_rank(run, "tp_rank_00_pp_rank_000", lambda s: s.__setitem__(7, torch.zeros(3)))
    code, out, err = run_cli("inspect", str(run), "--json")
    assert code == 3 or "7" in [str(e.get("key")).rsplit("/", 1)[-1]
                                for e in json.loads(out)["entries"]], err


def test_nemo_config_activation_that_disagrees_with_the_ranks_is_refused(
        nemo_ranks: Path, tmp_path: Path) -> None:
    # Was exit 0, every linear_fc1.weight joined wrong: the rank files are a
    # SwiGLU run's (fc1 96 rows per rank: two halves of ffn_hidden_size 96 / TP 2)
    # and model_config.yaml says activation: gelu; nemo.megatron_args sets
    # swiglu False and the halves are concatenated as one gelu fc1, though
    # 2 x 96 rows disagree with ffn_hidden_size 96 (NeMo builds fc1 of 48 rows
    # per rank from this config, and its load fails on the shape).
    run = _nemo_copy(nemo_ranks, tmp_path)
    _set_config(run, "activation", "gelu")
    try:
        joined = ckptool.load(str(run))
    except CkptoolError:
        return
    ref = _reference()
    key = "decoder.layers.0.mlp.linear_fc1.weight"
    assert torch.equal(joined[key], ref[key])


@pytest.mark.parametrize("key", ["tensor_model_parallel_size",
                                 "pipeline_model_parallel_size"])
def test_nemo_config_sizes_of_30_digits_are_refused(nemo_ranks: Path, tmp_path: Path,
                                                    key: str, run_cli: Any) -> None:
    # Was a traceback: OverflowError: Python int too large to convert to C
    # ssize_t, from layout.missing_rank_files (called by legacy._check_grid):
    # itertools.product(*(range(n) for n in places)) makes a tuple of each
    # range first.
    run = _nemo_copy(nemo_ranks, tmp_path)
    _set_config(run, key, "9" * 30)
    code, _, err = run_cli("inspect", str(run))
    assert code == 3, err


def test_nemo_config_tp_of_300_million_is_bounded(nemo_ranks: Path, tmp_path: Path) -> None:
    # Was killed after the timeout (6.5 GB resident after 20 s, from a
    # one-line edit of model_config.yaml): layout.missing_rank_files's
    # itertools.product materializes range(300000000) as a tuple before the
    # loop that stops after 8 names; the docstring's "a grid of a billion
    # ranks is counted, not walked" does not hold.
    run = _nemo_copy(nemo_ranks, tmp_path)
    _set_config(run, "tensor_model_parallel_size", "300000000")
    code, err = cli_in_subprocess("inspect", str(run), timeout=4)
    assert code == 3, err
