"""What ``recognise`` finds at a path: the kind of checkpoint of many files
it is, and where its files are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FILE, HF, DCP, DEEPSPEED, PER_RANK = "file", "hf", "dcp", "deepspeed", "per-rank"
HF_STORAGE, MEGATRON = "hf-storage", "megatron"
DS_UNIVERSAL = "ds-universal"  # DeepSpeed's universal checkpoint (ds_to_universal)


@dataclass(frozen=True)
class Layout:
    """What ``recognise`` found: one file, HF shards, DCP, or DeepSpeed."""

    kind: str  # FILE, HF, DCP or DEEPSPEED
    path: str  # as given
    directory: str  # the folder every file name below is relative to
    file: str | None = None  # FILE: the one checkpoint file (a full path)
    index: str | None = None  # HF: the index's file name
    metadata: tuple[str, ...] = ()  # DCP: the .metadata files; PER_RANK: each rank's file
    extras: tuple[str, ...] = ()  # files read beside (Lightning's meta.pt)
    # DCP: each rank's __<rank>.metadata beside .metadata, which dcp.load
    # unpickles when it cannot use .metadata: judged, never trusted unread
    fallbacks: tuple[str, ...] = ()
    wrapper: str | None = None  # "lightning" or "accelerate" (DCP)
    notes: tuple[str, ...] = ()  # what else the directory holds, said as warnings
    tag: str | None = None  # DEEPSPEED: the tag (the directory's name, or ``latest``'s)
    # Megatron: the iteration folder read (``iter_0000100``, ``release``)
    iteration: str | None = None
    # NeMo (a .nemo, a NeMo 2 folder): what its config says (``megatron.nemo``)
    nemo: dict[str, Any] | None = field(default=None, compare=False)


def describe(layout: Layout) -> str:
    """``a Hugging Face sharded checkpoint (model.safetensors.index.json)``..."""
    if layout.kind == HF:
        return f"a Hugging Face sharded checkpoint ({layout.index})"
    if layout.kind == DCP:
        wrapper = {"lightning": " (Lightning, with meta.pt)",
                   "accelerate": " (accelerate FSDP)",
                   "megatron": " (Megatron-core torch_dist)",
                   "megatron-dcp": " (Megatron)"}.get(layout.wrapper or "", "")
        return f"a torch.distributed.checkpoint directory{wrapper}"
    if layout.kind == DEEPSPEED:
        return f"a DeepSpeed checkpoint (tag {layout.tag})"
    if layout.kind == PER_RANK:
        return f"a checkpoint saved per rank ({len(layout.metadata)} files)"
    if layout.kind == HF_STORAGE:
        return f"a HuggingFaceStorageWriter checkpoint ({len(layout.metadata)} shards)"
    if layout.kind == DS_UNIVERSAL:
        return f"a DeepSpeed universal checkpoint ({layout.tag})"
    if layout.kind == MEGATRON:
        kind = "NeMo 1 checkpoint" if layout.nemo is not None else "legacy Megatron checkpoint"
        return f"a {kind} ({len(layout.metadata)} rank files)"
    return f"a directory holding one checkpoint file ({layout.file})"
