"""What a Megatron run's ``args`` may say that no map's Hugging Face model
computes, with no tensor to show it: a map refuses the run rather than write
a model whose logits are not the run's."""

from __future__ import annotations

from typing import Any

# a layer spec the maps do not convert (any true value)
_FLAGS = (("rotary_interleaved", "interleaved rotary embeddings"),
          ("attention_output_gate", "gated attention output"),
          ("qk_layernorm", "query and key norms"),
          ("apply_layernorm_1p", "zero-centred norm weights (layernorm 1p)"),
          ("layernorm_zero_centered_gamma", "zero-centred norm weights"))

# values that change the arithmetic: the values that leave it as the maps'
# models compute it (megatron-core 0.16's TransformerConfig), and what it is
_ARITHMETIC = (
    ("window_size", (None,), "sliding-window attention"),
    ("qk_l2_norm", (None, False), "an L2 norm of queries and keys"),
    ("softmax_type", (None, "vanilla"), "another attention softmax"),
    ("glu_linear_offset", (None, 0, 0.0), "an offset on the GLU's linear half"),
    ("activation_func_clamp_value", (None,), "a clamped activation"),
)


def unexpressed(args: dict[str, Any]) -> str | None:
    """Why the maps cannot express the run ``args`` describe; None where they can."""
    for flag, why in _FLAGS:
        if args.get(flag):
            return f"the model uses {why} ({flag}), which the maps do not convert"
    for flag, plain, why in _ARITHMETIC:
        if args.get(flag) not in plain:
            return (f"the model uses {why} ({flag} {args[flag]!r:.40}), which the maps' "
                    "Hugging Face models do not compute")
    return None
