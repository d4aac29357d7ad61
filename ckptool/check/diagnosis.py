"""``ckptool diagnose``: why a checkpoint will not load on a target machine
or into a model, as findings with stable codes, and the one ``ckptool fix``
command that repairs everything fixable at once.

``diagnose`` runs the checks of ``ckptool.check.findings`` and plans their
fixes as one command (``ckptool.check.fixcommand``); a ``Diagnosis`` holds
the lot, for the CLI's text and JSON and for the browser's findings pane.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ckptool.check import findings, loadcheck, manyfiles, zerofix
from ckptool.check.findings import ERROR, WARNING, Finding
from ckptool.check.fixcommand import plan_command
from ckptool.check.gpus.machine import Machine, probe
from ckptool.check.loadcheck import TagLoad
from ckptool.check.modelspec import ModelKeys, saved_settings
from ckptool.check.reconcile import KeyReport, MaybeShape, ShapeHint, explain_shapes, reconcile
from ckptool.describe import shell_word
from ckptool.errors import EXIT_FINDINGS, EXIT_OK
from ckptool.model import Checkpoint
from ckptool.write.fix.plan import FixOptions
from ckptool.write.flagged import flagged

__all__ = ["ERROR", "WARNING", "Diagnosis", "Finding", "describe_keys", "diagnose"]


@dataclass
class Diagnosis:
    checkpoint: Checkpoint
    machine: Machine
    tags: list[TagLoad]
    findings: list[Finding]
    model: ModelKeys | None = None
    keys: KeyReport | None = None
    shape_hints: list[ShapeHint] = field(default_factory=list)
    fix_command: str | None = None
    fix_output: str | None = None  # the file fix_command writes
    fix_refused: str | None = None  # why no command could be planned
    fix_options: FixOptions | None = None  # what fix_command asks for

    @property
    def exit_code(self) -> int:
        return EXIT_FINDINGS if self.findings else EXIT_OK

    @property
    def remaining(self) -> list[str]:
        """Codes of findings that ``fix_command`` does not repair."""
        fixed = self.fix_command is not None
        return [f.code for f in self.findings
                if not (fixed and f.fix and (f.fix.startswith("ckptool fix ")
                                             or f.fix == self.fix_command))]

    def load_errors(self) -> list[str]:
        """What plain ``torch.load(path)`` raises here, one line per cause
        (for Hugging Face ``.bin`` shards: ``torch.load`` of a shard)."""
        out = [f"RuntimeError: {t.error}" for t in self.tags if t.error]
        if self.checkpoint.format in ("dcp", "deepspeed", "dtensor-ranks"):  # not torch.load's
            # (each rank's file is a torch file: one saved on a missing GPU fails)
            return out if self.checkpoint.format in ("dcp", "dtensor-ranks") else []
        refused = loadcheck.refused_globals(self.checkpoint)
        if not loadcheck.weights_only_default():
            return out
        if self.checkpoint.format == "torchscript":
            out.append("RuntimeError: Cannot use ``weights_only=True`` with TorchScript "
                       "archives passed to ``torch.load``.")
        elif refused:
            out.append(f"UnpicklingError: Weights only load failed. ... Unsupported global: "
                       f"GLOBAL {refused[0]} was not an allowed global by default.")
        return out


def diagnose(ckpt: Checkpoint, machine: Machine | None = None,
             model: ModelKeys | None = None) -> Diagnosis:
    """Every finding about ``ckpt`` loading on ``machine`` (default: this
    one) and into ``model`` (from ``modelspec``), when given."""
    if machine is None:
        machine = probe()
    tags = loadcheck.plan_tags(ckpt, machine)
    result = Diagnosis(ckpt, machine, tags, [], model)
    opts = FixOptions()
    name = shell_word(ckpt.path)
    result.findings += findings.format_findings(ckpt, name)
    consolidate = zerofix.plan(ckpt)  # DeepSpeed: convert first; fix then works on that file
    if consolidate is not None:
        result.findings.append(consolidate.finding)
    else:  # (a DeepSpeed checkpoint's devices and classes stay behind in its files)
        result.findings += findings.device_findings(ckpt, tags, machine, opts, name)
        result.findings += findings.memory_findings(tags, machine)
        result.findings += findings.wrapping_findings(ckpt, opts, name)
        result.findings += findings.global_findings(ckpt, opts, name)
        # a file flagged for what lies beside it (a Trainer's rng_state.pth)
        # is refused by fix too: its fixes salvage as well
        opts.salvage = opts.salvage or (bool(flagged(ckpt)) and ckpt.main_state_dict is not None)
    result.findings += findings.content_findings(ckpt)
    result.findings += findings.companion_findings(ckpt)
    # DCP: the keys carry the entry they were saved under ("model."), which
    # is how they are loaded (dcp.load({"model": sd})): compared without it
    entry = manyfiles.entry_prefix(ckpt)
    if ckpt.main_state_dict is not None and model is not None:
        tensors = ckpt.state_dict()
        names = ckpt.main_state_dict.keys  # extra-state entries too: strict loading checks them
        if consolidate is not None:  # the converted file holds the tied names too
            tensors = {**tensors, **{a: tensors[k] for a, k in ckpt.aliases.items()
                                     if k in tensors}}
            names = (*names, *(a for a in ckpt.aliases if a in tensors))

        def shapes(of: Sequence[str]) -> dict[str, MaybeShape]:
            return {n[len(entry):]: tensors[n].shape if n in tensors else None for n in of}

        result.keys = reconcile(shapes(names), model.shapes, model.tied)
        rewrite = result.keys.rewrite
        # a tie the files record (an index's, a safetensors header's) is no
        # stored weight: a model without that name (as the keys are renamed to
        # fit it) loads the file all the same; load_state_dict leaves it out alike
        kept = tuple(n for n in names if consolidate is not None or n not in ckpt.aliases
                     or rewrite.apply(n[len(entry):]) in model.shapes)
        if kept != tuple(names):
            result.keys = reconcile(shapes(kept), model.shapes, model.tied, rewrite)
        result.shape_hints = explain_shapes(result.keys.mismatched, model.arguments,
                                            saved_settings(ckpt.root))
        result.findings += findings.key_findings(ckpt, result.keys, result.shape_hints, model,
                                                 opts, name)
    elif ckpt.main_state_dict is not None:
        result.findings += findings.prefix_findings(ckpt, opts, name, entry)
    if opts.salvage:  # every fix of a flagged file salvages, or fix refuses it
        result.findings = [replace(f, fix=f"{f.fix} --salvage") if f.fix and f.fix.startswith(
            "ckptool fix ") and "--salvage" not in f.fix else f for f in result.findings]
    if consolidate is not None:
        result.fix_command, result.fix_output = zerofix.command(consolidate, opts)
        result.fix_options = None if opts == FixOptions() else opts
        result.findings = zerofix.pointed(result.findings, consolidate, result.fix_command)
        return result
    command = plan_command(ckpt, opts)
    if command.refused is not None:
        result.fix_refused = command.refused
        # a finding never offers a command that fix would refuse
        result.findings = [replace(f, fix=None) if f.fix and f.fix.startswith("ckptool fix")
                           else f for f in result.findings]
    elif command.line is not None:
        result.fix_command, result.fix_output, result.fix_options = (
            command.line, command.output, opts)
    return result


def describe_keys(d: Diagnosis) -> str | None:
    """The key comparison with the model in one line, or None without a model."""
    if d.keys is None or d.model is None:
        return None
    k = d.keys
    line = f"{d.model.source}: {k.expected} expected · {k.before} match as saved"
    if not k.rewrite.empty:
        line += f" · {len(k.matched) + len(k.mismatched)} after the rewrite"
    return line + (f" · {len(k.missing)} missing · {len(k.unexpected)} unexpected · "
                   f"{len(k.mismatched)} shape")
