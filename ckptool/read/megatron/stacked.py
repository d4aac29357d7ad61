"""The layers of a Megatron-core ``torch_dist`` checkpoint: each
``decoder.layers.*`` tensor holds every layer, stacked on a leading axis
(``[L, ...]``; an expert's ``[L, E, ...]``), because Megatron-core saves each
layer's tensor as one slice of a global tensor
(``TransformerLayer.sharded_state_dict``: ``prepend_axis_num``).
"""

from __future__ import annotations

import re
from typing import Any

from ckptool.read.megatron import facts as facts_of
from ckptool.read.megatron.names import COMMON_FILE, iteration_of
from ckptool.read.tensors import TensorRecord

# "decoder.layers.self_attention.linear_qkv.weight": layers with no number
STACKED = re.compile(r"(?:^|\.)layers\.(?!\d)")


def is_stacked(key: str) -> bool:
    return STACKED.search(key) is not None


def summary(root: dict[str, Any], extra_roots: dict[str, Any],
            folder: str | None) -> dict[str, Any]:
    """What inspect says of a ``torch_dist`` checkpoint: the iteration, the
    run's sizes (from ``common.pt``'s ``args``) and the stacked tensors."""
    common = extra_roots.get(COMMON_FILE)
    # torch_dist: common.pt's; torch_dcp and fsdp_dtensor: the DCP values' own
    common = common if isinstance(common, dict) else root
    args = facts_of.args_dict(common.get("args"))
    run = facts_of.facts(args, common.get("iteration"))
    stacked = [k for k, v in root.items() if isinstance(v, TensorRecord) and is_stacked(k)]
    iteration = run.iteration if run.iteration is not None else (
        iteration_of(folder) if folder else None)
    fmt = "torch_dist" if COMMON_FILE in extra_roots else (run.ckpt_format or "torch_dcp")
    return {"format": fmt, "iteration": iteration, "folder": folder,
            "tensor_parallel": run.tp, "pipeline_parallel": run.pp,
            "expert_parallel": run.ep, "virtual_pipeline": run.vpp,
            "num_layers": run.num_layers, "stacked": len(stacked),
            "args": args or {}}
