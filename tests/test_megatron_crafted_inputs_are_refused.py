"""Crafted Megatron, NeMo and DeepSpeed universal inputs (an adversarial
review of the readers): each is refused with one line and its exit code, in
bounded time and memory, reading nothing outside the checkpoint and
writing nothing beside it."""

from __future__ import annotations

import collections
import shutil
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_nemo
from megatron_builders import whole_model, write_legacy, write_torch_dist

from ckptool.errors import CorruptCheckpointError
from ckptool.read import fs
from ckptool.read.reader import open_checkpoint

FIXTURES = Path(__file__).parent / "fixtures"


def _count_isfile(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths ``fs.isfile`` is asked of from now on."""
    asked: list[str] = []
    real = fs.isfile

    def counted(path: str) -> bool:
        asked.append(path)
        return real(path)

    monkeypatch.setattr(fs, "isfile", counted)
    return asked


def _set_args(folder: Path, rank: str, **values: Any) -> None:
    path = folder / rank / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    for k, v in values.items():
        setattr(state["args"], k, v)
    torch.save(state, path)


# -- legacy rank files -------------------------------------------------------

def test_a_huge_tensor_parallel_size_in_args_is_refused_without_walking_its_grid(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = write_legacy(tmp_path, whole_model(layers=2), tp=2, pp=1)
    for rank in ("mp_rank_00", "mp_rank_01"):
        _set_args(folder, rank, tensor_model_parallel_size=10**6)
    asked = _count_isfile(monkeypatch)
    with pytest.raises(CorruptCheckpointError, match=r"mp_rank_02/model_optim_rng\.pt, .* "
                       r"and 999994 more are missing \(the run was TP 1000000 x PP 1"):
        open_checkpoint(str(tmp_path))
    assert len(asked) < 100  # (was one per rank of the grid: a billion for TP 1e9)


def test_a_rank_folder_of_high_numbers_is_refused_without_walking_its_grid(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_cli: Any) -> None:
    folder = write_legacy(tmp_path, whole_model(layers=2), tp=2, pp=1)
    (folder / "mp_rank_99_999_999").mkdir()
    shutil.copy(folder / "mp_rank_00" / "model_optim_rng.pt",
                folder / "mp_rank_99_999_999" / "model_optim_rng.pt")
    asked = _count_isfile(monkeypatch)
    code, _, err = run_cli("inspect", str(tmp_path))
    assert code == 3
    assert "mp_rank_00_000_000/model_optim_rng.pt" in err and "are missing" in err
    code, out, _ = run_cli("verify", str(tmp_path))
    assert code == 1 and "a rank's file is missing" in out
    assert len(asked) < 1000  # (was 10^8 for 100 x 1000 x 1000 folder names)


def test_a_tensor_missing_from_one_tensor_parallel_rank_is_refused(tmp_path: Path) -> None:
    folder = write_legacy(tmp_path, whole_model(layers=2), tp=2, pp=1)
    path = folder / "mp_rank_01" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    del state["model"]["decoder.layers.0.self_attention.linear_qkv.weight"]
    torch.save(state, path)
    # (was joined from mp_rank_00's half alone: [16, 16] for [32, 16])
    with pytest.raises(CorruptCheckpointError, match=r"linear_qkv\.weight: the 2 tensor-"
                       r"parallel ranks' pieces are in mp_rank_00 alone"):
        open_checkpoint(str(tmp_path))


# -- convert --map rules.toml --------------------------------------------------

KEEP_REST = '[[rule]]\nfrom = "*"\ndrop = true\n'


@pytest.mark.parametrize(("rules", "said"), [
    ('[[rule]]\nfrom = "decoder.layers.{layer}.*"\nto = "x.{layr}"\n',
     "holds a brace other than {layer} and {expert}"),
    ('[[rule]]\nfrom = "decoder.layers.{layer}.*"\nto = "x.{0}"\n',
     "holds a brace other than"),
    ('[[rule]]\nfrom = "decoder.layers.{layer}.*"\nto = "x.{"\n', "holds a brace other than"),
    ('[[rule]]\nfrom = "embedding.*"\nto = "x.{layer}"\n',
     "'to' names {layer}, and 'from' does not"),
    ('[[rule]]\nfrom = "decoder.layers.{layer}.{layer}.*"\nto = "x"\n',
     "'from' names {layer} twice"),
    ('[[rule]]\nfrom = "embedding.word_embeddings.weight"\nto = ["a", "b"]\n'
     'split = "halves"\nvocab = true\n', "vocab = true cuts one tensor's rows"),
    ('[[rule]]\nfrom = "embedding.word_embeddings.weight"\nto = "e"\n'
     '[config]\nwhen = 2023-01-01T00:00:00\n', "[config] holds a value JSON cannot hold"),
])
def test_a_rules_file_that_cannot_work_is_a_usage_error(tmp_path: Path, run_cli: Any,
                                                        rules: str, said: str) -> None:
    write_legacy(tmp_path / "run", whole_model(layers=2), tp=1, pp=1, vocab_size=50)
    path = tmp_path / "rules.toml"
    head, _, config = rules.partition("[config]")
    path.write_text(head + KEEP_REST + (f"[config]{config}" if config else ""))
    code, _, err = run_cli("convert", str(tmp_path / "run"), str(tmp_path / "out"),
                           "--map", str(path))  # (was an IndexError, KeyError, re.error...)
    assert code == 2, err
    assert said in err
    assert not (tmp_path / "out").exists()


# -- convert --map llama: args of no use ---------------------------------------

@pytest.mark.parametrize("args", [{"num_attention_heads": 0},
                                  {"num_attention_heads": "abc"},
                                  {"num_attention_heads": 4, "group_query_attention": True,
                                   "num_query_groups": "x"}])
def test_args_of_no_use_to_a_map_are_refused_in_one_line(tmp_path: Path, run_cli: Any,
                                                         args: dict[str, Any]) -> None:
    write_legacy(tmp_path / "run", whole_model(layers=2), tp=1, pp=1, vocab_size=50, **args)
    code, _, err = run_cli("convert", str(tmp_path / "run"), str(tmp_path / "out"),
                           "--map", "llama")  # (was ZeroDivisionError, ValueError)
    assert code == 3, err
    assert "the run's args hold a value the llama map cannot use" in err
    assert not (tmp_path / "out").exists()


# -- convert --unstack-layers of stacks of no bytes ------------------------------

def _stacked(root: Path, stack: torch.Tensor) -> None:
    write_torch_dist(root, {"decoder.layers.mlp.linear_fc1.weight": stack,
                            "embedding.word_embeddings.weight": torch.ones(4, 2)},
                     num_layers=stack.shape[0])


def test_a_stack_of_a_hundred_million_empty_layers_is_refused(tmp_path: Path,
                                                              run_cli: Any) -> None:
    _stacked(tmp_path / "run", torch.ones(10**8, 0))
    code, _, err = run_cli("convert", str(tmp_path / "run"), str(tmp_path / "o.safetensors"),
                           "--unstack-layers")  # (was 10^8 tensors planned: GBs, minutes)
    assert code == 3
    assert "100000000 layers stacked, more than ckptool unstacks" in err


def test_a_stack_of_no_layers_is_kept_not_dropped(tmp_path: Path, run_cli: Any) -> None:
    from safetensors import safe_open

    _stacked(tmp_path / "run", torch.ones(0, 3))
    out = tmp_path / "o.safetensors"
    code, _, err = run_cli("convert", str(tmp_path / "run"), str(out), "--unstack-layers")
    assert code == 0, err
    with safe_open(str(out), "pt") as f:  # (was left out, unsaid)
        assert "decoder.layers.mlp.linear_fc1.weight" in set(f.keys())


# -- .nemo archives ----------------------------------------------------------------

def _header_offsets(path: Path) -> dict[str, int]:
    with tarfile.open(path) as tf:
        return {m.name: m.offset for m in tf.getmembers()}


@pytest.mark.parametrize("damage", ["cut before common.pt", "a damaged header"])
def test_a_nemo_that_ends_early_is_refused_not_read_short(tmp_path: Path, run_cli: Any,
                                                          damage: str) -> None:
    path, _ = make_nemo.make("dist", tmp_path)
    data = bytearray(path.read_bytes())
    at = _header_offsets(path)["./model_weights/common.pt"]
    if damage.startswith("cut"):
        del data[at:]  # (a cut between members: tarfile stops there, quietly)
    else:
        data[at + 148:at + 156] = b"garbage!"  # its checksum: tarfile stops there too
    bad = tmp_path / "bad.nemo"
    bad.write_bytes(bytes(data))
    before = sorted(tmp_path.rglob("*"))
    code, _, err = run_cli("inspect", str(bad))  # (was read as a plain DCP: common.pt,
    assert code == 3, err                         # metadata.json gone, unsaid)
    assert f"byte {at} is neither a member's header nor the archive's end" in err
    assert sorted(tmp_path.rglob("*")) == before


# -- DeepSpeed universal -------------------------------------------------------------

def test_a_universal_parameter_named_outside_zero_is_refused(tmp_path: Path) -> None:
    shutil.copytree(FIXTURES / "deepspeed_universal" / "z2_fp32", tmp_path / "ck")
    folder = tmp_path / "ck" / "global_step2_universal"
    (tmp_path / "secret").mkdir()
    torch.save({"param": torch.full((24,), 42.0)}, tmp_path / "secret" / "fp32.pt")
    states = folder / "mp_rank_00_model_states.pt"
    saved = torch.load(states, weights_only=False)
    group = saved["param_shapes"][1]
    saved["param_shapes"][1] = collections.OrderedDict(
        ("../../../secret" if k == "lin.bias" else k, v) for k, v in group.items())
    torch.save(saved, states)
    # (was read: the file outside the checkpoint written into the output)
    with pytest.raises(CorruptCheckpointError, match=r"param_shapes name a parameter "
                       r"'\.\./\.\./\.\./secret': not a folder name of zero/"):
        open_checkpoint(str(folder))
