"""What a Megatron checkpoint's ``args`` (the run's ``argparse.Namespace``,
read as inert data) says about the model and how it was split.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ckptool.read.values import StandIn, TorchDtype


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


# the tokenizers whose vocabulary ``args.vocab_size`` gives ("size of vocab
# before EOD or padding"): the null tokenizers add their end-of-document id
# after it (megatron/training/tokenizer/tokenizer.py, 0.16: ``_NullTokenizer``);
# every other tokenizer's size is its own files', not recorded in args
VOCAB_FROM_ARGS = {"NullTokenizer": 1, "NullMultimodalTokenizer": 1, "TikTokenizer": 0}


def true_vocab(args: dict[str, Any]) -> int | None:
    """The rows of the embedding that are the tokenizer's (the rest is
    Megatron's padding to a multiple of 128 x TP), where ``args`` tell; else
    None."""
    extra = VOCAB_FROM_ARGS.get(str(args.get("tokenizer_type")))
    size = _int(args, "vocab_size")
    return None if extra is None or not size else size + extra


@dataclass(frozen=True)
class Facts:
    """The sizes a Megatron run's arguments give (None: not recorded)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # experts' own tensor-parallel size (None: ``tp``)
    vpp: int | None = None
    num_layers: int | None = None
    vocab_size: int | None = None  # the tokenizer's vocabulary (rows past it: padding)
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
        vocab_size=true_vocab(a),
        padded_vocab_size=_int(a, "padded_vocab_size"),
        swiglu=a.get("swiglu") is True,
        num_experts=_int(a, "num_experts"),
        iteration=iteration if isinstance(iteration, int) and not isinstance(iteration, bool)
        else _int(a, "iteration"),
        ckpt_format=a.get("ckpt_format") if isinstance(a.get("ckpt_format"), str) else None,
    )
