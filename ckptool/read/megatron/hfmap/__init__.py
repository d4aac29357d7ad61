"""A Megatron-core GPT model's tensors under the names, layouts and
``config.json`` of a transformers model: what ``convert --map`` writes.

Pure: the plan is made from the merged (TP=1, PP=1) state dict's names and
shapes and the ``args`` Namespace (as a dict); every output tensor is a
``Derived`` of one source tensor, checked against its shape here, so a wrong
size fails before any byte is read.

Megatron-core's conventions (``megatron/core``), as the plans follow them:

- ``linear_qkv`` (``SelfAttention.get_query_key_value_tensors``): its rows
  are grouped per query group: for each of the ``num_query_groups`` groups,
  ``heads_per_group * kv_channels`` query rows, then ``kv_channels`` key rows,
  then ``kv_channels`` value rows; its bias likewise;
- a gated MLP's ``linear_fc1`` (``MLP.forward``'s ``glu``,
  ``fused_bias_swiglu.swiglu``): ``torch.chunk(y, 2)``: the first half goes
  through the activation (HF ``gate_proj``, Mixtral ``w1``), the second is
  the linear half (``up_proj``, ``w3``);
- rotary embeddings without ``rotary_interleaved`` rotate halves
  (``rope_utils._rotate_half``), as HF Llama's ``rotate_half``: no
  permutation of the query and key rows;
- the router (``moe/router.py``) is ``router.weight [experts, hidden]``; with
  the default softmax score function the top-k logits are softmaxed, which is
  Mixtral's softmax, top-k and renormalisation (Qwen2-MoE's
  ``norm_topk_prob``); with ``moe_router_pre_softmax`` the top-k of the
  softmax are kept as they are (Qwen2-MoE without ``norm_topk_prob``);
- experts (``moe/experts.py``): ``SequentialMLP`` names them
  ``mlp.experts.local_experts.{e}.linear_fc1.weight``, ``TEGroupedMLP``
  ``mlp.experts.linear_fc1.weight{e}``; the shared experts
  (``moe/shared_experts.py``) are ``mlp.shared_experts.linear_fc1/fc2`` and
  the sigmoid gate ``mlp.shared_experts.gate_weight [1, hidden]``;
- Transformer Engine's layer specs fuse the norms into the next linear:
  ``self_attention.linear_qkv.layer_norm_weight`` (and ``_bias``) is the
  input norm, ``mlp.linear_fc1.layer_norm_weight`` the pre-MLP norm.

The modules:

- ``model``: the source names (``LAYER``, ``EXPERT``, ``EMBEDDING``, ...),
  the ``Builder`` that checks and records every output tensor, and the model
  read from the shapes and args (sizes, norm, dtype, vocabulary, tying), with
  the pieces every map writes alike (embeddings, final norm, ``lm_head``);
- ``llama``: the Llama map and the Llama-like parts the mixture of experts
  maps share (rotary attention, SwiGLU MLP, rope and decoder ``config.json``);
- ``moe``: the Mixtral and Qwen2-MoE maps (router, experts, shared experts);
- ``gpt2``: the GPT-2 map;
- this ``__init__``: ``MAPS``, ``Plan`` and ``plan``, which picks the map.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptool.read.derived import Derived
from ckptool.read.megatron.hfmap.gpt2 import build_gpt2
from ckptool.read.megatron.hfmap.llama import build_llama
from ckptool.read.megatron.hfmap.model import (
    EMBEDDING,
    EXPERT,
    FINAL_NORM,
    LAYER,
    OUTPUT,
    POSITIONS,
    Builder,
    ignored,
    layer_of,
    read_model,
    refuse,
)
from ckptool.read.megatron.hfmap.moe import build_mixtral, build_qwen2_moe

__all__ = ["EMBEDDING", "EXPERT", "FINAL_NORM", "LAYER", "MAPS", "OUTPUT", "POSITIONS", "Plan",
           "ignored", "layer_of", "plan"]

MAPS = ("llama", "gpt2", "mixtral", "qwen2-moe")


@dataclass(frozen=True)
class Plan:
    tensors: list[Derived]  # every output tensor: embeddings, layers in order, final norm, lm_head
    config: dict[str, Any]  # the config.json transformers needs for this model
    notes: list[str]  # what is said to the user


_BUILDERS = {"llama": build_llama, "gpt2": build_gpt2, "mixtral": build_mixtral,
             "qwen2-moe": build_qwen2_moe}


def plan(name: str, shapes: dict[str, tuple[int, ...]], args: dict[str, Any]) -> Plan:
    """The tensors and ``config.json`` of the transformers model ``name``
    (one of ``MAPS``) made from a merged Megatron-core GPT model's state dict
    (``shapes``: its names, no ``model.`` prefix) and its ``args``. Every
    tensor is placed or the plan is refused naming it."""
    build = _BUILDERS.get(name)
    if build is None:
        raise refuse(f"no map {name!r}", f"the maps are {', '.join(MAPS)}")
    b = Builder(shapes, args, name)
    m = read_model(b)
    config = build(b, m)
    b.leftovers(name)
    return Plan(tensors=b.tensors, config=config, notes=list(dict.fromkeys(b.notes)))
