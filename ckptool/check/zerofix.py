"""What ``diagnose`` says of a DeepSpeed checkpoint, and the command it prints.

No model loads a DeepSpeed checkpoint as it is (``ckptool.check.manyfiles``):
the finding ``zero-checkpoint`` says so, and the fix is the ``ckptool
convert`` that writes its consolidated weights as one file beside it:
safetensors, or a torch file where the model ties weights (a torch file
keeps every tied name; safetensors keeps one, and strict loading wants
all). Where the keys also need a rewrite to load into ``--model`` (a
Lightning ``_forward_module.`` prefix...), the same options as for any file
become a ``ckptool fix`` of that file, run after the convert: one command
line, ``convert ... && fix ...``, that works as printed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ckptool.check.findings import ERROR, Finding
from ckptool.describe import beside, plural, shell_word
from ckptool.model import Checkpoint
from ckptool.read.layouts.per_rank import PER_RANK
from ckptool.write.fix.flags import flags as command_flags
from ckptool.write.fix.plan import FixOptions

DEEPSPEED = "deepspeed"
# (the formats of layouts.ds_universal and megatron.legacy: their readers not imported)
MEGATRON, UNIVERSAL = "megatron", "deepspeed-universal"



@dataclass
class Consolidation:
    finding: Finding
    output: str  # the file convert writes
    command: str  # the convert command


def plan(ckpt: Checkpoint) -> Consolidation | None:
    """The finding and convert command for a DeepSpeed checkpoint, or one
    saved per rank; None for any other."""
    if ckpt.format == PER_RANK:
        return _per_rank(ckpt)
    if ckpt.format == MEGATRON:
        return _megatron(ckpt)
    if ckpt.format == UNIVERSAL:
        output, snippet = consolidated(ckpt)
        command = f"ckptool convert {shell_word(ckpt.path)} {shell_word(output)}"
        message = ("a DeepSpeed universal checkpoint (ds_to_universal's output): only a "
                   "DeepSpeed engine with load_universal resumes it, at any parallel sizes; "
                   "the fix writes its fp32 weights as one model")
        return Consolidation(Finding("universal-checkpoint", ERROR, message, command, snippet),
                             output, command)
    if ckpt.format != DEEPSPEED:
        return None
    output, snippet = consolidated(ckpt)
    command = f"ckptool convert {shell_word(ckpt.path)} {shell_word(output)}"
    meta = ckpt.metadata
    stage, ranks = meta.get("zero_stage"), plural(meta.get("world_size") or 1, "rank")
    weights = ("its weights are the module's" if stage == 0 else
               "its fp32 master weights are partitioned over the ranks' files"
               + (" and its model states hold 0-element placeholders" if stage == 3 else ""))
    message = (f"a DeepSpeed ZeRO {stage} checkpoint of {ranks}: {weights}, so no model "
               f"loads it as it is; only a DeepSpeed engine of {ranks} resumes it")
    if ckpt.aliases:
        tied = next(iter(ckpt.aliases.items()))
        message += (f". The fix writes a torch file: it keeps the tied names ({tied[0]} = "
                    f"{tied[1]}) that safetensors would drop")
    finding = Finding("zero-checkpoint", ERROR, message, command, snippet)
    return Consolidation(finding, output, command)


def _per_rank(ckpt: Checkpoint) -> Consolidation:
    output, snippet = consolidated(ckpt)
    command = f"ckptool convert {shell_word(ckpt.path)} {shell_word(output)}"
    ranks = plural(ckpt.metadata.get("ranks") or 1, "rank")
    message = (f"saved per rank: each of the {ranks}' files holds that rank's shards of "
               "DTensors (torch.load of one gives a shard, and only after "
               "`import torch.distributed.tensor`); no model loads them as they are until "
               "the ranks' shards are joined")
    finding = Finding("per-rank-checkpoint", ERROR, message, command, snippet)
    return Consolidation(finding, output, command)


def _megatron(ckpt: Checkpoint) -> Consolidation:
    output, snippet = consolidated(ckpt)
    command = f"ckptool convert {shell_word(ckpt.path)} {shell_word(output)}"
    run = ckpt.metadata.get("megatron") or {}
    sizes = f"TP {run.get('tensor_parallel')} x PP {run.get('pipeline_parallel')}"
    message = (f"a legacy Megatron checkpoint of {sizes} "
               f"({plural(ckpt.metadata.get('ranks') or 1, 'rank file')}): each holds its "
               "ranks' slices of the model, so only Megatron's load_checkpoint with the same "
               "parallel sizes loads them as they are; the fix joins them into one model")
    finding = Finding("megatron-checkpoint", ERROR, message, command, snippet)
    return Consolidation(finding, output, command)


def consolidated(ckpt: Checkpoint, device: str | None = None) -> tuple[str, str]:
    """The file ``convert`` writes a DeepSpeed checkpoint into, beside it, and
    the Python line that loads it (onto ``device``). A torch file where the
    model ties weights: it keeps every tied name (safetensors drops all but
    one), so that strict loading takes it."""
    ext = ".pt" if ckpt.aliases else ".safetensors"
    output = fresh(beside(ckpt.path, ""), ext)
    if ckpt.aliases:
        where = f", map_location={device!r}" if device else ""
        return output, f"torch.load({output!r}, weights_only=True{where})"
    return output, (f"safetensors.torch.load_file({output!r}"
                    + (f", device={device!r})" if device else ")"))


def fresh(path: str, ext: str) -> str:
    """``DIR.safetensors``, or the first ``DIR.2.safetensors``... that does not exist."""
    output, n = f"{path}{ext}", 2
    while os.path.lexists(output):
        output, n = f"{path}.{n}{ext}", n + 1
    return output


def command(plan: Consolidation, opts: FixOptions) -> tuple[str, str]:
    """The diagnosis's command and the file it leaves: the convert, and a fix
    of its output where the findings asked for one (``opts``)."""
    if opts == FixOptions():
        return plan.command, plan.output
    stem, ext = os.path.splitext(plan.output)
    fixed = fresh(f"{stem}.fixed", ext)
    return (f"{plan.command} && ckptool fix {shell_word(plan.output)} "
            f"{' '.join(command_flags(opts))} -o {shell_word(fixed)}"), fixed


def pointed(found: list[Finding], plan: Consolidation, line: str) -> list[Finding]:
    """``found`` with every finding the command repairs pointing at all of it."""
    return [replace(f, fix=line) if f.fix and (f.fix.startswith("ckptool fix")
                                               or f is plan.finding) else f for f in found]
