"""Which weights of a DeepSpeed checkpoint ``convert --weights module``
writes: rank 0's ``module``, as the model held them (half precision in a
bf16 or fp16 run), rather than the consolidated fp32 master weights the
state dict is made of (``deepspeed``)."""

from __future__ import annotations

from ckptool.errors import CorruptCheckpointError, UnsupportedCheckpointError, UsageError
from ckptool.keys import join_key, split_key
from ckptool.model import Checkpoint
from ckptool.read.layouts.base import BROKEN_HINT
from ckptool.read.layouts.deepspeed import DEEPSPEED


def module_weights(ckpt: Checkpoint) -> tuple[str, list[str]]:
    """Where rank 0's ``module`` is in a DeepSpeed checkpoint (its key path)
    and its names: the weights as the model held them (half precision in a
    bf16 or fp16 run), for ``convert --weights module``. ZeRO 3 keeps only
    0-element placeholders there: refused."""
    meta = ckpt.metadata
    if ckpt.format != DEEPSPEED:
        raise UsageError("--weights chooses between a DeepSpeed checkpoint's weights",
                         f"{ckpt.path} is {ckpt.format}, with one set of weights: leave it out")
    if meta.get("zero_stage") == 3:
        raise UnsupportedCheckpointError(
            "a ZeRO 3 checkpoint keeps no module weights: its model-states files hold "
            "0-element placeholders for every partitioned parameter",
            "convert the fp32 master weights (the default), with --dtype bf16 or fp16 to "
            "get the run's precision")
    if meta.get("expert_files"):
        raise UnsupportedCheckpointError(
            "a MoE checkpoint's module holds no expert: DeepSpeed saves each expert in its "
            f"own file ({meta['expert_files']} here)",
            "convert the fp32 master weights (the default), with --dtype bf16 or fp16 to "
            "get the run's precision")
    top = f"<{meta.get('model_states')}>"
    names = []
    for t in ckpt.tensors:
        parts = split_key(t.key)
        if len(parts) == 3 and parts[:2] == [top, "module"]:
            names.append(parts[2])
    if not names:
        raise CorruptCheckpointError(f"{meta.get('model_states')} holds no module weights",
                                     BROKEN_HINT)
    return join_key(top, "module"), names
