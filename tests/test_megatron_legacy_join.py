"""Legacy Megatron rank files (``mp_rank_XX_YYY/model_optim_rng.pt``) read
as one model: joined by Megatron's conventions, equal to the whole model
they were split from; a missing or stray rank named; a tensor the rules do
not know refused by name."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from megatron_builders import whole_model, write_legacy
from safetensors.torch import load_file

import ckptool
from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckptool.read.reader import open_checkpoint


def _cut(full: dict[str, torch.Tensor], vocab: int) -> dict[str, torch.Tensor]:
    out = dict(full)
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        out[key] = full[key][:vocab]
    return out


@pytest.mark.parametrize(("tp", "pp", "vpp", "ep", "experts"), [
    (2, 2, 1, 1, 0), (1, 2, 1, 1, 0), (2, 1, 1, 1, 0), (4, 1, 1, 1, 0), (2, 2, 2, 1, 0),
    (1, 1, 1, 2, 4), (2, 2, 1, 2, 4)])
def test_the_ranks_join_into_the_whole_model(tmp_path: Path, tp: int, pp: int, vpp: int,
                                             ep: int, experts: int) -> None:
    full = whole_model(layers=8, experts=experts)
    write_legacy(tmp_path, full, tp=tp, pp=pp, vpp=vpp, ep=ep, vocab_size=50)
    joined = ckptool.load(str(tmp_path))
    want = _cut(full, 50)
    assert list(joined) == list(want) or sorted(joined) == sorted(want)
    for key, value in want.items():
        assert torch.equal(joined[key], value), key


def test_inspect_says_the_run_and_the_cut(tmp_path: Path, run_cli: Any) -> None:
    write_legacy(tmp_path, whole_model(), vocab_size=50)
    code, out, err = run_cli("inspect", str(tmp_path))
    assert code == 0, err
    out = " ".join(out.split())
    assert "megatron (legacy per-rank files, joined by megatron-core 0.16's rules" in out
    assert "torch · iteration 10 · TP 2 x PP 2 · 4 layers" in out
    assert "vocabulary padding cut from embedding.word_embeddings.weight: 64 -> 50 rows" in out
    assert "rng_state is left out" in out


def test_without_the_true_vocabulary_the_padding_is_kept(tmp_path: Path) -> None:
    full = whole_model()
    write_legacy(tmp_path, full)
    joined = ckptool.load(str(tmp_path))
    assert torch.equal(joined["output_layer.weight"], full["output_layer.weight"])


def test_convert_writes_the_whole_model(tmp_path: Path, run_cli: Any) -> None:
    full = whole_model()
    write_legacy(tmp_path / "run", full, vocab_size=50)
    out = tmp_path / "model.safetensors"
    code, _, err = run_cli("convert", str(tmp_path / "run"), str(out))
    assert code == 0, err
    written = load_file(out)
    for key, value in _cut(full, 50).items():
        assert torch.equal(written[key], value), key


def test_a_missing_rank_file_is_named(tmp_path: Path, run_cli: Any) -> None:
    folder = write_legacy(tmp_path, whole_model())
    (folder / "mp_rank_01_001" / "model_optim_rng.pt").unlink()
    code, _, err = run_cli("inspect", str(tmp_path))
    assert code == 3
    assert "mp_rank_01_001/model_optim_rng.pt is missing" in err
    code, out, _ = run_cli("verify", str(tmp_path))
    assert code == 1
    assert "mp_rank_01_001/model_optim_rng.pt: a rank's file is missing" in out
    assert "megatron" in out


def test_a_rank_folder_gone_is_named_by_the_run_sizes(tmp_path: Path) -> None:
    folder = write_legacy(tmp_path, whole_model())
    shutil.rmtree(folder / "mp_rank_01_000")
    shutil.rmtree(folder / "mp_rank_01_001")
    with pytest.raises(CorruptCheckpointError, match=re.escape(
            "mp_rank_01_000/model_optim_rng.pt, mp_rank_01_001/model_optim_rng.pt are missing")):
        open_checkpoint(str(tmp_path))


def test_a_tensor_the_rules_do_not_know_is_refused_by_name(tmp_path: Path) -> None:
    full = whole_model()
    full["decoder.layers.1.self_attention.mystery.weight"] = torch.ones(4, 4)
    write_legacy(tmp_path, full)
    with pytest.raises(UnsupportedCheckpointError,
                       match=r"cannot place decoder\.layers\.1\.self_attention\.mystery"):
        open_checkpoint(str(tmp_path))


def test_a_layer_count_other_than_args_is_refused(tmp_path: Path) -> None:
    folder = write_legacy(tmp_path, whole_model())
    path = folder / "mp_rank_00_000" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["args"].num_layers = 6
    torch.save(state, path)
    with pytest.raises(CorruptCheckpointError, match="4 layers, and args say num_layers=6"):
        open_checkpoint(str(tmp_path))


def test_the_tracker_picks_the_iteration(tmp_path: Path, run_cli: Any) -> None:
    write_legacy(tmp_path, whole_model(seed=1), iteration=5)
    write_legacy(tmp_path, whole_model(seed=2), iteration=10)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5\n")
    code, out, err = run_cli("inspect", str(tmp_path))
    assert code == 0, err
    out = " ".join(out.split())
    assert "iteration 5" in out and "iter_0000010/: other iterations" in out
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    code, _, err = run_cli("inspect", str(tmp_path))
    assert code == 3
    assert "names iter_0000007, but" in err and "iter_0000005/, iter_0000010/" in err


def test_nothing_of_megatron_is_imported(tmp_path: Path) -> None:
    write_legacy(tmp_path, whole_model())
    ckptool.load(str(tmp_path))
    assert not any(m == "megatron" or m.startswith("megatron.") for m in sys.modules)


def test_diagnose_says_only_megatron_loads_it_and_convert_joins_it(tmp_path: Path,
                                                                   run_cli: Any) -> None:
    write_legacy(tmp_path / "run", whole_model())
    code, out, err = run_cli("diagnose", str(tmp_path / "run"))
    assert code == 1, err
    out = " ".join(out.split())
    assert "megatron-checkpoint" in out and "a legacy Megatron checkpoint of TP 2 x PP 2" in out
    assert f"ckptool convert {tmp_path / 'run'} {tmp_path / 'run'}.safetensors" in out
    assert "UnpicklingError" not in out


def test_fix_points_at_convert(tmp_path: Path, run_cli: Any) -> None:
    write_legacy(tmp_path / "run", whole_model())
    code, _, err = run_cli("fix", str(tmp_path / "run"), "--to", "cpu")
    assert code == 3
    assert "is a legacy Megatron checkpoint: fix rewrites state dicts" in err
    assert f"ckptool convert {tmp_path / 'run'} {tmp_path / 'run'}.safetensors" in err
