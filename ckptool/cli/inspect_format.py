"""The format row of a checkpoint of many files in ``inspect``'s summary
(its index, DCP's version and wrapper, DeepSpeed's stage and ranks...), and
a Megatron checkpoint's run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptool.describe import plural

if TYPE_CHECKING:
    from ckptool.model import Checkpoint


def many_files_format(ckpt: Checkpoint) -> str:
    """The format row of a checkpoint of many files: its index, or DCP's
    version, wrapper and ranks."""
    meta = ckpt.metadata
    if ckpt.format == "dcp":
        wrapper = {"lightning": ", a Lightning .ckpt directory",
                   "accelerate": ", accelerate's FSDP folders",
                   "megatron": ", Megatron-core torch_dist",
                   "megatron-dcp": ", Megatron"}.get(meta.get("wrapper", ""), "")
        version = f" {meta['version']}" if meta.get("version") else ""
        ranks = meta.get("ranks")
        written = f" · written by {plural(ranks, 'rank')}" if ranks else ""
        return f"dcp (torch.distributed.checkpoint{version}{wrapper}){written}"
    if ckpt.format == "deepspeed":
        said = [f"ZeRO {meta.get('zero_stage')}", plural(meta.get("world_size") or 0, "rank"),
                f"{meta.get('run_dtype')} run", f"tag {meta.get('tag')}"]
        if meta.get("optimizer") == "BF16_Optimizer":
            said.append("BF16_Optimizer")
        if meta.get("ds_version"):
            said.append(f"DeepSpeed {meta['ds_version']}")
        return f"deepspeed ({' · '.join(said)})"
    if ckpt.format == "deepspeed-universal":
        from ckptool.read.layouts.ds_universal import info_line
        return info_line(meta)
    if ckpt.format == "dtensor-ranks":
        mesh = "x".join(str(n) for n in meta.get("mesh") or ())
        return (f"dtensor-ranks (each rank's torch.save of its shards · "
                f"{plural(meta.get('ranks') or 0, 'rank')}{f' · mesh {mesh}' if mesh else ''})")
    if ckpt.format == "megatron":
        kind = "NeMo 1's per-rank files" if meta["megatron"].get("format") == "nemo-ranks" \
            else "legacy per-rank files"
        return (f"megatron ({kind}, joined by {meta['megatron']['rules']}'s "
                f"rules · {plural(meta.get('ranks') or 0, 'rank')})")
    if ckpt.format == "hf-storage":
        return (f"hf-storage (torch's HuggingFaceStorageWriter shards, joined by their "
                f"DCP_SHARDING_INFO · {plural(meta.get('ranks') or 0, 'rank')})")
    return f"{ckpt.format} (index {meta.get('index')})"


def megatron_line(meta: dict[str, Any]) -> str:
    """A Megatron checkpoint's run: its iteration, how it was split, its layers."""
    said = [meta.get("format") or "?"]
    if meta.get("iteration") is not None:
        said.append(f"iteration {meta['iteration']}")
    elif meta.get("folder") is not None:
        said.append(f"folder {meta['folder']}")
    sizes = f"TP {meta.get('tensor_parallel')} x PP {meta.get('pipeline_parallel')}"
    if (meta.get("expert_parallel") or 1) > 1:
        sizes += f" x EP {meta['expert_parallel']}"
    if meta.get("virtual_pipeline"):
        sizes += f" (virtual PP {meta['virtual_pipeline']})"
    said.append(sizes)
    if meta.get("num_layers") is not None:
        said.append(plural(meta["num_layers"], "layer"))
    stacked = meta.get("stacked")
    if stacked:
        said.append(f"{plural(stacked, 'tensor')} stack the layers on a leading axis")
    return " · ".join(said)
