"""What a Megatron checkpoint's ``args`` (the run's ``argparse.Namespace``,
read as inert data) says about the model and how it was split.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ckptool.read.values import StandIn, TorchDtype

# the arguments shown and used (Megatron-LM's megatron/training/arguments.py)
KEPT = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers", "num_layers", "hidden_size", "ffn_hidden_size",
    "num_attention_heads", "num_query_groups", "group_query_attention", "kv_channels", "swiglu",
    "normalization", "norm_epsilon", "position_embedding_type", "rotary_base",
    "rotary_percent", "rotary_interleaved", "max_position_embeddings", "seq_length",
    "vocab_size", "padded_vocab_size", "make_vocab_size_divisible_by",
    "untie_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias", "num_experts",
    "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
    "qk_layernorm", "params_dtype", "bf16", "fp16", "ckpt_format", "iteration",
    "tokenizer_type", "use_dist_ckpt", "use_distributed_optimizer",
)


def args_dict(value: Any) -> dict[str, Any] | None:
    """The attributes of a stored ``argparse.Namespace`` (or of a plain
    dict, as NeMo stores its config), as plain values: dtypes as their
    names; None for anything else."""
    if isinstance(value, StandIn) and value.qualname in ("argparse.Namespace",
                                                          "types.SimpleNamespace"):
        state = value.state_dict_view()
    elif isinstance(value, dict):
        state = value
    else:
        return None
    out: dict[str, Any] = {}
    for key, v in state.items():
        if isinstance(key, str):  # (a dtype as torch names it: "torch.bfloat16")
            out[key] = v if type(v) in (bool, int, float, str, type(None)) else (
                repr(v) if isinstance(v, TorchDtype) else str(v))
    return out


def _int(args: dict[str, Any], name: str, default: int | None = None) -> int | None:
    v = args.get(name)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else default


@dataclass(frozen=True)
class Facts:
    """The sizes a Megatron run's arguments give (None: not recorded)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # experts' own tensor-parallel size (None: ``tp``)
    vpp: int | None = None
    num_layers: int | None = None
    vocab_size: int | None = None  # the true vocabulary (rows past it are padding)
    padded_vocab_size: int | None = None
    swiglu: bool = False
    num_experts: int | None = None
    iteration: int | None = None
    ckpt_format: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def facts(args: dict[str, Any] | None, iteration: Any = None) -> Facts:
    """The sizes ``args`` records (``args_dict``'s), and the iteration the
    checkpoint stores beside them."""
    a = args or {}
    vpp = _int(a, "virtual_pipeline_model_parallel_size")
    return Facts(
        tp=_int(a, "tensor_model_parallel_size", 1) or 1,
        pp=_int(a, "pipeline_model_parallel_size", 1) or 1,
        ep=_int(a, "expert_model_parallel_size", 1) or 1,
        etp=_int(a, "expert_tensor_parallel_size"),
        vpp=vpp if vpp and vpp > 1 else None,
        num_layers=_int(a, "num_layers"),
        vocab_size=_int(a, "vocab_size"),
        padded_vocab_size=_int(a, "padded_vocab_size"),
        swiglu=a.get("swiglu") is True,
        num_experts=_int(a, "num_experts"),
        iteration=iteration if isinstance(iteration, int) and not isinstance(iteration, bool)
        else _int(a, "iteration"),
        ckpt_format=a.get("ckpt_format") if isinstance(a.get("ckpt_format"), str) else None,
    )


def shown_args(args: dict[str, Any] | None) -> dict[str, Any]:
    """The arguments worth showing (``KEPT``), those recorded."""
    return {k: args[k] for k in KEPT if args and k in args}
