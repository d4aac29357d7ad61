"""``ckptool diagnose``: why a checkpoint will not load on a target machine
or into a model, as findings with stable codes, and the one ``ckptool fix``
command that repairs everything fixable at once.

``diagnose`` runs the checks of ``ckptool.check.findings`` and plans their
fixes as one command (``ckptool.check.fixcommand``); a ``Diagnosis`` holds
the lot, for the CLI's text and JSON and for the browser's findings pane.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ckptool.check import adapters, findings, loadable, loadcheck, manyfiles, zerofix
from ckptool.check.adapters import AdapterMatch
from ckptool.check.findings import ERROR, INFO, WARNING, Finding
from ckptool.check.fixcommand import framework_folder, plan_command
from ckptool.check.gpus.machine import Machine, probe
from ckptool.check.loadcheck import TagLoad
from ckptool.check.loadnames import LoadNames, from_table
from ckptool.check.modelspec import ModelKeys, saved_settings
from ckptool.check.reconcile import (
    KeyReport,
    Load,
    MaybeShape,
    ShapeHint,
    explain_shapes,
    reconcile,
)
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
    # what the model's library renames as it loads the keys (one line), and how
    load_note: str | None = None
    load_names: LoadNames | None = None
    adapter: AdapterMatch | None = None  # a PEFT adapter against the model it adapts
    notes: list[Finding] = field(default_factory=list)  # INFO: said, no problem, not counted

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
        if self.checkpoint.format in ("dcp", "deepspeed", "dtensor-ranks", "megatron",
                                      "deepspeed-universal"):
            # not torch.load's (each rank's file is a torch file: one saved on
            # a missing GPU fails)
            return out if not self.checkpoint.format.startswith("deepspeed") else []
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
    # (a framework folder's model is fixed as a folder: its loader reads it by name)
    name = shell_word(framework_folder(ckpt) or ckpt.path)
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
    result.findings += loadable.loader_findings(ckpt)  # the folder's own loader finds it?
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

        if ckpt.framework is not None and ckpt.framework.kind == "peft":
            result.adapter = adapters.match(shapes(names), model.shapes,
                                            ckpt.framework.adapter.get("peft_type"))
            result.findings += _adapter_findings(result.adapter, model)
        else:
            _compare_keys(result, ckpt, model, names, shapes, consolidate is not None, opts,
                          name)
    elif ckpt.main_state_dict is not None:
        result.findings += findings.prefix_findings(ckpt, opts, name, entry)
    result.notes = [f for f in result.findings if f.severity == INFO]
    result.findings = [f for f in result.findings if f.severity != INFO]
    if opts.salvage:  # every fix of a flagged file salvages, or fix refuses it
        result.findings = [replace(f, fix=f"{f.fix} --salvage") if f.fix and f.fix.startswith(
            "ckptool fix ") and "--salvage" not in f.fix else f for f in result.findings]
    if consolidate is not None:
        result.fix_command, result.fix_output = zerofix.command(consolidate, opts)
        result.fix_options = None if opts == FixOptions() else opts
        result.findings = zerofix.pointed(result.findings, consolidate, result.fix_command)
        return result
    return _planned(result, ckpt, opts)


def _compare_keys(result: Diagnosis, ckpt: Checkpoint, model: ModelKeys, names: Sequence[str],
                  shapes: Callable[[Sequence[str]], dict[str, MaybeShape]], consolidated: bool,
                  opts: FixOptions, name: str) -> None:
    """The state dict's keys against the model's, as findings on ``result``."""
    entry = manyfiles.entry_prefix(ckpt)
    result.keys, result.load_names = _compare(ckpt, shapes(names), model)
    load = _load(result.load_names, model)
    rewrite = result.keys.rewrite
    # a tie the files record (an index's, a safetensors header's) is no
    # stored weight: a model without that name (as the keys are renamed to
    # fit it) loads the file all the same; load_state_dict leaves it out alike
    kept = tuple(n for n in names if consolidated or n not in ckpt.aliases
                 or _fits(rewrite.apply(n[len(entry):]), model, load))
    if kept != tuple(names):
        result.keys = reconcile(shapes(kept), model.shapes, model.tied, rewrite, load)
    if result.load_names is not None:
        result.load_note = result.load_names.describe(result.load_names.loaded(
            [rewrite.apply(n) for n in shapes(kept)], model.shapes), rewrite.empty)
    result.shape_hints = explain_shapes(result.keys.mismatched, model.arguments,
                                        saved_settings(ckpt.root))
    result.findings += findings.key_findings(ckpt, result.keys, result.shape_hints, model,
                                             opts, name)


def _planned(result: Diagnosis, ckpt: Checkpoint, opts: FixOptions) -> Diagnosis:
    """``result`` with the one fix command for its findings, or why none."""
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


def _adapter_findings(match: AdapterMatch, model: ModelKeys) -> list[Finding]:
    """A PEFT adapter that does not fit the model it is given: each module
    it targets that the model lacks or shapes differently."""
    if match.fits:
        return []
    what = "; ".join(match.problems[:3]) + (
        f" (and {len(match.problems) - 3} more)" if len(match.problems) > 3 else "")
    if not match.problems:
        what = "it holds no adapter weights ckptool recognises"
    return [Finding("adapter-mismatch", ERROR,
                    f"this PEFT adapter does not fit {model.source}: {what}", None,
                    "PeftModel.from_pretrained(base, path)  # needs the base it was trained on",
                    tuple(p.partition(":")[0] for p in match.problems))]


def _compare(ckpt: Checkpoint, shapes: dict[str, MaybeShape],
             model: ModelKeys) -> tuple[KeyReport, LoadNames | None]:
    """The keys against the model's, named as its library loads them: its
    own renames (a transformers model), else, for a folder transformers
    wrote, ckptool's table of them where they fit the model better."""
    if model.load_names is not None:
        own = model.load_names
        return reconcile(shapes, model.shapes, model.tied, load=_load(own, model)), own
    plain = reconcile(shapes, model.shapes, model.tied)
    fw = ckpt.framework
    names = from_table(fw.model_type, fw.model_class) if fw is not None and fw.kind in (
        "transformers", "trainer", "accelerate") else None
    if names is None or plain.clean:
        return plain, None
    loaded = reconcile(shapes, model.shapes, model.tied, load=_load(names, model))
    return (loaded, names) if len(loaded.matched) > len(plain.matched) else (plain, None)


def _load(names: LoadNames | None, model: ModelKeys) -> Load | None:
    if names is None:
        return None
    return lambda shapes: names.shapes(shapes, model.shapes)


def _fits(name: str, model: ModelKeys, load: Load | None) -> bool:
    return name in model.shapes or (load is not None and any(
        n in model.shapes for n in load({name: None})))


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


def library_rows(d: Diagnosis) -> list[tuple[str, str]]:
    """What the model's library does with the keys, as (label, line) rows:
    the names it renames at load, an adapter against its base."""
    rows = []
    if d.load_note is not None:
        rows.append(("at load", d.load_note))
    if d.adapter is not None and d.model is not None:
        fw = d.checkpoint.framework
        folder = fw.directory if fw is not None else d.checkpoint.path
        rows.append(("adapter", f"against {d.model.source}: "
                                f"{adapters.describe(d.adapter, folder)}"))
    return rows


def no_problems(d: Diagnosis) -> str:
    """What diagnose says when it finds nothing, as the model's library loads it."""
    if d.adapter is not None:
        return ("no problems found: the adapter fits the model; PEFT loads it "
                "(PeftModel.from_pretrained), not a plain load_state_dict")
    if d.load_note is not None and d.load_names is not None:
        return (f"no problems found: {d.load_names.library} renames the keys as it loads "
                "them (from_pretrained); a plain load_state_dict does not: "
                "ckptool.load_state_dict(path, model=...) gives them renamed")
    if any(n.code == "tied-keys" for n in d.notes):
        return ("no problems found: from_pretrained loads it and ties the names above again; "
                "a strict load_state_dict wants them too: ckptool.load_state_dict(path, "
                "model=model) gives them")
    return manyfiles.no_problems(d.checkpoint)
