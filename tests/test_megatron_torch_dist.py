"""A Megatron-core ``torch_dist`` checkpoint: DCP with ``metadata.json`` and
``common.pt``, picked by the save directory's tracker file; Megatron's own
classes in its pickles read as data, nothing of Megatron imported."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptool.errors import UnsupportedCheckpointError
from ckptool.read.reader import open_checkpoint


def _save(root: Path, iteration: int = 10, common: bool = True,
          backend: str = "torch_dist") -> Path:
    import torch.distributed.checkpoint as dcp

    folder = root / f"iter_{iteration:07d}"
    gen = torch.Generator().manual_seed(iteration)
    state = {"decoder.layers.self_attention.linear_qkv.weight": torch.randn(4, 32, 16,
                                                                           generator=gen),
             "decoder.layers.mlp.linear_fc1.weight": torch.randn(4, 48, 16, generator=gen),
             "embedding.word_embeddings.weight": torch.randn(64, 16, generator=gen),
             "decoder.final_layernorm.weight": torch.randn(16, generator=gen)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no process group: one process)
        dcp.save(state, checkpoint_id=str(folder))
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": backend,
                                                      "sharded_backend_version": 1}))
    if common:
        args = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                  expert_model_parallel_size=1, num_layers=4,
                                  params_dtype=torch.bfloat16)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration},
                   folder / "common.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return folder


def test_inspect_says_the_run_and_the_stacked_layers(tmp_path: Path, run_cli: Any) -> None:
    _save(tmp_path)
    code, out, err = run_cli("inspect", str(tmp_path))
    assert code == 0, err
    out = " ".join(out.split())
    assert "dcp (torch.distributed.checkpoint 1.0.0, Megatron-core torch_dist)" in out
    assert ("megatron torch_dist · iteration 10 · TP 2 x PP 2 · 4 layers · 2 tensors stack "
            "the layers") in out
    assert "common.pt" in out
    ckpt = open_checkpoint(str(tmp_path))
    meta = ckpt.metadata["megatron"]
    assert (meta["format"], meta["folder"], meta["stacked"]) == ("torch_dist",
                                                                 "iter_0000010", 2)
    assert meta["args"]["params_dtype"] == "torch.bfloat16"
    assert not ckpt.unsafe_globals


def test_the_iteration_folder_reads_alone_and_as_its_save_directory(tmp_path: Path) -> None:
    folder = _save(tmp_path)
    whole, alone = open_checkpoint(str(tmp_path)), open_checkpoint(str(folder))
    assert [t.key for t in whole.tensors] == [t.key for t in alone.tensors]
    assert alone.metadata["megatron"]["iteration"] == 10


def test_without_common_pt_the_run_is_unknown_and_said(tmp_path: Path, run_cli: Any) -> None:
    _save(tmp_path, common=False)
    code, out, err = run_cli("inspect", str(tmp_path))
    assert code == 0, err
    assert "has no common.pt" in " ".join(out.split())


def test_another_backend_is_refused_by_name(tmp_path: Path) -> None:
    _save(tmp_path, backend="zarr")
    with pytest.raises(UnsupportedCheckpointError, match="'zarr' backend"):
        open_checkpoint(str(tmp_path))


MCORE = '''
import dataclasses, pickle, sys, types
from torch.distributed.checkpoint.metadata import Metadata
names = ["megatron", "megatron.core", "megatron.core.dist_checkpointing",
         "megatron.core.dist_checkpointing.strategies",
         "megatron.core.dist_checkpointing.strategies.torch"]
for n in names:
    sys.modules[n] = types.ModuleType(n)
mod = sys.modules[names[-1]]
@dataclasses.dataclass
class MCoreMetadata(Metadata):
    mcore_data: dict | None = None
MCoreMetadata.__module__ = mod.__name__
mod.MCoreMetadata = MCoreMetadata
path = sys.argv[1]
with open(path, "rb") as f:
    md = pickle.load(f)
fields = {f.name: getattr(md, f.name) for f in dataclasses.fields(Metadata)}
out = MCoreMetadata(**fields, mcore_data={"decoder.layers.mlp.linear_fc1.weight": {}})
with open(path, "wb") as f:
    pickle.dump(out, f)
'''


def test_megatron_s_own_metadata_class_is_data(tmp_path: Path, run_cli: Any) -> None:
    """Megatron-core up to 0.15 pickled its own ``MCoreMetadata`` (torch's
    fields and ``mcore_data``): read as torch's, and judged data."""
    folder = _save(tmp_path)
    subprocess.run([sys.executable, "-c", MCORE, str(folder / ".metadata")], check=True)
    assert b"MCoreMetadata" in (folder / ".metadata").read_bytes()
    ckpt = open_checkpoint(str(tmp_path))
    assert len(ckpt.tensors) == 4
    assert not ckpt.unsafe_globals
    assert not [g for g in ckpt.globals if g.category == "custom"]
    code, out, _ = run_cli("verify", str(tmp_path))
    assert code == 0, out
    assert not any(m == "megatron" or m.startswith("megatron.") for m in sys.modules)


def test_a_torch_dcp_iteration_says_its_run(tmp_path: Path, run_cli: Any) -> None:
    """``--ckpt-format torch_dcp``: plain DCP of the state dict Megatron
    builds (args and iteration as values beside the model's tensors)."""
    import torch.distributed.checkpoint as dcp

    args = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=4,
                              num_layers=2, ckpt_format="torch_dcp")
    state = {"args": args, "iteration": 5,
             "model": {"decoder.layers.0.mlp.linear_fc1.weight": torch.ones(4, 2)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "iter_0000005"))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    code, out, err = run_cli("inspect", str(tmp_path))
    assert code == 0, err
    out = " ".join(out.split())
    assert "dcp (torch.distributed.checkpoint 1.0.0, Megatron)" in out
    assert "megatron torch_dcp · iteration 5 · TP 1 x PP 4 · 2 layers" in out
