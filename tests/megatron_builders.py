"""Megatron checkpoints built by hand: a ``torch_dist`` save directory of a
given state (``write_torch_dist``), and legacy Megatron rank files built
from a whole model by Megatron's conventions (column-parallel rows,
row-parallel columns, SwiGLU halves per rank, padded vocabulary rows, layers
numbered per stage, virtual chunks as ``model0``/``model1``, experts per
expert-parallel rank), so that a test knows the whole model the join must
give. The files the real writer lays out are in ``tests/fixtures/megatron``
(``make_megatron.py``); these vary what it cannot cheaply: virtual
pipelines, experts, damage.
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path
from typing import Any

import torch


def whole_model(layers: int = 4, hidden: int = 16, ffn: int = 24, vocab: int = 50,
                padded: int = 64, heads: int = 4, groups: int = 2, experts: int = 0,
                seed: int = 0) -> dict[str, torch.Tensor]:
    """A whole (TP 1, PP 1) Megatron-core GPT state dict, padded vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    d = hidden // heads

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    full = {"embedding.word_embeddings.weight": r(padded, hidden)}
    for i in range(layers):
        p = f"decoder.layers.{i}."
        full[p + "input_layernorm.weight"] = r(hidden)
        full[p + "self_attention.linear_qkv.weight"] = r((heads + 2 * groups) * d, hidden)
        full[p + "self_attention.linear_proj.weight"] = r(hidden, heads * d)
        full[p + "pre_mlp_layernorm.weight"] = r(hidden)
        if experts:
            full[p + "mlp.router.weight"] = r(experts, hidden)
            for e in range(experts):
                q = f"{p}mlp.experts.local_experts.{e}."
                full[q + "linear_fc1.weight"] = r(2 * ffn, hidden)
                full[q + "linear_fc2.weight"] = r(hidden, ffn)
        else:
            full[p + "mlp.linear_fc1.weight"] = r(2 * ffn, hidden)
            full[p + "mlp.linear_fc2.weight"] = r(hidden, ffn)
    full["decoder.final_layernorm.weight"] = r(hidden)
    full["output_layer.weight"] = r(padded, hidden)
    return full


def _split(key: str, value: torch.Tensor, tp: int, t: int) -> torch.Tensor:
    if "linear_qkv" in key or "word_embeddings" in key or "output_layer" in key:
        return value.chunk(tp, 0)[t]
    if "linear_fc1" in key:
        gate, up = value.chunk(2, 0)
        return torch.cat([gate.chunk(tp, 0)[t], up.chunk(tp, 0)[t]])
    if "linear_proj" in key or "linear_fc2" in key:
        return value.chunk(tp, 1)[t]
    return value


def write_legacy(root: Path, full: dict[str, torch.Tensor], tp: int = 2, pp: int = 2,
                 vpp: int = 1, ep: int = 1, iteration: int = 10, **args: Any) -> Path:
    """Write ``full`` as a legacy save directory (tracker file and
    ``iter_NNNNNNN/mp_rank_*``); returns the iteration folder."""
    layers = 1 + max(int(k.split(".")[2]) for k in full if k.startswith("decoder.layers."))
    experts = len({k.split(".")[6] for k in full if ".local_experts." in k})
    per_chunk = layers // (pp * vpp)
    ns = argparse.Namespace(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, num_layers=layers, swiglu=True,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        num_experts=experts or None, params_dtype=torch.float32,
        **{"tokenizer_type": "TikTokenizer", **args})  # (its vocab_size is args')
    folder = root / f"iter_{iteration:07d}"
    for t in range(tp):
        for s in range(pp):
            for e in range(ep):
                chunks: list[dict[str, torch.Tensor]] = [{} for _ in range(vpp)]
                for key, value in full.items():
                    if key.startswith("decoder.layers."):
                        i = int(key.split(".")[2])
                        v, stage = divmod(i // per_chunk, pp)
                        if stage != s:
                            continue
                        local = key.replace(f"layers.{i}.", f"layers.{i % per_chunk}.")
                        if ".local_experts." in key:
                            x = int(key.split(".")[6])
                            if x // (experts // ep) != e:
                                continue
                            local = local.replace(f"local_experts.{x}.",
                                                  f"local_experts.{x % (experts // ep)}.")
                    else:
                        v = 0 if key.startswith("embedding") else vpp - 1
                        if (key.startswith("embedding") and s != 0) or (
                                not key.startswith("embedding") and s != pp - 1):
                            continue
                        local = key
                    chunks[v][local] = _split(key, value, tp, t).clone()
                name = f"mp_rank_{t:02d}" + (f"_{s:03d}" if pp > 1 else "") + (
                    f"_{e:03d}" if ep > 1 else "")
                state: dict[str, Any] = {"args": ns, "checkpoint_version": 3.0,
                                         "iteration": iteration,
                                         "rng_state": [{"random_rng_state": torch.ones(3)}]}
                if vpp > 1:
                    state.update({f"model{v}": chunks[v] for v in range(vpp)})
                else:
                    state["model"] = chunks[0]
                os.makedirs(folder / name)
                torch.save(state, folder / name / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return folder


def write_torch_dist(root: Path, state: dict[str, torch.Tensor], iteration: int = 1,
                     **args: Any) -> Path:
    """A Megatron-core ``torch_dist`` save directory of ``state`` (DCP files,
    ``metadata.json``, ``common.pt`` with ``args``, the tracker) at ``root``."""
    import torch.distributed.checkpoint as dcp

    folder = root / f"iter_{iteration:07d}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no process group: one process)
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    torch.save({"args": argparse.Namespace(**args), "iteration": iteration},
               folder / "common.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return root
